"""Loading: --config PATH, else $HYPERSWAP_CONFIG, else ~/.config/hyperswap/tenants.json, merged over
the shipped defaults, validated, and checked for what can be known at load (the commands a release
would run). The user's file is never written.

Every entry point takes the release kinds the file may use (`kinds`, a `ReleaseKinds`): this module
knows none but "none". The application's are listed in proxy/engines/release_kinds.py, and
proxy/engines/loading.py gives these entry points with them bound (what the proxy, the docs and the
tests call)."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from proxy.config.jsonfile import check_tree, read_json
from proxy.config.kinds import ReleaseKinds
from proxy.config.merge import Provenance, field_sources, merge, settings_sources
from proxy.config.messages import problems, schema_error
from proxy.config.registry import Registry
from proxy.config.schema import Config
from proxy.errors import ConfigError

ENV_CONFIG = "HYPERSWAP_CONFIG"
SHIPPED_DEFAULTS = Path(__file__).parent.parent / "defaults" / "tenants.json"


def user_config_path() -> Path:
    return Path(os.path.expanduser("~")) / ".config" / "hyperswap" / "tenants.json"


def _resolve(path: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path | None:
    if path is not None:
        return Path(path)
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG])
    home = user_config_path()
    return home if home.exists() else None


def load_registry(path: str | os.PathLike[str] | None = None, *, kinds: ReleaseKinds,
                  env: Mapping[str, str] | None = None, shipped: Path = SHIPPED_DEFAULTS) -> Registry:
    """Load --config PATH, else $HYPERSWAP_CONFIG, else ~/.config/hyperswap/tenants.json, else defaults."""
    env = os.environ if env is None else env
    defaults = read_json(shipped)
    source = _resolve(path, env)
    prov: Provenance = {}
    merged = defaults
    early: list[str] = []
    if source is not None:
        user = read_json(source)
        early = check_tree(user, str(source))
        if not isinstance(user, dict):
            raise ConfigError(f"{source}: the top level must be a JSON object", problems=["(top level): expected an object"])
        tenants = user.get("tenants")
        if tenants is not None and not isinstance(tenants, dict):
            raise ConfigError(f"{source} does not match the schema", problems=["tenants: expected an object"])
        merged = merge(defaults, user, (), prov)
    return _validate(merged, source, prov, early, env, kinds)


def load_registry_over(data: Mapping[str, object], path: str | os.PathLike[str],
                       pinned: Mapping[str, Mapping[str, object]] | None = None, *, kinds: ReleaseKinds) -> Registry:
    """The shipped defaults, then `data` (the demo's scenario), then the file at `path` over both
    (`hyperswap demo --config`): its admin, proxy, telemetry and gpu_profile sections and its tenants.
    `pinned`: tenant fields the file cannot change (the simulators' upstreams); the source is the file."""
    source = Path(path)
    user = read_json(source)
    early = check_tree(user, str(source))
    if not isinstance(user, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object", problems=["(top level): expected an object"])
    if user.get("tenants") is not None and not isinstance(user["tenants"], dict):
        raise ConfigError(f"{source} does not match the schema", problems=["tenants: expected an object"])
    prov: Provenance = {}
    early += check_tree(data, "the configuration")
    merged = copy.deepcopy(merge(merge(read_json(SHIPPED_DEFAULTS), dict(data), (), prov), user, (), prov))
    tenants = merged.get("tenants") if isinstance(merged, dict) else None
    for name, fields in (pinned or {}).items():
        body = tenants.get(name) if isinstance(tenants, dict) else None
        if isinstance(body, dict):
            body.update(fields)
    return _validate(merged, source, prov, early, os.environ, kinds)


def registry_from_dict(data: Mapping[str, object], *, kinds: ReleaseKinds) -> Registry:
    """Build a registry from an in-memory config (tests, scenarios), with shipped defaults merged under it."""
    prov: Provenance = {}
    early = check_tree(data, "the configuration")
    merged = merge(read_json(SHIPPED_DEFAULTS), dict(data), (), prov)
    return _validate(merged, None, prov, early, os.environ, kinds)


def command_problems(config: Config, env: Mapping[str, str]) -> list[str]:
    """What can be known wrong at load beyond the schema, asked of each release step (a `process`
    step's program exists and is executable, its working directory exists). Each problem names its
    path in tenants.json."""
    return [problem for tenant in config.tenants.values() for i, step in enumerate(tenant.release_steps)
            for problem in step.load_problems(tenant.release_path(i), env)]


def _validate(merged: object, source: Path | None, prov: Provenance, early: list[str],
              env: Mapping[str, str], kinds: ReleaseKinds) -> Registry:
    """`early`: the tree's problems (tree_problems), listed with the schema's."""
    merged = copy.deepcopy(merged)  # never write into the caller's dicts
    if isinstance(merged, dict) and isinstance(merged.get("tenants"), dict):
        for name, body in merged["tenants"].items():
            if isinstance(body, dict):
                body.setdefault("name", name)
    where = str(source) if source else "the configuration"
    try:
        config = kinds.config_model.model_validate(merged)
    except ValidationError as exc:
        named = {p.split(": ", 1)[0] for p in early}  # a NaN is named once, by the tree's message
        raise schema_error(where, early + [p for p in problems(exc, kinds) if p.split(": ", 1)[0] not in named]) from None
    if early:
        raise schema_error(where, early)
    for name, tenant in config.tenants.items():
        if tenant.name != name:
            raise ConfigError(f"{source}: tenant key {name!r} and its name {tenant.name!r} differ",
                              problems=[f"tenants.{name}.name: must equal the key {name!r} (or be left out)"])
    missing = command_problems(config, env)
    if missing:
        raise ConfigError(f"{where}: a command the proxy would run cannot be found", problems=missing,
                          fix="correct the paths listed above; the proxy checks them at load so a start never "
                              "fails for it later")
    return Registry(config, source, field_sources(config, prov), settings_sources(config, prov))
