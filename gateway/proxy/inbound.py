"""Inbound stage: headers, body limits, JSON, model, and the `RouteRequest` built from them.

Raises `ClientGone` or a `GatewayError` (400/404/413/415); on success the exchange holds
the body to forward (`body`/`raw`, rewritten at most once), the request the router sees,
the filtered headers and the upstream path.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.asgi import Scope
from gateway.body import (
    check_content_type,
    check_multipart,
    parse_json,
    read_body,
    validate,
)
from gateway.errors import BadRequest, Forbidden, ModelNotFound
from gateway.hashing import digest_hex
from gateway.keys import agent_lineage, route_request, session_key
from gateway.proxy.continuation import continuing, response_digest
from gateway.proxy.exchange import Exchange
from gateway.scope import PRINCIPAL_KEY, Caller
from gateway.state import GatewayState
from gateway.stream_usage import inject_usage, with_usage_option
from gateway.traceparent import TRACEPARENT, child
from gateway.types import (
    ROUTE_SPECS,
    UPSTREAM_PATHS,
    Endpoint,
    RouteRequest,
    SessionKey,
    TierDecision,
)
from gateway.upload import open_upload
from gateway.upstream import request_headers
from gateway.upstream.headers import CREDENTIAL_HEADERS


def tenant_salt(tenant: str) -> str:
    """A tenant's cache salt: stable, and naming no tenant in the engines' logs."""
    return "kvgate-" + digest_hex(tenant)[:16]


def declared_length(value: bytes | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest("invalid Content-Length header") from None


# What inbound and identity wrote that a re-run on another tier keeps.
_CARRIED = (
    "errors",
    "find_response_id",
    "headers",
    "named_class",
    "parent_key",
    "path",
    "pools",
    "session_header",
    "strip_usage",
    "traceparent",
)


class Inbound:
    """Configured once per route from the settings; `read(ex)` per request."""

    __slots__ = (
        "_agent_headers",
        "_continues",
        "_credentials",
        "_endpoint",
        "_engine_auth",
        "_lineage_key",
        "_lineage_names",
        "_lineage_pairs",
        "_may_inject_usage",
        "_multipart",
        "_path",
        "_priority_header",
        "_propagate",
        "_rewrites",
        "_salted",
        "_session_header",
        "_state",
        "_tenant_header",
    )

    def __init__(self, state: GatewayState, endpoint: Endpoint, path: str) -> None:
        self._state = state
        self._endpoint = endpoint
        self._path = UPSTREAM_PATHS.get(path, path)  # the engine's path for this route
        s = state.settings
        self._session_header = s.session.header.lower().encode("latin-1")
        self._priority_header = s.session.priority_header.lower().encode("latin-1")
        self._tenant_header = s.session.tenant_header.lower().encode("latin-1")
        # Session ids agent tools send unasked; the configured header wins over them.
        self._agent_headers = frozenset(
            h.lower().encode("latin-1") for h in s.session.agent_headers
        ) - {self._session_header}
        self._lineage_pairs = tuple(
            (
                p.agent.lower().encode("latin-1"),
                p.parent.lower().encode("latin-1"),
                p.scope.lower().encode("latin-1") if p.scope else None,
            )
            for p in s.session.lineage_headers
        )
        self._lineage_names = frozenset(
            name for pair in self._lineage_pairs for name in pair if name is not None
        )
        spec = ROUTE_SPECS[endpoint]
        self._continues = spec.continues
        self._multipart = spec.multipart
        self._lineage_key = state.lineage.key_for if state.lineage is not None else None
        # Features' rewrites of the body (gateway.hooks.InboundRewrite), fixed at start-up.
        self._rewrites = tuple(state.inbound_rewrites)
        # The client's credentials are for the gateway: every header known to carry one is
        # dropped, and the engine gets the gateway's own key. Only Authorization may go on,
        # when the operator passes it (engines read no other credential header).
        self._credentials = CREDENTIAL_HEADERS | {
            h.lower().encode("latin-1") for h in s.auth.credential_headers
        }
        self._engine_auth: tuple[tuple[bytes, bytes], ...] = ()
        if s.upstream.passes_client_authorization(s.auth.enabled):
            self._credentials = self._credentials - {b"authorization"}
        else:
            self._engine_auth = s.upstream.auth_headers()
        for rewrite in self._rewrites:
            # Headers a feature keeps from the engine go with the credentials.
            self._credentials = self._credentials | rewrite.drop_headers
        self._salted = (
            s.auth.enabled
            and s.auth.cache_salt
            and endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)
        )
        # W3C trace context: the engine gets the gateway's child of the caller's trace.
        self._propagate = s.tracing.propagate
        # Only these endpoints stream tokens with an optional usage event.
        self._may_inject_usage = endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)

    async def read(self, ex: Exchange) -> None:
        state = self._state
        scope = ex.scope
        content_type = content_length = session = priority = tenant = agent = None
        traceparent = None
        sh, ph, th = self._session_header, self._priority_header, self._tenant_header
        agents, lineage_names = self._agent_headers, self._lineage_names
        lineage: dict[bytes, bytes] | None = None
        for name, value in scope["headers"]:
            if name in lineage_names:
                if lineage is None:
                    lineage = {}
                lineage[name] = value
            if name == b"content-type":
                content_type = value
            elif name == b"content-length":
                content_length = value
            elif name == sh:
                session = value
            elif name == ph:
                priority = value
            elif name == th:
                tenant = value
            elif name in agents:
                agent = value
            elif name == TRACEPARENT:
                traceparent = value
        own: str | None = None
        if lineage is not None:
            own, ex.parent_key = agent_lineage(self._lineage_pairs, lineage)
        if session is None:
            session = own.encode("latin-1") if own is not None else agent
        ex.traceparent = traceparent
        limits = state.settings.limits
        if self._multipart:
            # Streamed through, never read whole: only the form's leading fields are known
            # (the `model` the SDKs send before the file; gateway.upload).
            upload = await open_upload(
                ex.receive,
                limits.max_body_bytes,
                declared_length(content_length),
                check_multipart(content_type),
            )
            model = upload.fields.get("model", "").strip()
            tenant_name = self._authorize(
                scope, model, tenant.decode("latin-1") if tenant else None
            )
            known = state.cluster.known_models()
            if model and known is not None and model not in known:
                raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
            ex.body, ex.upload = None, upload
            ex.request = RouteRequest(
                request_id=ex.request_id,
                model=model,
                session_key=session_key({}, self._endpoint, session.decode("latin-1"))[0]
                if session
                else SessionKey("x:" + ex.request_id),
                key_source="header" if session else "request",
                endpoint=self._endpoint,
                priority_class=priority.decode("latin-1") if priority else "default",
                tenant=tenant_name,
                stream=upload.fields.get("stream", "").strip().lower() == "true",
            )
            ex.named_class = priority is not None
            self.forward_headers(ex, scope, self._path)
            return
        check_content_type(content_type)
        raw = await read_body(ex.receive, limits.max_body_bytes, declared_length(content_length))
        body: dict[str, Any] = parse_json(raw, limits.max_json_depth)
        model = validate(body, self._endpoint)
        rewritten = False
        if not model:
            # vLLM serves its one model to a body that names none; so does the gateway.
            model = self._only_model()
            body = {**body, "model": model}
            rewritten = True
        tenant_name = self._authorize(scope, model, tenant.decode("latin-1") if tenant else None)
        ex.session_header = session.decode("latin-1") if session else None
        if (tiers := state.tiers) is not None:
            principal: Caller | None = scope.get(PRINCIPAL_KEY)
            entry = tiers.entry(
                model,
                self._endpoint,
                body,
                scope["headers"],
                session=ex.session_header,
                api_key=principal.name if principal is not None else None,
                tenant=tenant_name,
                priority_class=priority.decode("latin-1") if priority else None,
            )
            if entry is not None:
                # A tiered public name: the entry tier's model from here on (gateway.tiers).
                ex.tier = entry
                model = entry.model
                body, rewritten = {**body, "model": model}, True
        if state.resolve_model is not None and (served := state.resolve_model(model)) != model:
            # An alias: the engines only know the served name.
            body = {**body, "model": served}
            rewritten = True
            model = served
        if self._salted and tenant_name is not None:
            # Keys on: the tenant's salt (the client's own only partitions within it), so
            # the engines' prefix caches, and the gateway's prefix and lineage indexes,
            # which hash the salt in (gateway.keys), never mix tenants.
            own = body.get("cache_salt")
            salt = tenant_salt(tenant_name) + (f"/{own}" if isinstance(own, str) and own else "")
            body, rewritten = {**body, "cache_salt": salt}, True
        for rewrite in self._rewrites:
            if (changed := rewrite.body(body)) is not None:
                body, rewritten = changed, True
        known = state.cluster.known_models()
        if known is not None and model not in known:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        session_cfg = state.settings.session
        request = route_request(
            body,
            self._endpoint,
            ex.request_id,
            session_header=session.decode("latin-1") if session else None,
            block_tokens=session_cfg.block_tokens,
            max_prefix_blocks=session_cfg.max_prefix_blocks,
            completion_key_chars=session_cfg.completion_key_chars,
            priority_class=priority.decode("latin-1") if priority else None,
            tenant=tenant_name,
            user_is_session=session_cfg.user_is_session,
            lineage=self._lineage_key,
        )
        if self._continues is not None:
            ex.find_response_id = True
            earlier = body.get(self._continues)
            if isinstance(earlier, str) and earlier:
                # Stored on one replica only: its placement pins the request (attempts).
                request = continuing(request, earlier)
                ex.chain_root = response_digest(earlier)  # until its own root is found
        # The one place the forwarded body changes: every later rewrite (admission's
        # payload, the PD legs) starts from this body/raw pair (gateway.stream_usage).
        if state.observers and self._may_inject_usage:
            injected = inject_usage(body)
            if injected is not None:
                # The client's bytes plus the one field, unless they are rewritten anyway.
                spliced = None if rewritten else with_usage_option(body, raw)
                body, ex.strip_usage = injected
                if spliced is not None:
                    raw = spliced
                else:
                    rewritten = True
        if rewritten:
            raw = orjson.dumps(body)
        ex.body, ex.raw, ex.request = body, raw, request
        ex.named_class = priority is not None or "priority" in body
        self.forward_headers(ex, scope, self._path)

    def retier(self, ex: Exchange, decision: TierDecision) -> Exchange:
        """A fresh exchange for the same client request on another tier: the body as
        forwarded, with that tier's model, and its `RouteRequest` rebuilt (prefix hashes are
        seeded with the model). Before any byte of the answer went out."""
        state = self._state
        model = decision.model
        if state.resolve_model is not None:
            model = state.resolve_model(model)
        assert ex.body is not None and ex.request is not None
        body = {**ex.body, "model": model}
        known = state.cluster.known_models()
        if known is not None and model not in known:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        session_cfg = state.settings.session
        first = ex.request
        request = route_request(
            body,
            self._endpoint,
            ex.request_id,
            session_header=ex.session_header,
            block_tokens=session_cfg.block_tokens,
            max_prefix_blocks=session_cfg.max_prefix_blocks,
            completion_key_chars=session_cfg.completion_key_chars,
            priority_class=first.priority_class,
            tenant=first.tenant,
            user_is_session=session_cfg.user_is_session,
            lineage=self._lineage_key,
        )
        fresh = Exchange(
            ex.scope, ex.receive, ex.send, ex.call, ex.request_id, ex.t0, ex.started_at
        )
        fresh.body, fresh.raw, fresh.request = body, orjson.dumps(body), request
        for name in _CARRIED:
            setattr(fresh, name, getattr(ex, name))
        fresh.tier = decision
        return fresh

    def _only_model(self) -> str:
        known = self._state.cluster.known_models()
        if known is not None and len(known) == 1:
            return next(iter(known))
        served = "not known yet" if known is None else f"{len(known)} models"
        raise BadRequest(
            f"'model' is required: it may be left out only when the gateway serves exactly "
            f"one model (it serves {served})",
            param="model",
        )

    def _authorize(self, scope: Scope, model: str, tenant_name: str | None) -> str | None:
        """The caller's key may use `model` and acts for its own tenant; returns the tenant."""
        principal: Caller | None = scope.get(PRINCIPAL_KEY)
        if principal is None:
            return tenant_name
        if principal.models and model not in principal.models:
            raise Forbidden(
                f"API key {principal.name!r} may not use the model `{model}`.", param="model"
            )
        if tenant_name is not None and tenant_name != principal.tenant:
            raise Forbidden(
                f"API key {principal.name!r} acts for tenant {principal.tenant!r}, "
                f"not {tenant_name!r}."
            )
        return principal.tenant

    def forward_headers(self, ex: Exchange, scope: Scope, path: str) -> None:
        """`ex.headers` and `ex.path` for the engine: `path` plus the client's query."""
        propagate = self._propagate
        headers = request_headers(scope["headers"], traced=propagate)
        if propagate and self._state.tracer is None:
            # With spans on, the request's span id goes instead (gateway.proxy.endpoint).
            headers.append((TRACEPARENT, child(ex.traceparent)))
        credentials = self._credentials
        headers = [h for h in headers if h[0] not in credentials]
        headers.extend(self._engine_auth)
        ex.headers = headers
        # The query string goes along unchanged (vLLM ignores it; a proxy must not eat it).
        query: bytes = scope.get("query_string", b"")
        ex.path = path + "?" + query.decode("latin-1") if query else path
