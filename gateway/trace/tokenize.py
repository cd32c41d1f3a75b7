"""Text to token blocks, for counting and for block hashing at capture.

The default is the simulator's deterministic offline approximation (one token per 4
characters, cut at fixed offsets; see gateway.sim.tokenizer), so capture works with no
model files, counts prompts the way the simulated engines do, and the replayer can build
text of an exact intended length. A real `tokenizer.json` is used when given (needs the
optional `tokenizers` package).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Protocol

from gateway.errors import ConfigError
from gateway.sim.tokenizer import CHARS_PER_TOKEN

APPROX_TOKENIZER_NAME = f"approx-{CHARS_PER_TOKEN}cpt"


class Tokenizer(Protocol):
    name: str

    def count(self, text: str) -> int: ...

    def blocks(self, text: str, block_tokens: int) -> tuple[int, list[bytes]]:
        """(token count, one payload per block including the partial last one)."""
        ...


class ApproxTokenizer:
    """About 4 characters a token, no vocabulary; the same cut as the simulated engines."""

    name = APPROX_TOKENIZER_NAME

    def count(self, text: str) -> int:
        return -(-len(text) // CHARS_PER_TOKEN)

    def blocks(self, text: str, block_tokens: int) -> tuple[int, list[bytes]]:
        span = CHARS_PER_TOKEN * block_tokens
        payloads = [
            text[i : i + span].encode("utf-8", "surrogatepass") for i in range(0, len(text), span)
        ]
        return self.count(text), payloads


class HFTokenizer:
    """A real tokenizer from a `tokenizer.json` file."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:
            raise ConfigError(
                "a tokenizer.json needs the 'tokenizers' package (pip install tokenizers)"
            ) from exc
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} does not exist")
        self._tok = _HF.from_file(str(path))
        self.name = f"hf:{path.parent.name or path.stem}"

    def _ids(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def count(self, text: str) -> int:
        return len(self._ids(text))

    def blocks(self, text: str, block_tokens: int) -> tuple[int, list[bytes]]:
        ids = self._ids(text)
        payloads = []
        for start in range(0, len(ids), block_tokens):
            chunk = ids[start : start + block_tokens]
            payloads.append(struct.pack(f"<{len(chunk)}I", *chunk))
        return len(ids), payloads


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The approximation when `path` is None, else the real tokenizer stored at `path`."""
    if path is None:
        return ApproxTokenizer()
    return HFTokenizer(Path(path))
