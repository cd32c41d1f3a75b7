"""Pure ASGI middlewares, one per module (no BaseHTTPMiddleware: it buffers and hides
client disconnects)."""
