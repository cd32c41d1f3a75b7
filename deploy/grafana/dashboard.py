"""Writes kvgate.json, the Grafana dashboard, from the panel list below.

    python deploy/grafana/dashboard.py   # after editing a panel; a test checks the JSON is current

Every expression here is evaluated against a real Prometheus scraping a gateway by
tests/deploy/test_prometheus.py, so a misspelt metric fails the suite: with every feature
on, each one returns data; on a plain `kvgate serve` with traffic, each panel not listed in
NEEDS returns data too (a zero, not "No data": `or vector(0)` where a series only appears
after its first event). Every kvgate_* selector carries the job, namespace and instance
variables.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvgate.json")
DS = {"type": "prometheus", "uid": "${datasource}"}


def q(quantile: float, metric: str, by: str = "") -> str:
    return (
        f"histogram_quantile({quantile}, sum by (le{', ' + by if by else ''}) "
        f"(rate({metric}_bucket[$__rate_interval])))"
    )


def tokens(by: str = "") -> str:
    b = f" by ({by})" if by else ""
    return (
        f"sum{b} (rate(kvgate_prompt_tokens_total[$__rate_interval])) + "
        f"sum{b} (rate(kvgate_generation_tokens_total[$__rate_interval]))"
    )


def per_1k(denominator: str, by: str = "") -> str:
    b = f" by ({by})" if by else ""
    return (
        f"1000 * sum{b} (rate(kvgate_replica_cost_total[$__rate_interval])) / "
        f"clamp_min({denominator}, 1e-9)"
    )


# Series that appear only after their first event (a 5xx, a retry, a gateway error): a
# healthy fleet then reads 0 rather than "No data".
ZERO = " or vector(0)"
FILTER = 'job=~"$job", namespace=~"$namespace", instance=~"$instance"'
PRICES = (
    "Needs prices: pools[].price_per_card_hour (with pools) or replicas[].price_per_hour / "
    "discovery.dns[].price_per_hour."
)
ADMISSION = "Needs admission.enabled: true."
# Panels that only have data with a feature on, and what to set: the panel's description.
NEEDS = {
    "Cost per 1K tokens": PRICES,
    "Replicas from DNS": "Needs discovery.dns (replicas found in DNS).",
    "Queue depth": ADMISSION,
    "Wait p99": ADMISSION + " Empty until a request has waited in a queue.",
    "Rejected (429)": ADMISSION,
    "Pool weights": "Needs pools (pools.pools and pools.models).",
    "Cost per 1K tokens by pool": "Needs pools with prices (pools.pools[].price_per_card_hour).",
    "PD decisions": "Needs pd.models (prefill/decode disaggregation settings per model).",
    "Store degraded": "Needs store.backend: redis.",
}

OUTPUT = "sum{b} (rate(kvgate_generation_tokens_total[$__rate_interval]))"
HIT = (
    "sum{b} (rate(kvgate_cached_prompt_tokens_total[$__rate_interval])) / "
    "clamp_min(sum{b} (rate(kvgate_prompt_tokens_total[$__rate_interval])), 1)"
)

# (row, [(title, unit, [(legend, expr), ...]), ...])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    (
        "Fleet",
        [
            (
                "Requests by status",
                "reqps",
                [("{{status}}", "sum by (status) (rate(kvgate_requests_total[$__rate_interval]))")],
            ),
            (
                "5xx share",
                "percentunit",
                [
                    (
                        "5xx share",
                        (
                            '(sum(rate(kvgate_requests_total{status=~"5.."}[$__rate_interval]))'
                            f"{ZERO}) / "
                            "clamp_min(sum(rate(kvgate_requests_total[$__rate_interval])), 1e-9)"
                        ),
                    ),
                ],
            ),
            (
                "Errors the gateway made",
                "reqps",
                [
                    (
                        "{{code}}",
                        f"sum by (code) (rate(kvgate_errors_total[$__rate_interval])){ZERO}",
                    ),
                ],
            ),
            (
                "Time to first token",
                "s",
                [
                    (f"p{int(p * 100)}", q(p, "kvgate_time_to_first_token_seconds"))
                    for p in (0.5, 0.9, 0.99)
                ],
            ),
            (
                "Time per output token",
                "s",
                [
                    *(
                        (f"TPOT p{int(p * 100)}", q(p, "kvgate_time_per_output_token_seconds"))
                        for p in (0.5, 0.99)
                    ),
                    ("inter-token p99", q(0.99, "kvgate_inter_token_latency_seconds")),
                ],
            ),
            (
                "End-to-end latency",
                "s",
                [
                    (f"p{int(p * 100)}", q(p, "kvgate_e2e_request_latency_seconds"))
                    for p in (0.5, 0.99)
                ],
            ),
            (
                "Prefix hit rate (cached / prompt tokens)",
                "percentunit",
                [("fleet", HIT.format(b=""))],
            ),
            (
                "Tokens per second",
                "short",
                [("total (prompt + output)", tokens()), ("output", OUTPUT.format(b=""))],
            ),
            (
                "Cost per 1K tokens",
                "short",
                [
                    ("per 1K total tokens", per_1k(tokens())),
                    ("per 1K output tokens", per_1k(OUTPUT.format(b=""))),
                ],
            ),
        ],
    ),
    (
        "Replicas",
        [
            (
                "Requests per replica",
                "reqps",
                [
                    (
                        "{{replica}}",
                        "sum by (replica) (rate(kvgate_requests_total[$__rate_interval]))",
                    )
                ],
            ),
            ("In flight", "short", [("{{replica}}", "sum by (replica) (kvgate_in_flight)")]),
            (
                "Engine KV usage",
                "percentunit",
                [("{{replica}}", "max by (replica) (kvgate_scrape_kv_usage)")],
            ),
            (
                "Engine queue (waiting)",
                "short",
                [("{{replica}}", "max by (replica) (kvgate_scrape_waiting)")],
            ),
            (
                "Hit rate per replica",
                "percentunit",
                [
                    ("{{replica}}", HIT.format(b=" by (replica)")),
                    ("{{replica}} (engine)", "max by (replica) (kvgate_scrape_prefix_hit_rate)"),
                ],
            ),
            ("Healthy", "short", [("{{replica}}", "min by (replica) (kvgate_replica_healthy)")]),
            (
                "TTFT p99 per replica",
                "s",
                [("{{replica}}", q(0.99, "kvgate_time_to_first_token_seconds", "replica"))],
            ),
            (
                "Replicas from DNS",
                "short",
                [("{{target}}", "max by (target) (kvgate_discovery_replicas)")],
            ),
        ],
    ),
    (
        "Admission",
        [
            (
                "Queue depth",
                "short",
                [("{{priority_class}}", "sum by (priority_class) (kvgate_admission_queue_depth)")],
            ),
            (
                "Wait p99",
                "s",
                [
                    (
                        "{{priority_class}}",
                        q(0.99, "kvgate_admission_wait_seconds", "priority_class"),
                    )
                ],
            ),
            (
                "Rejected (429)",
                "reqps",
                [
                    (
                        "{{priority_class}} {{reason}}",
                        "sum by (priority_class, reason) (rate(kvgate_admission_rejected_total[$__rate_interval]))",
                    )
                ],
            ),
        ],
    ),
    (
        "Routing, pools and PD",
        [
            (
                "Routing decisions",
                "ops",
                [
                    (
                        "{{reason}}",
                        "sum by (reason) (rate(kvgate_routing_decisions_total[$__rate_interval]))",
                    )
                ],
            ),
            (
                "Retries",
                "ops",
                [
                    (
                        "{{reason}}",
                        f"sum by (reason) (rate(kvgate_retries_total[$__rate_interval])){ZERO}",
                    )
                ],
            ),
            ("Pool weights", "percentunit", [("{{pool}}", "max by (pool) (kvgate_pool_weight)")]),
            ("Cost per 1K tokens by pool", "short", [("{{pool}}", per_1k(tokens("pool"), "pool"))]),
            (
                "PD decisions",
                "ops",
                [
                    (
                        "{{decision}} {{reason}}",
                        "sum by (decision, reason) (rate(kvgate_pd_decisions_total[$__rate_interval]))",
                    )
                ],
            ),
            (
                "Store degraded",
                "short",
                [("{{instance}}", "max by (instance) (kvgate_store_degraded)")],
            ),
        ],
    ),
]


def scoped(expr: str) -> str:
    """`expr` with the dashboard's job, namespace and instance filters on every kvgate_*
    selector (merged into a selector's own matchers)."""

    def add(match: re.Match[str]) -> str:
        own = match[2]
        return f"{match[1]}{{{own + ', ' if own else ''}{FILTER}}}"

    return re.sub(r"\b(kvgate_[a-z0-9_]+)(?:\{([^}]*)\})?", add, expr)


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        # Outside Kubernetes there is no namespace label: ".*" also matches its absence.
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def panel(
    pid: int, title: str, unit: str, targets: list[tuple[str, str]], x: int, y: int
) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": NEEDS.get(title, ""),
        "datasource": DS,
        "gridPos": {"h": 8, "w": 6, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DS,
                "expr": scoped(expr),
                "legendFormat": legend,
            }
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row, items in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets) in enumerate(items):
            panels.append(panel(pid, title, unit, targets, (i % 4) * 6, y + (i // 4) * 8))
            pid += 1
        y += ((len(items) + 3) // 4) * 8
    return {
        "uid": "kvgate-overview",
        "title": "kvgate",
        "tags": ["kvgate", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                    "current": {},
                },
                variable("job", "Job", "label_values(kvgate_requests_total, job)"),
                variable(
                    "namespace",
                    "Namespace",
                    'label_values(kvgate_requests_total{job=~"$job"}, namespace)',
                ),
                variable(
                    "instance",
                    "Instance",
                    'label_values(kvgate_requests_total{job=~"$job", namespace=~"$namespace"}, '
                    "instance)",
                ),
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
