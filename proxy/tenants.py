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
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.errors import ConfigError, UnknownTenant

GIB = 2**30
MIB = 2**20

ENV_CONFIG = "HYPERSWAP_CONFIG"
SHIPPED_DEFAULTS = Path(__file__).with_name("defaults") / "tenants.json"

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_DEPTH = 32  # JSON nesting; release.body is the only free-form part and needs a few levels

EngineKind = Literal["ollama", "comfyui", "generic"]
WakeOn = Literal["writes", "any"]  # which requests start a stopped app (see Tenant.wake_on)
Progress = Literal["streams", "off"]  # progress lines for streamed requests that wait (see Tenant.progress)
ReleaseKind = Literal["ollama_unload", "comfyui_free", "http", "none", "process", "systemd", "docker"]
# The kinds that release a tenant by stopping it, and so can start it again (proxy/lifecycle/).
LIFECYCLE_KINDS = frozenset({"process", "systemd", "docker"})
DEFAULT_STOP_TIMEOUT_S = 10.0  # process: SIGTERM, then SIGKILL after this; docker: `stop?t=`
DEFAULT_DOCKER_SOCKET = "/var/run/docker.sock"


def user_config_path() -> Path:
    return Path(os.path.expanduser("~")) / ".config" / "hyperswap" / "tenants.json"


# ---------------------------------------------------------------------------------------------
# Bounds: every number in the file has a sane range, so nonsense fails at load with its path
# instead of at run time (1e300 GiB made every request 500, a negative timeout made every request
# 504 at once, a 0 s watchdog interval spun a core).

DAY_S = 86400.0
MAX_GIB = 16384.0  # 16 TiB: far above any card, far below where a byte count stops being exact


@dataclass(frozen=True, slots=True)
class Bound:
    """[low, high] in `unit`; `low_open`: low itself is refused (a zero timeout would fire at once)."""

    low: float
    high: float
    unit: str = ""
    low_open: bool = False

    def problem(self, value: float) -> str | None:
        too_low = value <= self.low if self.low_open else value < self.low
        if not too_low and value <= self.high:
            return None
        unit = f" {self.unit}" if self.unit else ""
        return f"must be {'>' if self.low_open else '>='} {_num(self.low)} and <= {_num(self.high)}{unit}, got {_num(value)}"


def _num(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 10**15:
        return f"a {x.bit_length()}-bit integer"  # float(x) could overflow
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


# By field name (docs/reference/tenants-json.md is generated from them); names not here fall back to their
# suffix, so a field added later gets a range too.
BOUNDS: dict[str, Bound] = {
    "priority": Bound(-1_000_000, 1_000_000),
    "release_timeout_s": Bound(0, 3600, "s", low_open=True),
    "timeout_s": Bound(0, 3600, "s", low_open=True),  # one release step's own timeout
    "stop_timeout_s": Bound(0, 3600, "s"),  # 0: SIGKILL (docker: kill) at once
    "start_timeout_s": Bound(0, 3600, "s", low_open=True),
    "restart_limit": Bound(1, 1000, "restarts"),
    "idle_release_after_s": Bound(0, 30 * DAY_S, "s"),  # 0: release as soon as it goes idle
    "connect_s": Bound(0, 3600, "s", low_open=True),
    "read_s": Bound(0, DAY_S, "s", low_open=True),
    "write_s": Bound(0, DAY_S, "s", low_open=True),
    "pool_s": Bound(0, DAY_S, "s", low_open=True),
    "watchdog_interval_s": Bound(0.05, 3600, "s"),  # each tick reads the GPU and polls the engines
    "release_poll_s": Bound(0.01, 10, "s"),  # each poll reads the GPU
    "queue_timeout_s": Bound(0, DAY_S, "s"),  # 0: never wait for a handoff, answer 503 at once
    "job_lost_after_s": Bound(0, DAY_S, "s", low_open=True),
    "retention_days": Bound(0, 3650, "days", low_open=True),  # 0 would delete every row at open
    "max_rows": Bound(1, 100_000_000, "rows"),
    "replay_body_max_mb": Bound(0, 1024, "MiB"),  # kept in memory while the request runs
    # gpu_profile: wide enough for any card; the card's own range is checked against what NVML reports
    "power_limit_w": Bound(1, 5000, "W"),
    "gpc_clock_offset_mhz": Bound(-5000, 5000, "MHz"),
    "mem_clock_offset_mhz": Bound(-10000, 10000, "MHz"),
    "fan_speed_percent": Bound(0, 100, "%"),
    "device": Bound(0, 63),
    "check_interval_s": Bound(1, 3600, "s"),  # each check reads the card's settings through NVML
    "keep_warm_models": Bound(0, 1000, "models"),
    "overtake_limit": Bound(0, 1000, "requests"),  # 0: strict arrival order, a swap for every change of tenant
    "swap_hold_s": Bound(0, 60, "s"),  # 0: off; a hold is added to a swap's latency, so it stays short
    "swap_hold_recent_s": Bound(0, 3600, "s"),
}
SUFFIX_BOUNDS: dict[str, Bound] = {"_gb": Bound(0, MAX_GIB, "GiB"), "_s": Bound(0, DAY_S, "s")}


def bound_for(field: str) -> Bound | None:
    if field in BOUNDS:
        return BOUNDS[field]
    return next((b for suffix, b in SUFFIX_BOUNDS.items() if field.endswith(suffix)), None)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _in_bounds(cls, value: Any, info: ValidationInfo) -> Any:
        bound = bound_for(info.field_name or "")
        if bound is None:
            return value
        if isinstance(value, dict):  # model_vram_gb: one bound for every entry
            for key, inner in value.items():
                problem = bound.problem(inner) if _number(inner) else None
                if problem:
                    raise ValueError(f"{key!r} {problem}")
        elif _number(value):
            problem = bound.problem(value)
            if problem:
                raise ValueError(problem)
        return value


def _no_spaces(value: str) -> None:
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{value!r} contains a space or control character")


def _host_port(value: str) -> str:
    _no_spaces(value)
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected host:port (like 127.0.0.1:11435), got {value!r}")
    if int(port) == 0:
        raise ValueError("port 0 picks a new random port at every start, so no client could find it: use a fixed port 1-65535")
    if int(port) > 65535:
        raise ValueError(f"port {port} is out of range: use 1-65535")
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


_DEVICE_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]+")


def _device_list(values: list[int | str] | None) -> list[int | str] | None:
    """`devices`: NVML indices (0, 1, ...) or UUIDs as `nvidia-smi -L` prints them (GPU-..., MIG-...)."""
    if values is None:
        return None
    if not values:
        raise ValueError("an empty list pins the tenant to no GPU: leave devices out (any device) or name one, like [0]")
    seen: set[str] = set()
    for v in values:
        if isinstance(v, int) and v < 0:
            raise ValueError(f"{v} is not a device index: NVML counts from 0 (`nvidia-smi -L`)")
        if isinstance(v, str) and not _DEVICE_UUID.fullmatch(v):
            raise ValueError(f"{v!r} is neither a device index nor a UUID like 'GPU-8f2c...' (`nvidia-smi -L` lists them)")
        key = str(v).lower()
        if key in seen:
            raise ValueError(f"{v!r} is listed twice")
        seen.add(key)
    return values


def _upstream_url(value: str) -> str:
    _no_spaces(value)
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:  # a port that is no number or out of range, a broken [v6] address
        raise ValueError(f"expected http(s)://host:port with a port 1-65535, got {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
    if port == 0:
        raise ValueError(f"port 0 in {value!r}: use the engine's port (1-65535)")
    # Relays send each request's own path to host:port, so anything more would be silently ignored.
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"expected only scheme://host:port, got {value!r}: a path, query or user here would be "
                         "ignored (each request keeps its own path)")
    return value.rstrip("/")


class PodMatch(_Strict):
    """A Kubernetes pod this tenant's processes run in: its namespace and/or labels (all must match)."""

    namespace: str | None = Field(default=None, description="the pod's namespace")
    labels: dict[str, str] = Field(default_factory=dict, description="labels the pod carries, every one with this value")

    @model_validator(mode="after")
    def _not_everything(self) -> PodMatch:
        if self.namespace is None and not self.labels:
            raise ValueError("name a namespace or at least one label (an empty pod rule would match every pod)")
        return self

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return (self.namespace is None or self.namespace == namespace) and all(
            labels.get(k) == v for k, v in self.labels.items())


class MatchRules(_Strict):
    """How to recognise the tenant's GPU processes."""

    process_names: list[str] = Field(
        default_factory=list, description="exact process names (comm, or argv[0] basename) that belong to this tenant, "
        "where its port cannot tell")
    cmdline_patterns: list[str] = Field(
        default_factory=list, description="regular expressions searched in the command line when no tenant names the "
        "process exactly (Ollama's runner subprocesses; ComfyUI's main.py with its flags)")
    pod: PodMatch | None = Field(default=None, description="on Kubernetes: the pod's namespace and labels")

    @field_validator("cmdline_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} is not a valid regular expression: {exc}") from None
        return patterns


HttpMethod = Literal["GET", "POST", "PUT", "DELETE"]


def _call_url(value: str) -> str:
    _no_spaces(value)
    if value.startswith("/"):
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected a path on the upstream (like /wake_up) or an http(s):// URL, got {value!r}")
    return value


class HttpCall(_Strict):
    """One HTTP call the proxy makes to the app: the shape of an `http` release (method, url, body)."""

    method: HttpMethod = Field(default="POST", description="the HTTP method")
    url: str = Field(description="absolute URL, or a path on the upstream")
    body: dict[str, Any] | None = Field(default=None, description="JSON body to send")

    _url = field_validator("url")(_call_url)


# Fields that belong to some release kinds only, and the kinds that need them. A field named for
# another kind is refused at its own path, so a typo in `kind` cannot silently drop a command.
KIND_FIELDS: Mapping[str, frozenset[str]] = {
    "resume": frozenset({"http"}),
    "command": frozenset({"process"}),
    "stop_command": frozenset({"process"}),
    "cwd": frozenset({"process"}),
    "env": frozenset({"process"}),
    "stop_timeout_s": frozenset({"process", "docker"}),
    "unit": frozenset({"systemd"}),
    "scope": frozenset({"systemd"}),
    "container": frozenset({"docker"}),
    "socket": frozenset({"docker"}),
}
REQUIRED_FIELDS: Mapping[str, str] = {"command": "process", "unit": "systemd", "container": "docker"}

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# systemd unit names (systemd.unit(5)): no leading '-', so a name can never read as an option.
UNIT_NAME = re.compile(r"[A-Za-z0-9_:.\\@][A-Za-z0-9_:.\\@-]{0,254}")
# Docker container names and ids ([a-zA-Z0-9][a-zA-Z0-9_.-]+, or hex): safe in a URL path as they are.
CONTAINER_NAME = re.compile(r"/?[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")


class ReleaseSpec(_Strict):
    """How to ask the tenant for its memory back (one step, when `release` is a list of steps).

    The lifecycle kinds (`process`, `systemd`, `docker`) release by stopping the app, and start it
    again when a request arrives for it (proxy/lifecycle/)."""

    kind: ReleaseKind = Field(
        default="none", description="how the memory is asked back: ollama_unload (every loaded model with keep_alive 0), "
        "comfyui_free (POST /free), http (a call you configure), process, systemd or docker (stop the app, start it again "
        "on its next request), or none (not reclaimable: a release answers 409 with the reason)")
    reason: str | None = Field(default=None, description="kind none: why it cannot be released (shown in 409s)")
    method: HttpMethod = Field(default="POST", description="kind http: the HTTP method")
    url: str | None = Field(default=None, description="kind http: absolute URL, or a path on the upstream")
    body: dict[str, Any] | None = Field(default=None, description="kind http: JSON body to send")
    unload_models: bool = Field(default=True, description="kind comfyui_free: ask ComfyUI to unload its models")
    free_memory: bool = Field(default=True, description="kind comfyui_free: ask ComfyUI to free its cached memory too")
    timeout_s: float | None = Field(
        default=None, description="how long this step may take until the card shows the memory back; "
                                  "null: the tenant's release_timeout_s")
    resume: HttpCall | None = Field(default=None, description="kind http: the call that wakes the app before its next "
                                                               "request is forwarded (vLLM's /wake_up)")
    command: list[str] | None = Field(default=None, validate_default=True,
                                      description="kind process: the command the proxy runs and owns, argv style")
    stop_command: list[str] | None = Field(
        default=None, description="kind process: a command run to stop the app instead of signals, argv style (like "
        "llama-swap's cmdStop: [\"docker\", \"stop\", \"tts\"]); it and the app's exit share stop_timeout_s, it "
        "is killed with its process group when it runs over, and SIGTERM then SIGKILL follow when it fails or the "
        "app still runs")
    cwd: str | None = Field(default=None, description="kind process: its working directory (absolute)")
    env: dict[str, str] | None = Field(default=None, description="kind process: added to the proxy's environment")
    stop_timeout_s: float | None = Field(
        default=None, description=f"kinds process and docker: SIGTERM, then SIGKILL after this long "
                                  f"(default {DEFAULT_STOP_TIMEOUT_S:g})")
    unit: str | None = Field(default=None, validate_default=True, description="kind systemd: the unit, like comfyui.service")
    scope: Literal["system", "user"] | None = Field(
        default=None, description="kind systemd: the system manager (default) or the user's (`systemctl --user`)")
    container: str | None = Field(default=None, validate_default=True, description="kind docker: container name or id")
    socket: str | None = Field(default=None, description=f"kind docker: the Engine API's Unix socket "
                                                         f"(default {DEFAULT_DOCKER_SOCKET}; Podman's works too)")

    @field_validator(*KIND_FIELDS)
    @classmethod
    def _for_its_kind(cls, value: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind")
        field = info.field_name or ""
        if kind is None:  # the kind itself is wrong: that error is enough
            return value
        if value is None:
            if REQUIRED_FIELDS.get(field) == kind:
                raise ValueError(f"release kind {kind!r} needs {field!r}")
            return value
        if kind not in KIND_FIELDS[field]:
            kinds = " or ".join(repr(k) for k in sorted(KIND_FIELDS[field]))
            raise ValueError(f"only release kind {kinds} takes {field!r} (this release is kind {kind!r})")
        return value

    @field_validator("command", "stop_command")
    @classmethod
    def _command(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        if not value or not value[0]:
            raise ValueError("expected the program and its arguments, like [\"llama-server\", \"--port\", \"8081\"]")
        if any("\0" in arg for arg in value):
            raise ValueError("an argument contains a NUL character")
        if "/" in value[0] and not value[0].startswith("/"):
            raise ValueError(f"{value[0]!r}: give the program as an absolute path or a bare name found on PATH")
        return value

    @field_validator("cwd", "socket")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith(("/", "~")) or "\0" in value):
            raise ValueError(f"expected an absolute path, got {value!r}")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, inner in (value or {}).items():
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"{key!r} is not an environment variable name (letters, digits, '_')")
            if "\0" in inner:
                raise ValueError(f"{key!r}: the value contains a NUL character")
        return value

    @field_validator("unit")
    @classmethod
    def _unit(cls, value: str | None) -> str | None:
        if value is not None and not UNIT_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a systemd unit name (like comfyui.service)")
        return value

    @field_validator("container")
    @classmethod
    def _container(cls, value: str | None) -> str | None:
        if value is not None and not CONTAINER_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not a container name or id (letters, digits, '_', '.', '-')")
        return value.lstrip("/") if value is not None else None

    @model_validator(mode="after")
    def _http_needs_url(self) -> ReleaseSpec:
        if self.kind == "http" and not self.url:
            raise ValueError("release kind 'http' needs a 'url' (absolute, or a path on the upstream)")
        return self

    @property
    def stops(self) -> bool:
        """This step stops the app (and so the proxy can start it again)."""
        return self.kind in LIFECYCLE_KINDS

    @property
    def effective_stop_timeout_s(self) -> float:
        return DEFAULT_STOP_TIMEOUT_S if self.stop_timeout_s is None else self.stop_timeout_s

    @property
    def effective_scope(self) -> Literal["system", "user"]:
        return self.scope or "system"

    @property
    def effective_socket(self) -> str:
        return self.socket or DEFAULT_DOCKER_SOCKET


# Tags of the two shapes `release` takes; _problems leaves them out of an error's path.
_ONE_STEP, _STEPS = "(one release)", "(release steps)"


def _release_shape(value: Any) -> str:
    return _STEPS if isinstance(value, list) else _ONE_STEP


Release = Annotated[Annotated[ReleaseSpec, Tag(_ONE_STEP)] | Annotated[list[ReleaseSpec], Tag(_STEPS)],
                    Discriminator(_release_shape)]


class ReadySpec(_Strict):
    """When a started tenant is ready for requests: an HTTP path answering a status, or its port open."""

    path: str | None = Field(default=None, description="GET this path on the upstream; null: the engine's own "
                                                        "(Ollama /api/version, ComfyUI /system_stats), else the port")
    status: int = Field(default=200, ge=100, le=599, description="the status that means ready")
    tcp: bool = Field(default=False, description="ready as soon as the upstream port accepts a connection")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            _no_spaces(value)
            if not value.startswith("/"):
                raise ValueError(f"expected a path on the upstream starting with '/', got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_way(self) -> ReadySpec:
        if self.tcp and self.path is not None:
            raise ValueError("give either a path or tcp: true, not both")
        return self


class Timeouts(_Strict):
    """Timeouts of the proxy's connections to the tenant's upstream."""

    connect_s: float = Field(default=5.0, description="connecting to the upstream")
    read_s: float | None = Field(default=None, description="no byte from the engine for this long: its answer's head "
                                                            "once the request is sent, or between body chunks; null: no "
                                                            "limit (a model load sends nothing for minutes)")
    write_s: float | None = Field(default=None, description="a stalled upload: the engine reads nothing of the request "
                                                             "body for this long; null: no limit")
    pool_s: float | None = Field(default=None, description="waiting for a free upstream connection when all 1024 are "
                                                            "busy, then 503; null: 30 s")


def _only_when_started(field: str, info: ValidationInfo) -> None:
    """A field set on a tenant the proxy does not start (no release step of it stops the app) is an error."""
    release = info.data.get("release")
    steps = release if isinstance(release, list) else [release] if release is not None else []
    if release is not None and not any(step.stops for step in steps):
        raise ValueError(f"'{field}' applies to a tenant the proxy starts: one whose release is of kind process, "
                         "systemd or docker")


class Tenant(_Strict):
    name: str = Field(default="", description="set from its key in tenants (leave it out)")
    engine: EngineKind = Field(default="generic", description="selects the adapter: what needs the GPU, Host/Origin "
                                                               "rules, how an out-of-memory failure shows")
    description: str = Field(default="", description="words for people (the dashboard shows them)")
    listen: str | None = Field(default=None, description="where the drop-in listens, host:port; absent for a VRAM-only "
                                                          "tenant")
    upstream: str | None = Field(default=None, description="where the engine really is, http(s)://host:port and "
                                                            "nothing more (each request keeps its own path)")
    match: MatchRules = Field(default_factory=MatchRules, description="how its GPU processes are recognised where its "
                                                                       "port cannot tell")
    priority: int = Field(default=0, description="order among waiting requests (higher first, then arrival) and the "
                                                 "order idle tenants are released in (lowest first); the watchdog's "
                                                 "relief of a starved busy tenant takes only from tenants below it")
    protect_idle_memory: bool = Field(
        default=False,
        description="keep this tenant's idle memory from requesters of lower priority (off: idle memory serves whoever asks)")
    needs_vram_gb: float = Field(default=0.0, description="GiB it needs to work (ComfyUI prompts, a start); Ollama "
                                                          "uses the model's size instead")
    release: Release = Field(default_factory=ReleaseSpec,
                             description="how to get its memory back: one release, or a list of steps tried in order "
                                         "until the card shows the memory back")
    idle_release_after_s: float | None = Field(default=None, description="release unasked after this long without GPU "
                                                                        "traffic (0: as soon as it goes idle); null: never")
    idle_vram_gb: float = Field(default=0.0, description="GiB of VRAM it holds when idle (its CUDA context floor): a "
                                                         "\"running\" job while at the floor is stale")
    release_timeout_s: float = Field(default=10.0, description="how long a release may take until the card shows the "
                                                              "memory back")
    context_allowance_gb: float = Field(default=1.0, description="GiB added to an Ollama model's size for its context "
                                                                 "and KV cache")
    model_vram_gb: dict[str, float] = Field(default_factory=dict, description="per-model or per-checkpoint need "
                                                                                 "overrides in GiB")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="upstream timeouts")
    replay_body_max_mb: float = Field(default=16.0, description="GPU request bodies up to this size are kept for an "
                                                                   "OOM retry (0: never kept)")
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Host names the listener answers besides loopback (and, for Ollama, what Ollama "
        "allows): llm.example.com, *.example.com, an address, or * for no check (only behind your own auth); no port. "
        "Any other Host gets 403")
    devices: list[int | str] | None = Field(
        default=None, description="GPUs this tenant's engine uses on a host with several: NVML indices (0) or UUIDs "
                                  "(GPU-...); unset: discovered from the engine's process, else any device")
    model_paths: list[str] = Field(default_factory=list,
                                   description="where its model files are (absolute paths); replaces what the "
                                                 "proxy finds itself (Ollama: its models directory, the one OLLAMA_MODELS "
                                                 "names; ComfyUI: its models directory; any other tenant: model files, or "
                                                 "directories of them)")
    ready: ReadySpec | None = Field(
        default=None, description="a tenant the proxy starts (release kind process, systemd or docker): when it is "
                                  "ready after a start; null: the engine's own probe, else the upstream port")
    start_timeout_s: float = Field(default=120.0, description="a tenant the proxy starts: how long a start may take "
                                                              "until ready")
    wake_on: WakeOn = Field(
        default="writes", description="a tenant the proxy starts: which requests start it while it is stopped. writes: "
        "any method but GET, HEAD and OPTIONS, and websockets; a read (a model list, a health poll) gets 503 with "
        "Retry-After and the reason, so a poll never makes the app flap. any: reads "
        "start it too")
    restart: Literal["never", "on-failure"] = Field(
        default="never", description="a tenant the proxy starts, when it crashes or stops answering while running: "
                                     "never (the next request starts it again), or on-failure (started again at once, "
                                     "backing off after crashes in a row; a clean exit, code 0, is left stopped)")
    restart_limit: int = Field(default=3, description="restart on-failure: crashes in a row it restarts after (an app "
                                                      "that ran a minute starts the count over); then a request must")
    progress: Progress = Field(
        default="streams", description="a streamed request (Ollama chat and generate, /v1 completions with stream) "
        "that must wait for GPU memory: streams answers it at once and tells it why it waits, each release and the "
        "load, as thinking lines (Ollama message.thinking, OpenAI delta.reasoning_content), then the engine's own "
        "stream follows unchanged; off: the client hears nothing until the engine answers. On by default: a silent "
        "wait of seconds to minutes looks like a hang and trips clients' read timeouts, while every client that "
        "parses the engine's stream parses these lines. A request's X-HyperSwap-Progress header (on/off) overrides it")
    preload: bool = Field(default=False, description="a tenant the proxy starts: start it once the proxy is up (its "
                                                     "memory planned like any start), without waiting for a request; "
                                                     "a failure is shown in health and never stops the proxy")

    @field_validator("release")
    @classmethod
    def _release_steps(cls, value: ReleaseSpec | list[ReleaseSpec], info: ValidationInfo) -> ReleaseSpec | list[ReleaseSpec]:
        steps = value if isinstance(value, list) else [value]
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list releases nothing: give one release, or steps tried in order")
            if any(step.kind == "none" for step in value):
                raise ValueError("a step of kind 'none' releases nothing: leave it out of the list, or make release "
                                 "one object of kind 'none'")
            stopping = [i for i, step in enumerate(value) if step.stops]
            if len(stopping) > 1:
                raise ValueError(f"steps {stopping} each stop the app: give at most one step of kind process, "
                                 "systemd or docker (the one that also starts it again)")
            if stopping and stopping[0] != len(value) - 1:
                raise ValueError(f"step {stopping[0]} stops the app, so the steps after it have nothing left to "
                                 "release: make the stopping step the last")
        if any(step.stops for step in steps) and "upstream" in info.data and not info.data["upstream"]:
            raise ValueError("a tenant the proxy stops and starts needs an 'upstream' (where it is probed for "
                             "readiness after a start)")
        return value

    @field_validator("ready")
    @classmethod
    def _ready_only_when_started(cls, value: ReadySpec | None, info: ValidationInfo) -> ReadySpec | None:
        if value is not None:
            _only_when_started("ready", info)
        return value

    @field_validator("restart")
    @classmethod
    def _restart_only_when_started(cls, value: str, info: ValidationInfo) -> str:
        if value != "never":
            _only_when_started("restart", info)
        return value

    @field_validator("preload")
    @classmethod
    def _preload_only_when_started(cls, value: bool, info: ValidationInfo) -> bool:
        if value:
            _only_when_started("preload", info)
        return value

    @field_validator("model_paths")
    @classmethod
    def _model_paths(cls, values: list[str]) -> list[str]:
        for v in values:
            if not (v.startswith("/") or v.startswith("~")) or "\0" in v:
                raise ValueError(f"expected an absolute path (/srv/models or ~/models), got {v!r}")
        return values

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str | None) -> str | None:
        return None if v is None else _host_port(v)

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: str | None) -> str | None:
        return None if v is None else _upstream_url(v)

    _hosts = field_validator("allowed_hosts")(_allowed_hosts)
    _devices = field_validator("devices")(_device_list)

    @model_validator(mode="after")
    def _listen_needs_upstream(self) -> Tenant:  # number ranges: BOUNDS
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
        return any(step.kind != "none" for step in self.release_steps)

    @property
    def not_reclaimable_reason(self) -> str:
        return self.release_steps[0].reason or (
            f"tenant {self.name!r} has no release strategy (release.kind is 'none' in tenants.json)")

    @property
    def release_steps(self) -> tuple[ReleaseSpec, ...]:
        """The release as steps tried in order (one step when `release` is one object)."""
        return tuple(self.release) if isinstance(self.release, list) else (self.release,)

    @property
    def lifecycle(self) -> ReleaseSpec | None:
        """The step that stops the app and starts it again (kind process, systemd or docker), if any."""
        return next((step for step in self.release_steps if step.stops), None)

    def release_path(self, step: int) -> str:
        """Where a release step sits in tenants.json, for messages (`tenants.llama.release.1`)."""
        return f"tenants.{self.name}.release" + (f".{step}" if isinstance(self.release, list) else "")


class AdminSpec(_Strict):
    """The admin listener: API, dashboard, /metrics, /mcp."""

    listen: str = Field(default="127.0.0.1:11400", description="host:port; off loopback it needs a bearer token")
    token_env: str = Field(default="HYPERSWAP_ADMIN_TOKEN", description="the environment variable holding the bearer "
                                                                        "token")
    token_file: str | None = Field(default=None, description="a file holding the bearer token")
    cors_origins: list[str] = Field(default_factory=list, description="web pages allowed to call the admin API "
                                                                      "cross-origin")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names the admin API answers besides loopback")

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        return _host_port(v)

    _hosts = field_validator("allowed_hosts")(_allowed_hosts)


class ProxySettings(_Strict):
    """How the proxy plans, waits and watches."""

    watchdog_interval_s: float = Field(default=1.0, description="how often the watchdog reads the GPU and polls the "
                                                                "engines (idle release, CPU spill, stale jobs)")
    # NVML reads are sub-millisecond; 50 ms bounds the added wait
    release_poll_s: float = Field(default=0.05, description="how often the card is read while a release runs")
    queue_timeout_s: float = Field(default=300.0, description="how long a request waits for memory before a 503 with "
                                                              "Retry-After (0: answer 503 at once)")
    starvation_after_s: float = Field(default=60.0, description="how long later higher-priority arrivals may run ahead "
                                                                "of a waiter; then it goes ahead of them")
    overtake_limit: int = Field(default=8, description="requests for a model already on the card that may go ahead "
                                                       "of a request waiting to swap it away (batching: one handoff "
                                                       "for a burst); then that tenant starts nothing new until the "
                                                       "swap. starvation_after_s bounds the same wait in time")
    swap_hold_s: float = Field(default=0.5, description="the longest a swap away from a tenant active lately is held "
                                                        "after that tenant's last use, so that requests for what is "
                                                        "on the card sent right after go first (one swap for a "
                                                        "burst); weighed by the reload it risks (a tenth of it at "
                                                        "2 GB/s), bounded by overtake_limit. 0: off, a swap starts "
                                                        "at once")
    swap_hold_recent_s: float = Field(default=5.0, description="with swap_hold_s: only a swap away from a tenant whose "
                                                               "work ran or ended this recently is held")
    spill_stable_s: float = Field(default=5.0, description="how long Ollama's split (size_vram < size) must hold still "
                                                           "to count as a CPU spill (a load grows)")
    job_lost_after_s: float = Field(default=120.0, description="a relayed job of an engine whose queue cannot be read "
                                                               "(down, restarting) stays busy this long after the last "
                                                               "good read, then ends with a stale_job decision")
    warm_margin_gb: float = Field(default=4.0, description="model files are read into RAM only while MemAvailable stays "
                                                           "above this many GiB (never into swap)")
    warm_during_release: bool = Field(default=True, description="read the next model's files while the other tenant "
                                                                "releases")
    keep_warm_models: int = Field(default=0, description="keep the N most recently used models' files in RAM (0: off)")


class TelemetrySettings(_Strict):
    path: str | None = Field(
        default=None, description="SQLite file; null = ~/.local/state/hyperswap/telemetry.sqlite3, 'off' disables; "
                                  "$HYPERSWAP_TELEMETRY sets it when this is null (a path; empty or off disables)")
    retention_days: float = Field(default=30.0, description="rows older than this are deleted")
    max_rows: int = Field(default=500_000, description="the most rows kept of each kind; the oldest go first")


class LockedClocks(_Strict):
    min: int = Field(ge=0, le=20000, description="MHz")
    max: int = Field(ge=0, le=20000, description="MHz")

    @model_validator(mode="after")
    def _ordered(self) -> LockedClocks:
        if self.min > self.max:
            raise ValueError(f"min ({self.min} MHz) must not be above max ({self.max} MHz)")
        return self


GPU_PROFILE_SETTINGS = ("power_limit_w", "locked_clocks_mhz", "gpc_clock_offset_mhz", "mem_clock_offset_mhz",
                        "fan_policy", "fan_speed_percent")


class GpuProfile(_Strict):
    """The GPU settings the operator wants (`gpu_profile` in tenants.json). Read and compared always;
    written only with `apply: true` (and the root permission NVML needs to write)."""

    apply: bool = Field(default=False, description="write the profile to the card (needs root); off: compare only")
    device: int = Field(default=0, description="the NVML index of the GPU the profile is for (other cards are only read)")
    power_limit_w: float | None = Field(default=None, description="the power limit in watts (the card's own range is "
                                                                  "checked against NVML)")
    locked_clocks_mhz: LockedClocks | None = Field(default=None, description="graphics clock range {min, max} in MHz")
    gpc_clock_offset_mhz: int | None = Field(default=None, description="graphics clock offset in MHz")
    mem_clock_offset_mhz: int | None = Field(default=None, description="memory clock offset in MHz")
    fan_policy: Literal["auto", "manual"] | None = Field(
        default=None, description="auto (the driver's curve) or manual with fan_speed_percent (a speed outside the range "
        "NVML gives for the fans is unsupported and never written: a fan held too slow does not follow the temperature)")
    fan_speed_percent: int | None = Field(default=None, description="every fan, with fan_policy manual")
    check_interval_s: float = Field(default=30.0, description="how often the card is read and compared")

    @model_validator(mode="after")
    def _coherent(self) -> GpuProfile:
        if all(getattr(self, name) is None for name in GPU_PROFILE_SETTINGS):
            raise ValueError("sets nothing: give at least one of " + ", ".join(GPU_PROFILE_SETTINGS))
        if self.fan_speed_percent is not None and self.fan_policy != "manual":
            raise ValueError("fan_speed_percent needs fan_policy \"manual\" (the driver ignores a speed under \"auto\")")
        if self.fan_policy == "manual" and self.fan_speed_percent is None:
            raise ValueError("fan_policy \"manual\" needs fan_speed_percent (else the fans keep whatever speed they had)")
        return self


class Config(_Strict):
    admin: AdminSpec = Field(default_factory=AdminSpec, description="the admin listener")
    proxy: ProxySettings = Field(default_factory=ProxySettings, description="planning, waiting, watching")
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings, description="the stored history")
    tenants: dict[str, Tenant] = Field(default_factory=dict, description="the applications, by name")
    gpu_profile: GpuProfile | None = Field(default=None, description="the GPU settings you want, compared (and with "
                                                                     "apply, written)")

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, Tenant]) -> dict[str, Tenant]:
        for name in tenants:
            if not name:
                raise ValueError("a tenant name must not be empty")
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a "
                                 "letter or digit (it appears in URLs, metrics and logs)")
        return tenants

    @model_validator(mode="after")
    def _ports_unique(self) -> Config:
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
    # the other sections (admin, proxy, telemetry, gpu_profile): dotted field -> "user" | "default"
    settings_provenance: Mapping[str, str] = dc_field(default_factory=dict)

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
    "finite_number": "expected a finite number (not NaN or Infinity)",
    "missing": "required field is missing",
    "extra_forbidden": "unknown key (check the spelling against the tenants.json reference, docs/reference/tenants-json.md)",
}


def _problems(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = err["loc"]
        path = ".".join(str(p) for p in loc if p not in (_ONE_STEP, _STEPS)) or "(top level)"
        msg = _FRIENDLY.get(err["type"])
        if loc and loc[-1] in (_ONE_STEP, _STEPS) and err["type"] in ("model_type", "list_type"):
            msg = "expected an object (one release) or a list of them (steps tried in order)"
        if msg is None:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "literal_error":
                msg = msg.replace("Input should be", "expected")
        out.append(f"{path}: {msg}")
    return out


class _RepeatedKeys(dict[str, Any]):
    """A JSON object that named a key twice (json keeps the last silently; we refuse it)."""

    repeated: list[str]


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    repeated: list[str] = []
    for key, value in pairs:
        if key in out:
            repeated.append(key)
        out[key] = value
    if not repeated:
        return out
    marked = _RepeatedKeys(out)
    marked.repeated = repeated
    return marked


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist",
                          fix="create it, or drop --config / HYPERSWAP_CONFIG to use the shipped defaults") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        return json.loads(text, object_pairs_hook=_object)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}",
                          fix="fix the JSON at that line and column") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to read",
                          fix=f"a tenants.json needs a few levels; keep it under {MAX_DEPTH}") from None
    except ValueError as exc:  # an integer literal of thousands of digits
        raise ConfigError(f"{path}: a number cannot be read: {exc}", fix="write numbers of a sensible size") from None


def _non_finite(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def tree_problems(data: Any) -> tuple[list[str], bool]:
    """What JSON allows but a configuration must not hold, each with its path: a key given twice,
    NaN or Infinity (also a literal too large for a float), nesting deeper than MAX_DEPTH. Also
    whether anything was too deep to go on with. Iterative: a deep document cannot overflow the stack."""
    problems: list[str] = []
    too_deep = False
    stack: list[tuple[tuple[str, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        where = ".".join(path) or "(top level)"
        if len(path) > MAX_DEPTH:
            problems.append(f"{where}: nested deeper than {MAX_DEPTH} levels")
            too_deep = True
            continue
        if isinstance(value, _RepeatedKeys):
            problems += [f"{where}: key {key!r} twice (JSON would silently keep the last one): remove one"
                         for key in dict.fromkeys(value.repeated)]
        if isinstance(value, float) and not math.isfinite(value):
            why = "" if math.isnan(value) else " (a literal too large for a float reads as Infinity)"
            problems.append(f"{where}: {_non_finite(value)} is not a number a configuration can use{why}: "
                            "write a finite number")
        elif isinstance(value, dict):
            stack += [((*path, str(k)), v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [((*path, str(i)), v) for i, v in reversed(list(enumerate(value)))]
    return problems, too_deep


def _schema_error(where: str, problems: list[str]) -> ConfigError:
    return ConfigError(f"{where} does not match the schema", problems=problems,
                       fix="correct the fields listed above; see the tenants.json reference, docs/reference/tenants-json.md")


def _check_tree(data: Any, where: str) -> list[str]:
    """The tree's problems, to be listed with the schema's; raised at once when merging and
    validating would recurse too deep."""
    problems, too_deep = tree_problems(data)
    if too_deep:
        raise _schema_error(where, problems)
    return problems


def _merge(base: Any, override: Any, path: tuple[str, ...], prov: dict[tuple[str, ...], str]) -> Any:
    """Deep-merge override onto base; lists and scalars are replaced whole."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if key in out and value is None and path == ("tenants",):
                del out[key]  # "desktop": null removes a shipped tenant
                prov[(*path, key)] = "removed"
                continue
            out[key] = _merge(out.get(key), value, (*path, key), prov) if key in out else value
            if not (isinstance(value, dict) and isinstance(base.get(key), dict)):
                _mark_user(value, (*path, key), prov)
        return out
    return override


def _mark_user(value: Any, path: tuple[str, ...], prov: dict[tuple[str, ...], str]) -> None:
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            _mark_user(inner, (*path, key), prov)
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
    early: list[str] = []
    if source is not None:
        user = _read_json(source)
        early = _check_tree(user, str(source))
        if not isinstance(user, dict):
            raise ConfigError(f"{source}: the top level must be a JSON object", problems=["(top level): expected an object"])
        tenants = user.get("tenants")
        if tenants is not None and not isinstance(tenants, dict):
            raise ConfigError(f"{source} does not match the schema", problems=["tenants: expected an object"])
        merged = _merge(defaults, user, (), prov)
    return _validate(merged, source, prov, early, env)


def load_registry_over(data: Mapping[str, Any], path: str | os.PathLike[str],
                       pinned: Mapping[str, Mapping[str, Any]] | None = None) -> Registry:
    """The shipped defaults, then `data` (the demo's scenario), then the file at `path` over both
    (`hyperswap demo --config`): its admin, proxy, telemetry and gpu_profile sections and its tenants.
    `pinned`: tenant fields the file cannot change (the simulators' upstreams); the source is the file."""
    source = Path(path)
    user = _read_json(source)
    early = _check_tree(user, str(source))
    if not isinstance(user, dict):
        raise ConfigError(f"{source}: the top level must be a JSON object", problems=["(top level): expected an object"])
    if user.get("tenants") is not None and not isinstance(user["tenants"], dict):
        raise ConfigError(f"{source} does not match the schema", problems=["tenants: expected an object"])
    prov: dict[tuple[str, ...], str] = {}
    early += _check_tree(data, "the configuration")
    merged = copy.deepcopy(_merge(_merge(_read_json(SHIPPED_DEFAULTS), dict(data), (), prov), user, (), prov))
    for name, fields in (pinned or {}).items():
        body = merged.get("tenants", {}).get(name)
        if isinstance(body, dict):
            body.update(fields)
    return _validate(merged, source, prov, early, os.environ)


def registry_from_dict(data: Mapping[str, Any]) -> Registry:
    """Build a registry from an in-memory config (tests, scenarios), with shipped defaults merged under it."""
    prov: dict[tuple[str, ...], str] = {}
    early = _check_tree(data, "the configuration")
    merged = _merge(_read_json(SHIPPED_DEFAULTS), dict(data), (), prov)
    return _validate(merged, None, prov, early, os.environ)


def command_problems(config: Config, env: Mapping[str, str]) -> list[str]:
    """What can be known at load about the commands `process` releases run: the program exists and
    is executable (an absolute path, or a bare name on the PATH the child gets: its `env`'s PATH,
    else the proxy's), and the working directory exists. Each problem names its path in tenants.json."""
    problems: list[str] = []
    for tenant in config.tenants.values():
        for i, step in enumerate(tenant.release_steps):
            if step.kind != "process" or not step.command:
                continue
            where = tenant.release_path(i)
            search = (step.env or {}).get("PATH", env.get("PATH", os.defpath))
            for field, argv in (("command", step.command), ("stop_command", step.stop_command)):
                if not argv:
                    continue
                program = argv[0]
                if program.startswith("/"):
                    if not os.path.isfile(program):
                        problems.append(f"{where}.{field}.0: {program} does not exist (or is not a file)")
                    elif not os.access(program, os.X_OK):
                        problems.append(f"{where}.{field}.0: {program} is not executable (chmod +x, or run it "
                                        "through its interpreter)")
                elif shutil.which(program, path=search) is None:
                    problems.append(f"{where}.{field}.0: {program!r} is not found on PATH ({search}): install it, "
                                    "give its absolute path, or set PATH in release.env")
            if step.cwd is not None and not os.path.isdir(os.path.expanduser(step.cwd)):
                problems.append(f"{where}.cwd: {step.cwd} is not a directory")
    return problems


def _validate(merged: Any, source: Path | None, prov: dict[tuple[str, ...], str], early: list[str],
              env: Mapping[str, str]) -> Registry:
    """`early`: the tree's problems (tree_problems), listed with the schema's."""
    merged = copy.deepcopy(merged)  # never write into the caller's dicts
    if isinstance(merged.get("tenants"), dict):
        for name, body in merged["tenants"].items():
            if isinstance(body, dict):
                body.setdefault("name", name)
    where = str(source) if source else "the configuration"
    try:
        config = Config.model_validate(merged)
    except ValidationError as exc:
        named = {p.split(": ", 1)[0] for p in early}  # a NaN is named once, by the tree's message
        raise _schema_error(where, early + [p for p in _problems(exc) if p.split(": ", 1)[0] not in named]) from None
    if early:
        raise _schema_error(where, early)
    for name, tenant in config.tenants.items():
        if tenant.name != name:
            raise ConfigError(f"{source}: tenant key {name!r} and its name {tenant.name!r} differ",
                              problems=[f"tenants.{name}.name: must equal the key {name!r} (or be left out)"])
    missing = command_problems(config, env)
    if missing:
        raise ConfigError(f"{where}: a command the proxy would run cannot be found", problems=missing,
                          fix="correct the paths listed above; the proxy checks them at load so a start never "
                              "fails for it later")
    return Registry(config, source, _field_sources(config, prov), _settings_sources(config, prov))


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value and prefix.count(".") < 1:
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, value


SETTINGS_SECTIONS = ("admin", "proxy", "telemetry", "gpu_profile")


def _settings_sources(config: Config, prov: dict[tuple[str, ...], str]) -> dict[str, str]:
    """Each field of the sections other than `tenants`, dotted (`proxy.queue_timeout_s`): user or default."""
    out: dict[str, str] = {}
    for section in SETTINGS_SECTIONS:
        value = getattr(config, section)
        if value is None:
            continue
        for key in value.model_dump():
            parts = (section, key)
            user = any(src == "user" and (k[:2] == parts or k == (section,)) for k, src in prov.items())
            out[f"{section}.{key}"] = "user" if user else "default"
    return out


def setting_value(config: Config, dotted: str) -> Any:
    """A section's field as JSON would show it (`proxy.queue_timeout_s` -> 300.0)."""
    section, key = dotted.split(".", 1)
    return getattr(config, section).model_dump(mode="json")[key]


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
