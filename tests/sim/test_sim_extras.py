"""vLLM's other endpoints on the simulated engine (gateway.sim.extras, gateway.sim.speech,
embeddings): tokenize, detokenize, rerank, score, classify, pooling, the audio uploads and
speech, over uvicorn on loopback with httpx and the official `openai` client."""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from sim_helpers import eventually, test_profile

from gateway.sim import extras
from gateway.sim.cluster import SimCluster
from gateway.sim.faults import NO_FAULTS, FaultConfig
from gateway.sim.server import SimEngine
from gateway.sim.speech import RATE, SAMPLES_PER_CHAR, wav_parts
from gateway.sim.tokenizer import approx_token_ids
from gateway.sim.wire import WireError

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "kvgate-sim"


class Served:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster
        self.engine: SimEngine = cluster.engines[0]
        self.url = cluster.urls[0]
        self.http = httpx.AsyncClient(base_url=self.url, timeout=10)
        self.oai = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="-", max_retries=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[Served]:
    async with SimCluster(1, test_profile()) as cluster:
        s = Served(cluster)
        try:
            yield s
        finally:
            await s.http.aclose()
            await s.oai.close()


async def post(served: Served, path: str, body: Any) -> httpx.Response:
    return await served.http.post(path, json=body)


# ---- tokenize / detokenize ------------------------------------------------------------------


async def test_tokenize_and_detokenize_round_trip_ascii(served: Served) -> None:
    text = "The sea is wide and deep."
    got = (await post(served, "/tokenize", {"prompt": text, "return_token_strs": True})).json()
    assert got["count"] == len(got["tokens"]) == -(-len(text) // 4)
    assert got["tokens"] == list(approx_token_ids(text))
    assert "".join(got["token_strs"]) == text
    assert got["max_model_len"] == 1024  # min(max_model_len, KV capacity) of the profile
    back = (await post(served, "/detokenize", {"tokens": got["tokens"]})).json()
    assert back == {"prompt": text}


async def test_tokenize_chat_messages_counts_what_chat_would_prefill(served: Served) -> None:
    messages = [{"role": "user", "content": "count me " * 30}]
    counted = (await post(served, "/tokenize", {"messages": messages})).json()
    assert counted["token_strs"] is None
    chat = await served.oai.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == counted["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
        ("/v1/rerank", {"query": 1, "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/score", {"text_1": None, "text_2": "b"}, "text_1"),
        ("/v1/classify", {"input": 5}, "input"),
        ("/pooling", {"input": []}, "input"),
        ("/v1/audio/speech", {"input": 5}, "input"),
    ],
)
async def test_bad_bodies_get_a_400_naming_the_field(
    served: Served, path: str, body: Any, param: str
) -> None:
    reply = await post(served, path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError"
    assert error["code"] == 400


@pytest.mark.parametrize("path", ["/tokenize", "/v1/score", "/pooling"])
async def test_a_body_that_is_not_a_json_object_is_400(served: Served, path: str) -> None:
    for raw in (b"{oops", b"[1, 2]"):
        reply = await served.http.post(path, content=raw)
        assert reply.status_code == 400, raw
        assert reply.json()["error"]["message"]


async def test_another_model_is_404_on_every_extra_endpoint(served: Served) -> None:
    for path in ("/tokenize", "/v1/rerank", "/score", "/classify", "/pooling"):
        reply = await post(served, path, {"model": "other", "input": "x"})
        assert reply.status_code == 404, path
        assert reply.json()["error"]["param"] == "model"


# ---- rerank / score / classify / pooling ----------------------------------------------------


async def test_rerank_orders_by_score_and_honours_top_n(served: Served) -> None:
    docs = ["the cache", "a router", "prefill and decode", "memory pages"]
    full = (await post(served, "/v1/rerank", {"query": "kv cache", "documents": docs})).json()
    scores = [r["relevance_score"] for r in full["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert sorted(r["index"] for r in full["results"]) == [0, 1, 2, 3]
    assert all(docs[r["index"]] == r["document"]["text"] for r in full["results"])
    top = (
        await post(served, "/v2/rerank", {"query": "kv cache", "documents": docs, "top_n": 2})
    ).json()
    assert top["results"] == full["results"][:2]  # deterministic: the same scores again
    assert top["usage"]["total_tokens"] == full["usage"]["total_tokens"] > 0
    content = {"type": "image_url", "image_url": {"url": "x"}}
    multimodal = await post(served, "/rerank", {"query": content, "documents": content})
    assert multimodal.status_code == 200 and len(multimodal.json()["results"]) == 1


async def test_score_pairs_one_text_with_many_and_rejects_mismatches(served: Served) -> None:
    one_to_many = (
        await post(served, "/v1/score", {"text_1": "q", "text_2": ["a", "b", "c"]})
    ).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    # The newer forms name the same pairs: the same scores.
    queries = (await post(served, "/score", {"queries": "q", "documents": ["a", "b", "c"]})).json()
    assert [d["score"] for d in queries["data"]] == [d["score"] for d in one_to_many["data"]]
    bad = await post(served, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and "same length" in bad.json()["error"]["message"]


async def test_classify_and_pooling_are_deterministic_per_text(served: Served) -> None:
    first = (await post(served, "/v1/classify", {"input": ["good", "bad"]})).json()
    again = (await post(served, "/classify", {"input": ["bad"]})).json()
    assert first["data"][1]["probs"] == again["data"][0]["probs"]
    for item in first["data"]:
        assert item["probs"][0] + item["probs"][1] == pytest.approx(1.0)
        assert item["label"] == ("positive" if item["probs"][1] >= 0.5 else "negative")
    pooled = (await post(served, "/pooling", {"input": ["x", "x", "y"]})).json()
    vectors = [d["data"] for d in pooled["data"]]
    assert vectors[0] == vectors[1] != vectors[2] and len(vectors[0]) == 8
    chat = await post(served, "/pooling", {"messages": [{"role": "user", "content": "x"}]})
    assert len(chat.json()["data"]) == 1


async def test_extra_endpoints_answer_an_injected_fault(served: Served) -> None:
    await served.cluster.set_faults(0, FaultConfig(error=503))
    try:
        for path in ("/tokenize", "/v1/embeddings", "/v1/audio/transcriptions"):
            reply = await served.http.post(path, content=b"{}")
            assert reply.status_code == 503, path
            assert reply.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        await served.cluster.set_faults(0, NO_FAULTS)
    assert served.engine.faults.injected_errors >= 3


# ---- embeddings -----------------------------------------------------------------------------


async def test_embeddings_are_unit_vectors_deterministic_per_input(served: Served) -> None:
    out = await served.oai.embeddings.create(model=MODEL, input=["a b c", "d", "a b c"])
    vectors = [d.embedding for d in out.data]
    assert len(vectors[0]) == 32
    assert sum(v * v for v in vectors[0]) == pytest.approx(1.0)
    assert vectors[0] == vectors[2] != vectors[1]
    assert out.usage.prompt_tokens == 2 + 1 + 2
    tokens = await post(served, "/v1/embeddings", {"input": [[1, 2, 3]]})
    assert tokens.status_code == 200  # token-id inputs are taken as their JSON


async def test_embeddings_for_another_model_are_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        await served.oai.embeddings.create(model="other", input="x")
    assert "does not exist" in missing.value.response.json()["error"]["message"]


# ---- audio ----------------------------------------------------------------------------------


async def test_a_transcription_upload_is_checksummed_and_answered(served: Served) -> None:
    audio = bytes(range(256)) * 300  # 76,800 bytes
    before = served.engine.upload_bytes
    out = await served.oai.audio.transcriptions.create(
        model=MODEL, file=("clip.wav", audio, "audio/wav")
    )
    assert out.text == f"simulated transcript of {len(audio)} bytes"
    assert served.engine.uploads[-1] == (hashlib.sha256(audio).hexdigest(), len(audio))
    assert served.engine.upload_bytes - before > len(audio)  # the whole form was counted
    translated = await served.oai.audio.translations.create(
        model=MODEL, file=("clip.wav", audio[:1000], "audio/wav")
    )
    assert translated.text.endswith("1000 bytes")


async def test_a_streamed_transcription_sends_one_chunk_a_word(served: Served) -> None:
    files = {"file": ("a.wav", b"\0" * 64_000, "audio/wav")}
    reply = await served.http.post(
        "/v1/audio/transcriptions", files=files, data={"model": MODEL, "stream": "true"}
    )
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in reply.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import orjson

    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert text == "simulated transcript of 64000 bytes"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert chunks[-1]["usage"] == {"type": "duration", "seconds": 2}
    assert all("usage" not in c for c in chunks[:-1])


@pytest.mark.parametrize(
    ("files", "data", "status"),
    [
        ({"file": ("a.wav", b"x", "audio/wav")}, {"model": "other"}, 404),
        ({"other": ("a.wav", b"x", "audio/wav")}, {"model": MODEL}, 400),
    ],
)
async def test_bad_transcription_forms(
    served: Served, files: dict[str, Any], data: dict[str, str], status: int
) -> None:
    reply = await served.http.post("/v1/audio/transcriptions", files=files, data=data)
    assert reply.status_code == status
    not_a_form = await served.http.post("/v1/audio/transcriptions", json={"file": "x"})
    assert not_a_form.status_code == 400
    assert "multipart/form-data" in not_a_form.json()["error"]["message"]


async def test_speech_is_a_wav_as_long_as_its_text_sent_in_parts(served: Served) -> None:
    text = "hello there"
    async with served.http.stream(
        "POST", "/v1/audio/speech", json={"model": MODEL, "input": text, "voice": "a"}
    ) as reply:
        parts = [p async for p in reply.aiter_raw()]
        length = int(reply.headers["content-length"])
    body = b"".join(parts)
    size = 2 * SAMPLES_PER_CHAR * len(text)
    assert len(body) == length == 44 + size
    assert body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", body[24:28])[0] == RATE
    assert struct.unpack("<I", body[40:44])[0] == size
    assert served.engine.speeches[-1] == (hashlib.sha256(body).hexdigest(), len(body))
    again = await served.http.post("/v1/audio/speech", json={"input": text})
    assert again.content == body  # deterministic noise seeded by the text


async def test_speech_held_back_then_left_by_its_client_counts_a_disconnect(
    served: Served,
) -> None:
    engine = served.engine
    engine.speech_hold = asyncio.Event()
    gone = engine.aborted
    sent = engine.speech_bytes_sent
    speeches = len(engine.speeches)
    try:
        async with served.http.stream(
            "POST", "/v1/audio/speech", json={"input": "x" * 200}
        ) as reply:
            first = await anext(reply.aiter_raw())
            assert first[:4] == b"RIFF"
            await eventually(lambda: engine.speech_bytes_sent > sent)
        await eventually(lambda: engine.aborted == gone + 1)
    finally:
        engine.speech_hold.set()
        engine.speech_hold = None
    assert len(engine.speeches) == speeches  # never sent whole


async def test_wav_parts_are_bounded_and_sum_to_the_size() -> None:
    total, parts = wav_parts("abc", part_bytes=1000)
    chunks = list(parts)
    assert sum(map(len, chunks)) == total == 44 + 2 * SAMPLES_PER_CHAR * 3
    assert all(len(c) <= 1000 for c in chunks[1:]) and len(chunks[0]) == 44
    empty_total, _ = wav_parts("")
    assert empty_total == 44 + 2 * SAMPLES_PER_CHAR  # at least one character's worth


async def test_multipart_parts_reads_fields_and_stops_at_the_closing_boundary() -> None:
    raw = (
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n'
        b"Content-Type: audio/wav\r\n\r\n\x00\x01\r\n"
        b'--b--\r\n--b\r\nContent-Disposition: form-data; name="late"\r\n\r\nx\r\n'
    )
    parts = extras.multipart_parts(raw, 'multipart/form-data; boundary="b"')
    assert parts == {"model": b"m", "file": b"\x00\x01"}
    with pytest.raises(WireError):
        extras.multipart_parts(raw, "multipart/form-data")
