"""Record what the released engines put on the wire, from their own code, as test fixtures.

    python tools/record_engine_fixtures.py [--wheels DIR] [--out tests/fixtures/engines]

Downloads the vLLM and SGLang wheels (`pip download --no-deps`, nothing installed), unzips
only the modules named below and loads them with importlib. CI never runs this: the tests
read the JSON it writes (tests/fixtures/engines/<engine>-<version>/), so they need no
engine wheel, GPU or model.

What is real and what is a stand-in (each fixture file says it again under "recorded"):

* KV events: the engines' own `ZmqEventPublisher` (PUB + replay ROUTER) and event
  structs (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`) publish on
  loopback; a SUB socket records the live frames and a DEALER the replay answers, byte for
  byte. For SGLang, `BlockStored` events are made by its real `KVCacheEventRecorder`
  (sglang/srt/mem_cache/events.py: page splitting, EAGLE bigram pairs, salt, LoRA name,
  coalescing) from stand-in radix nodes.
* Imports the engines need and that would pull in torch, CUDA kernels or the whole
  config system are stubbed, each with the smallest thing that behaves the same for this
  code (see `_stub_vllm` and `_stub_sglang`). SGLang's page hash is stubbed (it is a C++
  extension): the block hash *values* are therefore stand-ins, their type and chaining
  real. kvgate never compares engine hash values with anything but each other.
* Metric names and label sets are read from the engines' source with `ast` (the stat
  loggers cannot be imported without the engine); vLLM's `cache_config_info` labels are
  the field names of its `CacheConfig`.
* SGLang `/server_info` and vLLM `/kv_event_sources` / `cache_config_info` bodies: built
  from the engine's own config classes and declared defaults (read with `ast`), as the
  route code serializes them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from typing import Any

import zmq

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"

VLLM_FILES = (
    "vllm/config/kv_events.py",
    "vllm/distributed/kv_events.py",
    "vllm/v1/metrics/loggers.py",
    "vllm/config/cache.py",
)
SGLANG_FILES = (
    "sglang/srt/disaggregation/kv_events.py",
    "sglang/srt/utils/network.py",
    "sglang/srt/mem_cache/events.py",
    "sglang/srt/observability/metrics_collector.py",
    "sglang/srt/arg_groups/fields/schedule.py",
    "sglang/srt/arg_groups/fields/observability.py",
    "sglang/srt/arg_groups/fields/serving.py",
)


# ---- getting the code ----------------------------------------------------------------------


def wheel(wheels: Path, name: str, version: str) -> Path:
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", f"{name}=={version}"]
            + ["-d", str(wheels)],
            check=True,
        )
        found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    return found[0]


def unzip(whl: Path, names: tuple[str, ...], into: Path) -> str:
    with zipfile.ZipFile(whl) as z:
        for n in names:
            z.extract(n, into)
    return hashlib.sha256(whl.read_bytes()).hexdigest()


def load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stub(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _stub_vllm() -> None:
    # vllm.config.utils.config is a pydantic-dataclass decorator; a plain dataclass keeps
    # the fields and defaults (all KVEventsConfig needs). The logger is vLLM's logging
    # setup; network_utils is only used for `tcp://*:0` binds (not used here);
    # ExternalBlockHash is `bytes | int` in kv_cache_utils (which imports torch).
    stub("vllm")
    stub("vllm.config")
    stub("vllm.config.utils", config=dataclasses.dataclass)
    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.utils")
    stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: False,
        split_zmq_path=lambda path: tuple(path.replace("://", ":").split(":")),
    )
    stub("vllm.v1")
    stub("vllm.v1.core")
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)


def _stub_sglang() -> None:
    # get_parallel is the scheduler's runtime context (not used by the publisher itself);
    # mem_cache.utils imports CUDA kernels: its three hash helpers are replaced by a plain
    # sha256 chain of the same types (hex strings, then int64).
    stub("sglang")
    stub("sglang.srt")
    stub("sglang.srt.runtime_context", get_parallel=lambda: None)

    def node_hashes(node: Any, page_size: int) -> list[str]:
        prior = b""
        if node.parent is not None and node.parent.hash_value:
            prior = bytes.fromhex(node.parent.hash_value[-1])
        out = []
        raw = list(node.key.token_ids)
        for start in range(0, len(node.key), page_size):
            prior = hashlib.sha256(prior + repr(raw[start : start + page_size]).encode()).digest()
            out.append(prior.hex())
        return out

    def event_hashes(node: Any, page_size: int) -> list[str]:
        salt = f"{node.key.extra_key}|{node.key.cache_salt}".encode()
        return [
            hashlib.sha256(salt + bytes.fromhex(h)).hexdigest()
            for h in node_hashes(node, page_size)
        ]

    stub(
        "sglang.srt.mem_cache.utils",
        compute_node_hash_values=node_hashes,
        compute_node_event_hash_values=event_hashes,
        hash_str_to_int64=lambda s: int.from_bytes(bytes.fromhex(s[:16]), "big", signed=True),
    )


# ---- recording frames ------------------------------------------------------------------------


def hexframes(frames: list[bytes]) -> list[str]:
    return [f.hex() for f in frames]


class Recorder:
    """A SUB on the publisher's PUB endpoint and a DEALER on its replay endpoint."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, replay: str | None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.ctx = ctx
        time.sleep(0.3)  # the slow-joiner: PUB drops what it sends before the SUB is in

    def live(self, count: int) -> list[list[str]]:
        out = []
        while len(out) < count and self.sub.poll(3000):
            out.append(hexframes(self.sub.recv_multipart()))
        if len(out) != count:
            raise RuntimeError(f"expected {count} live messages, got {len(out)}")
        return out

    def replay(self, start: int) -> list[list[str]]:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while dealer.poll(3000):
            frames = dealer.recv_multipart()
            out.append(hexframes(frames))
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(0)
        return out

    def close(self) -> None:
        self.sub.close(0)


def ports(base: int) -> tuple[str, str]:
    # Wildcard hosts: both publishers bind those (a concrete host makes vLLM's PUB connect).
    return f"tcp://*:{base}", f"tcp://*:{base + 100}"


def dial(endpoint: str) -> str:
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:")


def free_base() -> int:
    """A port p with p, p+1 (a second DP rank) and p+100, p+101 (their replay) free."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 102 >= 65535:
            continue
        try:
            for p in (port, port + 1, port + 100, port + 101):
                with socket.socket() as t:
                    t.bind(("0.0.0.0", p))
        except OSError:
            continue
        return port


def run_scenario(
    ctx: zmq.Context[Any],
    make: Any,
    batches: list[Any],
    *,
    rank: int,
    topic: str,
    make_kwargs: dict[str, Any],
    base: int | None = None,
) -> dict[str, Any]:
    """Publish `batches` through a real publisher of DP rank `rank` and record them."""
    base = base or free_base()
    endpoint, replay = ports(base)
    pub = make(rank, endpoint=endpoint, replay_endpoint=replay, topic=topic, **make_kwargs)
    # The publisher puts rank r on port+r: what a subscriber must dial.
    endpoint_r = pub.offset_endpoint_port(endpoint, rank)
    replay_r = pub.offset_endpoint_port(replay, rank)
    rec = Recorder(ctx, dial(endpoint_r), dial(replay_r))
    try:
        for b in batches:
            pub.publish(b)
        live = rec.live(len(batches))
        replay_all = rec.replay(0)
        replay_tail = rec.replay(len(batches) - 1)
        config = None
        if hasattr(pub, "get_publisher_config"):
            config = dataclasses.asdict(pub.get_publisher_config())
        return {
            "dp_rank": rank,
            "topic": topic,
            "endpoint": endpoint,
            "endpoint_for_rank": endpoint_r,
            "replay_endpoint_for_rank": replay_r,
            "publisher_config": config,
            "live": live,
            "replay_from_0": replay_all,
            "replay_from_last": replay_tail,
        }
    finally:
        rec.close()
        pub.shutdown()


# ---- vLLM ------------------------------------------------------------------------------------


def record_vllm(src: Path) -> dict[str, Any]:
    _stub_vllm()
    load("vllm.config.kv_events", src / "vllm/config/kv_events.py")
    ev = load("vllm.distributed.kv_events", src / "vllm/distributed/kv_events.py")
    stored, removed, cleared, batch = (
        ev.BlockStored,
        ev.BlockRemoved,
        ev.AllBlocksCleared,
        ev.KVEventBatch,
    )
    bs = 16
    toks = list(range(100, 100 + 3 * bs))
    h = [0x1111, 0x2222, 0x3333]

    def s(**kw: Any) -> Any:
        base = {"lora_id": None, "medium": "GPU", "lora_name": None}
        base.update(kw)
        return stored(**base)

    plain = [
        batch(
            time.time(),
            [
                s(
                    block_hashes=h[:2],
                    parent_block_hash=None,
                    token_ids=toks[: 2 * bs],
                    block_size=bs,
                )
            ],
        ),
        batch(
            time.time(),
            [
                s(
                    block_hashes=h[2:],
                    parent_block_hash=h[1],
                    token_ids=toks[2 * bs :],
                    block_size=bs,
                )
            ],
        ),
        batch(time.time(), [removed(block_hashes=h[2:], medium="GPU")]),
        batch(time.time(), [cleared()]),
    ]
    # LoRA: vLLM puts the adapter name first in every block's extra keys; a cache_salt goes
    # into the first block's (after any multimodal keys).
    # Fresh structs: a publisher stamps its rank on a batch that has none.
    rank1 = [
        batch(
            time.time(),
            [
                s(
                    block_hashes=h[:2],
                    parent_block_hash=None,
                    token_ids=toks[: 2 * bs],
                    block_size=bs,
                )
            ],
        ),
        batch(
            time.time(),
            [
                s(
                    block_hashes=h[2:],
                    parent_block_hash=h[1],
                    token_ids=toks[2 * bs :],
                    block_size=bs,
                )
            ],
        ),
    ]
    namespaced = [
        batch(
            time.time(),
            [
                s(
                    block_hashes=[0x41, 0x42],
                    parent_block_hash=None,
                    token_ids=toks[: 2 * bs],
                    block_size=bs,
                    lora_id=1,
                    lora_name="sql-adapter",
                    extra_keys=[["sql-adapter"], ["sql-adapter"]],
                )
            ],
        ),
        batch(
            time.time(),
            [
                s(
                    block_hashes=[0x51],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    extra_keys=[["tenant-a"]],
                )
            ],
        ),
        batch(
            time.time(),
            [
                s(
                    block_hashes=[0x61],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    extra_keys=[[["img-1", 0]]],
                )
            ],
        ),
    ]
    tiers = [
        batch(
            time.time(),
            [
                s(
                    block_hashes=h[:1],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    medium="GPU",
                )
            ],
        ),
        batch(
            time.time(),
            [
                s(
                    block_hashes=h[:1],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    medium="CPU",
                )
            ],
        ),
        batch(
            time.time(),
            [
                s(
                    block_hashes=h[:1],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    medium="STORAGE",
                    locality="LOCAL",
                    ownership="lmcache",
                )
            ],
        ),
        batch(time.time(), [removed(block_hashes=h[:1], medium="GPU")]),
    ]
    # A hybrid model: a full-attention group and a sliding-window group publish the same
    # tokens under their own hashes.
    hybrid = [
        batch(
            time.time(),
            [
                s(
                    block_hashes=[0x71],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    group_idx=0,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128,
                ),
                s(
                    block_hashes=[0x81],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    group_idx=1,
                    kv_cache_spec_kind="full_attention",
                ),
            ],
        ),
        batch(time.time(), [removed(block_hashes=[0x71], medium="GPU", group_idx=0)]),
    ]
    spec = [
        batch(
            time.time(),
            [
                s(
                    block_hashes=[0x91],
                    parent_block_hash=None,
                    token_ids=toks[:bs],
                    block_size=bs,
                    session_id="conv-7",
                    lookahead_token_ids=[[toks[bs]]],
                )
            ],
        ),
    ]
    ctx = zmq.Context.instance()
    make = ev.ZmqEventPublisher
    base = free_base()  # one engine: rank r on base + r
    scenarios = {
        "plain": run_scenario(ctx, make, plain, rank=0, topic="", make_kwargs={}, base=base),
        "plain_dp_rank1": run_scenario(
            ctx, make, rank1, rank=1, topic="", make_kwargs={}, base=base
        ),
        "namespaced": run_scenario(ctx, make, namespaced, rank=0, topic="", make_kwargs={}),
        "tiers": run_scenario(ctx, make, tiers, rank=0, topic="", make_kwargs={}),
        "hybrid": run_scenario(ctx, make, hybrid, rank=0, topic="", make_kwargs={}),
        "lookahead_session": run_scenario(ctx, make, spec, rank=0, topic="", make_kwargs={}),
    }
    # /kv_event_sources: {dp_rank: KVEventsConfig} as FastAPI serializes it.
    sources = {
        str(sc["dp_rank"]): sc["publisher_config"]
        for sc in (scenarios["plain"], scenarios["plain_dp_rank1"])
    }
    return {"events": scenarios, "kv_event_sources": sources}


def _call_names(tree: ast.AST, prefix: str) -> list[dict[str, Any]]:
    """Every `X(name="<prefix>...", labelnames=...)` call: name, kind and label expression."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        name = kw.get("name")
        if not (isinstance(name, ast.Constant) and str(name.value).startswith(prefix)):
            continue
        func = node.func
        kind = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?")
        labels = kw.get("labelnames")
        out.append(
            {
                "name": name.value,
                "kind": kind.removeprefix("_").removesuffix("_cls"),
                "labelnames_source": ast.unparse(labels) if labels is not None else None,
            }
        )
    return out


def vllm_metrics(src: Path) -> dict[str, Any]:
    tree = ast.parse((src / "vllm/v1/metrics/loggers.py").read_text())
    series = _call_names(tree, "vllm:")
    base = ["model_name", "engine"]  # `labelnames = ["model_name", "engine"]` in loggers.py
    for s in series:
        expr = s["labelnames_source"]
        if expr == "labelnames":
            s["labels"] = base
        elif expr and expr.startswith("labelnames + ["):
            s["labels"] = base + ast.literal_eval(expr.removeprefix("labelnames + "))
    cache = ast.parse((src / "vllm/config/cache.py").read_text())
    fields: list[str] = []
    for node in ast.walk(cache):
        if isinstance(node, ast.ClassDef) and node.name == "CacheConfig":
            for stmt in node.body:
                target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
                if (
                    isinstance(target, ast.Name)
                    and not target.id.startswith("_")
                    and not target.id.isupper()
                ):
                    fields.append(target.id)
    # `name = "vllm:cache_config_info"` then `Gauge(name=name, labelnames=metrics_info.keys())`:
    # an info gauge whose labels are CacheConfig's fields (`metrics_info()`), value 1.
    series.append({"name": "vllm:cache_config_info", "kind": "gauge", "labels": fields})
    return {"series": series}


# ---- SGLang ----------------------------------------------------------------------------------


class _Key:
    """A stand-in for sglang's RadixKey: the attributes KVCacheEventRecorder reads."""

    def __init__(
        self,
        ids: list[int],
        *,
        bigram: bool = False,
        salt: str | None = None,
        extra: str | None = None,
    ) -> None:
        self.token_ids = ids
        self.is_bigram = bigram
        self.cache_salt = salt
        self.extra_key = extra

    def __len__(self) -> int:
        n = len(self.token_ids)
        return (n - 1 if n else 0) if self.is_bigram else n


class _Node:
    def __init__(self, key: _Key, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.hash_value: list[str] | None = None
        self.event_hash_value: list[str] | None = None


def record_sglang(src: Path) -> dict[str, Any]:
    _stub_sglang()
    load("sglang.srt.utils.network", src / "sglang/srt/utils/network.py")
    ev = load("sglang.srt.disaggregation.kv_events", src / "sglang/srt/disaggregation/kv_events.py")
    rec_mod = load("sglang.srt.mem_cache.events", src / "sglang/srt/mem_cache/events.py")

    def events_of(page: int, build: Any, **kw: Any) -> list[Any]:
        recorder = rec_mod.KVCacheEventRecorder(enabled=True, page_size=page, **kw)
        build(recorder)
        return list(recorder.take())

    root = _Node(_Key([]), None)
    root.hash_value = []
    toks = list(range(100, 148))

    def chain(page: int, **key_kw: Any) -> Any:
        def build(r: Any) -> None:
            a = _Node(_Key(toks[:32], **key_kw), root)
            r.record_store(a)
            b = _Node(_Key(toks[32:48], **key_kw), a)
            r.record_store(b)

        return build

    def removal(page: int) -> Any:
        def build(r: Any) -> None:
            a = _Node(_Key(toks[:32]), root)
            r.record_store(a)
            b = _Node(_Key(toks[32:48]), a)
            r.record_store(b)
            r.record_remove(b)
            r.record_store(b, medium=ev.StorageMedium.CPU)
            r.record_store(b, medium=ev.StorageMedium.EXTERNAL)
            r.record_all_cleared()

        return build

    def bigram(r: Any) -> None:
        # EAGLE: the radix key holds N+1 raw tokens for N bigrams.
        a = _Node(_Key(toks[:33], bigram=True), root)
        r.record_store(a)

    def salted(r: Any) -> None:
        a = _Node(_Key(toks[:16], salt="tenant-a"), root)
        r.record_store(a)

    lora_names = rec_mod.KvEventLoraNames()

    class _Req:
        extra_key = "adapter-uuid-0000000000000000000000"
        lora_id = "adapter-uuid-0000000000000000000000"

    lora_names.register(_Req(), lora_name="sql-adapter")

    def lora(r: Any) -> None:
        a = _Node(_Key(toks[:16], extra=_Req.extra_key), root)
        r.record_store(a)

    batch = ev.KVEventBatch
    page1 = events_of(1, chain(1))
    page16 = events_of(16, chain(16))
    scenarios_in = {
        "page1": [batch(time.time(), page1)],
        "page16": [batch(time.time(), page16), batch(time.time(), events_of(16, removal(16)))],
        "page16_dp_rank1": [batch(time.time(), events_of(16, chain(16)))],
        "eagle_bigram_page1": [batch(time.time(), events_of(1, bigram))],
        "salted": [batch(time.time(), events_of(16, salted))],
        "lora": [batch(time.time(), events_of(16, lora, lora_names=lora_names))],
    }
    ctx = zmq.Context.instance()
    make = ev.ZmqEventPublisher
    scenarios = {}
    for name, batches in scenarios_in.items():
        rank = 1 if name.endswith("dp_rank1") else 0
        scenarios[name] = run_scenario(
            ctx, make, batches, rank=rank, topic="", make_kwargs={"bind": True}
        )
    return {"events": scenarios}


def _declared_defaults(path: Path, names: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id in names and node.value is not None:
            try:
                out[target.id] = ast.literal_eval(node.value)
            except ValueError:
                out[target.id] = ast.unparse(node.value)
    return out


def sglang_metrics_and_info(src: Path) -> dict[str, Any]:
    tree = ast.parse((src / "sglang/srt/observability/metrics_collector.py").read_text())
    series = _call_names(tree, "sglang:")
    # The scheduler collector's `labels` dict (metrics_collector.py, `labels = {...}`):
    # priority only with priority scheduling, dp_rank only under DP.
    base = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
    for s in series:
        if s["labelnames_source"] == "labels.keys()":
            s["labels"] = base
            s["optional_labels"] = ["priority", "dp_rank"]
    wanted = {
        "enable_metrics",
        "enable_priority_scheduling",
        "schedule_low_priority_values_first",
        "page_size",
        "enable_cache_report",
    }
    defaults: dict[str, Any] = {}
    for f in ("schedule.py", "observability.py", "serving.py"):
        defaults.update(_declared_defaults(src / "sglang/srt/arg_groups/fields" / f, wanted))
    return {"series": series, "server_args_defaults": defaults}


# ---- main ------------------------------------------------------------------------------------


def write(out: Path, name: str, body: dict[str, Any], recorded: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({"recorded": recorded, **body}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheels", type=Path, default=Path(tempfile.gettempdir()) / "kvgate-wheels")
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/engines"))
    args = ap.parse_args()
    args.wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp)
        vw = wheel(args.wheels, "vllm", VLLM_VERSION)
        sw = wheel(args.wheels, "sglang", SGLANG_VERSION)
        vsha = unzip(vw, VLLM_FILES, src)
        ssha = unzip(sw, SGLANG_FILES, src)
        info = {
            "msgspec": _version("msgspec"),
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
        }
        vdir = args.out / f"vllm-{VLLM_VERSION}"
        vrec = {"engine": "vllm", "version": VLLM_VERSION, "wheel": vw.name, "sha256": vsha, **info}
        v = record_vllm(src)
        write(
            vdir,
            "events.json",
            {"scenarios": v["events"]},
            {
                **vrec,
                "how": "vllm/distributed/kv_events.py ZmqEventPublisher + event structs, live",
            },
        )
        write(
            vdir,
            "http.json",
            {"kv_event_sources": v["kv_event_sources"]},
            {
                **vrec,
                "how": "GET /kv_event_sources: {dp_rank: KVEventsConfig} from the real publishers' get_publisher_config()",
            },
        )
        write(
            vdir,
            "metrics.json",
            vllm_metrics(src),
            {
                **vrec,
                "how": "ast of vllm/v1/metrics/loggers.py and CacheConfig (vllm/config/cache.py)",
            },
        )
        sdir = args.out / f"sglang-{SGLANG_VERSION}"
        srec = {
            "engine": "sglang",
            "version": SGLANG_VERSION,
            "wheel": sw.name,
            "sha256": ssha,
            **info,
        }
        s = record_sglang(src)
        write(
            sdir,
            "events.json",
            {"scenarios": s["events"]},
            {
                **srec,
                "how": "sglang/srt/disaggregation/kv_events.py ZmqEventPublisher + mem_cache/events.py KVCacheEventRecorder, live; page hash stubbed",
            },
        )
        write(
            sdir,
            "metrics.json",
            sglang_metrics_and_info(src),
            {
                **srec,
                "how": "ast of sglang/srt/observability/metrics_collector.py and arg_groups/fields/*.py",
            },
        )
    print(f"wrote fixtures under {args.out}")


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
