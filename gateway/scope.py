"""The keys under which the front door leaves what it learnt in the ASGI scope, for the
stages after it, and the shapes of what it leaves there: named on the ground floor so the
request path reads them without importing the features that write them (gateway.auth
writes both; its `Principal` and `Ticket` are what the protocols describe)."""

from __future__ import annotations

from typing import Protocol

REQUEST_ID_KEY = "kvgate.request_id"  # str: the request's id (gateway.request_id)
PRINCIPAL_KEY = "kvgate.principal"  # Caller: who is calling (gateway.auth.middleware)
TICKET_KEY = "kvgate.ticket"  # QuotaCharge: the quota charge of this request (gateway.auth)
HEAD_HOLDER_KEY = "kvgate.head_holder"  # HeadHolder: joins a head to its body (gateway.coalesce)


class Caller(Protocol):
    """What an API key allows, as the request path reads it (under `PRINCIPAL_KEY`)."""

    @property
    def name(self) -> str:
        """The key's label (named in refusals; never the key itself)."""
        ...

    @property
    def tenant(self) -> str: ...

    @property
    def admin(self) -> bool: ...

    @property
    def max_priority(self) -> str | None:
        """The best priority class the key may ask for; None: any."""
        ...

    @property
    def models(self) -> frozenset[str]:
        """The models the key may use; empty: any."""
        ...

    @property
    def pools(self) -> frozenset[str]:
        """The pools the key's requests may land on; empty: any."""
        ...


class QuotaCharge(Protocol):
    """The charges the request path makes on a request's quota (under `TICKET_KEY`); the
    settlement at the end is the quota feature's own (a `gateway.hooks.RequestMeter`)."""

    def charge(self, input_tokens: int, output_tokens: int) -> None:
        """At dispatch: the request's estimated tokens."""
        ...

    def delivered(self, output_tokens: int) -> None:
        """`output_tokens` went to the client so far (counted as events go out)."""
        ...
