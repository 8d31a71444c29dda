"""A tenant as tenants.json describes it, its release steps, and the whole file (`Config`).

A release kind is one pydantic model, a subclass of `ReleaseSpec` with `kind` a one-value Literal,
that holds its own fields and its own effect: `release()` (ask for the memory back) and, where it
has one, `wake()` (its resume call); a kind that stops the app also builds its lifecycle controller
(`proxy.lifecycle.controller.StoppingRelease`). Kinds live beside the code they drive (the Ollama
and ComfyUI releases in their adapters, the lifecycle kinds beside their controllers) and are listed
with one line each in `proxy/engines/release_kinds.py`. Which kinds a file may use is a parameter,
never a global: `proxy.config.kinds.ReleaseKinds` closes `release` over the kinds it is given (the
union of those models, told apart by `kind`; absent: "none") and loading takes it. Only the "none"
kind is built in: it is the default, and it releases nothing; the `Tenant` and `Config` here know no
other kind in a file (a step built in Python of any kind is taken as it is).

Every number has a range (`bounds`), every model refuses unknown keys, and every field has a
description (docs/reference/tenants-json.md is generated from them)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import Discriminator, Field, GetCoreSchemaHandler, InstanceOf, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import CoreSchema

from proxy.config.fields import TENANT_NAME, StrictModel, device_list, host_list, host_port, no_spaces, upstream_url
from proxy.config.settings import AdminSpec, GpuProfile, ProxySettings, TelemetrySettings
from proxy.config.units import GIB, MIB

if TYPE_CHECKING:
    import httpx

# ---------------------------------------------------------------------------------------------
# Release steps: the base of every release kind


class ReleaseFailed(Exception):
    """The engine refused or could not be reached when asked for memory back."""


class ReleaseSpec(StrictModel):
    """One release step: how to ask the tenant for its memory back. Each kind subclasses it."""

    kind: str = Field(
        default="none", description="how the memory is asked back: ollama_unload (every loaded model with keep_alive 0), "
        "comfyui_free (POST /free), http (a call you configure), process, systemd or docker (stop the app, start it again "
        "on its next request), cuda_suspend (its CUDA processes parked in host RAM, restored before its next "
        "request), or none (not reclaimable: a release answers 409 with the reason)")
    timeout_s: float | None = Field(
        default=None, description="how long this step may take until the card shows the memory back; "
                                  "null: the tenant's release_timeout_s")

    # What the proxy may rely on, by kind (never by comparing `kind`):
    stops: ClassVar[bool] = False  # it stops the app, so the proxy can start it again (proxy/lifecycle/)
    reclaims: ClassVar[bool] = True  # it gives memory back at all (only "none" does not)
    suspends: ClassVar[bool] = False  # it suspends the tenant's processes (the proxy runs it with their pids)

    @classmethod
    def kind_name(cls) -> str:
        """The `kind` this model answers to in tenants.json (its Literal's one value)."""
        return str(cls.model_fields["kind"].default)

    @property
    def resumes(self) -> bool:
        """It owes a call that wakes the app before its next request is forwarded (`wake()`)."""
        return False

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object]:
        """Ask for the memory back; returns what was asked (the caller confirms on the GPU). Raises
        ReleaseFailed when refused; httpx errors pass through (the caller names the tenant)."""
        raise ReleaseFailed(f"release kind {self.kind!r} of tenant {tenant.name!r} has no release call")

    async def wake(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object] | None:
        """Wake the app after this step released it (its resume call); None when there is nothing to call."""
        return None

    def load_problems(self, where: str, env: Mapping[str, str]) -> list[str]:
        """What can be known wrong at load beyond the schema (a program that is not there), each as
        `path: problem`; `where`: the step's path in tenants.json; `env`: the proxy's environment."""
        return []


class NoRelease(ReleaseSpec):
    """Not reclaimable: a release answers 409 with the reason (the default)."""

    kind: Literal["none"] = "none"
    reason: str | None = Field(default=None, description="kind none: why it cannot be released (shown in 409s)")

    reclaims: ClassVar[bool] = False

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object]:
        raise ReleaseFailed(tenant.not_reclaimable_reason)


# ---------------------------------------------------------------------------------------------
# `release` as the union of a closed set of kinds (proxy/config/kinds.py builds it for the kinds it is given)

# Tags of the shapes `release` takes; messages.problems leaves them out of an error's path.
ONE_STEP, STEPS, BUILT = "(one release)", "(release steps)", "(a step built in Python)"


def kind_tag(name: str) -> str:
    return f"(kind {name})"


def is_tag(part: object) -> bool:
    return part in (ONE_STEP, STEPS, BUILT) or (isinstance(part, str) and part.startswith("(kind ") and part.endswith(")"))


def _release_shape(value: object) -> str:
    return STEPS if isinstance(value, list) else ONE_STEP


def _kind_of(value: object) -> str | None:
    """The tag of one step: its `kind` (absent: "none"); None for what is no object at all."""
    if isinstance(value, ReleaseSpec):
        return kind_tag(value.kind)
    if isinstance(value, dict):
        return kind_tag(str(value.get("kind", "none")))
    return None


def _built_or_kind(value: object) -> str | None:
    """The base `Tenant` knows no kind but "none": a step already built (any kind) is taken as it is."""
    return BUILT if isinstance(value, ReleaseSpec) else _kind_of(value)


def _union(members: tuple[object, ...]) -> object:
    return Union[members]  # noqa: UP007  (built from a tuple of types at run time)


def _one_step(kinds: Mapping[str, type[ReleaseSpec]] | None) -> object:
    """One step's validation: tagged by `kind` over `kinds`; None (the base `Tenant`): a step built in
    Python of any kind, or an object of kind "none" (the only kind built in)."""
    if kinds is None:
        members = (Annotated[InstanceOf[ReleaseSpec], Tag(BUILT)], Annotated[NoRelease, Tag(kind_tag("none"))])
        return Annotated[_union(members), Discriminator(_built_or_kind)]
    tagged = tuple(Annotated[model, Tag(kind_tag(name))] for name, model in kinds.items())
    if len(tagged) == 1:  # only the built-in "none": no union to tell apart
        return next(iter(kinds.values()))
    return Annotated[_union(tagged), Discriminator(_kind_of)]


class ReleaseSchema:
    """`Tenant.release`'s validation: one step or a list of them, each of one of `kinds` (in the order
    given; None: see `_one_step`). The closed union is a parameter, never a global: proxy/config/kinds.py
    builds the models that hold it for the kinds the application hands to loading."""

    def __init__(self, kinds: Mapping[str, type[ReleaseSpec]] | None = None) -> None:
        self.kinds = kinds

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        one = _one_step(self.kinds)
        shapes = Annotated[Annotated[one, Tag(ONE_STEP)] | Annotated[list[one], Tag(STEPS)],  # type: ignore[valid-type]
                           Discriminator(_release_shape)]
        return handler.generate_schema(shapes)


Release = Annotated[ReleaseSpec | list[ReleaseSpec], ReleaseSchema()]


# ---------------------------------------------------------------------------------------------
# A tenant

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
    release: Release = Field(default_factory=NoRelease,
                             description="how to get its memory back: one release, or a list of steps tried in order "
                                         "until the card shows the memory back")
    idle_release_after_s: float | None = Field(default=None, description="release unasked after this long without GPU "
                                                                        "traffic (0: as soon as it goes idle; a tenant the "
                                                                        "proxy starts is stopped, its soft release steps "
                                                                        "skipped); null: never")
    idle_vram_gb: float = Field(default=0.0, description="GiB of VRAM it holds when idle (its CUDA context floor): a "
                                                         "\"running\" job while at the floor is stale")
    release_timeout_s: float = Field(default=10.0, description="how long a release may take until the card shows the "
                                                              "memory back")
    context_allowance_gb: float = Field(default=1.0, description="GiB added to an Ollama model's size for its context "
                                                                 "and KV cache")
    model_vram_gb: dict[str, float] = Field(default_factory=dict, description="per-model or per-checkpoint need "
                                                                                 "overrides in GiB")
    runs_at_once: int | None = Field(
        default=None, ge=1, description="how many GPU requests its engine runs at once (Ollama: OLLAMA_NUM_PARALLEL; "
        "ComfyUI: 1 prompt). While another tenant's request waits for this one, the proxy admits no more than this, so "
        "its own queue (priority, overtake_limit, starvation_after_s) orders the rest, not the engine's; null: the "
        "engine's default (ollama and comfyui 1, others no bound)")
    timeouts: Timeouts = Field(default_factory=Timeouts, description="upstream timeouts")
    replay_body_max_mb: float = Field(default=16.0, description="GPU request bodies up to this size are kept for an "
                                                                   "OOM retry (0: never kept); a larger one is still "
                                                                   "planned, on the model the head of its body names "
                                                                   "(else needs_vram_gb), and streamed with no retry")
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
        "that must wait for GPU memory or load its model: streams answers it at once and tells it why it waits, "
        "each release and the load (a figure a second), and a failure's reason, as thinking lines (Ollama "
        "message.thinking, OpenAI delta.reasoning_content), then the engine's own "
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
            if not all(step.reclaims for step in value):
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
        return any(step.reclaims for step in self.release_steps)

    @property
    def not_reclaimable_reason(self) -> str:
        first = self.release_steps[0]
        return (first.reason if isinstance(first, NoRelease) else None) or (
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
