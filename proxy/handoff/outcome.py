"""A decision's outcome as people and programs read it: its events' facts merged (the decision log,
proxy/handoff/decisions.py, keeps them as JSON), typed. `DecisionView.read()` gives it; the admin API
documents and writes it as a `Decision`'s `outcome` (proxy/handoff/decision_json.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from proxy.encoding import JSONModel
from proxy.handoff.release_result import ReleaseOutcome


class DecisionOutcome(JSONModel):
    """A decision's outcome: its events' facts merged (proxy/handoff/decisions.py), so every key is
    optional: an outcome grows as the decision goes on (a handoff's releases come with its second event)."""
    ok: bool | None = None
    releases: list[ReleaseOutcome] | None = None
    status: int | None = None  # a rejection's HTTP status: 507, or 503 after the queue timeout
    result: str | None = None  # queued: admitted | ...; oom_retry: succeeded | failed | no plan | ...
    oom_retry: str | None = None  # a plan decision's retry result, once the retry ran
    waited_s: float | None = None  # queued: how long the request waited
    reason: str | None = None
    held_bytes: int | None = Field(default=None, description="release, idle_release: what the tenant held when asked")
    idle_s: float | None = Field(default=None, description="idle_release: the tenant's idle_release_after_s")
    waiting_for: list[str] | None = Field(default=None, description="queued: the busy tenants it waits for")
    behind: int | None = Field(default=None, description="queued: the waiting request it queues behind")
    ended_by: int | None = Field(default=None, description="queued: the decision that ended the wait")
    ended_with: str | None = None
    requeued_as: str | None = Field(default=None, description="a ComfyUI prompt retried after an OOM: the new prompt id")
    prompt_id: str | None = None
    job_id: str | None = Field(default=None, description="stale_job: the job no longer counted as running")
    # model_load: a load the engine timed itself (proxy/models/loads.py)
    at: float | None = Field(default=None, description="model_load: when the load ended (unix seconds)")
    model: str | None = None
    size_bytes: int | None = None
    seconds: float | None = None
    gbps: float | None = None
    resident_before_percent: float | None = None
    source: str | None = None
    load_class: str | None = Field(default=None, alias="class", description="model_load: warm, cold or unknown")
    not_released_busy: list[str] | None = Field(default=None, description="tenants of the plan that had work again "
                                                                          "when the release's turn came: not released")
    # start, stop, resume: a lifecycle tenant started or stopped, a soft release's resume call
    state: str | None = Field(default=None, description="start, stop: the tenant's lifecycle state after it")
    duration_s: float | None = Field(default=None, description="start, stop, resume: how long it took")
    error: str | None = Field(default=None, description="start, stop, resume: why it failed")
    fix: str | None = None
    output: list[str] | None = Field(default=None, description="start, stop: the app's last output lines")
    retry_in_s: float | None = Field(default=None, description="a failed start: when the next may begin")
    asked: Mapping[str, object] | None = Field(default=None, description="resume: what the app was asked and answered")
    request: int | None = Field(default=None, description="model_load: the decision of the request whose load it was "
                                                          "(its wait, or the handoff it caused)")
    # queued, plan: a request that waited or caused a handoff got its answer (FirstByte)
    arrived_at: float | None = Field(default=None, description="when the request arrived (unix seconds)")
    first_byte_s: float | None = Field(default=None, description="seconds from its arrival to its answer's first byte")
    first_byte_status: int | None = Field(default=None, description="the HTTP status its answer began with")
