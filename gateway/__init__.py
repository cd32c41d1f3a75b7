"""kvgate: a KV-cache-aware, session-sticky gateway for OpenAI-compatible inference engines."""

__version__ = "0.1.0"
