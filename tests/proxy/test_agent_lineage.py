"""Parent/child agent headers through the proxy and simulated engines: a child's first
request starts on its parent's replica, and the child then sticks to where it is on its
own session (Claude Code's and OpenCode's headers, and a configured pair)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.settings import LineageHeaders
from gateway.sim.server import SimEngine
from gateway.testing.servers import RunningGateway, gateway

MODEL = "kvgate-sim"
PARENTS = 8


@pytest.fixture
async def http(gw: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gw.url, timeout=30.0) as http:
        yield http


async def _ask(http: httpx.AsyncClient, headers: dict[str, str], text: str) -> str:
    response = await http.post(
        "/v1/chat/completions",
        headers=headers,
        json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]},
    )
    assert response.status_code == 200, response.text
    return response.headers["x-kvgate-replica"]


async def _families(
    http: httpx.AsyncClient,
    parent_headers: list[dict[str, str]],
    child_headers: list[tuple[dict[str, str], dict[str, str]]],
) -> list[tuple[str, list[str]]]:
    """Per family: the parent's replica, then its child's replicas (first request with the
    parent named, then two without it); prompts share nothing."""
    out = []
    for i, (parent, (first, later)) in enumerate(zip(parent_headers, child_headers)):
        home = await _ask(http, parent, f"parent {i} plans the work")
        seen = [await _ask(http, first, f"child {i} reads file {i}")]
        for turn in range(2):
            seen.append(await _ask(http, later, f"child {i} turn {turn}: grep {i}"))
        out.append((home, seen))
    return out


async def test_opencode_child_starts_on_its_parent_then_sticks(
    http: httpx.AsyncClient,
) -> None:
    parents = [{"X-Session-Id": f"ses_parent{i}"} for i in range(PARENTS)]
    children = [
        (
            {"X-Session-Id": f"ses_child{i}", "x-parent-session-id": f"ses_parent{i}"},
            {"X-Session-Id": f"ses_child{i}"},
        )
        for i in range(PARENTS)
    ]
    families = await _families(http, parents, children)
    assert len({home for home, _ in families}) >= 2, families  # parents spread
    assert all(seen == [home] * 3 for home, seen in families), families


async def test_without_the_parent_header_children_go_their_own_way(
    http: httpx.AsyncClient,
) -> None:
    parents = [{"X-Session-Id": f"ses_p{i}"} for i in range(PARENTS)]
    children = [({"X-Session-Id": f"ses_c{i}"},) * 2 for i in range(PARENTS)]
    families = await _families(http, parents, children)
    # Each child sticks to its own replica, but nothing ties it to its parent's.
    assert all(len(set(seen)) == 1 for _, seen in families), families
    assert any(seen[0] != home for home, seen in families), families


async def test_claude_code_subagents_and_nested_ones_follow_their_parent(
    http: httpx.AsyncClient,
) -> None:
    homes: dict[int, str] = {}
    for run in range(PARENTS):
        session = {"x-claude-code-session-id": f"run-{run}"}
        homes[run] = await _ask(http, session, f"main agent {run} starts")
        # A subagent: the run's session id plus its own agent id (no parent header).
        sub = {**session, "x-claude-code-agent-id": "agent_a"}
        assert await _ask(http, sub, f"subagent of run {run} explores") == homes[run]
        # A subagent the subagent started: it names its parent agent.
        nested = {**session, "x-claude-code-agent-id": "agent_b"}
        nested["x-claude-code-parent-agent-id"] = "agent_a"
        assert await _ask(http, nested, f"nested agent of run {run} greps") == homes[run]
    assert len(set(homes.values())) >= 2, homes


@pytest.fixture
async def custom_gw(engines: list[SimEngine]) -> AsyncIterator[RunningGateway]:
    pair = LineageHeaders(agent="X-Worker-Id", parent="X-Spawned-By")
    async with gateway(engines, session={"lineage_headers": [pair.model_dump()]}) as gw:
        yield gw


async def test_a_configured_pair_works_and_replaces_the_defaults(
    custom_gw: RunningGateway,
) -> None:
    async with httpx.AsyncClient(base_url=custom_gw.url, timeout=30.0) as http:
        parents = [{"X-Worker-Id": f"w{i}"} for i in range(PARENTS)]
        children = [
            ({"X-Worker-Id": f"w{i}.1", "X-Spawned-By": f"w{i}"}, {"X-Worker-Id": f"w{i}.1"})
            for i in range(PARENTS)
        ]
        families = await _families(http, parents, children)
        assert all(seen == [home] * 3 for home, seen in families), families
        # OpenCode's pair is no longer configured: its parent header means nothing here.
        orphans = [
            (
                {"X-Session-Id": f"o{i}.1", "x-parent-session-id": f"o{i}"},
                {"X-Session-Id": f"o{i}.1"},
            )
            for i in range(PARENTS)
        ]
        unrelated = await _families(http, [{"X-Session-Id": f"o{i}"} for i in range(8)], orphans)
        assert any(seen[0] != home for home, seen in unrelated), unrelated
