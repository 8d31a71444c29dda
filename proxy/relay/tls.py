"""The TLS client context the proxy's own HTTP clients share (relays, job polls, control calls,
health checks, MCP tool calls).

Building one reads the whole CA bundle: 30-140 ms each on a 2-core box, paid by every client built
with httpx's default `verify=True`. The context holds only the CA store and the verify settings, so
one per process serves every client; httpx and the relay pools share one across connections anyway.
"""

from __future__ import annotations

import functools
import os
import ssl

import httpx


def client_ssl_context(*, trust_env: bool = False) -> ssl.SSLContext:
    """What `httpx.create_ssl_context(trust_env=trust_env)` builds, built once: with trust_env, once
    per SSL_CERT_FILE / SSL_CERT_DIR value, so a changed variable is still honoured."""
    where = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")) if trust_env else None
    return _context(trust_env, where)


@functools.lru_cache(maxsize=8)
def _context(trust_env: bool, where: tuple[str | None, str | None] | None) -> ssl.SSLContext:
    return httpx.create_ssl_context(trust_env=trust_env)
