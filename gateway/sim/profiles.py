"""Hardware profiles: what a replica costs, as data.

Step time model (seconds of simulated time) for one engine step:

    step = step_overhead_s
         + prefill_tokens / prefill_tokens_per_s
         + (decode_base_s + decode_per_seq_s * n_decode) if n_decode else 0
         + attention_s_per_token * attended context tokens of the decoding sequences

Dense attention reads the whole context every decode step; sparse attention reads at most
`attention_window` tokens per sequence, which is why the sparse model decodes long contexts
much faster on the same card. The numbers are plausible orders of magnitude, not
measurements; they exist so policies can be compared, not so latencies can be predicted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

AttentionKind = Literal["dense", "sparse"]


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    name: str
    prefill_tokens_per_s: float
    decode_base_s: float
    decode_per_seq_s: float
    attention_s_per_token: float
    attention: AttentionKind
    attention_window: int
    num_gpu_blocks: int
    kv_bytes_per_token: int
    link_bytes_per_s: float
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    step_overhead_s: float = 0.002
    # Only reported (vLLM's cache_config_info): the blocks above are what the engine has.
    gpu_memory_utilization: float = 0.9
    # vLLM's `long_prefill_token_threshold`: at most this many prompt tokens of one request
    # per step, so one long prefill cannot take the whole step budget. 0 (vLLM's default
    # unless partial prefills are enabled) means no per-request cap.
    long_prefill_token_threshold: int = 0
    # Output length when the client gives no max_tokens: deterministic in [lo, hi].
    natural_output_tokens: tuple[int, int] = (16, 256)
    # Answer at once: no step loop, no sleeps (the gateway-overhead benchmark backend).
    instant: bool = False

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def scaled(self, **changes: object) -> HardwareProfile:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def step_time(self, prefill_tokens: int, n_decode: int, attended_tokens: int) -> float:
        t = self.step_overhead_s + prefill_tokens / self.prefill_tokens_per_s
        if n_decode:
            t += self.decode_base_s + self.decode_per_seq_s * n_decode
            t += self.attention_s_per_token * attended_tokens
        return t

    def attended(self, context_tokens: int) -> int:
        if self.attention == "sparse":
            return min(context_tokens, self.attention_window)
        return context_tokens

    def transfer_time(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.link_bytes_per_s


PROFILES: dict[str, HardwareProfile] = {
    # Near-zero cost: measures the gateway, not the engine.
    "instant": HardwareProfile(
        name="instant",
        prefill_tokens_per_s=1e12,
        decode_base_s=0.0,
        decode_per_seq_s=0.0,
        attention_s_per_token=0.0,
        attention="sparse",
        attention_window=2048,
        num_gpu_blocks=65536,
        kv_bytes_per_token=1,
        link_bytes_per_s=1e15,
        step_overhead_s=0.0,
        natural_output_tokens=(8, 32),
        instant=True,
    ),
    # Hopper-class card, a model with small KV (latent / sparse attention).
    "h200-sparse": HardwareProfile(
        name="h200-sparse",
        prefill_tokens_per_s=14000.0,
        decode_base_s=0.018,
        decode_per_seq_s=0.00012,
        attention_s_per_token=2.0e-8,
        attention="sparse",
        attention_window=2048,
        num_gpu_blocks=40000,
        kv_bytes_per_token=70_000,
        link_bytes_per_s=50e9,
    ),
    # The same card serving a dense-KV model: ~5x the bytes per token, a quarter the blocks.
    "h200-dense": HardwareProfile(
        name="h200-dense",
        prefill_tokens_per_s=9000.0,
        decode_base_s=0.022,
        decode_per_seq_s=0.00015,
        attention_s_per_token=4.0e-8,
        attention="dense",
        attention_window=0,
        num_gpu_blocks=10000,
        kv_bytes_per_token=327_680,
        link_bytes_per_s=50e9,
    ),
    # A slower, cheaper card with less memory and a slower interconnect.
    "domestic": HardwareProfile(
        name="domestic",
        prefill_tokens_per_s=4500.0,
        decode_base_s=0.035,
        decode_per_seq_s=0.0003,
        attention_s_per_token=6.0e-8,
        attention="dense",
        attention_window=0,
        num_gpu_blocks=6000,
        kv_bytes_per_token=163_840,
        link_bytes_per_s=12.5e9,
        max_num_seqs=128,
        max_num_batched_tokens=4096,
        max_model_len=65536,
    ),
    # Tiny KV, fast steps: makes eviction, queueing and preemption easy to provoke in tests.
    "tiny": HardwareProfile(
        name="tiny",
        prefill_tokens_per_s=200000.0,
        decode_base_s=0.002,
        decode_per_seq_s=0.0001,
        attention_s_per_token=0.0,
        attention="dense",
        attention_window=0,
        num_gpu_blocks=64,
        kv_bytes_per_token=1024,
        link_bytes_per_s=1e9,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=1024,
        step_overhead_s=0.0005,
    ),
}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown sim profile {name!r}; known profiles: {known}") from None
