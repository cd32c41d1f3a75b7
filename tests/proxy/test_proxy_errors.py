"""Gateway-made errors: OpenAI error bodies, right statuses, never a 500 or a traceback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway, sim_engines

MODEL = "kvgate-sim"
CHAT = "/v1/chat/completions"


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    async with sim_engines(2, "instant") as engines:
        yield engines


@pytest.fixture
async def gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    async with gateway(engines, limits={"max_body_bytes": 4096, "max_json_depth": 16}) as gw:
        yield gw


@pytest.fixture
async def http(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gw.url) as http:
        yield http


def assert_openai_error(
    resp: httpx.Response, status: int, code: str, param: str | None = None
) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["message"]
    if param is not None:
        assert error["param"] == param
    assert "Traceback" not in resp.text


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"", "invalid_json"),
        (b'{"model": "\xff\xfe"}', "invalid_json"),
        (b"[1,2,3]", "invalid_json"),
        (b'{"model": "kvgate-sim", "messages": [], "max_tokens": 1e999}', "invalid_json"),
        (b'{"model": "kvgate-sim", "messages": ' + b"[" * 40 + b"]" * 40 + b"}", "invalid_request"),
        (b"[" * 3000 + b"]" * 3000, "invalid_json"),
    ],
)
async def test_malformed_bodies(http: httpx.AsyncClient, content: bytes, code: str) -> None:
    resp = await http.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert resp.status_code == 400 or (resp.status_code == 413 and len(content) > 4096)
    if resp.status_code == 400:
        assert_openai_error(resp, 400, code)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": {"role": "user"}}, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**40},
            "max_tokens",
        ),
    ],
)
async def test_invalid_fields(http: httpx.AsyncClient, body: dict[str, object], param: str) -> None:
    assert_openai_error(await http.post(CHAT, json=body), 400, "invalid_request", param)


async def test_completions_prompt_and_embeddings_input(http: httpx.AsyncClient) -> None:
    assert_openai_error(
        await http.post("/v1/completions", json={"model": MODEL, "prompt": {"a": 1}}),
        400,
        "invalid_request",
        "prompt",
    )
    assert_openai_error(
        await http.post("/v1/embeddings", json={"model": MODEL}), 400, "invalid_request", "input"
    )


async def test_wrong_content_type_and_size_limit(http: httpx.AsyncClient) -> None:
    resp = await http.post(
        CHAT, content=b"model=x", headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert_openai_error(resp, 415, "unsupported_media_type")
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_openai_error(await http.post(CHAT, json=big), 413, "payload_too_large")

    async def chunked() -> AsyncIterator[
        bytes
    ]:  # no Content-Length: the limit applies while reading
        for _ in range(10):
            yield b" " * 1000

    assert_openai_error(await http.post(CHAT, content=chunked()), 413, "payload_too_large")


async def test_unknown_model_is_404_for_the_sdk(gw: RunningGateway) -> None:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "x"}]
            )
        assert info.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[])


async def test_no_healthy_replica_is_503_with_retry_after(
    gw: RunningGateway, http: httpx.AsyncClient
) -> None:
    for rid in list(gw.state.cluster.members):
        gw.state.cluster.set_healthy(rid, False)
    resp = await http.post(
        CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    assert_openai_error(resp, 503, "no_healthy_replica")
    assert resp.headers["retry-after"] == "1"
    assert (await http.get("/ready")).status_code == 503
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
        assert info.value.status_code == 503


async def test_upstream_timeout_is_504(engines: list[SimEngine]) -> None:
    from gateway.sim.faults import FaultConfig

    for engine in engines:
        await engine.set_faults(FaultConfig(slow=5.0))
    async with gateway(
        engines, timeouts={"response_headers_s": 0.3}, retries={"max_attempts": 1}
    ) as gw:
        async with openai.AsyncOpenAI(
            base_url=gw.url + "/v1", api_key="k", max_retries=0
        ) as client:
            with pytest.raises(openai.APIStatusError) as info:
                await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "x"}]
                )
            assert info.value.status_code == 504
            assert info.value.code == "upstream_timeout"
        assert all(n == 0 for n in gw.state.cluster.in_flight.values())


async def test_mid_stream_upstream_failure_is_reported_in_band(engines: list[SimEngine]) -> None:
    from gateway.sim.faults import FaultConfig

    await engines[0].set_faults(FaultConfig(stall=2))
    await engines[1].set_faults(FaultConfig(stall=2))
    async with gateway(engines, timeouts={"read_s": 0.3}) as gw:
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            resp = await http.post(
                CHAT,
                json={
                    "model": MODEL,
                    "stream": True,
                    "max_tokens": 50,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
        assert resp.status_code == 200  # the status went out before the engine stalled
        events = [e for e in resp.text.split("\n\n") if e.strip()]
        assert events[-1].startswith('data: {"error"') and "upstream_timeout" in events[-1]
        assert all(n == 0 for n in gw.state.cluster.in_flight.values())


class _BrokenRouter:
    name = "broken"

    def choose(self, request: object, view: object) -> object:
        raise RuntimeError("policy bug")


async def test_a_bug_still_answers_in_openai_shape(
    gw: RunningGateway, http: httpx.AsyncClient
) -> None:
    gw.state.set_router(_BrokenRouter())  # type: ignore[arg-type]
    resp = await http.post(
        CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert "policy bug" not in resp.text and "Traceback" not in resp.text
    assert 'kvgate_errors_total{code="internal_error"} 1.0' in gw.state.metrics.render().decode()
    assert all(n == 0 for n in gw.state.cluster.in_flight.values())
