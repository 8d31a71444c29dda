"""Where a running proxy's admin API answers, for the command-line clients (`hyperswap check`,
`hyperswap mcp`): an explicit --admin URL, else the admin.listen of the tenants.json in use."""

from __future__ import annotations

from proxy.config.loading import load_registry


def admin_base_url(config: str | None, admin_url: str | None) -> str:
    """`http://host:port` without a trailing slash; a wildcard listen address is reached on loopback.
    Raises ConfigError when the configuration cannot be read."""
    if admin_url:
        return admin_url.rstrip("/") if "://" in admin_url else f"http://{admin_url.rstrip('/')}"
    listen = load_registry(config).config.admin.listen
    host, _, port = listen.rpartition(":")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
    return f"http://{host}:{port}"
