"""The engine ports: what the rest of the proxy asks an engine, one small protocol per concern.

`EngineAdapter` (base.py) implements every port with a generic HTTP app's answer; an engine kind
(`<kind>.py`) overrides the members of the ports where its engine differs and inherits the rest.
A caller types against the port it asks (or the few its part of the proxy asks, at the end of
this module), so what it may ask an engine is in its signature, not in a 40-member class.

| port | what it answers | asked by |
|---|---|---|
| `HostAndHeaders` | the Host a listener accepts, the headers sent upstream | relay/listener.py, relay/forward.py |
| `Classifier` | GPU work or pass-through, an unload, a streamed answer | relay/listener.py, relay/gpu_gate.py |
| `JobTracker` | work that outlives its answer: job ids, end markers, the engine's queue | relay/, handoff/watchdog.py |
| `NeedEstimator` | what a request or a start needs on the card, and the load it names | relay/gpu_gate.py, handoff/ |
| `Releaser` | memory back, and the wake after it | handoff/release_runner.py, handoff/sleepers.py |
| `OomDetector` | an out-of-memory failure in an answer, a frame or history; the job's replay | relay/gpu_gate.py |
| `RetryViews` | a job retried under its own id as its client sees it: its runs' frames, history and queue | relay/gpu_gate.py |
| `SelfReport` | the engine's own memory, card and model placement figures | handoff/, admin/api.py |
| `InstalledModels` | the models the engine has installed, and their needs | admin/health.py, admin/events.py |
| `HealthProbes` | how health, readiness and `hyperswap verify` probe it | admin/health.py, handoff/sleepers.py, verify/ |
| `SettingsView` | the settings `/api/engines` shows | admin/health.py |
| `Deployment` | its service, its port move, its GPU flag | deploy/install.py, handoff/card_reader.py |
| `ModelLoads` | where its model files are, how long a load took | models/catalog.py, admin/models_api.py |
| `ModelNews` | a model changed, listed or loaded; where it keeps what it learns | relay/listener.py, engines/registry.py |

Facts a caller only reads are properties here: an adapter answers them with a class attribute.
The value types the ports speak (`Streamed`, `JobReplay`, `Relocation`, ...) are defined here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import httpx
from pydantic import Field

from proxy.config.schema import ReleaseSpec
from proxy.encoding import JSONModel
from proxy.engines.common import Need
from proxy.engines.model_files import FileHints, TenantFiles
from proxy.engines.settings import EngineReport, EnvReaders
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.snapshot import DeviceMemory
from proxy.hosts import HostPolicy

# -- the values the ports speak ------------------------------------------------------------------

# Raw bytes as ASGI and the wire carry them (latin-1); no decode/encode per request on the relay path.
Header = tuple[bytes, bytes]

RequestKind = Literal["gpu", "passthrough"]
# How an engine streams its answer to a request (proxy/relay/progress.py speaks each):
# Ollama's NDJSON chat and generate lines, the OpenAI-style SSE chat and completion chunks.
StreamFormat = Literal["ndjson-chat", "ndjson-generate", "sse-chat", "sse-completion"]

# One loaded model as the engine places it (Ollama's /api/ps rows: name, size, size_vram, expires_at).
Placement = dict[str, object]


class CatalogModel(JSONModel):
    """One installed model as the catalog lists it."""

    name: str
    size_bytes: int | None = Field(description="Ollama's size on disk; null for ComfyUI checkpoints")


class TenantCatalog(JSONModel):
    """An engine's installed models (`InstalledModels.catalog`); `error`: why the last listing failed."""

    engine: str
    models: list[CatalogModel]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Streamed:
    """A request whose answer the engine streams, and how: progress lines can go first."""
    format: StreamFormat
    model: str


@dataclass(frozen=True, slots=True)
class JobReplay:
    """A job that failed for lack of memory, as the engine kept it, ready to be submitted again."""
    body: bytes  # the request body as if submitted afresh: its need is estimated from it
    payload: dict[str, object]  # what resubmits it (same job id, same client, same extra data)
    job_id: str = ""
    row: object = None  # the job as the engine lists a pending one in its queue (ComfyUI: its `prompt` row)


@dataclass(frozen=True, slots=True)
class Requeued:
    """The engine's answer to a resubmitted job: the id it runs under (None: refused), the HTTP
    status, and the mark that tells the new run's record from the failed one's under the same id
    (ComfyUI: its queue number; None: the engine gives none)."""
    job_id: str | None
    status: int
    mark: str | None = None


JobFrameKind = Literal["start", "success", "oom", "error", "end"]
JobView = Literal["history", "queue", "jobs"]  # what a client reads of the engine's jobs (jobs: one list of both)


@dataclass(frozen=True, slots=True)
class JobFrame:
    """A websocket frame about one job's run: it began (`start`), succeeded, ran out of GPU memory
    (`oom`), failed otherwise (`error`: also an interrupt), or ended (`end`: the end marker)."""
    kind: JobFrameKind
    job_id: str


@dataclass(frozen=True, slots=True)
class Relocation:
    """How an engine is moved to another loopback port, so the proxy can take the engine's own
    (`hyperswap install`): a systemd drop-in for its service, and what to tell a person who starts it by hand."""

    port: int
    service: str | None = None  # the systemd unit that runs it, where the engine ships one
    environment: Mapping[str, str] = field(default_factory=dict)  # set by the drop-in (and by hand)
    instruction: str = ""  # one line: how to start it on `port` yourself


# -- the ports -----------------------------------------------------------------------------------

class HostAndHeaders(Protocol):
    """Which Host a tenant's listener answers (DNS rebinding) and what goes upstream."""

    upstream_host: str  # what the engine believes its own Host is

    def host_policy(self) -> HostPolicy:
        """The Host values the listener accepts (proxy/hosts.py)."""
        ...

    def upstream_headers(self, headers: Sequence[Header], *, client_ip: str | None, scheme: str,
                         websocket: bool = False) -> list[Header]:
        """The request headers to send upstream (lower-case names; `scheme` is the client-facing one)."""
        ...

    def rewrite_origin(self, origin: str, client_host: str, scheme: str) -> str:
        """The Origin the engine sees for a browser's `origin` (the same-origin rule)."""
        ...


class Classifier(Protocol):
    """What a request is: GPU work, an unload, a stream the proxy can speak ahead of."""

    def classify(self, method: str, path: str) -> RequestKind:
        """"gpu": it may load something onto the card and is admitted first; "passthrough": forwarded at once."""
        ...

    def unload_target(self, path: str, body: bytes) -> str | None:
        """The model a GPU-route request only unloads (it loads nothing and needs no memory), if any."""
        ...

    def stream_format(self, path: str, body: bytes) -> Streamed | None:
        """How the engine will stream its answer to this GPU request; None: not in a shape the proxy speaks."""
        ...


class JobTracker(Protocol):
    """Work that outlives its HTTP answer (a queued job): busy from the answer that names it to its end."""

    def captures_job(self, method: str, path: str) -> bool:
        """Whether the response to this request names a job that stays busy after it ends."""
        ...

    def job_id_from_response(self, status: int, body: bytes) -> str | None:
        ...

    def job_done_from_frame(self, text: str) -> str | None:
        """The job id a websocket text frame says is finished, if any."""
        ...

    def history_path(self, job_id: str) -> str | None:
        """Where to poll for a job's end when no websocket reports it (None: not pollable)."""
        ...

    def job_done_from_history(self, job_id: str, status: int, body: bytes) -> bool:
        ...

    def queue_path(self) -> str | None:
        """Where the engine lists the jobs it still has (None: it does not say)."""
        ...

    def job_ids_from_queue(self, status: int, body: bytes) -> frozenset[str] | None:
        """Every job id the engine's queue answer lists, running or pending; None if unreadable."""
        ...

    def job_news(self, method: str, path: str) -> bool:
        """Whether this request may change or learn of the engine's jobs (a queue delete or clear, a
        client polling for its job's end): the proxy checks the jobs it tracks right after it."""
        ...

    async def running_jobs(self, client: httpx.AsyncClient) -> list[str]:
        """Job ids the engine's own queue says are running now. Raises httpx errors."""
        ...

    def job_view(self, method: str, path: str) -> JobView | None:
        """Whether this request reads the engine's record of finished jobs (its history) or its queue."""
        ...


class NeedEstimator(Protocol):
    """What a request (or a start) needs on the card, and which load it is."""

    def load_key(self, model: str) -> str:
        """Names one load: requests with the same key share one reservation, and residency is per key."""
        ...

    async def estimate_need(self, path: str, body: bytes, client: httpx.AsyncClient) -> Need:
        """What the request needs in total on the card (the planner subtracts what the tenant holds)."""
        ...

    @property
    def starts_loaded(self) -> bool:
        """Whether a start loads the tenant's model (needs_vram_gb) or only its runtime (idle_vram_gb)."""
        ...

    @property
    def start_need_bytes(self) -> int:
        """The memory planned for a start (or a resume) of a stopped tenant."""
        ...

    # The JSON fields that name what a request loads, looked for in the head of a body too large to keep.
    head_model_fields: tuple[str, ...]

    def body_naming(self, model: str) -> bytes:
        """The smallest request body that loads `model`, for `estimate_need`."""
        ...

    async def head_need(self, path: str, head: bytes, client: httpx.AsyncClient) -> Need:
        """A request whose body is too large to keep, planned on the model its head names, else on
        the tenant's need (one door: nothing reaches the engine unplanned)."""
        ...

    # How many GPU requests the engine runs at once when tenants.json does not say; None: no bound.
    runs_at_once_default: int | None

    @property
    def runs_at_once(self) -> int | None:
        """How many GPU requests the engine runs at once (tenants.json's `runs_at_once`, else the
        engine's default): while another tenant waits for it, the scheduler admits no more."""
        ...


class Releaser(Protocol):
    """Memory back from an idle tenant, and the wake before its next request (the tenant's `release`)."""

    async def release(self, client: httpx.AsyncClient, step: ReleaseSpec | None = None) -> dict[str, object]:
        """Ask for the memory back; returns what was asked (the caller confirms on the card). Raises ReleaseFailed."""
        ...

    async def resume(self, client: httpx.AsyncClient, step: ReleaseSpec) -> dict[str, object] | None:
        """Wake the app `step` released; None when there is nothing to call. Raises ReleaseFailed."""
        ...


class OomDetector(Protocol):
    """An out-of-memory failure, wherever the engine says it, and the failed job ready to run again."""

    @property
    def answers_oom(self) -> bool:
        """Whether the HTTP answer itself can say the GPU ran out of memory (then it is retried once)."""
        ...

    def response_is_oom(self, status: int, body: bytes) -> bool:
        """An HTTP answer that says the GPU ran out of memory (only where `answers_oom`)."""
        ...

    def oom_in_history(self, job_id: str, body: bytes) -> bool:
        """Whether a finished job's history entry says it failed for lack of GPU memory."""
        ...

    async def job_replay(self, client: httpx.AsyncClient, job_id: str) -> JobReplay | None:
        """The failed job as the engine kept it, to submit again; None when it is not (yet) there."""
        ...

    async def resubmit(self, client: httpx.AsyncClient, replay: JobReplay) -> Requeued:
        """Submit the job again, under its own id where the engine takes one. Raises httpx errors."""
        ...


class RetryViews(Protocol):
    """A job retried under its own id as its client sees it: which run a frame or record belongs to,
    and the engine's history and queue answers without the failed run (relay/oom_retry.py)."""

    def job_frame(self, text: str) -> JobFrame | None:
        """What a websocket text frame says about a job's run, if anything (must be cheap)."""
        ...

    def history_without(self, body: bytes, hidden: Callable[[str, str | None], bool]) -> bytes | None:
        """A history answer without the records `hidden(job id, mark)` names; None: nothing hidden."""
        ...

    def queue_with(self, body: bytes, pending: Sequence[JobReplay]) -> bytes | None:
        """A queue answer that lists these jobs as pending too (each where it is not listed); None: unchanged."""
        ...

    def history_outcome(self, job_id: str, body: bytes) -> JobFrameKind | None:
        """How the job's record in a history answer says it ended: success, oom or error; None: not in it."""
        ...

    def jobs_without(self, body: bytes, hidden: Callable[[str, str | None], bool],
                     retried: Sequence[JobReplay]) -> bytes | None:
        """A jobs answer (the queue and the history as one list) without the finished jobs `hidden`
        names; a single job hidden reads as pending (`retried`: the jobs running again, as their
        failed run listed them). None: unchanged."""
        ...


class SelfReport(Protocol):
    """What the engine says about its own memory (no GPU reader needed: invariant 10). Unknown is None."""

    async def self_reported_bytes(self, client: httpx.AsyncClient) -> int | None:
        """The engine's own idea of its VRAM, marked as an estimate; None when it does not say."""
        ...

    async def device_report(self, client: httpx.AsyncClient) -> DeviceMemory | None:
        """The card's figures as the engine reports them; None when it does not (or runs on the CPU)."""
        ...

    async def runs_on_cpu(self, client: httpx.AsyncClient) -> bool:
        """The engine says it computes on the CPU, so it holds no GPU memory."""
        ...

    @property
    def placements_path(self) -> str | None:
        """Where the engine lists how it placed each loaded model (GPU or CPU in part); None: it does not."""
        ...

    async def placements(self, client: httpx.AsyncClient) -> list[Placement]:
        """The loaded models and where they sit (the watchdog's spill probe). Raises httpx errors."""
        ...

    def placement_key(self, placement: Placement) -> str:
        """The load key of one loaded model the engine lists (what a request for that load would have)."""
        ...

    async def unload_model(self, client: httpx.AsyncClient, model: str) -> bool:
        """Unload one model the engine holds (when its requests end); False: the engine has no such call."""
        ...


class InstalledModels(Protocol):
    """The models the engine has installed."""

    async def catalog(self, client: httpx.AsyncClient, timeout_s: float) -> TenantCatalog | None:
        """The installed models, or None for an engine without a catalog. Raises httpx errors."""
        ...

    @property
    def sized_catalog(self) -> bool:
        """Whether `installed_needs` lists the installed models with the memory each would need."""
        ...

    async def installed_needs(self, client: httpx.AsyncClient) -> list[tuple[str, int]]:
        """(model, bytes a load needs) for every installed model. Raises httpx errors."""
        ...


class HealthProbes(Protocol):
    """How health, readiness after a start and `hyperswap verify` probe the engine."""

    @property
    def probe_path(self) -> str:
        """What health GETs to see the engine answer."""
        ...

    @property
    def probe_strict(self) -> bool:
        """True: only a 200 with the engine's own answer is healthy; else any status < 500."""
        ...

    @property
    def ready_path(self) -> str | None:
        """The path that answers 200 once a started engine serves; None: its port accepting is enough."""
        ...

    @property
    def start_hint(self) -> str | None:
        """How to start the engine, for a fix text."""
        ...

    @property
    def verify_role(self) -> str | None:
        """What `hyperswap verify` drives it as: "generates", "renders" or nothing."""
        ...

    @property
    def floor_from_samples(self) -> bool:
        """Its idle footprint varies, so health takes the smallest it saw as the floor."""
        ...

    def version_from_probe(self, data: object) -> str | None:
        """The engine's version from the JSON answer to `probe_path`."""
        ...

    def status_websocket(self, client_id: str) -> str | None:
        """The websocket URL where the engine greets a client with a status frame; None when it has none."""
        ...

    def is_status_frame(self, text: str | bytes) -> bool:
        """Whether the first frame on `status_websocket` is the engine's greeting."""
        ...


class SettingsView(Protocol):
    """What `/api/engines` shows about the engine."""

    async def settings_view(self, client: httpx.AsyncClient, snap: AttributedSnapshot | None, env: EnvReaders,
                            host_reads: bool) -> EngineReport | None:
        """Reachable, version, the settings that matter for memory and where each came from; None:
        the engine reports nothing about itself."""
        ...


class Deployment(Protocol):
    """How the engine runs on the host: its service, a move to another port, its GPU flag."""

    @property
    def service_unit(self) -> str | None:
        """The systemd unit the engine's Linux installer ships (its Environment= is the engine's), or None."""
        ...

    @property
    def device_flag(self) -> str | None:
        """The command-line flag that picks its GPU on a host with several (proxy/gpu/devices.py); None: only
        CUDA_VISIBLE_DEVICES says."""
        ...

    def relocation(self, port: int) -> Relocation | None:
        """How to move this engine onto `port` of 127.0.0.1; None: no known way."""
        ...


class ModelLoads(Protocol):
    """Where the engine's model files are, and how long its loads take (proxy/models/)."""

    @property
    def load_timed_from_frames(self) -> bool:
        """Whether its loads run after the answer (a queued job), so they are timed from progress frames."""
        ...

    def model_files(self, hints: FileHints) -> TenantFiles | None:
        """Where its model files are (blocking: it walks directories); None: nothing to look for."""
        ...

    def load_seconds(self, answer_tail: bytes) -> float | None:
        """How long the engine says its model load took, from the end of its answer (None: it does not say)."""
        ...


class ModelNews(Protocol):
    """What passes through and changes what the engine holds or what a model name is: the adapter
    learns from it (Ollama: a pull, copy, create or delete; a list of the models; a load's answer)."""

    def model_news(self, method: str, path: str) -> bool:
        """Whether a pass-through request may change what a model name is, or list the models: the
        listener hands it and its answer to `saw_model_news`."""
        ...

    def saw_model_news(self, method: str, path: str, request: bytes, status: int, answer: bytes) -> None:
        """Such a request and its answer (each b"" when larger than the listener keeps)."""
        ...

    def saw_gpu_answer(self, path: str, body: bytes, status: int) -> None:
        """The engine answered a GPU request (its status, as its headers came): what it loaded, it holds now."""
        ...

    def keep_state_in(self, folder: Path | None) -> None:
        """Where what the adapter learns outlives a restart (the proxy's state folder); None: nowhere."""
        ...


PORTS: tuple[type, ...] = (HostAndHeaders, Classifier, JobTracker, NeedEstimator, Releaser, OomDetector, RetryViews,
                           SelfReport, InstalledModels, HealthProbes, SettingsView, Deployment, ModelLoads, ModelNews)


# -- what each part of the proxy asks, where it asks more than one port ------------------------------

class ListenerPorts(HostAndHeaders, Classifier, JobTracker, ModelNews, Protocol):
    """A tenant's listener (relay/listener.py): its Host rule, which requests are GPU work, their jobs,
    and what passing through tells the adapter."""


class GatePorts(Classifier, JobTracker, NeedEstimator, OomDetector, RetryViews, Protocol):
    """The GPU gate (relay/gpu_gate.py): an unload or a load, its need, its job, an OOM and its retry."""


class LifecyclePorts(HealthProbes, Releaser, Protocol):
    """The tenants the proxy stops and starts (handoff/sleepers.py): readiness, and the wake after a release."""


class HealthPorts(HealthProbes, InstalledModels, SettingsView, Protocol):
    """Health and `/api/engines` (admin/health.py): probes, the installed models' needs, the settings view."""


class CardPorts(SelfReport, Deployment, Protocol):
    """The card reader (handoff/card_reader.py): which card a tenant uses, and the engines' own figures
    when the GPU reader fails."""


class BrokerPorts(CardPorts, NeedEstimator, LifecyclePorts, Protocol):
    """The GPU broker and its parts (handoff/broker.py): the card reader's, a request's or a start's
    need and how many at once its engine runs, a release and the tenants the proxy stops and starts."""


class WatchdogPorts(SelfReport, JobTracker, Protocol):
    """The watchdog (handoff/watchdog.py): where the engine placed each model (Ollama's spill), its
    device, and the jobs its own queue runs."""
