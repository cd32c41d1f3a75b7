"""The identity stage's fast copy of a request keeps every field."""

from __future__ import annotations

import dataclasses

from gateway.proxy.identity import with_sticky
from gateway.types import Endpoint, ReplicaId, RouteRequest, SessionKey


def test_with_sticky_equals_dataclasses_replace_for_every_field() -> None:
    request = RouteRequest(
        request_id="r",
        model="m",
        session_key=SessionKey("s"),
        key_source="header",
        endpoint=Endpoint.COMPLETIONS,
        prefix_hashes=(1, 2),
        opener_hashes=(3,),
        block_tokens=7,
        prompt_tokens=99,
        max_tokens=5,
        priority_class="batch",
        tenant="t",
        stream=True,
        sticky_replica=ReplicaId("old"),
        lineage_hashes=(3, 1, 2),
        lineage_tail=b"tail",
    )
    # Every field differs from its default, so a field the copy forgot would show.
    defaults = RouteRequest(request_id="", model="", session_key=SessionKey(""))
    fields = [f.name for f in dataclasses.fields(RouteRequest)]
    assert all(getattr(request, n) != getattr(defaults, n) for n in fields), (
        "set the new field above"
    )
    assert with_sticky(request, ReplicaId("new")) == dataclasses.replace(
        request, sticky_replica=ReplicaId("new")
    )
