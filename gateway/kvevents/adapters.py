"""`AdapterNames`: the LoRA adapter a request names, so its prompt is keyed in that
adapter's namespace (the engines hash adapter blocks apart from the base model's: a
request for an adapter never hits base-model blocks, and hits its adapter's own).

How a request names one:

* vLLM (and SGLang's OpenAI server): `model` is the adapter's served name, listed in
  `/v1/models` as a card with a `parent` (vLLM's `--lora-modules name=path`);
* SGLang: the body's `lora_path` names it (a loaded adapter's name), or `model` is
  `<base>:<adapter>` for a served base model.

Pure lookups in what model discovery last found (gateway.models): never a request to an
engine on the request path. An adapter not yet listed is keyed as a plain prompt, as
before: its lookups then find no adapter block, and the base model's blocks may be
claimed until the listing says it is an adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol


class Listing(Protocol):
    @property
    def served(self) -> frozenset[str]: ...

    @property
    def adapters(self) -> frozenset[str]: ...


class AdapterNames:
    def __init__(self, listing: Listing, resolve: Callable[[str], str] | None = None) -> None:
        self.listing = listing
        self.resolve = resolve  # public model name -> the name sent upstream (aliases)

    def __call__(self, body: Mapping[str, Any]) -> str | None:
        lora = body.get("lora_path")
        if isinstance(lora, str) and lora:
            return lora
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return None
        if self.resolve is not None:
            model = self.resolve(model)
        listing = self.listing
        if model in listing.adapters:
            return model
        base, sep, name = model.partition(":")
        if sep and name and base in listing.served and model not in listing.served:
            return name
        return None
