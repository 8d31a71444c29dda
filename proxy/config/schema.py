"""The sections of tenants.json as pydantic models: a tenant, admin, proxy, telemetry, gpu_profile.

Every number has a range (`bounds`), every model refuses unknown keys, and every field has a
description (docs/reference/tenants-json.md is generated from them)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from proxy.config.fields import TENANT_NAME, StrictModel, device_list, host_list, host_port, no_spaces, upstream_url
from proxy.config.release import Release, ReleaseSpec
from proxy.config.units import GIB, MIB

EngineKind = Literal["ollama", "comfyui", "generic"]
WakeOn = Literal["writes", "any"]  # which requests start a stopped app (see Tenant.wake_on)
Progress = Literal["streams", "off"]  # progress lines for streamed requests that wait (see Tenant.progress)


class PodMatch(StrictModel):
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


class MatchRules(StrictModel):
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




class ReadySpec(StrictModel):
    """When a started tenant is ready for requests: an HTTP path answering a status, or its port open."""

    path: str | None = Field(default=None, description="GET this path on the upstream; null: the engine's own "
                                                        "(Ollama /api/version, ComfyUI /system_stats), else the port")
    status: int = Field(default=200, ge=100, le=599, description="the status that means ready")
    tcp: bool = Field(default=False, description="ready as soon as the upstream port accepts a connection")

    @field_validator("path")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        if value is not None:
            no_spaces(value)
            if not value.startswith("/"):
                raise ValueError(f"expected a path on the upstream starting with '/', got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_way(self) -> ReadySpec:
        if self.tcp and self.path is not None:
            raise ValueError("give either a path or tcp: true, not both")
        return self


class Timeouts(StrictModel):
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


class Tenant(StrictModel):
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
        return None if v is None else host_port(v)

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: str | None) -> str | None:
        return None if v is None else upstream_url(v)

    _hosts = field_validator("allowed_hosts")(host_list)
    _devices = field_validator("devices")(device_list)

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


class AdminSpec(StrictModel):
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
        return host_port(v)

    _hosts = field_validator("allowed_hosts")(host_list)


class ProxySettings(StrictModel):
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
    swap_hold_s: float = Field(default=0.0, description="how long a request that would swap away a tenant active "
                                                        "lately waits first, so that requests for what is on the card "
                                                        "sent right after it go before the swap (0: off, the swap "
                                                        "starts at once). Bounded by overtake_limit too")
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


class TelemetrySettings(StrictModel):
    path: str | None = Field(
        default=None, description="SQLite file; null = ~/.local/state/hyperswap/telemetry.sqlite3, 'off' disables; "
                                  "$HYPERSWAP_TELEMETRY sets it when this is null (a path; empty or off disables)")
    retention_days: float = Field(default=30.0, description="rows older than this are deleted")
    max_rows: int = Field(default=500_000, description="the most rows kept of each kind; the oldest go first")


class LockedClocks(StrictModel):
    min: int = Field(ge=0, le=20000, description="MHz")
    max: int = Field(ge=0, le=20000, description="MHz")

    @model_validator(mode="after")
    def _ordered(self) -> LockedClocks:
        if self.min > self.max:
            raise ValueError(f"min ({self.min} MHz) must not be above max ({self.max} MHz)")
        return self


GPU_PROFILE_SETTINGS = ("power_limit_w", "locked_clocks_mhz", "gpc_clock_offset_mhz", "mem_clock_offset_mhz",
                        "fan_policy", "fan_speed_percent")


class GpuProfile(StrictModel):
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


class Config(StrictModel):
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
