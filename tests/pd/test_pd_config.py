from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.pd.config import (
    AttentionShape,
    ModelPDSettings,
    PDMode,
    PDProtocol,
    PDSettings,
)


def test_dense_gqa_kv_bytes_per_token() -> None:
    # 80 layers, 8 KV heads of 128, bf16: K and V per head per layer.
    shape = AttentionShape(layers=80, kv_heads=8, head_dim=128, dtype="bf16")
    assert shape.kv_bytes_per_token() == 80 * 2 * 8 * 128 * 2


def test_mla_keeps_one_latent_per_layer() -> None:
    shape = AttentionShape(kind="mla", layers=61, head_dim=576, dtype="fp8")
    assert shape.kv_bytes_per_token() == 61 * 576


def test_hybrid_counts_only_full_attention_layers() -> None:
    full = AttentionShape(layers=48, kv_heads=2, head_dim=256)
    hybrid = AttentionShape(layers=48, kv_heads=2, head_dim=256, kv_layers=12)
    assert hybrid.kv_bytes_per_token() * 4 == full.kv_bytes_per_token()
    with pytest.raises(ValidationError):
        AttentionShape(layers=4, head_dim=64, kv_layers=5)


def test_explicit_bytes_override_shape() -> None:
    cfg = ModelPDSettings(
        mode="auto",
        kv_bytes_per_token=1000,
        attention=AttentionShape(layers=2, head_dim=2),
    )
    assert cfg.bytes_per_token() == 1000


def test_enabled_mode_needs_a_kv_size() -> None:
    with pytest.raises(ValidationError, match="kv_bytes_per_token or attention"):
        ModelPDSettings(mode="auto")
    assert ModelPDSettings().mode is PDMode.NEVER


def test_transfer_seconds_from_bandwidth_and_latency() -> None:
    cfg = ModelPDSettings(
        mode="always", kv_bytes_per_token=125_000, link_gbps=100, link_latency_ms=2.0
    )
    # 10_000 tokens * 125 kB = 1.25 GB = 10 Gbit -> 0.1 s on 100 Gbit/s, plus 2 ms.
    assert cfg.transfer_seconds(10_000) == pytest.approx(0.102)


def test_unknown_keys_rejected_and_frozen() -> None:
    with pytest.raises(ValidationError):
        PDSettings.model_validate({"models": {}, "modes": "auto"})
    settings = PDSettings()
    with pytest.raises(ValidationError):
        settings.default = settings.default  # type: ignore[misc]


def test_model_and_pool_lookup() -> None:
    settings = PDSettings.model_validate(
        {
            "models": {
                "*": {"mode": "auto", "kv_bytes_per_token": 10},
                "big": {"mode": "always", "kv_bytes_per_token": 20},
            },
            "pools": {"domestic": {"protocol": "sglang", "bootstrap_port": 9000}},
            "bootstrap_ports": {"p1": 9100},
        }
    )
    assert settings.enabled
    big = settings.for_model("big")
    other = settings.for_model("other")
    assert big is not None and big.mode is PDMode.ALWAYS
    assert other is not None and other.mode is PDMode.AUTO
    assert settings.for_pool("domestic").protocol is PDProtocol.SGLANG
    assert settings.for_pool(None).protocol is PDProtocol.VLLM
    assert settings.for_pool("elsewhere").protocol is PDProtocol.VLLM
    assert settings.bootstrap_port("p0", "domestic") == 9000
    assert settings.bootstrap_port("p1", "domestic") == 9100
    assert settings.bootstrap_port("p0", None) == 8998
    assert not PDSettings().enabled
    assert PDSettings().for_model("x") is None


def test_which_replicas_serve_whole_requests() -> None:
    from gateway.types import ReplicaId, ReplicaState, Role

    settings = PDSettings.model_validate({"pools": {"sg": {"protocol": "sglang"}}})

    def replica(role: Role, pool: str | None = None) -> ReplicaState:
        return ReplicaState(id=ReplicaId("r"), url="http://h:1", role=role, pool=pool)

    assert settings.serves_whole(replica(Role.BOTH, "sg"))
    assert settings.serves_whole(replica(Role.DECODE))
    assert not settings.serves_whole(replica(Role.DECODE, "sg"))
    assert not settings.serves_whole(replica(Role.PREFILL))
