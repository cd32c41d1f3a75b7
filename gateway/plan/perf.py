"""Speed of one replica from its budget: roofline estimates, and the `HardwareProfile` that
lets `kvgate simulate` run a trace on it.

* prefill: 2 x active parameters FLOPs per token at 40% of the card's dense peak for the
  weights' dtype (bf16 when the card only dequantises them), over `tp` cards;
* decode step: read the active weights once at 70% of HBM bandwidth, plus each sequence's
  KV, plus 2 x active parameters FLOPs per sequence;
* without CUDA graphs every step also pays the kernel launches of every layer (about
  0.28 ms a layer, what puts a 61-layer model near 59 tokens/s a stream in eager mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.plan.memory import Budget
from gateway.plan.shapes import DTYPE_CAPABILITY, dtype_bytes
from gateway.sim.profiles import HardwareProfile

MFU: Final = 0.4
MBU: Final = 0.7
STEP_OVERHEAD_S: Final = 0.002
EAGER_S_PER_LAYER: Final = 0.28e-3


@dataclass(frozen=True, slots=True)
class Speed:
    prefill_tokens_per_s: float  # one replica
    decode_base_s: float
    decode_per_seq_s: float
    attention_s_per_token: float
    step_overhead_s: float

    def step_s(self, batch: int, context: int) -> float:
        return (
            self.step_overhead_s
            + self.decode_base_s
            + self.decode_per_seq_s * batch
            + self.attention_s_per_token * context * batch
        )

    def decode_tokens_per_s(self, batch: int, context: int) -> float:
        """All `batch` streams together, each `context` tokens long."""
        return batch / self.step_s(batch, context)


def speed(b: Budget) -> Speed:
    m, card, tp = b.model, b.card, b.settings.tp
    flops = card.tflops_for(DTYPE_CAPABILITY.get(b.weight_dtype, "bf16")) * 1e12 * MFU * tp
    active = m.active_params_per_token
    read_bytes = active * dtype_bytes(b.weight_dtype) / tp
    bandwidth = card.bandwidth_tbs * 1e12 * MBU
    overhead = STEP_OVERHEAD_S + (0.0 if b.settings.cuda_graphs else m.layers * EAGER_S_PER_LAYER)
    return Speed(
        prefill_tokens_per_s=flops / (2 * active),
        decode_base_s=read_bytes / bandwidth,
        decode_per_seq_s=2 * active / flops,
        attention_s_per_token=b.kv_bytes_per_token / bandwidth,
        step_overhead_s=overhead,
    )


def sim_profile(b: Budget, *, name: str, context: int, link_gbps: float = 100.0) -> HardwareProfile:
    """A simulated engine with this replica's KV blocks and speeds. `context` (the traffic's
    typical length) turns hybrid models' per-sequence KV into an average per token."""
    s = speed(b)
    per_token = b.sequence_bytes(max(1, context)) / max(1, context)
    per_block = per_token * b.settings.block_size
    blocks = int(max(0.0, b.kv_gib) * 2**30 // per_block) if per_token else 0
    return HardwareProfile(
        name=name,
        prefill_tokens_per_s=s.prefill_tokens_per_s,
        decode_base_s=s.decode_base_s,
        decode_per_seq_s=s.decode_per_seq_s,
        attention_s_per_token=s.attention_s_per_token,
        attention="dense",
        attention_window=0,
        num_gpu_blocks=max(1, blocks),
        kv_bytes_per_token=max(1, int(per_token * b.settings.tp)),
        link_bytes_per_s=link_gbps * 1e9 / 8,
        block_size=b.settings.block_size,
        max_num_seqs=b.settings.max_num_seqs,
        max_num_batched_tokens=b.settings.max_num_batched_tokens,
        max_model_len=b.max_model_len,
        step_overhead_s=s.step_overhead_s,
    )
