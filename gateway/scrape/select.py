"""Ask an engine for only the series kvgate reads.

prometheus-client's ASGI app answers `?name[]=a&name[]=b` with those samples only. A vLLM
exposition runs to tens of kilobytes (some fifteen histograms of twenty-odd buckets, the
HTTP and process series) of which the readers use a dozen lines: asking for those lines
spares the engine's API server rendering the rest and the gateway reading it, on every
scrape of every replica.

Where an engine serves it: vLLM (`vllm/entrypoints/serve/instrumentator/metrics.py`)
registers two routes. `GET /metrics` is prometheus-fastapi-instrumentator's handler, which
renders the whole registry and ignores the query; any other path under it (`/metrics/`) is
prometheus-client's ASGI app, mounted behind a path pattern that avoids a redirect. So the
selective read goes to the path with a trailing slash. SGLang mounts prometheus-client's app
the same way, over a multiprocess collector: a collector registered without names, which a
restricted registry leaves out, so it answers the query with nothing (as vLLM does with
`--api-server-count` above 1). Servers that know no such path answer 404 (TGI).

So a replica is first read whole, which says which read samples it has; later reads are
selective. A selective answer that lacks a sample the whole read had is followed at once by
a whole read: if that read has what the selective one lacked, the replica is read whole from
then on; otherwise the engine changed (a restart, a new version) and what it has is learnt
anew. A selective read refused (a 3xx or a 4xx) makes the replica read whole from then on.
"""

from __future__ import annotations

import logging
from urllib.parse import quote

from gateway.scrape.adapters import read_samples_of
from gateway.scrape.config import EngineKind
from gateway.types import ReplicaId

log = logging.getLogger(__name__)


def selective_query(names: frozenset[str]) -> str:
    """`name[]=...` for each name, in a stable order (the client caches parsed URLs)."""
    return "&".join("name%5B%5D=" + quote(n, safe="") for n in sorted(names))


class SeriesSelection:
    """Per replica: read it whole, or only the read series (and what those must include)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._expected: dict[ReplicaId, frozenset[str]] = {}
        self._query: dict[ReplicaId, str] = {}
        self._whole: set[ReplicaId] = set()  # answers a selective read short: read whole

    def url(self, replica: ReplicaId, base: str) -> tuple[str, bool]:
        """The URL to read `replica`'s metrics at (`base` is its whole-exposition URL),
        and whether that read is selective."""
        query = self._query.get(replica)
        if query is None:
            return base, False
        if "?" in base:  # a configured path with a query of its own: add to it
            return f"{base}&{query}", True
        return f"{base.rstrip('/')}/?{query}", True  # vLLM's prometheus-client route

    def read_whole(self, replica: ReplicaId, kind: EngineKind, series: frozenset[str]) -> None:
        """A whole read of `replica` in dialect `kind` had the read samples `series`."""
        if not self.enabled or replica in self._whole or not series:
            return
        self._expected[replica] = series
        self._query[replica] = selective_query(read_samples_of(kind))

    def complete(self, replica: ReplicaId, series: frozenset[str]) -> bool:
        """Whether a selective read brought back every read sample a whole read had."""
        return series >= self._expected.get(replica, frozenset())

    def fell_short(
        self, replica: ReplicaId, kind: EngineKind, selected: frozenset[str], whole: frozenset[str]
    ) -> None:
        """A selective read brought back `selected`, the whole read that followed `whole`."""
        if whole - selected:
            self._whole.add(replica)
            self._query.pop(replica, None)
            self._expected.pop(replica, None)
            log.info(
                "replica %s answers a selective /metrics read without series it has "
                "(multiprocess collection); it is read whole",
                replica,
            )
            return
        self.read_whole(replica, kind, whole)

    def refused(self, replica: ReplicaId) -> None:
        """`replica` answered a selective read with a 3xx or 4xx: read it whole from now on."""
        self._whole.add(replica)
        self._query.pop(replica, None)
        self._expected.pop(replica, None)
        log.info("replica %s refuses a selective /metrics read; it is read whole", replica)

    def forget(self, replica: ReplicaId) -> None:
        """`replica` left the fleet (it may come back as another engine)."""
        self._expected.pop(replica, None)
        self._query.pop(replica, None)
        self._whole.discard(replica)
