"""Tenants as data: the schema, the registry, and loading tenants.json over the shipped defaults.

A tenant describes an application (how to recognise its processes, where it listens, how much it
matters, how to ask it for memory back), never code. The engine kind only selects an adapter in
`proxy.engines`; nothing here knows what an engine does.

Loading merges the shipped defaults *under* the user's file field by field, so a field added to the
schema in a later release appears in an old config with its default value, and every explicit user
value wins. `"name": null` removes a shipped tenant. The user's file is never written.
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError, UnknownTenant

GIB = 2**30
MIB = 2**20

ENV_CONFIG = "HYPERSWAP_CONFIG"
SHIPPED_DEFAULTS = Path(__file__).with_name("defaults") / "tenants.json"

EngineKind = Literal["ollama", "comfyui", "generic"]
ReleaseKind = Literal["ollama_unload", "comfyui_free", "http", "none"]


def user_config_path() -> Path:
    return Path(os.path.expanduser("~")) / ".config" / "hyperswap" / "tenants.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port (like 127.0.0.1:11435), got {value!r}")
    return value


_HOST_ENTRY = re.compile(r"^(\*|(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?|[0-9a-f:.]+|\[[0-9a-f:.]+\])$")


def _allowed_hosts(values: list[str]) -> list[str]:
    """Host names without port: `gpu.example.com`, `*.example.com`, an address, or `*` (no check)."""
    out = [v.strip().lower() for v in values]
    for v in out:
        if not _HOST_ENTRY.match(v) or (v.count(":") == 1 and not v.startswith("[")):
            raise ValueError(f"expected a host name without port (like gpu.example.com, *.example.com, "
                             f"192.168.1.5 or *), got {v!r}")
    return out


class MatchRules(_Strict):
    """How to recognise the tenant's GPU processes."""

    process_names: list[str] = Field(default_factory=list, description="exact process names (comm or argv[0] basename)")
    cmdline_patterns: list[str] = Field(default_factory=list, description="regular expressions searched in the command line")

    @field_validator("cmdline_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} is not a valid regular expression: {exc}") from None
        return patterns


class ReleaseSpec(_Strict):
    """How to ask the tenant for its memory back."""

    kind: ReleaseKind = "none"
    reason: str | None = Field(default=None, description="kind none: why it cannot be released (shown in 409s)")
    method: Literal["GET", "POST", "PUT", "DELETE"] = "POST"
    url: str | None = Field(default=None, description="kind http: absolute URL, or a path on the upstream")
    body: dict[str, Any] | None = Field(default=None, description="kind http: JSON body to send")
    unload_models: bool = True
    free_memory: bool = True

    @model_validator(mode="after")
    def _http_needs_url(self) -> "ReleaseSpec":
        if self.kind == "http" and not self.url:
            raise ValueError("release kind 'http' needs a 'url' (absolute, or a path on the upstream)")
        return self


class Timeouts(_Strict):
    connect_s: float = 5.0
    read_s: float | None = None  # a model load sends nothing for minutes
    write_s: float | None = None
    pool_s: float | None = None


class Tenant(_Strict):
    name: str = ""
    engine: EngineKind = "generic"
    description: str = ""
    listen: str | None = None
    upstream: str | None = None
    match: MatchRules = Field(default_factory=MatchRules)
    priority: int = 0
    protect_idle_memory: bool = Field(
        default=False, description="keep this tenant's idle memory from requesters of lower priority (off: idle memory serves whoever asks)")
    needs_vram_gb: float = 0.0
    release: ReleaseSpec = Field(default_factory=ReleaseSpec)
    idle_release_after_s: float | None = None
    idle_vram_gb: float = Field(default=0.0, description="VRAM held when idle (its CUDA context floor)")
    release_timeout_s: float = 10.0
    context_allowance_gb: float = Field(default=1.0, description="added to a model's size for context/KV cache")
    model_vram_gb: dict[str, float] = Field(default_factory=dict, description="per-model or per-checkpoint need overrides")
    timeouts: Timeouts = Field(default_factory=Timeouts)
    replay_body_max_mb: float = Field(default=16.0, description="GPU request bodies up to this size are kept for an OOM retry")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names the listener answers besides loopback")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        return None if v is None else _host_port(v)

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"expected an http:// or https:// URL, got {v!r}")
        return None if v is None else v.rstrip("/")

    _hosts = field_validator("allowed_hosts")(_allowed_hosts)

    @model_validator(mode="after")
    def _nonnegative(self) -> "Tenant":
        for field in ("needs_vram_gb", "idle_vram_gb", "context_allowance_gb", "release_timeout_s", "replay_body_max_mb"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must not be negative")
        if self.idle_release_after_s is not None and self.idle_release_after_s < 0:
            raise ValueError("idle_release_after_s must be null (never) or >= 0")
        if self.listen and not self.upstream:
            raise ValueError("a tenant with 'listen' needs an 'upstream' to forward to")
        return self

    # Bytes inside the proxy; GiB only at the configuration edge.
    @property
    def needs_vram_bytes(self) -> int:
        return int(self.needs_vram_gb * GIB)

    @property
    def idle_vram_bytes(self) -> int:
        return int(self.idle_vram_gb * GIB)

    @property
    def context_allowance_bytes(self) -> int:
        return int(self.context_allowance_gb * GIB)

    @property
    def replay_body_max_bytes(self) -> int:
        return int(self.replay_body_max_mb * MIB)

    @property
    def reclaimable(self) -> bool:
        return self.release.kind != "none"

    @property
    def not_reclaimable_reason(self) -> str:
        return self.release.reason or f"tenant {self.name!r} has no release strategy (release.kind is 'none' in tenants.json)"


class AdminSpec(_Strict):
    listen: str = "127.0.0.1:11400"
    token_env: str = "HYPERSWAP_ADMIN_TOKEN"
    token_file: str | None = None
    cors_origins: list[str] = Field(default_factory=list)
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names the admin API answers besides loopback")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _host_port(v)

    _hosts = field_validator("allowed_hosts")(_allowed_hosts)


class ProxySettings(_Strict):
    watchdog_interval_s: float = 1.0
    release_poll_s: float = 0.05  # NVML reads are sub-millisecond; 50 ms bounds the added wait
    queue_timeout_s: float = 300.0
    # A waiter overtaken by later higher-priority arrivals for this long goes ahead of them (no one starves).
    starvation_after_s: float = 60.0
    # Ollama's size_vram < size counts as a CPU spill only once the split held this long (a load grows).
    spill_stable_s: float = 5.0


class TelemetrySettings(_Strict):
    path: str | None = Field(default=None, description="SQLite file; null = ~/.local/state/hyperswap/telemetry.sqlite3, 'off' disables")
    retention_days: float = 30.0
    max_rows: int = 500_000


class Config(_Strict):
    admin: AdminSpec = Field(default_factory=AdminSpec)
    proxy: ProxySettings = Field(default_factory=ProxySettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    tenants: dict[str, Tenant] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ports_unique(self) -> "Config":
        seen: dict[str, str] = {self.admin.listen: "admin"}
        for name, t in self.tenants.items():
            if t.listen and t.listen in seen:
                raise ValueError(f"tenants {seen[t.listen]!r} and {name!r} both listen on {t.listen}")
            if t.listen:
                seen[t.listen] = name
        return self


# ---------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True, slots=True)
class Registry:
    """The merged, validated tenants, plus where each value came from."""

    config: Config
    source: Path | None  # the user file, or None for shipped defaults alone
    provenance: Mapping[str, Mapping[str, str]]  # tenant -> dotted field -> "user" | "default"

    @property
    def tenants(self) -> Mapping[str, Tenant]:
        return self.config.tenants

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.config.tenants.values())

    def __len__(self) -> int:
        return len(self.config.tenants)

    def __contains__(self, name: object) -> bool:
        return name in self.config.tenants

    def get(self, name: str) -> Tenant:
        try:
            return self.config.tenants[name]
        except KeyError:
            known = ", ".join(self.config.tenants) or "none"
            raise UnknownTenant(f"unknown tenant {name!r}", fix=f"use one of: {known}") from None

    def with_tenants(self, tenants: Mapping[str, Tenant]) -> "Registry":
        cfg = self.config.model_copy(update={"tenants": dict(tenants)})
        return Registry(cfg, self.source, self.provenance)


# ---------------------------------------------------------------------------------------------
# Loading

_FRIENDLY = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "list_type": "expected a list",
    "missing": "required field is missing",
    "extra_forbidden": "unknown key (check the spelling against the README's tenants.json reference)",
}


def _problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = _FRIENDLY.get(err["type"])
        if msg is None:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "literal_error":
                msg = msg.replace("Input should be", "expected")
        out.append(f"{path}: {msg}")
    return out


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist",
                          fix="create it, or drop --config / HYPERSWAP_CONFIG to use the shipped defaults") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}",
                          fix="fix the JSON at that line and column") from None


def _merge(base: Any, override: Any, path: tuple[str, ...], prov: dict[tuple[str, ...], str]) -> Any:
    """Deep-merge override onto base; lists and scalars are replaced whole."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if key in out and value is None and path == ("tenants",):
                del out[key]  # "desktop": null removes a shipped tenant
                prov[path + (key,)] = "removed"
                continue
            out[key] = _merge(out.get(key), value, path + (key,), prov) if key in out else value
            if not (isinstance(value, dict) and isinstance(base.get(key), dict)):
                _mark_user(value, path + (key,), prov)
        return out
    return override


def _mark_user(value: Any, path: tuple[str, ...], prov: dict[tuple[str, ...], str]) -> None:
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            _mark_user(inner, path + (key,), prov)
    else:
        prov[path] = "user"


def _resolve(path: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path | None:
    if path is not None:
        return Path(path)
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG])
    home = user_config_path()
    return home if home.exists() else None


def load_registry(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
                  shipped: Path = SHIPPED_DEFAULTS) -> Registry:
    """Load --config PATH, else $HYPERSWAP_CONFIG, else ~/.config/hyperswap/tenants.json, else defaults."""
    env = os.environ if env is None else env
    defaults = _read_json(shipped)
    source = _resolve(path, env)
    prov: dict[tuple[str, ...], str] = {}
    merged = defaults
    if source is not None:
        user = _read_json(source)
        if not isinstance(user, dict):
            raise ConfigError(f"{source}: the top level must be a JSON object", problems=["(top level): expected an object"])
        tenants = user.get("tenants")
        if tenants is not None and not isinstance(tenants, dict):
            raise ConfigError(f"{source} does not match the schema", problems=["tenants: expected an object"])
        merged = _merge(defaults, user, (), prov)
    return _validate(merged, source, prov)


def registry_from_dict(data: Mapping[str, Any]) -> Registry:
    """Build a registry from an in-memory config (tests, scenarios), with shipped defaults merged under it."""
    prov: dict[tuple[str, ...], str] = {}
    merged = _merge(_read_json(SHIPPED_DEFAULTS), dict(data), (), prov)
    return _validate(merged, None, prov)


def _validate(merged: Any, source: Path | None, prov: dict[tuple[str, ...], str]) -> Registry:
    merged = copy.deepcopy(merged)  # never write into the caller's dicts
    if isinstance(merged.get("tenants"), dict):
        for name, body in merged["tenants"].items():
            if isinstance(body, dict):
                body.setdefault("name", name)
    try:
        config = Config.model_validate(merged)
    except ValidationError as exc:
        where = str(source) if source else "the configuration"
        raise ConfigError(f"{where} does not match the schema", problems=_problems(exc),
                          fix="correct the fields listed above; see the README's tenants.json reference") from None
    for name, tenant in config.tenants.items():
        if tenant.name != name:
            raise ConfigError(f"{source}: tenant key {name!r} and its name {tenant.name!r} differ",
                              problems=[f"tenants.{name}.name: must equal the key {name!r} (or be left out)"])
    return Registry(config, source, _field_sources(config, prov))


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value and prefix.count(".") < 1:
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, value


def _field_sources(config: Config, prov: dict[tuple[str, ...], str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for name, tenant in config.tenants.items():
        fields: dict[str, str] = {}
        for key, value in tenant.model_dump().items():
            if key == "name":
                continue
            for dotted, _ in _leaves(value, key) if isinstance(value, dict) and key != "model_vram_gb" else [(key, value)]:
                parts = ("tenants", name, *dotted.split("."))
                user = any(src == "user" and (k[:len(parts)] == parts or parts[:len(k)] == k)
                           for k, src in prov.items())
                fields[dotted] = "user" if user else "default"
        out[name] = fields
    return out


def field_value(tenant: Tenant, dotted: str) -> Any:
    value: Any = tenant.model_dump()
    for part in dotted.split("."):
        value = value[part]
    return value
