"""The refusals (proxy/relay/refusals.py): each built once, answered with its status, its Retry-After and
its fields in the order clients have always seen them; the admin's document describes the same 507."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.admin.views import Rejection
from proxy.config.schema import Tenant
from proxy.config.units import GIB
from proxy.engines.loading import registry_from_dict
from proxy.errors import HyperSwapError
from proxy.handoff.plan import Blocker, Plan, Release
from proxy.handoff.plan_json import plan_json
from proxy.handoff.scheduler import Admitted, Handoff
from proxy.lifecycle.controller import LifecycleError
from proxy.relay import refusals


@pytest.fixture
def tenant() -> Tenant:
    return registry_from_dict({"tenants": {"ollama": {"engine": "ollama", "upstream": "http://127.0.0.1:1"}}}).get("ollama")


def handoff(waited_s: float = 2.5) -> Handoff:
    blockers = (Blocker(42, "python", "unmanaged", 3 * GIB, "unmanaged", "not a tenant"),
                Blocker(None, "comfyui", "comfyui", None, "busy", "rendering"))
    plan = Plan("ollama", 5 * GIB, GIB, 0, False, True, (Release("comfyui", GIB, (7,), "idle"),), blockers,
                "not enough", False, possible=False, wait_for=("comfyui",))
    return Handoff(plan=plan, releases=[], decision=None, waited_s=waited_s)


def answer(refusal: refusals.Refusal) -> tuple[int, str | None, dict[str, Any]]:
    response = refusal.response()
    return response.status_code, response.headers.get("retry-after"), json.loads(bytes(response.body))


def test_the_507_names_its_blockers_with_the_fields_in_their_wire_order(tenant: Tenant) -> None:
    status, retry, body = answer(refusals.not_enough_memory(tenant, handoff(), 5 * GIB))
    assert (status, retry) == (507, None)
    assert list(body) == ["error", "tenant", "need_gb", "available_gb", "blockers", "plan", "fix"], "no device on one card"
    assert body["blockers"][0] == {"pid": 42, "name": "python", "cmdline": "", "tenant": "unmanaged", "vram_gb": 3.0,
                                   "reason": "unmanaged", "detail": "not a tenant"}
    assert body["plan"] == plan_json(handoff().plan), "the plan as the decisions log it"
    assert body["fix"].startswith("stop the unmanaged processes named in blockers")
    assert Rejection.model_validate(body).plan.outcome == "impossible", "the admin document describes the same body"


@pytest.mark.parametrize(("timeout_s", "retry_after"), [(0.2, "1"), (12.5, "12"), (600, "30")])
def test_a_queue_timeout_says_when_to_come_back(tenant: Tenant, timeout_s: float, retry_after: str) -> None:
    admitted = Admitted("timeout", handoff(), "comfyui is busy")
    for refusal in (refusals.queue_timeout(tenant, admitted, timeout_s),
                    refusals.start_queue_timeout(tenant, admitted, timeout_s, {"state": "stopped"})):
        status, retry, body = answer(refusal)
        assert (status, retry) == (503, retry_after), type(refusal).__name__
        assert body["waited_s"] == 2.5 and body["waiting_for"] == ["comfyui"]
    _, _, relay = answer(refusals.queue_timeout(tenant, admitted, timeout_s))
    assert list(relay) == ["error", "tenant", "waited_s", "waiting_for", "blockers", "plan", "fix"]
    _, _, admin = answer(refusals.start_queue_timeout(tenant, admitted, timeout_s, {"state": "stopped"}))
    assert list(admin) == ["error", "fix", "tenant", "reason", "waited_s", "waiting_for", "lifecycle"]
    assert admin["error"].startswith("the start of ollama waited") and admin["reason"] == "queue_timeout"


@pytest.mark.parametrize(("retry_in_s", "retry_after"), [(1, "1"), (2.6, "3"), (0.2, "1"), (None, "1")])
def test_a_failed_start_is_told_as_it_was_raised_with_its_backoff(retry_in_s: float | None, retry_after: str) -> None:
    err = LifecycleError("tenant 'stt' could not be started: it exited", fix="see its output", output=["boom"])
    err.details.update({"tenant": "stt", "state": "failed", "retry_in_s": retry_in_s})
    status, retry, relay = answer(refusals.start_failed(err))
    assert (status, retry) == (503, retry_after)
    assert json.dumps(relay) == json.dumps(err.body()), "the listener's body is the error's, key for key"
    _, _, admin = answer(refusals.start_failed(err, {"state": "failed"}))
    assert list(admin) == ["error", "fix", "output", "tenant", "retry_in_s", "reason", "lifecycle"], "no state: in lifecycle"


def test_a_stopped_tenant_kept_asleep_says_why_and_only_a_read_is_told_to_poll(tenant: Tenant) -> None:
    start = "POST http://127.0.0.1:11400/api/tenants/ollama/start"
    status, retry, read = answer(refusals.kept_asleep(tenant, "failed", "exited", what="GET /api/tags", origin=None,
                                                      start_url=start))
    assert (status, retry) == (503, "10")
    assert list(read) == ["tenant", "state", "last_error", "error", "wake_on", "retry_after_s", "fix"]
    status, retry, foreign = answer(refusals.kept_asleep(tenant, "stopped", None, what="POST /api/chat",
                                                         origin="http://evil.example", start_url=start))
    assert (status, retry) == (403, None)
    assert list(foreign) == ["tenant", "state", "error", "fix"], "last_error only for a failed tenant"


def test_the_409s_carry_a_reason_and_lifecycle_only_where_one_is_known(tenant: Tenant) -> None:
    assert answer(refusals.busy(tenant, "2 requests", "released"))[2]["reason"] == "busy"
    assert "lifecycle" not in answer(refusals.busy(tenant, "2 requests", "released"))[2]
    assert answer(refusals.not_lifecycle(tenant, "start"))[2]["lifecycle"] is None, "null: not the proxy's to start"
    for refusal in (refusals.busy(tenant, "x", "stopped", {"state": "running"}), refusals.starting(tenant, {}),
                    refusals.not_reclaimable(tenant), refusals.no_log(tenant, "systemd unit", "`journalctl -f -u <unit>`", {})):
        status, retry, body = answer(refusal)
        assert (status, retry) == (409, None)
        assert list(body)[:4] == ["error", "fix", "tenant", "reason"]


def test_every_refusal_that_documents_a_retry_after_sends_one(tenant: Tenant) -> None:
    admitted = Admitted("timeout", handoff(), "busy")
    built: list[refusals.Refusal] = [
        refusals.not_enough_memory(tenant, handoff(), GIB), refusals.queue_timeout(tenant, admitted, 5),
        refusals.start_queue_timeout(tenant, admitted, 5, {}), refusals.start_failed(HyperSwapError("x")),
        refusals.kept_asleep(tenant, "stopped", None, what="GET /", origin=None, start_url="POST /start"),
        refusals.kept_asleep(tenant, "stopped", None, what="GET /", origin="http://x", start_url="POST /start"),
        refusals.not_reclaimable(tenant)]
    assert {type(r) for r in built} == {m for m, _ in refusals.MODELS}, "one of each"
    for refusal in built:
        assert (refusal.response().headers.get("retry-after") is not None) == (refusal.retry_after_from is not None), \
            type(refusal).__name__
