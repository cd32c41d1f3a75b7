"""Every Redis key and channel kvgate uses, in one place.

All keys live under one prefix so several gateways (or tests) can share a Redis server,
and so an operator can list or flush kvgate's state with one pattern (`<prefix>:*`).
Each key expires or is trimmed; nothing here grows without bound.

On a Redis Cluster a multi-key script must find all its keys in one hash slot: the quota
counters and in-flight sets, which one request's admission script reads together, share
the hash tag `{quota}`; the shared scraping's leases, members and loads, which one
pipeline per scrape round touches (and one script claims together), share `{scrape}`.
Every other verb touches one key per command.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.types import SessionKey

# One hash slot for every key the quota script reads at once (Redis Cluster).
QUOTA_TAG = "{quota}"
# One hash slot for the shared scraping's keys: a round is one pipeline to one node.
SCRAPE_TAG = "{scrape}"


@dataclass(frozen=True, slots=True)
class StoreKeys:
    prefix: str

    def session(self, session: SessionKey) -> str:
        """String: replica id. Expires after the session TTL, refreshed on use."""
        return f"{self.prefix}:sess:{session}"

    def session_pattern(self) -> str:
        return f"{self.prefix}:sess:*"

    def response_root(self, response: str) -> str:
        """String: the root of the Responses chain the answer `response` continues (both
        digests of response ids). Expires after the session TTL."""
        return f"{self.prefix}:chain:{response}"

    def ejections(self) -> str:
        """Hash: replica -> JSON {until, reason}. Entries pruned once past `until`."""
        return f"{self.prefix}:ejections"

    def prefixes(self) -> str:
        """Stream of prefix placements, trimmed to about `prefix_stream_max` entries."""
        return f"{self.prefix}:prefixes"

    def quota(self, scope: str, kind: str, index: int) -> str:
        """Counter of one quota minute (`scope`: "key:<name>" or "tenant:<name>"); expires
        two minutes after it closed."""
        return f"{self.prefix}:{QUOTA_TAG}:{scope}:{kind}:{index}"

    def inflight(self, scope: str) -> str:
        """Sorted set: request ticket -> lease expiry (epoch ms) of requests in flight."""
        return f"{self.prefix}:{QUOTA_TAG}:inflight:{scope}"

    def api_keys(self) -> str:
        """Hash: sha256 hex of an API key -> JSON key record (`kvgate keys`). No expiry."""
        return f"{self.prefix}:apikeys"

    def scrape_lease(self, replica: str) -> str:
        """String: the instance id of the gateway that scrapes `replica`; expires ten
        `scrape.lease_ttl_s` after its holder last renewed it, and is free at once when
        its holder is no live member (`scrape_members`)."""
        return f"{self.prefix}:{SCRAPE_TAG}:lease:{replica}"

    def scrape_members(self) -> str:
        """Sorted set: instance id -> expiry (epoch ms) of the gateways sharing scrapes."""
        return f"{self.prefix}:{SCRAPE_TAG}:members"

    def scrape_loads(self) -> str:
        """Hash: replica -> JSON of its last shared load and when it was scraped; expires
        when no gateway writes to it for a few lease TTLs."""
        return f"{self.prefix}:{SCRAPE_TAG}:loads"

    def scrape_wakes(self, member: str) -> str:
        """Set: engines other gateways began sending requests while their shared load read
        quiet; `member`, their scraper, pops them each round and reads them at once."""
        return f"{self.prefix}:{SCRAPE_TAG}:wake:{member}"

    def events(self) -> str:
        """Pub/sub channel: session moves, forgotten replicas, ejections (pushed at once)."""
        return f"{self.prefix}:events"
