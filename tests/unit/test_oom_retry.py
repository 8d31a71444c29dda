"""The OOM retry's need (handoff/oom_need.py) and what a client sees of a retried job (relay/oom_retry.py)."""

from __future__ import annotations

import json

from proxy.config.units import GIB
from proxy.engines.ports import JobFrame, JobFrameKind, JobReplay
from proxy.handoff.oom_need import OOM_HEADROOM_BYTES, oom_retry_need
from proxy.handoff.plan_json import plan_json
from proxy.relay.oom_retry import PASS, RetryBook, SocketFrames, Verdict

# -- the need -----------------------------------------------------------------------------------


def test_the_retry_asks_past_what_the_tenant_had_so_idle_tenants_are_released() -> None:
    # ComfyUI unloaded after its OOM: 0.3 GiB held, 6 free, Ollama idle with 16 GiB it could release.
    need = oom_retry_need(estimate=4 * GIB, held=int(0.3 * GIB), free=6 * GIB, reachable=22 * GIB)
    assert need == int(0.3 * GIB) + 6 * GIB + OOM_HEADROOM_BYTES


def test_a_retry_with_nobody_to_release_asks_for_what_it_can_reach_not_more_than_the_card() -> None:
    # The 507 "too large for this card" of a 10 GiB render: held + free + 1 GiB was past the card.
    reachable = int(23.2 * GIB)
    need = oom_retry_need(estimate=10 * GIB, held=int(0.3 * GIB), free=int(22.9 * GIB), reachable=reachable)
    assert need == reachable, "the raise stops at what the tenant can ever get: the retry runs on all of it"


def test_a_reading_that_counted_memory_twice_never_raises_the_need_past_reach() -> None:
    # A reading taken while ComfyUI sampled alone: 24.3 GiB held and 0.25 free on a card of 23.7.
    need = oom_retry_need(estimate=10 * GIB, held=int(24.3 * GIB), free=int(0.25 * GIB), reachable=int(23.2 * GIB))
    assert need == int(23.2 * GIB)


def test_the_estimate_is_never_lowered_by_the_cap() -> None:
    assert oom_retry_need(estimate=30 * GIB, held=0, free=20 * GIB, reachable=22 * GIB) == 30 * GIB, \
        "a request larger than anything reachable is still refused as before"


def test_an_unknown_reach_leaves_the_raise_uncapped() -> None:
    assert oom_retry_need(estimate=GIB, held=GIB, free=2 * GIB, reachable=None) == 3 * GIB + OOM_HEADROOM_BYTES


# -- the client's view -------------------------------------------------------------------------

def frame(kind: str, job: str = "p", **data: object) -> str:
    return json.dumps({"type": kind, "data": {"prompt_id": job, **data}})


def parse(text: str) -> JobFrame | None:
    msg = json.loads(text)
    data = msg["data"]
    kinds: dict[str, JobFrameKind] = {"execution_start": "start", "execution_success": "success", "execution_error": "oom"}
    if msg["type"] == "executing":
        return JobFrame("end", data["prompt_id"]) if data.get("node", "x") is None else None
    kind = kinds.get(msg["type"])
    return JobFrame(kind, data["prompt_id"]) if kind else None


class Gate:
    """What the GPU gate does with the frames a socket reports: the first run's OOM begins a retry."""

    def __init__(self, book: RetryBook) -> None:
        self.book = book
        self.reports: list[tuple[str, str, int]] = []

    def report(self, f: JobFrame, run: int) -> None:
        self.reports.append((f.kind, f.job_id, run))
        if f.kind == "oom" and run == 1:
            self.book.begin("comfyui", f.job_id)
        elif run > 1:
            self.book.end("comfyui", f.job_id)


def socket(book: RetryBook) -> tuple[SocketFrames, Gate, list[str]]:
    gate, later = Gate(book), list[str]()
    return book.watch("comfyui", parse, gate.report, later.append), gate, later


def test_the_failed_runs_error_and_end_are_dropped_once_the_job_runs_again() -> None:
    book = RetryBook()
    sock, gate, later = socket(book)
    assert sock.upstream(frame("execution_start")) == PASS
    assert sock.upstream(frame("execution_error")) == Verdict(send=False, ends_job=False)
    assert sock.upstream(frame("executing", node=None)) == Verdict(send=False, ends_job=True), \
        "the failed run ended: the proxy stops counting it until the retry is tracked"
    book.requeued("comfyui", "p", "8")
    assert later == [], "nothing the failed run sent reaches the client"
    assert sock.upstream(frame("execution_start")) == PASS
    assert sock.upstream(frame("execution_success")) == PASS
    assert sock.upstream(frame("executing", node=None)) == PASS
    assert gate.reports == [("oom", "p", 1), ("success", "p", 2)]
    assert book.phase("comfyui", "p") == "ended"


def test_the_failed_runs_frames_reach_the_client_as_they_came_when_no_retry_follows() -> None:
    book = RetryBook()
    sock, _, later = socket(book)
    sock.upstream(frame("execution_start"))
    error, end = frame("execution_error"), frame("executing", node=None)
    sock.upstream(error)
    sock.upstream(end)
    book.given_up("comfyui", "p")
    assert later == [error, end]


def test_an_end_marker_of_the_failed_run_after_the_requeue_is_not_the_retrys_end() -> None:
    book = RetryBook()
    sock, _, later = socket(book)
    sock.upstream(frame("execution_start"))
    sock.upstream(frame("execution_error"))
    book.requeued("comfyui", "p", "8")  # the re-queue answered before the failed run's end marker came
    assert sock.upstream(frame("executing", node=None)) == Verdict(send=False, ends_job=False), \
        "the job runs again under this id: its count goes on"
    assert later == []


def test_a_second_oom_reaches_the_client() -> None:
    book = RetryBook()
    sock, gate, _ = socket(book)
    sock.upstream(frame("execution_start"))
    sock.upstream(frame("execution_error"))
    sock.upstream(frame("executing", node=None))
    book.requeued("comfyui", "p", "8")
    sock.upstream(frame("execution_start"))
    assert sock.upstream(frame("execution_error")) == PASS, "retried once: the retry's error is the client's"
    assert sock.upstream(frame("executing", node=None)) == PASS
    assert gate.reports[-1] == ("oom", "p", 2)


def test_other_prompts_and_other_sockets_pass_untouched() -> None:
    book = RetryBook()
    sock, _, _ = socket(book)
    other, _, _ = socket(book)
    sock.upstream(frame("execution_start"))
    sock.upstream(frame("execution_error"))
    assert sock.upstream(frame("executing", "q", node=None)) == PASS
    assert other.upstream(frame("executing", node=None)) == PASS, "a socket that never saw the error relays the end"


def test_the_history_hides_the_failed_run_until_the_new_runs_record_replaces_it() -> None:
    book = RetryBook()
    assert not book.hidden("comfyui", "p", "7")
    book.begin("comfyui", "p")
    assert book.pending("comfyui") and not book.pending("ollama")
    assert book.hidden("comfyui", "p", "7"), "while the retry is decided"
    book.requeued("comfyui", "p", "8")
    assert book.hidden("comfyui", "p", "7") and not book.hidden("comfyui", "p", "8")
    book.end("comfyui", "p")
    assert not book.pending("comfyui")
    book.begin("comfyui", "q")
    book.given_up("comfyui", "q")
    assert not book.hidden("comfyui", "q", "9"), "no retry: the error is the client's"


def test_a_job_whose_retry_is_decided_is_listed_as_waiting_until_it_is_queued_again() -> None:
    book = RetryBook()
    book.begin("comfyui", "p")
    replay = JobReplay(b"{}", {}, "p", [7, "p", {}, {}, []])
    book.replaying("comfyui", "p", replay)
    assert book.waiting("comfyui") == [replay] and book.waiting("ollama") == []
    book.requeued("comfyui", "p", "8")
    assert book.waiting("comfyui") == [], "the engine lists it itself now"


# -- the retry's admission reads the card afresh ---------------------------------------------------

async def test_a_retry_is_planned_on_a_fresh_reading_not_the_one_taken_while_comfyui_sampled() -> None:
    from proxy.clock import ManualClock
    from proxy.engines.loading import registry_from_dict
    from proxy.gpu.snapshot import GpuSnapshot
    from proxy.handoff.broker import GpuBroker
    from proxy.handoff.decisions import DecisionLog
    from proxy.handoff.inflight import InFlight
    from tests.unit.cards import snap

    reg = registry_from_dict({"tenants": {"comfyui": {"engine": "comfyui", "upstream": "http://127.0.0.1:9",
                                                      "needs_vram_gb": 10.0,
                                                      "match": {"process_names": ["comfyui-proc"]}}}})
    total = int(23.7 * GIB)
    # while ComfyUI sampled alone: 24.3 GiB held, 0.25 free on a card of 23.7 (memory counted twice)
    sampling = snap([("comfyui", 10, int(24.3 * GIB))], free=int(0.25 * GIB), total=total)
    after = snap([("comfyui", 10, int(0.3 * GIB))], total=total)  # ComfyUI unloaded everything on its OOM
    clock = ManualClock()
    reads: list[str] = []

    class AfterTheOom:
        """The GPU reader (the port Arbitration reads the card through): ComfyUI unloaded everything."""

        def read(self) -> GpuSnapshot:
            reads.append("fresh")
            return after.snapshot

    broker = GpuBroker(reg, AfterTheOom(), InFlight(clock), clock, DecisionLog(clock))
    broker.scheduler.observe_card(sampling)
    try:
        body = json.dumps({"prompt": {"4": {"class_type": "CheckpointLoaderSimple",
                                            "inputs": {"ckpt_name": "flux.safetensors"}}}}).encode()
        admitted, _ = await broker.admit(reg.get("comfyui"), "/prompt", body, "OOM of ComfyUI prompt p", oom=True)
    finally:
        await broker.aclose()
    plan = admitted.handoff.plan
    assert reads, "the retry read the card afresh"
    assert admitted.outcome == "run", f"{admitted.outcome}: {admitted.reason}"
    assert 10 * GIB <= plan.need_bytes <= plan.reachable_bytes < total, plan_json(plan)
