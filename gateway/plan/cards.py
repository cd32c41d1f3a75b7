"""Accelerator cards as data: memory, bandwidth, compute per dtype, interconnect.

Memory is what the device reports (nvidia-smi / rocm-smi / npu-smi), in GiB, which is
what vLLM's `gpu_memory_utilization` multiplies. Compute is dense (no sparsity) peak.
Domestic cards' figures are public approximations. Users add or override cards in YAML:

    cards:
      my-card: {memory_gib: 96, bandwidth_tbs: 4.0, bf16_tflops: 148, fp8: native,
                fp8_tflops: 296, interconnect_gbs: 900, price_per_hour: 1.2}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import ConfigError

# native: the tensor cores compute in it; weight_only: weights are stored in it and
# dequantised to 16-bit per matmul (Marlin-style kernels): memory saved, no compute gained.
Support = Literal["native", "weight_only", "none"]


class Card(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = ""
    vendor: str = ""
    memory_gib: float = Field(gt=0)
    bandwidth_tbs: float = Field(gt=0, description="HBM bandwidth, TB/s")
    bf16_tflops: float = Field(gt=0)
    fp8_tflops: float = Field(0.0, ge=0)
    fp4_tflops: float = Field(0.0, ge=0)
    fp8: Support = "none"
    fp4: Support = "none"
    int8: Support = "native"
    int4: Support = "weight_only"
    interconnect: str = "pcie"
    interconnect_gbs: float = Field(32.0, gt=0, description="card-to-card within a node, GB/s")
    price_per_hour: float | None = Field(None, ge=0)
    # 1 for a MIG slice: vLLM cannot run tensor parallelism across slices of a card.
    max_tp: int = Field(16, ge=1, description="cards one replica may span")
    note: str = ""

    def supports(self, capability: str) -> Support:
        if capability == "bf16":
            return "native"
        value: Support = getattr(self, capability, "none")
        return value

    def tflops_for(self, weight_capability: str) -> float:
        """Dense peak the matmuls of a model with these weights run at."""
        if weight_capability == "fp4" and self.fp4 == "native" and self.fp4_tflops:
            return self.fp4_tflops
        if weight_capability == "fp8" and self.fp8 == "native" and self.fp8_tflops:
            return self.fp8_tflops
        return self.bf16_tflops


_NVLINK4 = {"interconnect": "nvlink", "interconnect_gbs": 900.0}
_BUILTIN: dict[str, dict[str, object]] = {
    "a100": {
        "vendor": "nvidia",
        "memory_gib": 80.0,
        "bandwidth_tbs": 2.039,
        "bf16_tflops": 312.0,
        "fp8": "weight_only",
        "fp4": "none",
        "interconnect": "nvlink",
        "interconnect_gbs": 600.0,
    },
    "l40s": {
        "vendor": "nvidia",
        "memory_gib": 45.0,
        "bandwidth_tbs": 0.864,
        "bf16_tflops": 362.0,
        "fp8": "native",
        "fp8_tflops": 733.0,
        "fp4": "none",
        "interconnect": "pcie",
        "interconnect_gbs": 32.0,
    },
    "h100": {
        "vendor": "nvidia",
        "memory_gib": 79.6,
        "bandwidth_tbs": 3.35,
        "bf16_tflops": 989.0,
        "fp8": "native",
        "fp8_tflops": 1979.0,
        "fp4": "weight_only",
        **_NVLINK4,
    },
    "h200": {
        "vendor": "nvidia",
        "memory_gib": 140.4,
        "bandwidth_tbs": 4.8,
        "bf16_tflops": 989.0,
        "fp8": "native",
        "fp8_tflops": 1979.0,
        "fp4": "weight_only",
        **_NVLINK4,
    },
    "h20": {
        "vendor": "nvidia",
        "memory_gib": 95.6,
        "bandwidth_tbs": 4.0,
        "bf16_tflops": 148.0,
        "fp8": "native",
        "fp8_tflops": 296.0,
        "fp4": "weight_only",
        **_NVLINK4,
    },
    "b200": {
        "vendor": "nvidia",
        "memory_gib": 179.0,
        "bandwidth_tbs": 8.0,
        "bf16_tflops": 2250.0,
        "fp8": "native",
        "fp8_tflops": 4500.0,
        "fp4": "native",
        "fp4_tflops": 9000.0,
        "interconnect": "nvlink",
        "interconnect_gbs": 1800.0,
    },
    "mi300x": {
        "vendor": "amd",
        "memory_gib": 192.0,
        "bandwidth_tbs": 5.3,
        "bf16_tflops": 1307.0,
        "fp8": "native",
        "fp8_tflops": 2615.0,
        "fp4": "none",
        "interconnect": "infinity-fabric",
        "interconnect_gbs": 896.0,
    },
    "mi325x": {
        "vendor": "amd",
        "memory_gib": 256.0,
        "bandwidth_tbs": 6.0,
        "bf16_tflops": 1307.0,
        "fp8": "native",
        "fp8_tflops": 2615.0,
        "fp4": "none",
        "interconnect": "infinity-fabric",
        "interconnect_gbs": 896.0,
    },
    "ascend-910b": {
        "vendor": "huawei",
        "memory_gib": 64.0,
        "bandwidth_tbs": 1.6,
        "bf16_tflops": 320.0,
        "fp8": "none",
        "fp4": "none",
        "int4": "none",
        "interconnect": "hccs",
        "interconnect_gbs": 392.0,
        "note": "public approximations",
    },
    "ascend-910c": {
        "vendor": "huawei",
        "memory_gib": 128.0,
        "bandwidth_tbs": 3.2,
        "bf16_tflops": 780.0,
        "fp8": "none",
        "fp4": "none",
        "int4": "none",
        "interconnect": "hccs",
        "interconnect_gbs": 392.0,
        "note": "public approximations (two 910B-class dies)",
    },
}


def builtin_cards() -> dict[str, Card]:
    return {name: Card.model_validate({"name": name, **spec}) for name, spec in _BUILTIN.items()}


class CardsFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    cards: dict[str, Card] = Field(default_factory=dict)


def load_cards(path: str | Path | None = None) -> Mapping[str, Card]:
    """Built-in cards, then the file's (which add new ones or replace built-in ones)."""
    cards = builtin_cards()
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
            parsed = CardsFile.model_validate(raw)
        except OSError as exc:
            raise ConfigError(f"cannot read cards file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"cards file {path} is not YAML: {exc}") from exc
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"cards file {path}: {where}: {first['msg']}") from exc
        for name, card in parsed.cards.items():
            cards[name.lower()] = card.model_copy(update={"name": name.lower()})
    return MappingProxyType(cards)


def get_card(name: str, cards: Mapping[str, Card] | None = None) -> Card:
    table = cards if cards is not None else load_cards()
    try:
        return table[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown card {name!r}; known: {', '.join(sorted(table))}") from None
