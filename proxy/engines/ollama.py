"""Ollama: which routes load a model, and the Host rule of a loopback-bound server.

Ollama bound to loopback answers 403 (empty body) to a Host it does not consider local, so the
upstream always gets the upstream's own Host (engine-wire-facts A.1). That hides the client's Host
from Ollama, so the listener applies Ollama's own Host rule first (`host_policy`). Its CORS check
passes `Origin == http://<Host>`, so the base same-origin rewrite keeps browser pages working.
"""

from __future__ import annotations

import json
import re
from urllib.parse import urlsplit

from proxy.engines.base import EngineAdapter, RequestKind
from proxy.relay.hosts import HostPolicy, is_loopback_host, listener_policy

# POST routes that schedule a runner (load a model). /api/pull only downloads: no GPU.
GPU_ROUTES = frozenset({
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
})


# Ollama's unload path (engine-wire-facts A.3/A.4): keep_alive exactly 0 and nothing to run.
UNLOAD_ROUTES = {"/api/generate": "prompt", "/api/chat": "messages"}
# A Go duration string (time.ParseDuration): "0", "0s", "0m0s", "0.0h"...
_GO_DURATION = re.compile(r"^[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|\u00b5s|ms|s|m|h))+$")


def keep_alive_is_zero(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value == 0
    if isinstance(value, str):
        if value == "0":
            return True
        return bool(_GO_DURATION.match(value)) and not any(c in "123456789" for c in value)
    return False


class OllamaAdapter(EngineAdapter):
    kind = "ollama"
    answers_oom = True
    model_layout = "ollama"

    def load_seconds(self, answer_tail: bytes) -> float | None:
        """`load_duration` (ns) on the final line of a generation, chat or embed answer."""
        from proxy.models.loads import ollama_load_seconds
        return ollama_load_seconds(answer_tail)

    def classify(self, method: str, path: str) -> RequestKind:
        if method.upper() == "POST" and path.rstrip("/") in GPU_ROUTES:
            return "gpu"
        return "passthrough"

    def unload_target(self, path: str, body: bytes) -> str | None:
        work = UNLOAD_ROUTES.get(path.rstrip("/"))
        if work is None or b"keep_alive" not in body:  # cheap filter: most requests never set it
            return None
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("model"), str) or data.get(work):
            return None
        return data["model"] if keep_alive_is_zero(data.get("keep_alive")) else None

    def host_policy(self) -> HostPolicy:
        """allowedHostsMiddleware, mirrored: what Ollama allows, plus the tenant's allowed_hosts.
        Ollama checks Host only when bound to loopback; one on another address checks none, and
        neither does a drop-in in front of it that listens off loopback itself."""
        engine_checks = is_loopback_host(urlsplit(self.tenant.upstream or "http://127.0.0.1").hostname or "")
        return listener_policy(self.listen_host(), self.tenant.allowed_hosts, engine_rule=True,
                               engine_checks=engine_checks)
