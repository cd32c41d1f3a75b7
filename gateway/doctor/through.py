"""What only the gateway sees (`kvgate doctor --gateway`): replicas failing requests the
gateway retries elsewhere (the clients never see them), admission queues and 429s,
ejected replicas, and replicas routed on the gateway's own counts for want of engine load.
Each finding names the fix. Counters are totals since the gateway started.
"""

from __future__ import annotations

from gateway.doctor.findings import Finding
from gateway.doctor.probe import GatewaySnapshot

ERROR_SHARE_WARN = 0.05
ERROR_SHARE_SEVERE = 0.15
ERROR_MIN_ATTEMPTS = 20  # fewer attempts than this: a share says nothing yet


def check_through_gateway(g: GatewaySnapshot) -> list[Finding]:
    return _errors(g) + _admission(g) + _ejected(g) + _load_missing(g)


def failures(g: GatewaySnapshot) -> dict[str, tuple[float, float]]:
    """Per replica: (failed attempts, attempts). Failed: given up on by the gateway (connect
    error, timeout, a 5xx it retried elsewhere) or a 5xx it relayed."""
    out: dict[str, tuple[float, float]] = {}
    for replica, statuses in g.requests.items():
        if replica:
            bad = sum(v for s, v in statuses.items() if s.startswith("5"))
            out[replica] = (bad, sum(statuses.values()))
    for replica, value in g.upstream_failures.items():
        if replica:
            bad, total = out.get(replica, (0.0, 0.0))
            out[replica] = (bad + value, total + value)
    return out


def _errors(g: GatewaySnapshot) -> list[Finding]:
    out = []
    for replica, (bad, attempts) in sorted(failures(g).items()):
        if attempts < ERROR_MIN_ATTEMPTS or bad < ERROR_SHARE_WARN * attempts:
            continue
        share = bad / attempts
        relayed = sum(v for s, v in g.requests.get(replica, {}).items() if s.startswith("5"))
        out.append(
            Finding(
                "replica_errors",
                "severe" if share >= ERROR_SHARE_SEVERE else "warning",
                replica,
                f"{share:.0%} of this replica's attempts fail",
                (
                    (
                        f"{bad:.0f} of {attempts:.0f} attempts failed: "
                        f"{g.upstream_failures.get(replica, 0.0):.0f} given up on by the "
                        f"gateway (kvgate_upstream_failures_total), {relayed:.0f} 5xx relayed"
                    ),
                    (
                        f"healthy: {g.healthy.get(replica, 1.0):.0f} (a replica that still "
                        "answers its probes keeps its sessions)"
                    ),
                ),
                "read this engine's log for the cause (out of memory, a crashed engine core "
                "behind a live API server); retried failures cost each client a round trip, "
                "relayed ones reach it. Until it is fixed, take it out of `replicas` (or its "
                "DNS record) so its sessions move to the others",
            )
        )
    return out


def _admission(g: GatewaySnapshot) -> list[Finding]:
    out = []
    queued = sum(g.queued.values())
    if queued > 0:
        shown = ", ".join(f"{c} {v:.0f}" for c, v in sorted(g.queued.items()) if v)
        out.append(
            Finding(
                "admission_queueing",
                "warning",
                "gateway",
                f"{queued:.0f} request(s) wait in the gateway's admission queues",
                (f"kvgate_admission_queue_depth by class: {shown}",),
                "the engines are at the saturation the gateway allows: add replicas (the "
                "keda/hpa overlays scale on this queue), or raise "
                "admission.saturation.max_inflight if the engines' own queues and KV usage "
                "show room",
            )
        )
    rejected = sum(g.rejected.values())
    if rejected > 0:
        shown = ", ".join(f"{k} {v:.0f}" for k, v in sorted(g.rejected.items()) if v)
        out.append(
            Finding(
                "admission_rejects",
                "warning",
                "gateway",
                f"{rejected:.0f} request(s) answered 429 by admission",
                (f"kvgate_admission_rejected_total by class/reason: {shown}",),
                "queue_full: raise admission.max_queue or add replicas; timeout: requests "
                "waited admission.max_wait_s without a slot, so add replicas or raise it",
            )
        )
    return out


def _ejected(g: GatewaySnapshot) -> list[Finding]:
    # kvgate_replica_ejected is 1 for an outlier ejection only: a replica its health probes
    # took out stays at 0 there, and shows as kvgate_replica_healthy 0.
    out = []
    for replica in sorted(g.ejected.keys() | g.healthy.keys()):
        outlier = g.ejected.get(replica, 0.0) >= 1
        if not replica or not (outlier or g.healthy.get(replica, 1.0) < 1):
            continue
        reasons = {
            key.split("/", 1)[1]: v
            for key, v in g.ejections.items()
            if key.split("/", 1)[0] == replica and v
        }
        why = ", ".join(f"{r} {v:.0f}" for r, v in sorted(reasons.items()))
        out.append(
            Finding(
                "replica_ejected",
                "warning",
                replica,
                "the gateway has ejected this replica: it gets no traffic",
                (
                    "kvgate_replica_ejected 1" if outlier else "kvgate_replica_healthy 0",
                    f"ejections by reason: {why}" if why else "ejections by reason: not exported",
                ),
                "check the engine's /health and its log; the gateway probes it and takes it "
                "back after health.cooldown_s once it answers. The others carry its load "
                "meanwhile: check their queues",
            )
        )
    return out


def _load_missing(g: GatewaySnapshot) -> list[Finding]:
    out = []
    for replica, value in sorted(g.load_missing.items()):
        if value < 1 or not replica:
            continue
        out.append(
            Finding(
                "no_engine_load",
                "warning",
                replica,
                "no engine load from this replica: routed on the gateway's own counts",
                ("kvgate_replica_engine_load_missing 1",),
                "the gateway cannot read the engine's queue and KV usage, so it balances on "
                "its own in-flight counts (blind to other clients of the engine): make the "
                "replica's /metrics reachable from the gateway, or name its kind with "
                "replicas[].engine (vllm, sglang)",
            )
        )
    return out
