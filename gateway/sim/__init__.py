"""A simulated vLLM/SGLang engine: a pure step model plus an HTTP server with vLLM's wire surface.

`EngineModel` (engine.py) has no I/O and no asyncio: the offline simulator drives it on a
virtual clock, `EngineRunner` (runner.py) on the real one, `gateway.sim.server` serves it.
"""
