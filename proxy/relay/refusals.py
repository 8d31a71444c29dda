"""Every refusal the proxy answers a client, one typed model each, built here and nowhere else.

A tenant's listener (relay/gpu_gate.py) and the admin API (admin/api.py) render the same models with
the same status and `Retry-After`; the admin's OpenAPI document (admin/views.py, admin/openapi.py) and
the generated refusal reference (docs/gen/refusals.py) are made from them too, so what is answered and
what is documented cannot drift apart. Each model lists its fields in the order they go on the wire,
and a body carries only the fields its builder set (`exclude_unset`): unknown is left out or null,
never invented.

    507 NotEnoughMemory    no plan frees enough, even once every busy tenant finished
    503 QueueTimeout       a request waited past proxy.queue_timeout_s (waiting could still help)
    503 StartQueueTimeout  the admin's start waited past it
    503 StartFailed        a sleeping tenant could not be started (or resumed)
    503 KeptAsleep         a read that must not start a stopped tenant (wake_on "writes")
    403 ForeignOrigin      a page from another origin that must not start it
    409 Conflict           an admin release, start, stop or log stream the tenant's state refuses
"""

from __future__ import annotations

from typing import ClassVar, Literal, Self, cast

from pydantic import Field, PrivateAttr
from starlette.responses import JSONResponse

from proxy.config.schema import Tenant
from proxy.encoding import JSONModel, JSONObject
from proxy.errors import HyperSwapError
from proxy.handoff import per_card
from proxy.handoff.plan import gib
from proxy.handoff.plan_json import Plan as PlanJSON
from proxy.handoff.plan_json import PlanDevice
from proxy.handoff.tickets import Admitted, Handoff

QUEUE_RETRY_AFTER_MAX_S = 30  # past the queue timeout, come back after as long again, but not later than this
STOPPED_RETRY_AFTER_S = 10  # a read kept from a stopped app: nothing starts it by itself, so poll slowly


class Refusal(JSONModel):
    """What every refusal shares: its status, its `Retry-After` (when coming back may help), and how
    it is rendered. Unknown keys are kept (`extra="allow"`), as in every admin view."""

    status: ClassVar[int]
    retry_after_from: ClassVar[str | None] = None  # what its Retry-After says, for the reference; None: it has none
    _retry_after_s: int | None = PrivateAttr(default=None)

    def retry_after(self, seconds: int) -> Self:
        self._retry_after_s = seconds
        return self

    def body(self) -> JSONObject:
        return cast(JSONObject, self.model_dump(mode="json", exclude_unset=True))

    def response(self) -> JSONResponse:
        headers = None if self._retry_after_s is None else {"Retry-After": str(self._retry_after_s)}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class RejectionBlocker(JSONModel):
    """A process in the way, named so that a person can find it."""

    pid: int | None
    name: str
    cmdline: str
    tenant: str
    vram_gb: float | None
    reason: str
    detail: str


class NotEnoughMemory(Refusal):
    """The 507 a tenant's listener answers when no plan frees enough memory."""

    status = 507
    error: str
    tenant: str
    need_gb: float | None
    available_gb: float | None
    blockers: list[RejectionBlocker]
    plan: PlanJSON = Field(description="the release plan that found no room")
    fix: str
    device: PlanDevice | None = Field(default=None, description="only on a host with several GPUs: the card that "
                                                                "has not enough memory; another may have room")


class QueueTimeout(Refusal):
    """The 503 past `proxy.queue_timeout_s`, with `Retry-After`: waiting could still help."""

    status = 503
    retry_after_from = f"the queue timeout, 1 to {QUEUE_RETRY_AFTER_MAX_S} s"
    error: str
    tenant: str
    waited_s: float = Field(description="how long the request waited for memory")
    waiting_for: list[str] = Field(description="the busy tenants it waited for")
    blockers: list[RejectionBlocker]
    plan: PlanJSON = Field(description="the plan it waited on")
    fix: str


class StartQueueTimeout(Refusal):
    """The admin's start of a tenant past `proxy.queue_timeout_s` (503, `Retry-After`)."""

    status = 503
    retry_after_from = f"the queue timeout, 1 to {QUEUE_RETRY_AFTER_MAX_S} s"
    error: str
    fix: str
    tenant: str
    reason: Literal["queue_timeout"]
    waited_s: float = Field(description="how long the start waited for memory")
    waiting_for: list[str] = Field(description="the busy tenants it waited for")
    lifecycle: dict[str, object]


class StartFailed(Refusal):
    """A sleeping tenant that could not be started or resumed (503; `Retry-After`: its backoff)."""

    status = 503
    retry_after_from = "the start's backoff (`retry_in_s`), at least 1 s"
    error: str
    fix: str | None = None
    output: list[str] | None = Field(default=None, description="the app's last output lines")
    tenant: str | None = None
    state: str | None = Field(default=None, description="its lifecycle state; a tenant's listener says it")
    retry_in_s: int | float | None = Field(default=None, description="seconds before a request may start it again")
    reason: Literal["start_failed"] | None = Field(default=None, description="the admin's start says it")
    lifecycle: dict[str, object] | None = Field(default=None, description="the admin's start: the tenant's state")


class KeptAsleep(Refusal):
    """A read (wake_on "writes") kept from a stopped tenant: 503 with `Retry-After`."""

    status = 503
    retry_after_from = f"{STOPPED_RETRY_AFTER_S} s"
    tenant: str
    state: str
    last_error: str | None = Field(default=None, description="a failed tenant: why")
    error: str
    wake_on: str
    retry_after_s: int
    fix: str


class ForeignOrigin(Refusal):
    """A browser page from an origin the listener does not allow never starts a stopped tenant: 403."""

    status = 403
    tenant: str
    state: str
    last_error: str | None = Field(default=None, description="a failed tenant: why")
    error: str
    fix: str


class Conflict(Refusal):
    """An admin call the tenant's state refuses (409): busy, starting, not reclaimable, not started by
    the proxy, or its output kept by another manager."""

    status = 409
    error: str
    fix: str
    tenant: str
    reason: Literal["busy", "starting", "not_reclaimable", "not_lifecycle", "no_log"] = Field(
        description="busy, starting, not_reclaimable, not_lifecycle, or no_log (its output is kept by systemd or docker)")
    lifecycle: dict[str, object] | None = Field(default=None, description="null for a tenant the proxy does not start")


# -- builders ------------------------------------------------------------------------------------

def blockers(handoff: Handoff) -> list[RejectionBlocker]:
    snap = handoff.snapshot
    out = []
    for b in handoff.plan.blockers:
        proc = snap.snapshot.process(b.pid) if snap is not None and b.pid is not None else None
        out.append(RejectionBlocker(pid=b.pid, name=b.name, cmdline=proc.cmdline if proc else "", tenant=b.tenant,
                                    vram_gb=gib(b.vram_bytes), reason=b.reason, detail=b.detail))
    return out


def blockers_json(handoff: Handoff) -> list[JSONObject]:
    return [cast(JSONObject, b.model_dump(mode="json")) for b in blockers(handoff)]


def _memory_fix(handoff: Handoff) -> str:
    reasons = {b.reason for b in handoff.plan.blockers}
    device = per_card.device(handoff.snapshot, handoff.plan.device) if handoff.snapshot else None
    if device is not None and device.total_bytes and handoff.plan.need_bytes > device.total_bytes - device.reserved_bytes:
        return "use a smaller model or quantisation: no release on this card can free that much"
    fixes = []
    if "unmanaged" in reasons:
        fixes.append("stop the unmanaged processes named in blockers, or register them as a tenant with a release")
    if "not_reclaimable" in reasons:
        fixes.append("give the not-reclaimable tenants a release in tenants.json, or stop them")
    if "protected" in reasons:
        fixes.append("raise this tenant's priority, or unset protect_idle_memory on the protected tenant")
    return "; ".join(fixes) or "free GPU memory held outside the proxy's tenants, or ask for less"


def not_enough_memory(tenant: Tenant, handoff: Handoff, need_bytes: int) -> NotEnoughMemory:
    """507: the need cannot be met even once every busy tenant finished and every reclaimable one
    were released."""
    plan = handoff.plan
    out = NotEnoughMemory(error=f"not enough GPU memory for {tenant.name}: {plan.explanation}", tenant=tenant.name,
                          need_gb=gib(need_bytes), available_gb=gib(plan.reachable_bytes),
                          blockers=blockers(handoff), plan=PlanJSON.of(plan), fix=_memory_fix(handoff))
    if plan.device is not None and handoff.snapshot is not None:  # a host with several cards: which one
        dev = per_card.device(handoff.snapshot, plan.device)
        out.device = PlanDevice(index=dev.index, name=dev.name, uuid=dev.uuid)
    return out


def queue_retry_after_s(timeout_s: float) -> int:
    """Past the queue timeout: come back after as long again (at least 1 s, at most 30 s)."""
    return max(1, int(min(timeout_s, QUEUE_RETRY_AFTER_MAX_S)))


def queue_timeout(tenant: Tenant, admitted: Admitted, timeout_s: float) -> Refusal:
    """503 past `proxy.queue_timeout_s` for a request: say when to come back."""
    handoff = admitted.handoff
    return QueueTimeout(
        error=f"{tenant.name} waited {timeout_s:g} s for GPU memory: {admitted.reason}", tenant=tenant.name,
        waited_s=round(handoff.waited_s, 3), waiting_for=list(handoff.plan.wait_for), blockers=blockers(handoff),
        plan=PlanJSON.of(handoff.plan),
        fix="retry after the busy tenants finish (Retry-After), or raise proxy.queue_timeout_s in tenants.json",
    ).retry_after(queue_retry_after_s(timeout_s))


def start_queue_timeout(tenant: Tenant, admitted: Admitted, timeout_s: float, lifecycle: dict[str, object]) -> Refusal:
    """503 past `proxy.queue_timeout_s` for the admin's start: said as the start's, with its state."""
    handoff = admitted.handoff
    return StartQueueTimeout(
        error=f"the start of {tenant.name} waited {timeout_s:g} s for GPU memory: {admitted.reason}",
        fix="start it again once the busy tenants finish (Retry-After), or raise proxy.queue_timeout_s in tenants.json",
        tenant=tenant.name, reason="queue_timeout", waited_s=round(handoff.waited_s, 3),
        waiting_for=list(handoff.plan.wait_for), lifecycle=lifecycle,
    ).retry_after(queue_retry_after_s(timeout_s))


def start_retry_after_s(retry_in_s: object) -> int:
    """A failed start may be tried again after its backoff: say when (at least 1 s)."""
    return max(1, round(retry_in_s)) if isinstance(retry_in_s, int | float) else 1


def start_failed(exc: HyperSwapError, lifecycle: dict[str, object] | None = None) -> Refusal:
    """503: the start (or resume) failed. A tenant's listener says the state it is left in; the admin's
    start says `reason` and the whole lifecycle instead."""
    body: dict[str, object] = dict(exc.body())
    if lifecycle is not None:
        body.pop("state", None)
        body.update(reason="start_failed", lifecycle=lifecycle)
    return StartFailed.model_validate(body).retry_after(start_retry_after_s(exc.details.get("retry_in_s")))


def kept_asleep(tenant: Tenant, state: str, last_error: str | None, *, what: str, origin: str | None,
                start_url: str) -> Refusal:
    """A request that must not start a stopped tenant: from a foreign origin (403), or a read (503)."""
    refusal: ForeignOrigin | KeptAsleep
    if origin is not None:
        refusal = ForeignOrigin(tenant=tenant.name, state=state,
                                error=f"{tenant.name} is {state}: a request from another origin ({origin[:200]!r}) "
                                      "never starts it",
                                fix=f"open it from its own address, or start it first ({start_url})")
    else:
        refusal = KeptAsleep(
            tenant=tenant.name, state=state,
            error=f"{tenant.name} is {state}: {what} only reads, and a read does not start it "
                  "(wake_on is \"writes\", so a poll never makes it flap)",
            wake_on=tenant.wake_on, retry_after_s=STOPPED_RETRY_AFTER_S,
            fix=f"send the request that needs it (a POST starts it), start it with {start_url}, or set "
                f"tenants.{tenant.name}.wake_on to \"any\" so reads start it too",
        ).retry_after(STOPPED_RETRY_AFTER_S)
    if state == "failed":  # only a failed tenant says why
        refusal.last_error = last_error
    return refusal


# The 409s of the admin API, one builder each.

def not_reclaimable(tenant: Tenant) -> Refusal:
    return Conflict(error=tenant.not_reclaimable_reason,
                    fix="this tenant cannot be released; stop it by hand if you need the memory",
                    tenant=tenant.name, reason="not_reclaimable")


def busy(tenant: Tenant, why: str, action: Literal["released", "stopped"],
         lifecycle: dict[str, object] | None = None) -> Refusal:
    out = Conflict(error=f"{tenant.name} is busy ({why}); a busy tenant is never {action}",
                   fix="wait for its work to finish, or cancel it in the application", tenant=tenant.name, reason="busy")
    if lifecycle is not None:  # a release's answer has none
        out.lifecycle = lifecycle
    return out


def starting(tenant: Tenant, lifecycle: dict[str, object]) -> Refusal:
    return Conflict(error=f"{tenant.name} is starting: it is stopped only once it runs and is idle",
                    fix="wait for the start to end, then stop it", tenant=tenant.name, reason="starting",
                    lifecycle=lifecycle)


def not_lifecycle(tenant: Tenant, action: str) -> Refusal:
    kinds = ", ".join(s.kind for s in tenant.release_steps) or "none"
    return Conflict(error=f"{tenant.name} is not a tenant the proxy starts and stops (release kind {kinds}): "
                          f"it cannot {action} it",
                    fix="only a tenant whose release in tenants.json is of kind process, systemd or docker is started "
                        "and stopped by the proxy; start or stop this one yourself",
                    tenant=tenant.name, reason="not_lifecycle", lifecycle=None)


def no_log(tenant: Tenant, runs_as: str, follow: str, lifecycle: dict[str, object]) -> Refusal:
    """Its app runs under a manager that keeps its output (`runs_as`: "systemd unit"; `follow`: how to
    read it there)."""
    return Conflict(error=f"{tenant.name}'s output is not the proxy's to stream: it runs as a {runs_as}, "
                          "whose output its manager keeps",
                    fix=f"follow it with {follow}", tenant=tenant.name, reason="no_log", lifecycle=lifecycle)


# Every refusal model, for the documentation (docs/gen/refusals.py): the model, when it is answered.
MODELS: tuple[tuple[type[Refusal], str], ...] = (
    (NotEnoughMemory, "a GPU request, or the start of a sleeping tenant, whose need no plan can meet"),
    (QueueTimeout, "a GPU request that waited past proxy.queue_timeout_s for memory"),
    (StartQueueTimeout, "POST /api/tenants/{name}/start that waited past proxy.queue_timeout_s"),
    (StartFailed, "a request to a sleeping tenant, or the admin's start, when the start failed"),
    (KeptAsleep, "a read to a stopped tenant whose wake_on is \"writes\""),
    (ForeignOrigin, "a request from a foreign browser Origin to a stopped tenant"),
    (Conflict, "an admin release, start, stop or log stream its state refuses"),
)
