"""Renderers: a request body as the engine tokenizes it, and which tokens a cut of the
gateway's canonical byte stream (gateway.keys) determines.

`Rendered.stable_tokens(end)` answers: of the engine's token ids for this prompt, how many
leading ones follow from the canonical bytes [0, end) alone, whatever comes after. Chat
messages are located in the rendered template text in order; a cut inside a message's
content keeps the tokens that end before it minus a safety margin (a subword tokenizer
may merge across the cut); a cut in a message's role header keeps the previous message.

* `SimRenderer`: the simulated engine's template and approximate tokenizer (four
  characters a token, ids from the characters): what `kvgate sim` engines publish.
* `HFRenderer`: a HuggingFace `tokenizer.json` and the model's Jinja chat template, as
  vLLM renders chat (optional packages `tokenizers` and `jinja2`).

Given a `TokenCache`, either tokenizes a rendered prompt that extends one seen before
incrementally (gateway.kvevents.incremental).
Token-id prompts (`/v1/completions` with a list of ids) need no renderer at all.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from gateway.keys import message_pieces
from gateway.kvevents.incremental import Encode, Encoded, IncrementalEncoder, plain
from gateway.kvevents.tokcache import TokenCache
from gateway.sim.tokenizer import approx_token_ids, render_chat, token_ids_text
from gateway.types import Endpoint

MARGIN_TOKENS = 2
# An opening is encoded from this many characters per token wanted: far more than tokens
# span, so where the text is cut changes none of the first ones (a subword tokenizer
# merges within a word, not across dozens of them).
OPENING_CHARS_PER_TOKEN = 32


def _opening_of(
    encode: Callable[[str], Sequence[int]], text: str, tokens: int
) -> Sequence[int] | None:
    cut = tokens * OPENING_CHARS_PER_TOKEN
    ids = encode(text[:cut])
    if len(text) > cut and len(ids) < tokens + MARGIN_TOKENS:
        return None  # the cut may be near the tokens wanted: only the whole text would say
    return ids[:tokens] if len(ids) >= tokens else None


@dataclass(frozen=True, slots=True)
class _Span:
    canon_start: int  # canonical offset where this message's content starts
    content: bytes
    rendered_start: int  # char offset of the content in the rendered text
    rendered_end: int
    prev_end: int  # rendered char offset where the previous message's content ended
    ascii: bool  # one character a byte: no decoding to count them


@dataclass(frozen=True, slots=True)
class Rendered:
    token_ids: Sequence[int]
    token_ends: Sequence[int]  # char offset where each token ends in the rendered text
    spans: tuple[_Span, ...]
    canon_size: int
    exact: bool = False  # token-id prompt: 4 canonical bytes per id
    keys: Sequence[int] | None = None  # token-block keys, when the encoder computed them
    reuse: str = ""  # the token cache's answer: "hit", "miss", "fallback" ("" no cache)
    reused: int = 0  # leading tokens taken from the cache

    def stable_tokens(self, end: int) -> int:
        if self.exact:
            return min(end // 4, len(self.token_ids))
        if end >= self.canon_size:
            return len(self.token_ids)
        cut = 0
        inside = False
        for span in self.spans:
            if end < span.canon_start:
                cut = span.prev_end
                break
            within = end - span.canon_start
            if within <= len(span.content):
                if span.ascii:
                    chars = within
                else:
                    chars = len(span.content[:within].decode("utf-8", "ignore"))
                cut = span.rendered_start + chars
                inside = True
                break
            cut = span.rendered_end
        n = bisect_right(self.token_ends, cut)
        return max(0, n - MARGIN_TOKENS) if inside else n


_BOTH = frozenset((Endpoint.CHAT, Endpoint.COMPLETIONS))


class Renderer(Protocol):
    # The endpoints whose prompts it can render at all (others are not handed to it).
    endpoints: frozenset[Endpoint]

    def render(self, body: Mapping[str, Any], endpoint: Endpoint) -> Rendered | None: ...

    # The first `tokens` token ids of what `render` gives, for far less work (the prompt's
    # opening, encoded alone), or None when they cannot be told apart from the rest.
    def opening(
        self, body: Mapping[str, Any], endpoint: Endpoint, tokens: int
    ) -> Sequence[int] | None: ...


def _content_str(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    return None  # images, audio: the engine's tokens are not the text's


def _encoder(
    encode: Encode, cache: TokenCache | None, block_size: int
) -> Callable[[str, bool], Encoded]:
    return plain(encode) if cache is None else IncrementalEncoder(encode, cache, block_size)


def _rendered(enc: Encoded, spans: tuple[_Span, ...], canon: int) -> Rendered:
    return Rendered(
        enc.ids, enc.ends, spans, canon, keys=enc.keys, reuse=enc.reuse, reused=enc.reused
    )


def _locate(body: Mapping[str, Any], text: str, enc: Encoded) -> Rendered:
    """Spans of the chat messages of `body` inside the rendered `text`."""
    spans: list[_Span] = []
    canon = 0
    pos = prev_end = 0
    for message in body.get("messages") or ():
        if not isinstance(message, Mapping):
            break
        pieces = message_pieces(message)
        header, content = pieces[0], pieces[1]
        value = _content_str(message.get("content"))
        found = text.find(value, pos) if value else (pos if value == "" else -1)
        if found < 0 or value is None:
            break
        start = canon + len(header)
        span = _Span(start, content, found, found + len(value), prev_end, content.isascii())
        spans.append(span)
        pos = prev_end = found + len(value)
        canon += sum(len(p) for p in pieces)
    else:
        return _rendered(enc, tuple(spans), canon)
    # A message the template changed (or a non-text part): nothing from it on is stable.
    return _rendered(enc, tuple(spans), canon + (1 << 62))


def _text_prompt(body: Mapping[str, Any]) -> str | list[int] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return prompt
    return None


def token_id_prompt(body: Mapping[str, Any]) -> Rendered | None:
    prompt = _text_prompt(body)
    if isinstance(prompt, list):
        return Rendered(prompt, (), (), 4 * len(prompt), exact=True)
    return None


def _token_id_opening(body: Mapping[str, Any], tokens: int) -> Sequence[int] | None:
    prompt = _text_prompt(body)
    return prompt[:tokens] if isinstance(prompt, list) and len(prompt) >= tokens else None


def _completion(text: str, enc: Encoded) -> Rendered:
    data = text.encode()
    return _rendered(enc, (_Span(0, data, 0, len(text), 0, data.isascii()),), len(data))


class TokenIdsOnly:
    """No tokenizer configured: only token-id prompts, which need none."""

    endpoints = frozenset((Endpoint.COMPLETIONS,))

    def render(self, body: Mapping[str, Any], endpoint: Endpoint) -> Rendered | None:
        return token_id_prompt(body) if endpoint is Endpoint.COMPLETIONS else None

    def opening(
        self, body: Mapping[str, Any], endpoint: Endpoint, tokens: int
    ) -> Sequence[int] | None:
        return _token_id_opening(body, tokens) if endpoint is Endpoint.COMPLETIONS else None


class SimRenderer:
    """What `gateway.sim` engines see: their fixed chat template, four characters a token."""

    endpoints = _BOTH

    def __init__(self, cache: TokenCache | None = None, block_size: int = 16) -> None:
        self._encode = _encoder(_sim_encode, cache, block_size)

    def render(self, body: Mapping[str, Any], endpoint: Endpoint) -> Rendered | None:
        prompt = _sim_prompt(body, endpoint)
        if isinstance(prompt, list):
            text = token_ids_text(prompt)
            return Rendered(approx_token_ids(text), (), (), 4 * len(prompt), exact=True)
        if prompt is None:
            return None
        if endpoint is Endpoint.CHAT:
            return _locate(body, prompt, self._encode(prompt, False))
        return _completion(prompt, self._encode(prompt, True))

    def opening(
        self, body: Mapping[str, Any], endpoint: Endpoint, tokens: int
    ) -> Sequence[int] | None:
        prompt = _sim_prompt(body, endpoint)
        if isinstance(prompt, list):
            prompt = token_ids_text(prompt[: 2 * tokens])
        return None if prompt is None else _opening_of(approx_token_ids, prompt, tokens)


def _sim_prompt(body: Mapping[str, Any], endpoint: Endpoint) -> str | list[int] | None:
    """The text the simulated engine tokenizes (its chat template rendered), or a
    completion's token ids."""
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        return render_chat(messages) if isinstance(messages, list) else None
    if endpoint is Endpoint.COMPLETIONS:
        return _text_prompt(body)
    return None


def _sim_encode(text: str, specials: bool) -> tuple[Sequence[int], Sequence[int]]:
    ids = approx_token_ids(text)
    return ids, _approx_ends(len(ids), len(text))


@lru_cache(maxsize=4)
def _ramp(n: int) -> array[int]:
    return array("q", range(4, 4 * n + 1, 4))


def _approx_ends(n: int, size: int) -> array[int]:
    # A slice of a cached ramp: building 20K ends from a range took a millisecond.
    ends = _ramp(1 << max(10, n - 1).bit_length())[:n]
    if n:
        ends[-1] = size
    return ends


class HFRenderer:
    """A HuggingFace tokenizer file and Jinja chat template (the engine's own)."""

    def __init__(
        self,
        tokenizer_path: str,
        chat_template: str | None,
        specials: Mapping[str, str],
        cache: TokenCache | None = None,
        block_size: int = 16,
    ) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(tokenizer_path)
        self._encode = _encoder(self._hf_encode, cache, block_size)
        self._template: Any = None
        self._specials = dict(specials)
        # Without a chat template only completions prompts can be rendered.
        self.endpoints = _BOTH if chat_template is not None else frozenset((Endpoint.COMPLETIONS,))
        if chat_template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(chat_template)

    def render(self, body: Mapping[str, Any], endpoint: Endpoint) -> Rendered | None:
        if endpoint is Endpoint.CHAT:
            text = self._chat_text(body)
            return None if text is None else _locate(body, text, self._encode(text, False))
        if endpoint is Endpoint.COMPLETIONS:
            prompt = _text_prompt(body)
            if isinstance(prompt, str):
                return _completion(prompt, self._encode(prompt, True))
            return token_id_prompt(body)
        return None

    def opening(
        self, body: Mapping[str, Any], endpoint: Endpoint, tokens: int
    ) -> Sequence[int] | None:
        # The template renders the whole conversation (it may depend on all of it); only
        # the opening is encoded, which is where a long prompt's time goes.
        if endpoint is Endpoint.CHAT:
            text = self._chat_text(body)
            return None if text is None else _opening_of(self._hf_ids(False), text, tokens)
        if endpoint is Endpoint.COMPLETIONS:
            prompt = _text_prompt(body)
            if isinstance(prompt, str):
                return _opening_of(self._hf_ids(True), prompt, tokens)
            return _token_id_opening(body, tokens)
        return None

    def _chat_text(self, body: Mapping[str, Any]) -> str | None:
        messages = body.get("messages")
        if self._template is None or not isinstance(messages, list):
            return None
        text: str = self._template.render(
            messages=messages,
            add_generation_prompt=True,
            tools=body.get("tools"),
            **self._specials,
        )
        return text

    def _hf_ids(self, specials: bool) -> Callable[[str], Sequence[int]]:
        tok = self._tok
        return lambda text: tok.encode(text, add_special_tokens=specials).ids

    def _hf_encode(self, text: str, specials: bool) -> tuple[Sequence[int], Sequence[int]]:
        enc = self._tok.encode(text, add_special_tokens=specials)
        return enc.ids, [e for _, e in enc.offsets]
