"""The report `kvgate trace replay` and `kvgate simulate` share: percentiles against
numpy-free hand arithmetic, what counts (only successful requests), the engines' hit rate
over the requests that report one, and the per-replica load imbalance."""

from __future__ import annotations

import math

import pytest

from gateway.trace.report import Percentiles, ReplayReport, RequestResult, percentile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0], 50, 1.0),
        ([1.0, 2.0], 50, 1.5),
        ([3.0, 1.0, 2.0], 50, 2.0),  # sorted first
        ([0.0, 10.0], 90, 9.0),  # linear between neighbours
        ([1.0, 2.0, 3.0, 4.0, 5.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 100, 5.0),
        ([1.0, 2.0, 3.0, 4.0, 5.0], 99, 4.96),
    ],
)
def test_percentile_interpolates_linearly(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_no_values_are_nan_not_zero() -> None:
    p = Percentiles.of([])
    assert all(math.isnan(v) for v in p.as_dict().values())


def _result(i: int, **kw: object) -> RequestResult:
    base: dict[str, object] = {"index": i, "start_s": 0.0, "end_s": 1.0, "ttft_s": 0.1}
    return RequestResult(**{**base, **kw})  # type: ignore[arg-type]


def test_only_successful_requests_count_and_errors_are_kinds() -> None:
    results = [
        _result(
            2,
            ttft_s=0.3,
            itl_s=(0.01, 0.03),
            prompt_tokens=100,
            output_tokens=10,
            cached_tokens=50,
            replica="a",
        ),
        _result(
            0,
            ttft_s=0.1,
            itl_s=(0.02,),
            prompt_tokens=100,
            output_tokens=20,
            cached_tokens=None,
            replica="b",
        ),
        _result(1, error="timeout", prompt_tokens=999, output_tokens=999, replica="a"),
        _result(3, error="timeout"),
        _result(4, error="http_503"),
    ]
    report = ReplayReport.build(results, 2.0, replicas=("a", "b", "c"))
    assert (report.requests, report.ok, report.errors) == (5, 2, 3)
    assert report.error_kinds == {"timeout": 2, "http_503": 1}
    assert report.prompt_tokens == 200 and report.output_tokens == 30  # failed ones not counted
    assert report.total_tokens_per_s == pytest.approx(230 / 2.0)
    assert report.output_tokens_per_s == pytest.approx(15.0)
    assert report.ttft_s.p50 == pytest.approx(0.2) and report.ttft_s.mean == pytest.approx(0.2)
    assert report.itl_s.p50 == pytest.approx(0.02)
    # The hit rate is over the requests that report cached tokens only: 50 / 100.
    assert report.hit_rate == pytest.approx(0.5)
    # a: 110 tokens, b: 120, c: 0 (listed, served nothing): max / mean = 120 / (230 / 3).
    assert report.replica_tokens == {"a": 110, "b": 120, "c": 0}
    assert report.load_imbalance == pytest.approx(120 / (230 / 3))
    assert [r.index for r in report.results] == [0, 1, 2, 3, 4]  # trace order
    text = report.render()
    assert "5 requests, 2 ok, 3 errors" in text
    assert "engine hit rate 50.0%" in text
    assert "http_503: 1, timeout: 2" in text
    assert "load imbalance  1.57" in text
    assert set(report.as_dict()) >= {"hit_rate", "load_imbalance", "error_kinds", "ttft_s"}


def test_nothing_reported_says_so() -> None:
    report = ReplayReport.build([_result(0, prompt_tokens=10)], 0.0)
    assert report.hit_rate is None and report.load_imbalance is None
    assert math.isnan(report.total_tokens_per_s)  # no duration: no rate, not infinity
    assert "n/a (no cached_tokens reported)" in report.render()
