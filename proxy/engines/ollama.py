"""Ollama: which routes load a model, and the Host rule of a loopback-bound server.

Ollama bound to loopback answers 403 (empty body) to a Host it does not consider local, so the
upstream always gets the upstream's own Host (engine-wire-facts A.1). Its CORS check passes
`Origin == http://<Host>`, so the base same-origin rewrite keeps browser pages working.
"""

from __future__ import annotations

from .base import EngineAdapter, RequestKind

# POST routes that schedule a runner (load a model). /api/pull only downloads: no GPU.
GPU_ROUTES = frozenset({
    "/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages",
})


class OllamaAdapter(EngineAdapter):
    kind = "ollama"

    def classify(self, method: str, path: str) -> RequestKind:
        if method.upper() == "POST" and path.rstrip("/") in GPU_ROUTES:
            return "gpu"
        return "passthrough"
