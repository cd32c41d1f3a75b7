"""The keys under which the front door leaves what it learnt in the ASGI scope, for the
stages after it: named on the ground floor so the request path reads them without
importing the features that write them."""

from __future__ import annotations

REQUEST_ID_KEY = "kvgate.request_id"  # str: the request's id (gateway.request_id)
PRINCIPAL_KEY = "kvgate.principal"  # Principal: who is calling (gateway.auth.middleware)
TICKET_KEY = "kvgate.ticket"  # Ticket: the quota charge of this request (gateway.auth)
HEAD_HOLDER_KEY = "kvgate.head_holder"  # HeadHolder: joins a head to its body (gateway.coalesce)
