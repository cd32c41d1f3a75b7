"""`kv_events:` settings section (gateway.kvevents)."""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineFormat(str, Enum):
    VLLM = "vllm"
    SGLANG = "sglang"


class TokenizerKind(str, Enum):
    NONE = "none"  # only token-id prompts map to token blocks
    SIM = "sim"  # what gateway.sim engines see (their template, 4 characters a token)
    HF = "hf"  # a tokenizer.json and a Jinja chat template from local files


# Covers a chat's first turn of ten thousand tokens or so with a real BPE on one core, the
# incremental next turn of a 100K-token conversation (3.2 ms BPE, 0.9 ms sim in
# bench_kvevents_cost), and a 100K-token prompt tokenized whole by a fast tokenizer (sim:
# 6 ms), which is what an instance behind a load balancer meets when the other instances
# served the previous turns: with two gateways, 5 ms left 135 of 742 waits over budget and
# 25 ms 1 or 2 (bench_kvevents --gateways 2). The wait ends when the tokens are there, and
# is a percent of the prefill that a cache hit saves at worst.
DEFAULT_ROUTE_BUDGET_MS = 25.0


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EventSource(_Section):
    """One replica's publisher, as given to the engine's `--kv-events-config`."""

    replica: str = Field(description="replica id (as in `replicas:`)")
    endpoint: str = Field(description="the engine's PUB endpoint, e.g. tcp://10.0.0.5:5557")
    replay_endpoint: str | None = Field(
        None, description="the engine's replay (ROUTER) endpoint, e.g. tcp://10.0.0.5:5558"
    )
    topic: str = Field("", description="topic the engine publishes on ('' = every topic)")
    engine: EngineFormat = Field(EngineFormat.VLLM, description="publisher dialect")

    @model_validator(mode="after")
    def _zmq_endpoints(self) -> EventSource:
        for value in (self.endpoint, self.replay_endpoint):
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{value!r} is not a tcp:// or ipc:// ZMQ endpoint")
        return self


class TokenizerSettings(_Section):
    kind: TokenizerKind = Field(TokenizerKind.NONE, description="how prompts become token ids")
    path: str | None = Field(None, description="hf: the model's tokenizer.json")
    chat_template: str | None = Field(None, description="hf: a Jinja chat template file")
    bos_token: str = Field("", description="hf: value of bos_token in the template")
    eos_token: str = Field("", description="hf: value of eos_token in the template")
    workers: int = Field(1, ge=1, le=16, description="tokenizer processes (or threads)")
    executor: Literal["auto", "process", "thread"] = Field(
        "auto",
        description="where prompts are tokenized: worker processes (each with its own "
        "tokenizer and token cache; the event loop never waits on them for the GIL, which a "
        "Hugging Face tokenizer holds for its whole encode) or threads of the gateway (no "
        "extra process; right for the sim tokenizer, which lets go of the GIL); auto: "
        "processes for hf, threads otherwise",
    )
    max_pending: int = Field(64, ge=1, description="prompts waiting at most; more are dropped")
    timeout_s: float = Field(
        1.0, gt=0, description="a prompt taking longer is counted slow and not used"
    )
    cache_entries: int = Field(
        1024,
        ge=0,
        description="tokenized prompts kept so a later turn tokenizes only what it adds "
        "(0: tokenize every prompt whole)",
    )
    cache_bytes: int = Field(256 << 20, ge=0, description="memory bound of that token cache")
    route_budget_ms: float = Field(
        DEFAULT_ROUTE_BUDGET_MS,
        ge=0,
        le=1000,
        description="a request whose prompt the bridge does not know yet is tokenized before "
        "its routing decision, which waits for it at most this long (0: never wait, route "
        "on what earlier prompts taught)",
    )

    @model_validator(mode="after")
    def _hf_needs_files(self) -> TokenizerSettings:
        if self.kind is TokenizerKind.HF and not self.path:
            raise ValueError("tokenizer.kind 'hf' needs tokenizer.path (a tokenizer.json)")
        return self


class KVEventsSettings(_Section):
    """Subscribe to the engines' KV cache events and route on what they really hold."""

    enabled: bool = Field(False, description="subscribe to the sources below")
    sources: tuple[EventSource, ...] = Field((), description="one publisher per replica")
    discover: bool = Field(
        True,
        description="follow the publishers each replica not listed in `sources` describes "
        "(vLLM GET /kv_event_sources, SGLang /server_info kv_events; every DP rank), read at "
        "start and again when the replica comes back into service (intake: thread only)",
    )
    block_size: int = Field(
        16,
        ge=1,
        le=1024,
        description="the block size prompts are keyed at (tokens); an engine paging at "
        "another size is re-cut to it on intake",
    )
    medium_weights: dict[str, float] = Field(
        # vLLM's STORAGE and SGLang's EXTERNAL are fetched over a network or from an
        # offloading store: worth about as much as a local disk.
        default_factory=lambda: {
            "GPU": 1.0,
            "CPU": 0.5,
            "CPU_PINNED": 0.5,
            "DISK": 0.25,
            "STORAGE": 0.25,
            "EXTERNAL": 0.25,
        },
        description="worth of a cached block by where it lives, against recomputing it (0)",
    )
    warmup_s: float = Field(
        60.0,
        ge=0,
        description="after losing events it could not replay, a replica's index "
        "is trusted again this long after it restarted",
    )
    max_blocks_per_replica: int = Field(1 << 21, ge=1, description="index bound per replica")
    bridge_max_entries: int = Field(500_000, ge=1, description="prompt blocks mapped at most")
    replay_timeout_s: float = Field(1.0, gt=0, description="wait for a replay answer")
    intake: Literal["thread", "process"] = Field(
        "thread",
        description="where events are decoded and indexed: a thread of the gateway (it "
        "shares the interpreter lock with the event loop), or a process of their own that "
        "sends the gateway only what changed for lookups, for hosts with a core to spare "
        "(gateway.kvevents.remote)",
    )
    tokenizer: TokenizerSettings = Field(default_factory=TokenizerSettings)

    @model_validator(mode="after")
    def _unique(self) -> KVEventsSettings:
        seen = [s.replica for s in self.sources]
        dup = {r for r in seen if seen.count(r) > 1}
        if dup:
            raise ValueError(f"replica(s) {sorted(dup)} have more than one event source")
        if any(w < 0 for w in self.medium_weights.values()):
            raise ValueError("medium_weights must not be negative")
        return self
