"""Loading tenants.json with the proxy's release kinds: the entry points the application, the docs
and the tests call.

proxy/config/loading.py reads, merges and checks a file and takes the release kinds it may use as a
parameter (proxy/config/ knows none but "none"); these are the same entry points with the kinds of
proxy/engines/release_kinds.py bound (`KINDS`), so a tenant of any kind validates in any interpreter
that imported this module, whatever else it imported. `kinds`: another set (a test's own kind:
`KINDS.adding(Model)`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from proxy.config import loading
from proxy.config.kinds import ReleaseKinds
from proxy.config.loading import SHIPPED_DEFAULTS
from proxy.config.registry import Registry
from proxy.engines.release_kinds import KINDS


def load_registry(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                  shipped: Path = SHIPPED_DEFAULTS, kinds: ReleaseKinds = KINDS) -> Registry:
    """Load --config PATH, else $HYPERSWAP_CONFIG, else ~/.config/hyperswap/tenants.json, else defaults."""
    return loading.load_registry(path, kinds=kinds, env=env, shipped=shipped)


def load_registry_over(data: Mapping[str, object], path: str | os.PathLike[str],
                       pinned: Mapping[str, Mapping[str, object]] | None = None, *,
                       kinds: ReleaseKinds = KINDS) -> Registry:
    """The shipped defaults, `data` (the demo's scenario), then the file at `path` over both."""
    return loading.load_registry_over(data, path, pinned, kinds=kinds)


def registry_from_dict(data: Mapping[str, object], *, kinds: ReleaseKinds = KINDS) -> Registry:
    """A registry from an in-memory config (tests, scenarios), with the shipped defaults merged under it."""
    return loading.registry_from_dict(data, kinds=kinds)
