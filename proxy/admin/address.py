"""Where a running proxy's admin API answers, for every command-line client (`hyperswap check`, `verify`,
`plan`, `mcp`, the deploy gate): an explicit --admin URL, else the admin.listen of the tenants.json in
use. The one place that turns a listen address into a URL to call."""

from __future__ import annotations

from proxy.engines.loading import load_registry

WILDCARD_HOSTS = ("0.0.0.0", "", "::", "[::]")  # addresses to listen on, not to call: reached on loopback


def local_url(listen: str) -> str:
    """A listen address (`host:port`) as a URL a local client can open."""
    host, _, port = listen.rpartition(":")
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    return f"http://{host}:{port}"


def admin_base_url(config: str | None, admin_url: str | None) -> str:
    """`http://host:port` without a trailing slash: --admin as given (a scheme added when missing), else
    the admin listener of tenants.json. Raises ConfigError when the configuration cannot be read."""
    if admin_url:
        return admin_url.rstrip("/") if "://" in admin_url else f"http://{admin_url.rstrip('/')}"
    return local_url(load_registry(config).config.admin.listen)
