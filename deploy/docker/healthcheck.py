"""Container HEALTHCHECK: exit 0 when GET /health answers 2xx (no curl in a slim image)."""

import os
import sys
import urllib.request

port = os.environ.get("KVGATE_SERVER__PORT", "8000")
url = os.environ.get("KVGATE_HEALTHCHECK_URL", f"http://127.0.0.1:{port}/health")
try:
    with urllib.request.urlopen(url, timeout=2) as response:
        sys.exit(0 if 200 <= response.status < 300 else 1)
except OSError as exc:
    print(f"{url}: {exc}", file=sys.stderr)
    sys.exit(1)
