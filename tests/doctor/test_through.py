"""`check_through_gateway` and the gateway-side checks at their thresholds: the error share
counts retried and relayed failures alike, and says nothing on too few attempts; a stale
view is judged against each replica's own freshness bound."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.doctor.checks import check_cluster
from gateway.doctor.findings import Finding, Hints
from gateway.doctor.probe import GatewaySnapshot
from gateway.doctor.through import (
    ERROR_MIN_ATTEMPTS,
    ERROR_SHARE_SEVERE,
    ERROR_SHARE_WARN,
    check_through_gateway,
    failures,
)


def snap(**fields: Any) -> GatewaySnapshot:
    return GatewaySnapshot(url="http://gw", at=0.0, **fields)


def errors_of(g: GatewaySnapshot) -> list[Finding]:
    return [f for f in check_through_gateway(g) if f.code == "replica_errors"]


def split(attempts: int, share: float) -> GatewaySnapshot:
    """`attempts` to replica r1, the failing share as relayed 503s."""
    bad = round(share * attempts)
    return snap(
        requests={"r1": {"200": attempts - bad, "503": bad}} if bad else {"r1": {"200": attempts}}
    )


@pytest.mark.parametrize("attempts", [ERROR_MIN_ATTEMPTS - 1, ERROR_MIN_ATTEMPTS, 200])
def test_the_error_share_is_judged_only_past_the_minimum_attempts(attempts: int) -> None:
    found = errors_of(split(attempts, 1.0))
    if attempts < ERROR_MIN_ATTEMPTS:
        assert found == []
    else:
        (f,) = found
        assert (f.replica, f.severity) == ("r1", "severe")
        assert f"{attempts} of {attempts} attempts failed" in f.evidence[0]


def test_severity_steps_at_the_warn_and_severe_shares() -> None:
    n = 1000
    below_warn = split(n, ERROR_SHARE_WARN - 1 / n)
    at_warn = split(n, ERROR_SHARE_WARN)
    below_severe = split(n, ERROR_SHARE_SEVERE - 1 / n)
    at_severe = split(n, ERROR_SHARE_SEVERE)
    assert errors_of(below_warn) == []
    assert [f.severity for f in errors_of(at_warn)] == ["warning"]
    assert [f.severity for f in errors_of(below_severe)] == ["warning"]
    assert [f.severity for f in errors_of(at_severe)] == ["severe"]


def test_retried_failures_count_as_attempts_and_failures_and_4xx_do_not_fail() -> None:
    g = snap(
        requests={"r1": {"200": 80, "404": 10, "429": 5}, "": {"500": 99}},
        upstream_failures={"r1": 15, "": 50},
    )
    # The unlabelled series (requests answered before a replica was chosen) is nobody's.
    assert failures(g) == {"r1": (15.0, 110.0)}
    (f,) = errors_of(g)
    assert "15 of 110 attempts failed: 15 given up on" in f.evidence[0]
    assert "0 5xx relayed" in f.evidence[0]
    assert f.severity == ("severe" if ERROR_SHARE_SEVERE <= 15 / 110 else "warning")


def test_ejection_comes_from_either_signal_and_names_its_reasons() -> None:
    g = snap(
        ejected={"r1": 1.0, "r2": 0.0, "r3": 0.0},
        healthy={"r1": 1.0, "r2": 0.0, "r3": 1.0, "": 0.0},
        ejections={"r1/errors": 3.0, "r1/latency": 0.0, "r2/errors": 1.0},
    )
    found = {f.replica: f for f in check_through_gateway(g) if f.code == "replica_ejected"}
    assert sorted(found) == ["r1", "r2"]
    assert found["r1"].evidence == ("kvgate_replica_ejected 1", "ejections by reason: errors 3")
    assert found["r2"].evidence[0] == "kvgate_replica_healthy 0"


def test_admission_findings_appear_only_with_something_queued_or_rejected() -> None:
    quiet = snap(queued={"batch": 0.0}, rejected={"batch/queue_full": 0.0})
    assert check_through_gateway(quiet) == []
    busy = snap(queued={"batch": 3.0, "interactive": 0.0}, rejected={"batch/timeout": 2.0})
    codes = {f.code: f for f in check_through_gateway(busy)}
    assert codes["admission_queueing"].evidence == (
        "kvgate_admission_queue_depth by class: batch 3",
    )
    assert "batch/timeout 2" in codes["admission_rejects"].evidence[0]


def test_a_stale_view_is_judged_by_each_replicas_own_bound() -> None:
    hints = Hints()
    limit = hints.stale_after_s
    g = snap(
        scrape_age_s={"at": limit, "past": limit + 0.5, "quiet": limit + 0.5},
        scrape_fresh_for_s={"quiet": limit + 1.0},
        scrape_errors={"past": 4.0},
    )
    stale = [f for f in check_cluster({}, g, hints) if f.code == "stale_metrics"]
    assert [f.replica for f in stale] == ["past"]
    assert stale[0].evidence[1] == "kvgate_scrape_errors_total 4"


def test_an_unreachable_gateway_is_one_finding_and_nothing_it_would_have_said() -> None:
    g = snap(error="connection refused", queued={"batch": 9.0}, scrape_age_s={"r1": 1e9})
    assert [f.code for f in check_cluster({}, g, Hints())] == ["gateway_unreachable"]
