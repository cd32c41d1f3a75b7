"""Broken configuration is reported, never a traceback; URLs with fragments (issue 19, item 8)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from gateway.cli import main
from gateway.errors import ConfigError
from gateway.settings import load_settings
from gateway.testing.servers import gateway, sim_engines


def test_non_utf8_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"server:\n  host: caf\xe9\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "UTF-8" in err and "Traceback" not in err
    assert main(["serve", "-c", str(bad)]) == 2
    assert "UTF-8" in capsys.readouterr().err


def test_invalid_json_in_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = tmp_path / "ok.yaml"
    ok.write_text("server:\n  port: 9000\n")
    monkeypatch.setenv("KVGATE_REPLICAS", "[{bad")
    assert main(["check-config", str(ok)]) == 1
    err = capsys.readouterr().err
    assert "KVGATE_REPLICAS" in err and "JSON" in err
    assert main(["serve", "-c", str(ok)]) == 2
    assert "KVGATE_REPLICAS" in capsys.readouterr().err


@pytest.mark.parametrize(
    "url", ["http://10.0.0.5:8000#frag", "http://10.0.0.5:8000/?x=1", "http://10.0.0.5:8000#"]
)
def test_replica_urls_with_a_query_or_fragment_are_refused(url: str) -> None:
    # The request path is appended to the URL: it would land in the fragment or the query.
    with pytest.raises(ConfigError, match="fragment"):
        load_settings(replicas=[{"url": url}])


async def test_a_client_fragment_never_reaches_the_engine() -> None:
    # RFC 9110 7.1: a fragment is not part of the request target; the query still goes along.
    body = orjson.dumps(
        {"model": "kvgate-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    async with (
        sim_engines(1, "instant") as engines,
        gateway(engines, health={"interval_s": 60}) as gw,
    ):
        reader, writer = await asyncio.open_connection(gw.server.host, gw.server.port)
        writer.write(
            b"POST /v1/chat/completions?a=1#frag HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)).startswith(
            b"HTTP/1.1 200"
        )
        writer.close()
        assert engines[0].request_log[-1].query == "a=1"
