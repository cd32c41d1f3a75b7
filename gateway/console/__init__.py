"""The live web console at `/console` and the read-only admin JSON it draws from.

A sampler (a lifespan task) snapshots the gateway's own state every few seconds into a
bounded history; the page polls the admin endpoints. Per-request figures (tokens, time to
first byte per replica, sessions) come from an outcome observer that is attached only while
someone reads the console (see `gateway.console.config.ConsoleSettings.measure`).
"""
