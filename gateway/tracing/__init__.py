"""Distributed tracing: W3C `traceparent` to the engines, optional OpenTelemetry spans.

Not to be confused with gateway.trace, which captures a private record of the traffic.
"""
