"""Incremental tokenization: a later turn reuses the earlier turn's token ids, and the result
is always the whole prompt's tokenization (sim tokenizer, and a byte-level BPE trained here)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest

from gateway.kvevents.incremental import Encoded, IncrementalEncoder
from gateway.kvevents.install import KVEventsFeature
from gateway.kvevents.render import HFRenderer, Renderer, SimRenderer
from gateway.kvevents.tokcache import CHUNK_CHARS, Entry, TokenCache, chunk_hashes
from gateway.kvevents.tokenkeys import chain_keys, root_seed
from gateway.sim.server import KVEventsOptions
from gateway.sim.tokenizer import approx_token_ids
from gateway.testing.servers import gateway, sim_engines
from gateway.types import Endpoint

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = [
    "the",
    "cache",
    "block",
    "token",
    "prefix",
    "engine",
    "route",
    "replica",
    "evict",
    "memory",
    "write",
    "path",
    "log",
    "memtable",
    "compaction",
    "flush",
    "déjà",
    "naïve",
    "東京",
    "🚀",
    "x=1;",
    "f(a,b)",
    "->",
    "{k:",
    "v}",
    "3.14",
    "...",
    "!!",
]


def text(rng: random.Random, n_words: int) -> str:
    out = []
    for _ in range(n_words):
        out.append(rng.choice(WORDS))
        out.append(rng.choice([" ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", "\t", ""]))
    return "".join(out)


def conversations(seed: int, layout: str, turns: int = 7) -> list[list[dict[str, Any]]]:
    """The message lists of one conversation's successive requests."""
    rng = random.Random(seed)
    system = {"role": "system", "content": text(rng, rng.randint(50, 400))}
    history: list[tuple[str, str]] = []
    out = []
    for _ in range(turns):
        history.append(("user", text(rng, rng.randint(20, 300))))
        if layout == "turns":
            msgs = [system] + [{"role": r, "content": c} for r, c in history]
        else:  # growing: the whole conversation so far in one user message
            joined = "\n".join(f"{r}: {c}" for r, c in history)
            msgs = [system, {"role": "user", "content": joined}]
        out.append(msgs)
        history.append(("assistant", text(rng, rng.randint(5, 200))))
    return out


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rng = random.Random(0)
    tok.train_from_iterator([text(rng, 80) for _ in range(200)], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def renderers(kind: str, bpe: str | None, cache: TokenCache | None) -> Renderer:
    if kind == "sim":
        return SimRenderer(cache, 16)
    pytest.importorskip("jinja2")
    assert bpe is not None
    return HFRenderer(bpe, CHATML, {}, cache, 16)


@pytest.mark.parametrize("layout", ["turns", "growing"])
@pytest.mark.parametrize("kind", ["sim", "bpe"])
def test_incremental_ids_equal_whole_prompt_tokenization(
    kind: str, layout: str, request: pytest.FixtureRequest
) -> None:
    bpe = request.getfixturevalue("bpe_path") if kind == "bpe" else None
    cache = TokenCache()
    incremental = renderers(kind, bpe, cache)
    whole = renderers(kind, bpe, None)
    outcomes: list[str] = []
    reused = 0
    for seed in range(25):
        for msgs in conversations(seed, layout):
            body = {"model": "m", "messages": msgs}
            got = incremental.render(body, Endpoint.CHAT)
            want = whole.render(body, Endpoint.CHAT)
            assert got is not None and want is not None
            assert list(got.token_ids) == list(want.token_ids)
            assert list(got.token_ends) == list(want.token_ends)
            assert got.keys is not None
            assert list(got.keys) == chain_keys(want.token_ids, 16, root_seed())
            outcomes.append(got.reuse)
            reused += got.reused
    # Every later turn long enough to share a chunk with the previous one extends it.
    assert outcomes.count("hit") > len(outcomes) // 2, outcomes
    assert "fallback" not in outcomes
    assert reused > 0
    # Each turn replaced the entry it fully extends: one per conversation when a turn
    # repeats the previous one's generation prompt (turns), else at most the last two.
    assert len(cache) <= (25 if layout == "turns" else 50)


def test_a_completion_prompt_keeps_its_leading_special_token(bpe_path: str) -> None:
    pytest.importorskip("jinja2")
    cache = TokenCache()
    incremental = HFRenderer(bpe_path, None, {}, cache)
    whole = HFRenderer(bpe_path, None, {})
    rng = random.Random(5)
    prompt = text(rng, 900)
    for _ in range(4):
        prompt += text(rng, 200)
        got = incremental.render({"prompt": prompt}, Endpoint.COMPLETIONS)
        want = whole.render({"prompt": prompt}, Endpoint.COMPLETIONS)
        assert got is not None and want is not None
        assert list(got.token_ids) == list(want.token_ids)
    assert got.reuse == "hit"


def _context_dependent(text: str, specials: bool) -> tuple[Sequence[int], Sequence[int]]:
    """A tokenizer whose every id depends on how its input starts (a tail never agrees)."""
    mark = ord(text[0]) if text else 0
    ids = [i ^ mark for i in approx_token_ids(text)]
    return ids, [min(4 * (i + 1), len(text)) for i in range(len(ids))]


def test_a_disagreeing_overlap_falls_back_to_whole_tokenization() -> None:
    cache = TokenCache()
    encoder = IncrementalEncoder(_context_dependent, cache, 16)
    rng = random.Random(1)
    first = "Q" + text(rng, 2000)
    assert encoder(first, False).reuse == "miss"
    second = first + text(rng, 100)
    enc: Encoded = encoder(second, False)
    assert enc.reuse == "fallback" and enc.reused == 0
    assert list(enc.ids) == list(_context_dependent(second, False)[0])
    assert len(cache) == 1  # the whole tokenization replaced the entry it extends


def test_a_changed_early_message_is_not_reused() -> None:
    cache = TokenCache()
    renderer = SimRenderer(cache)
    rng = random.Random(2)
    msgs = conversations(3, "turns")[-1]
    assert renderer.render({"messages": msgs}, Endpoint.CHAT) is not None
    edited = [{**msgs[0], "content": "Other system. " + msgs[0]["content"]}, *msgs[1:]]
    edited[-1] = {**edited[-1], "content": edited[-1]["content"] + text(rng, 20)}
    got = renderer.render({"messages": edited}, Endpoint.CHAT)
    assert got is not None and got.reuse == "miss"


def entry(n_chunks: int, tag: int, tokens: int = 100) -> Entry:
    from array import array

    hashes = tuple(chunk_hashes(f"{tag:08d}" * (CHUNK_CHARS // 8) * n_chunks))
    return Entry(hashes, array("I", range(tokens)), array("q", range(tokens)), array("Q"))


def test_the_cache_is_bounded_by_entries_and_bytes() -> None:
    cache = TokenCache(max_entries=3, max_bytes=1 << 30)
    entries = [entry(2, t) for t in range(5)]
    for e in entries:
        cache.put(e)
    assert len(cache) == 3 and cache.stats().evictions == 2
    assert cache.find(entries[0].hashes) is None  # least recently used first
    found = cache.find(entries[4].hashes)
    assert found is not None and found[0] is entries[4] and found[1] == 2
    assert cache.stats().bytes == sum(e.size for e in entries[2:])

    one = entries[0].size
    small = TokenCache(max_entries=100, max_bytes=2 * one + one // 2)
    for e in entries:
        small.put(e)
    assert len(small) == 2 and small.stats().bytes <= small.max_bytes
    huge = entry(1, 9, tokens=1 << 16)
    small.put(huge)  # larger than the whole bound: not kept, nothing evicted for it
    assert len(small) == 2 and small.find(huge.hashes) is None


def test_an_extending_entry_replaces_the_one_it_extends() -> None:
    cache = TokenCache()
    base = entry(2, 7)
    cache.put(base)
    longer = Entry(
        base.hashes + (123,), base.ids, base.ends, base.keys
    )  # same leading chunks, one more
    cache.put(longer, replaces=base)
    assert len(cache) == 1 and cache.stats().bytes == longer.size
    found = cache.find(base.hashes)
    assert found is not None and found[0] is longer and found[1] == 2


@pytest.mark.parametrize("executor", ["thread", "process"])
async def test_a_gateway_tokenizes_each_turn_incrementally(executor: str) -> None:
    # In a worker process (gateway.kvevents.workers) as in a thread: one worker, one
    # conversation, so every later turn finds the earlier one in that worker's cache.
    from tests.kvevents.test_kv_routing import MODEL, sources, until

    tokenizer = {"kind": "sim", "executor": executor}
    async with (
        sim_engines(2, "instant", kv_events=KVEventsOptions()) as engines,
        gateway(
            engines,
            kv_events={"enabled": True, "sources": sources(engines), "tokenizer": tokenizer},
        ) as gw,
        openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client,
        httpx.AsyncClient(base_url=gw.url) as http,
    ):
        feature: KVEventsFeature = gw.state.extras["kv_events"]
        processes = feature.stage.processes
        assert (processes is not None) is (executor == "process")
        rng = random.Random(4)
        messages: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 1500)}]
        for _ in range(4):
            # More than a prompt block (2048 bytes) a turn, else the stage knows it already.
            messages.append({"role": "user", "content": text(rng, 600)})
            done = await client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=4,
            )
            await until(lambda: feature.stage.pending == 0)
            messages.append({"role": "assistant", "content": done.choices[0].message.content})
        page = (await http.get("/metrics")).text
        assert len(feature.bridge) >= 4
        worker = processes._procs[0].proc if processes is not None else None
        assert worker is None or worker.returncode is None
    assert 'kvgate_kv_token_cache_lookups_total{outcome="miss"} 1.0' in page
    assert 'kvgate_kv_token_cache_lookups_total{outcome="hit"} 3.0' in page
    assert "kvgate_kv_token_cache_entries 1.0" in page
    assert 'kvgate_kv_tokenize_jobs_total{outcome="done"} 4.0' in page
    reused = [ln for ln in page.splitlines() if ln.startswith("kvgate_kv_token_cache_reused")]
    assert reused and float(reused[0].split()[-1]) > 3 * 1000
    assert worker is None or worker.returncode is not None  # the gateway's stop ended it


def test_stable_tokens_count_ascii_content_as_decoding_would() -> None:
    from dataclasses import replace

    msgs = conversations(8, "turns")[-1]
    ascii_msgs = [{**m, "content": m["content"].encode("ascii", "ignore").decode()} for m in msgs]
    rendered = SimRenderer().render({"messages": ascii_msgs}, Endpoint.CHAT)
    assert rendered is not None and all(s.ascii for s in rendered.spans)
    decoding = replace(rendered, spans=tuple(replace(s, ascii=False) for s in rendered.spans))
    for end in range(0, rendered.canon_size + 8, 7):
        assert rendered.stable_tokens(end) == decoding.stable_tokens(end)


def test_the_cache_bounds_come_from_the_tokenizer_settings() -> None:
    from gateway.kvevents.config import TokenizerSettings
    from gateway.kvevents.install import make_cache

    cache = make_cache(TokenizerSettings(kind="sim", cache_entries=8, cache_bytes=1 << 20))
    assert cache is not None and (cache.max_entries, cache.max_bytes) == (8, 1 << 20)
    assert make_cache(TokenizerSettings(kind="sim", cache_entries=0)) is None
