"""The request path, as a pipeline of small stages around one `Exchange` per request.

`ProxyEndpoint` (gateway.proxy.endpoint) is the ASGI callable per OpenAI route; the stages
are inbound, identity, attempts (routing, admission, failover), relay and outcome, each in
its own module. See docs/architecture.md.
"""

from gateway.proxy.endpoint import ProxyEndpoint
from gateway.proxy.exchange import Exchange
from gateway.proxy.relay import REPLICA_HEADER
from gateway.scope import REQUEST_ID_KEY as REQUEST_ID_SCOPE_KEY

__all__ = ["REPLICA_HEADER", "REQUEST_ID_SCOPE_KEY", "Exchange", "ProxyEndpoint"]
