"""A tiny Ollama-shaped app the proxy can start (release kind `process`): just enough of Ollama's API for
a streamed chat through the official client, so a test sees a request wait for its app's start.

    python tiny_ollama.py PORT

Once its interpreter is up it listens (its start: the proxy's request waits for it), and answers:
- `GET /api/version`: its readiness probe; `GET /api/ps`, `GET /api/tags`: one model, nothing loaded;
- `POST /api/chat`: NDJSON, one line per word of "hello from the app", then the done line;
- anything else: 404 JSON. SIGTERM ends it at once.
"""

from __future__ import annotations

import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "tiny:1b"
WORDS = ["hello", " from", " the", " app"]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/api/version":
            self._json(200, {"version": "0.12.0"})
        elif self.path == "/api/ps":
            self._json(200, {"models": []})
        elif self.path == "/api/tags":
            self._json(200, {"models": [{"name": MODEL, "model": MODEL, "size": 2**30}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/api/chat":
            self._json(404, {"error": "not found"})
            return
        model = json.loads(body or b"{}").get("model", MODEL)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        stamp = "2026-01-01T00:00:00.000000Z"
        lines = [{"model": model, "created_at": stamp, "message": {"role": "assistant", "content": w}, "done": False}
                 for w in WORDS]
        lines.append({"model": model, "created_at": stamp, "message": {"role": "assistant", "content": ""},
                      "done": True, "done_reason": "stop", "total_duration": 1000, "load_duration": 10,
                      "prompt_eval_count": 1, "eval_count": len(WORDS)})
        for line in lines:
            chunk = json.dumps(line).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    port = int(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
