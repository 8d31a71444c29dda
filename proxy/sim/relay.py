"""A simulated speech relay: a real app the proxy can start and stop (release kind `process`).

    python -m proxy.sim.relay --port P [--host H] [--vram-gb X] [--load-s S] [--gpu-dir D] [--model M]

It "loads its model" (sleeps `--load-s` on its own clock: it is a process of its own), registers its
memory with the simulated GPU watching `--gpu-dir` (`<pid>.json`, then waits for the card's answer;
refused memory is a CUDA out-of-memory exit, code 1), then serves HTTP on loopback:

- `GET /health`: 200 `{"status": "ok", "model", "vram_bytes"}` (its ready probe);
- `POST /v1/audio/transcriptions` (OpenAI's path, as whisper servers use it): reads the whole body,
  takes `--transcribe-s` seconds, answers 200 JSON `{"text", "model", "bytes"}`;
- `GET /v1/captions?segments=N&interval_s=T`: a live-captions stream (`text/event-stream`), one
  `data:` line every T seconds, N of them (0: until the client goes away);
- anything else: 404 JSON.

SIGTERM (or SIGINT) ends it at once with code 0; its memory is back on the simulated card as soon as
the process is gone (the card watches /proc), as NVML would show.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

GIB = 2**30
REGISTER_TIMEOUT_S = 30.0


class OutOfMemory(Exception):
    pass


def register_vram(folder: Path, nbytes: int, *, timeout_s: float = REGISTER_TIMEOUT_S, poll_s: float = 0.002) -> None:
    """Tell the simulated GPU this process now holds `nbytes`, and wait for its answer. Raises
    OutOfMemory when the card refuses (it did not fit), TimeoutError when nobody answers."""
    pid = os.getpid()
    folder.mkdir(parents=True, exist_ok=True)
    ok, oom = folder / f"{pid}.ok", folder / f"{pid}.oom"
    for stale in (ok, oom):  # a previous process with this pid
        stale.unlink(missing_ok=True)
    tmp = folder / f".{pid}.json.tmp"
    tmp.write_text(json.dumps({"vram_bytes": nbytes}))
    tmp.replace(folder / f"{pid}.json")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ok.exists():
            return
        if oom.exists():
            try:
                refused = json.loads(oom.read_text())
            except (OSError, ValueError):
                refused = {"requested": nbytes, "free": 0}
            oom.unlink(missing_ok=True)
            raise OutOfMemory(f"CUDA out of memory: tried to allocate {refused['requested'] / GIB:.2f} GiB "
                              f"with {refused['free'] / GIB:.2f} GiB free")
        time.sleep(poll_s)
    raise TimeoutError(f"no simulated GPU answered in {folder} within {timeout_s:g} s")


class _Handler(BaseHTTPRequestHandler):
    server: _RelayServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would bury the start-up lines the proxy keeps

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/health":
            self._json(200, {"status": "ok", "model": self.server.model, "vram_bytes": self.server.vram_bytes})
        elif url.path == "/v1/captions":
            self._captions(parse_qs(url.query))
        else:
            self._json(404, {"error": f"no route {url.path}"})

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if url.path != "/v1/audio/transcriptions":
            self._json(404, {"error": f"no route {url.path}"})
            return
        if self.server.transcribe_s:
            time.sleep(self.server.transcribe_s)
        self._json(200, {"text": f"(transcribed {len(body)} bytes of audio)", "model": self.server.model,
                         "bytes": len(body)})

    def _captions(self, query: dict[str, list[str]]) -> None:
        segments = int(query.get("segments", ["0"])[0])
        interval_s = float(query.get("interval_s", ["0.05"])[0])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = 0
        try:
            while segments <= 0 or n < segments:
                line = f"data: {json.dumps({'segment': n, 'text': f'segment {n}'})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
                n += 1
                time.sleep(interval_s)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


class _RelayServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], model: str, vram_bytes: int, transcribe_s: float) -> None:
        super().__init__(address, _Handler)
        self.model = model
        self.vram_bytes = vram_bytes
        self.transcribe_s = transcribe_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.sim.relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--vram-gb", type=float, default=0.0, help="GiB it holds on the simulated GPU once loaded")
    parser.add_argument("--load-s", type=float, default=0.0, help="seconds its model takes to load")
    parser.add_argument("--gpu-dir", type=Path, default=None, help="the folder the simulated GPU watches")
    parser.add_argument("--model", default="whisper-large-v3")
    parser.add_argument("--transcribe-s", type=float, default=0.0, help="seconds one transcription takes")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        nbytes = int(args.vram_gb * GIB)
        print(f"loading {args.model} ({args.vram_gb:g} GiB)", flush=True)
        if args.load_s > 0:
            time.sleep(args.load_s)
        if args.gpu_dir is not None and nbytes:
            try:
                register_vram(args.gpu_dir, nbytes)
            except (OutOfMemory, TimeoutError, OSError) as exc:
                print(f"error: {exc}", file=sys.stderr, flush=True)
                return 1
        try:
            server = _RelayServer((args.host, args.port), args.model, nbytes, args.transcribe_s)
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr, flush=True)
            return 1
        print(f"{args.model} loaded; listening on http://{args.host}:{args.port}", flush=True)
        with server:
            server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
