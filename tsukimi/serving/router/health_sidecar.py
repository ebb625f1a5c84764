"""The health port's server: a process of its own, beside the router, answering /health and
/metrics from the files the router publishes (tsukimi/serving/router/health_port.py), so that
nothing in the router's process (its event loop, its GIL, a garbage collection of its heap)
delays an answer.

    python -m tsukimi.serving.router.health_sidecar DIR HOST PORT STALE_AFTER_S

    DIR/health.json   {"at_s": CLOCK_MONOTONIC s, "body": {...}}: /health answers `body` plus
                      "age_ms"; 503 with "status": "stale" once at_s is older than STALE_AFTER_S
                      (or the file is missing: the router has published nothing yet)
    DIR/metrics.prom  /metrics answers it as it is (Prometheus text)

Once it listens, it writes its port and a newline to stdout (port 0: the one the OS gave); it
exits when its stdin reaches EOF: the router closed it, or died. Standard library only: it
starts in tens of milliseconds, and its own collections are of a few thousand objects.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HEALTH_FILE = "health.json"
METRICS_FILE = "metrics.prom"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # prometheus_client.CONTENT_TYPE_LATEST


def answer(directory: Path, path: str, stale_after_s: float) -> tuple[int, str, bytes]:
    """(status, content type, body) for GET `path` from the files in `directory` (reads only)."""
    if path == "/metrics":
        try:
            return 200, METRICS_TYPE, (directory / METRICS_FILE).read_bytes()
        except OSError:
            return 503, METRICS_TYPE, b"# the router has published no metrics yet\n"
    if path != "/health":
        return 404, "application/json", b'{"error": "not found: this port serves /health and /metrics"}'
    try:
        published = json.loads((directory / HEALTH_FILE).read_bytes())
    except (OSError, ValueError):
        return 503, "application/json", b'{"status": "stale", "error": "the router has published no health yet"}'
    age_s = time.monotonic() - float(published["at_s"])
    body = {**published["body"], "age_ms": round(age_s * 1e3)}
    if age_s > stale_after_s:
        return 503, "application/json", json.dumps({**body, "status": "stale"}).encode()
    return 200, "application/json", json.dumps(body).encode()


def _handler(directory: Path, stale_after_s: float) -> type[BaseHTTPRequestHandler]:
    """A request handler class answering GET through `answer` (HTTP/1.1, keep-alive)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            status, content_type, body = answer(directory, self.path.split("?", 1)[0], stale_after_s)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Silent: a probe every 0.2 s is no news."""

    return Handler


def main(argv: list[str]) -> None:
    """Serves until stdin reaches EOF (see the module). Raises OSError (the port is taken)."""
    directory, host, port, stale_after_s = Path(argv[0]), argv[1], int(argv[2]), float(argv[3])
    server = ThreadingHTTPServer((host, port), _handler(directory, stale_after_s))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), name="health-sidecar", daemon=True).start()
    sys.stdout.write(f"{server.server_address[1]}\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()  # NOTE: EOF: the router closed our stdin, or died
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    main(sys.argv[1:])
