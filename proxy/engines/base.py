"""The engine adapter base: the generic (any HTTP app) answer to every engine port.

One adapter instance per tenant. The ports (ports.py) are what the rest of the proxy asks an
engine, one small protocol per concern (headers, classification, jobs, need, release, OOM,
self-report, installed models, health probes, settings view, deployment, model loads);
`EngineAdapter` implements them all, section by section below, and an engine kind overrides the
members of the ports where its engine differs. Nobody outside `proxy/engines/` switches on an
engine's name: they ask its adapter, typed as the port they use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from proxy.config.schema import ReleaseSpec, Tenant
from proxy.engines import ports
from proxy.engines.common import Need, named_in_head, release_by_strategy, resume_by_strategy
from proxy.engines.model_files import FileHints, TenantFiles, plain_tenant_files
from proxy.engines.ports import (
    Header,
    JobFrame,
    JobReplay,
    Placement,
    Relocation,
    RequestKind,
    Requeued,
    Streamed,
    TenantCatalog,
)
from proxy.engines.settings import EngineReport, EnvReaders
from proxy.gpu.attribution import AttributedSnapshot
from proxy.gpu.snapshot import DeviceMemory
from proxy.hosts import HostPolicy, listener_policy

# RFC 9110 section 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate", b"proxy-authorization",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
# The websocket client library writes its own handshake; the client's would be wrong upstream.
WS_HANDSHAKE = frozenset({
    b"host", b"origin", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol", b"sec-websocket-accept", b"user-agent",
})
FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host"})


def strip_hop_by_hop(headers: Sequence[Header]) -> list[Header]:
    """Drop hop-by-hop headers, including any the Connection header names.

    Names must be lower-case, as ASGI servers and `http1` hand them over (HTTP names are case-insensitive)."""
    out = [(k, v) for k, v in headers if k not in HOP_BY_HOP and not k.startswith(b"proxy-")]
    if len(out) != len(headers):  # something was dropped: maybe a Connection header naming more
        named = {token.strip().lower() for k, v in headers if k == b"connection" for token in v.split(b",")}
        if named:
            out = [(k, v) for k, v in out if k not in named]
    return out


def origin_netloc(origin: str) -> str | None:
    try:
        parts = urlsplit(origin)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    host = parts.netloc.lower()
    default = ":443" if parts.scheme == "https" else ":80"
    return host.removesuffix(default)


def same_origin(origin: str, host: str, scheme: str) -> bool:
    """True when a browser's Origin names the address it opened (the client-facing Host)."""
    netloc = origin_netloc(origin)
    if netloc is None:
        return False
    default = ":443" if scheme in ("https", "wss") else ":80"
    return netloc == host.lower().removesuffix(default)


class EngineAdapter(ports.HostAndHeaders, ports.Classifier, ports.JobTracker, ports.NeedEstimator, ports.Releaser,
                    ports.OomDetector, ports.RetryViews, ports.SelfReport, ports.InstalledModels, ports.HealthProbes,
                    ports.SettingsView, ports.Deployment, ports.ModelLoads, ports.ModelNews):
    """Generic engine: every POST/PUT may load something onto the GPU; the rest passes through.

    It answers every engine port (ports.py) as a generic HTTP app would, one section per port in
    the order of its bases; an engine kind overrides the members of the ports its engine has."""

    kind: str = "generic"

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        upstream = urlsplit(tenant.upstream or "http://127.0.0.1")
        self.upstream_host = upstream.netloc  # what the engine believes its own Host is
        self._upstream_origin = f"{upstream.scheme}://{upstream.netloc}"
        self._host_header = (b"host", self.upstream_host.encode("latin-1"))

    # -- HostAndHeaders: which Host the listener answers (DNS rebinding), what goes upstream --------
    def listen_host(self) -> str | None:
        return self.tenant.listen.rpartition(":")[0] if self.tenant.listen else None

    def host_policy(self) -> HostPolicy:
        """Loopback, the listener's own address and the tenant's allowed_hosts (see proxy/hosts.py).
        The engine gets its own Host from the proxy, so whatever it checks itself no longer applies."""
        return listener_policy(self.listen_host(), self.tenant.allowed_hosts)

    def upstream_headers(self, headers: Sequence[Header], *, client_ip: str | None, scheme: str,
                         websocket: bool = False) -> list[Header]:
        """The request headers to send upstream: hop-by-hop stripped, Host/Origin per engine,
        X-Forwarded-* appended. Names lower-case (ASGI's); `scheme` is the client-facing one
        (http, https, ws, wss)."""
        client_host = b""
        prior: list[bytes] = []
        out: list[Header] = [self._host_header]
        for name, value in strip_hop_by_hop(headers):
            if name == b"host":
                client_host = value
            elif name in FORWARDED:
                if name == b"x-forwarded-for":
                    prior.append(value)
            elif websocket and name in WS_HANDSHAKE and name != b"origin":
                continue
            elif name == b"origin":
                out.append((name, self.rewrite_origin(value.decode("latin-1"), client_host.decode("latin-1"),
                                                      scheme).encode("latin-1")))
            else:
                out.append((name, value))
        if client_ip:
            prior.append(client_ip.encode("latin-1"))
        if prior:
            out.append((b"x-forwarded-for", b", ".join(prior)))
        out.append((b"x-forwarded-proto", b"https" if scheme in ("https", "wss") else b"http"))
        if client_host:
            out.append((b"x-forwarded-host", client_host))
        return out

    def rewrite_origin(self, origin: str, client_host: str, scheme: str) -> str:
        """Same-origin rule, shared by every engine that checks Origin against Host.

        The upstream sees Host = its own address. A browser that opened the proxy's address sends
        Origin = that address; it is the same origin seen through the proxy, so it is rewritten to the
        upstream's origin and the engine's Host/Origin check passes as it would have directly. Any
        other Origin (a different site, a different port) is forwarded untouched, so the engine keeps
        rejecting cross-origin requests exactly as it would without the proxy: the proxy must not
        launder a foreign page's request into a same-origin one (a CSRF hole).
        """
        if client_host and same_origin(origin, client_host, scheme):
            return self._upstream_origin
        return origin

    # -- Classifier ---------------------------------------------------------------------------------
    def classify(self, method: str, path: str) -> RequestKind:
        return "gpu" if method.upper() in ("POST", "PUT") else "passthrough"

    def unload_target(self, path: str, body: bytes) -> str | None:
        """The model a GPU-route request only unloads (it loads nothing and needs no memory), if any."""
        return None

    def stream_format(self, path: str, body: bytes) -> Streamed | None:
        """How the engine will stream its answer to this GPU request; None: it does not stream one
        (or not in a shape the proxy can speak ahead of it)."""
        return None

    # -- JobTracker (engines whose work outlives the HTTP response) ---------------------------------
    def captures_job(self, method: str, path: str) -> bool:
        """Whether the response to this request names a job that stays busy after it ends."""
        return False

    def job_id_from_response(self, status: int, body: bytes) -> str | None:
        return None

    def job_done_from_frame(self, text: str) -> str | None:
        """The job id a websocket text frame says is finished, if any."""
        return None

    def history_path(self, job_id: str) -> str | None:
        """Where to poll for a job's end when no websocket reports it (None: not pollable)."""
        return None

    def job_done_from_history(self, job_id: str, status: int, body: bytes) -> bool:
        return False

    def queue_path(self) -> str | None:
        """Where the engine lists the jobs it still has (None: it does not say)."""
        return None

    def job_ids_from_queue(self, status: int, body: bytes) -> frozenset[str] | None:
        """Every job id the engine's queue answer lists, running or pending; None if unreadable."""
        return None

    def job_news(self, method: str, path: str) -> bool:
        """Whether this request may change or learn of the engine's jobs (a queue delete or clear, a
        client polling for its job's end): the proxy checks the jobs it tracks right after it."""
        return False

    async def running_jobs(self, client: httpx.AsyncClient) -> list[str]:
        """Job ids the engine's own queue says are running now (at `queue_path()`). Raises httpx errors."""
        return []

    # -- NeedEstimator and Releaser: what a request needs, how to get memory back ----------------------
    # What a start takes on the card before any request loads something: a generic app loads its
    # model as it starts (needs_vram_gb); an engine that loads per request (Ollama, ComfyUI) only
    # its runtime (idle_vram_gb).
    starts_loaded: bool = True

    def load_key(self, model: str) -> str:
        """Names one load: requests with the same key share one reservation, and residency is per key."""
        return f"{self.tenant.name}:{model}"

    async def estimate_need(self, path: str, body: bytes, client: httpx.AsyncClient) -> Need:
        """What the request needs in total on the card (the planner subtracts what the tenant already holds)."""
        t = self.tenant
        return Need(t.needs_vram_bytes, f"{t.needs_vram_gb:.2f} GiB (needs_vram_gb)", t.name)

    # The JSON fields that name what a request loads, looked for in the head of a body too large to
    # keep (`head_need`); none: such a request is planned on the tenant's need.
    head_model_fields: tuple[str, ...] = ()

    def body_naming(self, model: str) -> bytes:
        """The smallest request body that loads `model`, for `estimate_need` (`head_need`)."""
        return json.dumps({"model": model}).encode()

    async def head_need(self, path: str, head: bytes, client: httpx.AsyncClient) -> Need:
        """A request whose body is too large to keep (over replay_body_max_mb) is planned like any other
        (one door): on the model its head names, else on the tenant's configured need."""
        model = named_in_head(head, self.head_model_fields)
        if model is not None:
            return await self.estimate_need(path, self.body_naming(model), client)
        t = self.tenant
        return Need(t.needs_vram_bytes, f"{t.needs_vram_gb:.2f} GiB (needs_vram_gb: its body is too large to read the "
                                        "model from)", t.name)

    @property
    def start_need_bytes(self) -> int:
        """The memory planned for a start (or a resume) of a stopped tenant, before its request's own need."""
        return self.tenant.needs_vram_bytes if self.starts_loaded else self.tenant.idle_vram_bytes

    async def release(self, client: httpx.AsyncClient, step: ReleaseSpec | None = None) -> dict[str, object]:
        """Ask for the memory back (the tenant's `release.kind`; `step`: one of its release steps, default
        the first). Raises ReleaseFailed."""
        return await release_by_strategy(self.tenant, client, step)

    async def resume(self, client: httpx.AsyncClient, step: ReleaseSpec) -> dict[str, object] | None:
        """Wake the app after `step` released it (its `resume` call), before the next request is
        forwarded; None when there is nothing to call. Raises ReleaseFailed."""
        return await resume_by_strategy(self.tenant, client, step)

    # -- OomDetector --------------------------------------------------------------------------------
    # Whether the engine's HTTP answer itself can say the GPU ran out of memory (then the request is
    # retried once); an engine whose jobs outlive the answer reports it later, on a frame or in history.
    answers_oom: bool = False

    def response_is_oom(self, status: int, body: bytes) -> bool:
        """An HTTP answer that says the GPU ran out of memory (only where `answers_oom`)."""
        return False

    def oom_in_history(self, job_id: str, body: bytes) -> bool:
        """Whether a finished job's history entry says it failed for lack of GPU memory."""
        return False

    async def job_replay(self, client: httpx.AsyncClient, job_id: str) -> JobReplay | None:
        """The failed job as the engine kept it, to submit again; None when it is not (yet) there."""
        return None

    async def resubmit(self, client: httpx.AsyncClient, replay: JobReplay) -> Requeued:
        """Submit the job again, under its own id where the engine takes one. Raises httpx errors."""
        return Requeued(None, 0)

    # -- RetryViews: a job retried under its own id, as its client sees it ----------------------------
    def job_frame(self, text: str) -> JobFrame | None:
        """What a websocket text frame says about a job's run, if anything (must be cheap)."""
        return None

    def job_view(self, method: str, path: str) -> ports.JobView | None:
        """Whether this request reads the engine's record of finished jobs (its history) or its queue."""
        return None

    def history_without(self, body: bytes, hidden: Callable[[str, str | None], bool]) -> bytes | None:
        """A history answer without the records `hidden(job id, mark)` names; None: nothing hidden."""
        return None

    def queue_with(self, body: bytes, pending: Sequence[JobReplay]) -> bytes | None:
        """A queue answer that lists these jobs as pending too (each where it is not listed); None: unchanged."""
        return None

    def history_outcome(self, job_id: str, body: bytes) -> ports.JobFrameKind | None:
        """How the job's record in a history answer says it ended: success, oom or error; None: not in it."""
        return None

    def jobs_without(self, body: bytes, hidden: Callable[[str, str | None], bool],
                     retried: Sequence[JobReplay]) -> bytes | None:
        """A jobs answer without the finished jobs `hidden` names; None: unchanged."""
        return None

    # -- SelfReport: what the engine says about itself (no GPU reader: invariant 10) -----------------
    async def self_reported_bytes(self, client: httpx.AsyncClient) -> int | None:
        """The engine's own idea of its VRAM, marked as an estimate; None when it does not say."""
        return None

    async def device_report(self, client: httpx.AsyncClient) -> DeviceMemory | None:
        """The card's figures as the engine reports them; None when it does not (or runs on the CPU)."""
        return None

    async def runs_on_cpu(self, client: httpx.AsyncClient) -> bool:
        """The engine says it computes on the CPU, so it holds no GPU memory."""
        return False

    # Where the engine lists how it placed each loaded model (GPU or CPU in part); None: it does not.
    placements_path: str | None = None

    async def placements(self, client: httpx.AsyncClient) -> list[Placement]:
        """The loaded models and where they sit (the watchdog's spill probe). Raises httpx errors."""
        return []

    def placement_key(self, placement: Placement) -> str:
        """The load key of one loaded model the engine lists (what a request for that load would have)."""
        return self.load_key(str(placement.get("name")))

    async def unload_model(self, client: httpx.AsyncClient, model: str) -> bool:
        """Unload one model the engine holds (when its requests end); False: the engine has no such call."""
        return False

    # -- ModelNews ----------------------------------------------------------------------------------
    def model_news(self, method: str, path: str) -> bool:
        """Whether a pass-through request may change what a model name is, or list the models."""
        return False

    def saw_model_news(self, method: str, path: str, request: bytes, status: int, answer: bytes) -> None:
        """Such a request and its answer (each b"" when larger than the listener keeps)."""

    def saw_gpu_answer(self, path: str, body: bytes, status: int) -> None:
        """The engine answered a GPU request (its status): what it loaded, it holds now."""

    def keep_state_in(self, folder: Path | None) -> None:
        """Where what the adapter learns outlives a restart (the proxy's state folder); None: nowhere."""

    # -- InstalledModels ----------------------------------------------------------------------------
    async def catalog(self, client: httpx.AsyncClient, timeout_s: float) -> TenantCatalog | None:
        """The installed models, or None for an engine without a catalog. Raises httpx errors."""
        return None

    # How many GPU requests the engine runs at once when tenants.json does not say (`runs_at_once`);
    # None: no bound the proxy knows of.
    runs_at_once_default: int | None = None

    @property
    def runs_at_once(self) -> int | None:
        return self.tenant.runs_at_once or self.runs_at_once_default

    # Whether `installed_needs` lists the installed models with the memory each would need.
    sized_catalog: bool = False

    async def installed_needs(self, client: httpx.AsyncClient) -> list[tuple[str, int]]:
        """(model, bytes a load needs) for every installed model. Raises httpx errors."""
        return []

    # -- HealthProbes: health, readiness after a start, `hyperswap verify` ---------------------------
    probe_path: str = "/"  # what health GETs to see the engine answer
    # After the proxy starts the tenant (proxy/lifecycle/): the path that answers 200 once the engine
    # serves requests; None: ready as soon as its upstream port accepts a connection. tenants.json's
    # `ready` overrides it.
    ready_path: str | None = None
    verify_role: str | None = None  # what `hyperswap verify` drives it as: "generates", "renders" or nothing
    probe_strict: bool = False  # True: only a 200 with the engine's own answer is healthy; else any status < 500
    start_hint: str | None = None  # how to start the engine, for a fix text

    def status_websocket(self, client_id: str) -> str | None:
        """The websocket URL where the engine greets a client with a status frame (health opens it);
        None when it has none."""
        return None

    def is_status_frame(self, text: str | bytes) -> bool:
        """Whether the first frame on `status_websocket` is the engine's greeting."""
        return False

    # Its idle footprint varies (caches grow and shrink), so health takes the smallest it saw as the floor.
    floor_from_samples: bool = False

    def version_from_probe(self, data: object) -> str | None:
        """The engine's version from the JSON answer to `probe_path`."""
        return None

    # -- SettingsView: /api/engines -----------------------------------------------------------------
    async def settings_view(self, client: httpx.AsyncClient, snap: AttributedSnapshot | None, env: EnvReaders,
                            host_reads: bool) -> EngineReport | None:
        """What /api/engines shows: reachable, version, the settings that matter for memory and where
        each came from; None for an engine that reports nothing about itself."""
        return None

    # -- Deployment ---------------------------------------------------------------------------------
    # The systemd unit the engine's Linux installer ships (its Environment= is the engine's), or None.
    service_unit: str | None = None
    # The command-line flag that picks the engine's GPU on a host with several (proxy/gpu/devices.py);
    # None: the engine has none, and only CUDA_VISIBLE_DEVICES in its environment says.
    device_flag: str | None = None

    def relocation(self, port: int) -> Relocation | None:
        """How to move this engine onto `port` of 127.0.0.1; None: no known way (a generic app's own flags)."""
        return None

    # -- ModelLoads: where the model files are, how long a load took ---------------------------------
    # Whether its model loads run after the answer (a queued job), so they are timed from the engine's
    # progress frames (proxy/models/frames.py) instead of from the answer (`load_seconds`).
    load_timed_from_frames: bool = False

    def model_files(self, hints: FileHints) -> TenantFiles | None:
        """Where the engine's model files are (blocking: it walks directories). The generic engine has
        no layout of its own: only the tenant's model_paths say (None: nothing to look for)."""
        return plain_tenant_files(self.tenant)

    def load_seconds(self, answer_tail: bytes) -> float | None:
        """How long the engine says its model load took, from the end of its answer (None: it does not say)."""
        return None
