"""Helpers for tests and for third-party policy authors.

* `gateway.testing.views`: `make_request`, `ViewBuilder` (policies, no event loop needed);
* `gateway.testing.clock`: `FakeClock`;
* `gateway.testing.servers`: `sim_engines`, `gateway` (real uvicorn servers on loopback);
* `gateway.testing.forms`: multipart forms laid out as the SDKs send them, paced senders.

Import the submodules directly; this package imports nothing heavy by itself.
"""
