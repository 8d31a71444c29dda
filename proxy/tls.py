"""One TLS client context for the whole process.

httpx builds a new verifying context for every client it is not handed one: each loads the CA bundle,
~80 ms of CPU. The proxy makes clients per listener, per extension and per MCP tool call (most of
them to loopback engines that never use TLS), so they all share this one; an `ssl.SSLContext` is
safe to share between clients and threads."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def client_context() -> ssl.SSLContext:
    """httpx's default verifying context (its CA bundle), built once on first use."""
    return httpx.create_ssl_context()
