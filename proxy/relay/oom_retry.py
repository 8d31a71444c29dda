"""An OOM retry the client sees as its own job's: the job that ran out of memory runs again under
its own id (ComfyUI takes a client-chosen `prompt_id` since 2025-07), for the same client, so the
engine's history, queue and websocket frames name the id the client holds; what the proxy relays
is then the engine's own view, less the failed run while its retry is decided or runs:

- the failed run's `execution_error` frame, and its end marker, are held back on each websocket
  of the client until the proxy knows whether the job runs again; dropped if it does, relayed as
  they came if it does not (no room even after every release, the engine refused it);
- the failed run's history record is left out of `GET /history` and `/history/{id}` (so the id
  reads `{}`, as for any job not finished) until the new run's record replaces it. The engine's
  record of a run carries a mark (ComfyUI: its queue number) that tells the two runs apart;
- while its retry is decided (it may wait in the proxy's queue for memory) `GET /queue` lists the
  job pending, as the engine lists it once it is queued again;
- the jobs API (`GET /api/jobs`, 0.8.0: the queue and the history as one list, a job looked up in
  the history first) leaves the failed run out of its list, and reads the job as pending.

`RetryBook` holds each retried job's phase; `SocketFrames` is one websocket's filter. Both are
plain state, changed by the GPU gate (proxy/relay/gpu_gate.py) and the listener.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from proxy.engines.ports import JobFrame, JobReplay

Phase = Literal["deciding", "requeued", "given_up", "ended"]
KEEP = 4096  # retried jobs remembered, oldest forgotten first


@dataclass(slots=True)
class _Retry:
    phase: Phase = "deciding"
    mark: str | None = None  # the new run's mark in the engine's records
    replay: JobReplay | None = None  # the failed run, as it runs again (listed pending while it is decided)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the relay does with one frame: `send` it to the client now, and whether it is the end of
    the job as the proxy counts its work (`ends_job`)."""
    send: bool = True
    ends_job: bool = True


PASS = Verdict()


class RetryBook:
    """The jobs retried after an out-of-memory failure, keyed by (tenant, job id)."""

    def __init__(self) -> None:
        self._retries: OrderedDict[tuple[str, str], _Retry] = OrderedDict()
        self._sockets: set[SocketFrames] = set()

    def phase(self, tenant: str, job_id: str) -> Phase | None:
        retry = self._retries.get((tenant, job_id))
        return retry.phase if retry is not None else None

    def begin(self, tenant: str, job_id: str) -> bool:
        """The first run's OOM: True when it is new (a retry is to be decided), False when known."""
        key = (tenant, job_id)
        if key in self._retries:
            return False
        self._retries[key] = _Retry()
        while len(self._retries) > KEEP:
            self._retries.popitem(last=False)
        return True

    def replaying(self, tenant: str, job_id: str, replay: JobReplay) -> None:
        """The failed run read back: while its retry is decided, the client's queue lists it pending."""
        retry = self._retries.get((tenant, job_id))
        if retry is not None:
            retry.replay = replay

    def waiting(self, tenant: str) -> list[JobReplay]:
        """The jobs whose retry is being decided (in the proxy's queue, say, waiting for memory)."""
        return [r.replay for (t, _), r in self._retries.items()
                if t == tenant and r.phase == "deciding" and r.replay is not None]

    def retried(self, tenant: str) -> list[JobReplay]:
        """The jobs whose failed run the client must not see, as that run listed them."""
        return [r.replay for (t, _), r in self._retries.items()
                if t == tenant and r.phase in ("deciding", "requeued") and r.replay is not None]

    def requeued(self, tenant: str, job_id: str, mark: str | None) -> None:
        """The job runs again under its own id: the failed run's frames held back are dropped."""
        retry = self._retries.setdefault((tenant, job_id), _Retry())
        retry.phase, retry.mark = "requeued", mark
        self._settle(tenant, job_id, relay=False)

    def given_up(self, tenant: str, job_id: str) -> None:
        """No retry: the client gets the failed run as it came."""
        self._retries.setdefault((tenant, job_id), _Retry()).phase = "given_up"
        self._settle(tenant, job_id, relay=True)

    def end(self, tenant: str, job_id: str) -> bool:
        """The new run ended; True only the first time (several sockets and the poll see it)."""
        retry = self._retries.get((tenant, job_id))
        if retry is None or retry.phase != "requeued":
            return False
        retry.phase = "ended"
        return True

    def hidden(self, tenant: str, job_id: str, mark: str | None) -> bool:
        """Whether the client must not see this record of the job: the failed run's, while its retry
        is decided or until the new run's record replaces it."""
        retry = self._retries.get((tenant, job_id))
        if retry is None or retry.phase == "given_up":
            return False
        if retry.phase == "deciding":
            return True
        return retry.mark is not None and mark != retry.mark

    def pending(self, tenant: str) -> bool:
        """Any retry of the tenant's whose failed run the client must not see (cheap: most answers need no look)."""
        return any(t == tenant and r.phase in ("deciding", "requeued") for (t, _), r in self._retries.items())

    def watch(self, tenant: str, parse: Callable[[str], JobFrame | None], report: Callable[[JobFrame, int], None],
              later: Callable[[str], None]) -> SocketFrames:
        sock = SocketFrames(self, tenant, parse, report, later)
        self._sockets.add(sock)
        return sock

    def unwatch(self, sock: SocketFrames) -> None:
        self._sockets.discard(sock)

    def _settle(self, tenant: str, job_id: str, *, relay: bool) -> None:
        for sock in list(self._sockets):
            if sock.tenant == tenant:
                sock.settled(job_id, relay=relay)


class SocketFrames:
    """One client websocket's view of retried jobs: which run of each job a frame belongs to (runs
    begin with a start frame), the failed run's error and end marker held back while its retry is
    decided. `report(frame, run)` tells the gate of each job frame (run 1 is the first; a socket that
    saw no start of the job counts the latest run); `later(text)` relays a frame held back."""

    def __init__(self, book: RetryBook, tenant: str, parse: Callable[[str], JobFrame | None],
                 report: Callable[[JobFrame, int], None], later: Callable[[str], None]) -> None:
        self.book = book
        self.tenant = tenant
        self._parse = parse
        self._report = report
        self._later = later
        self._starts: OrderedDict[str, int] = OrderedDict()  # job -> runs begun on this socket
        self._held: dict[str, list[str]] = {}  # job -> the failed run's frames, while its retry is decided
        self._awaiting: set[str] = set()  # jobs whose failed run's end marker is still to come

    def upstream(self, text: str) -> Verdict:
        frame = self._parse(text)
        if frame is None:
            return PASS
        job = frame.job_id
        if frame.kind == "start":
            self._starts[job] = self._starts.pop(job, 0) + 1
            while len(self._starts) > KEEP:
                self._starts.popitem(last=False)
            return PASS
        if frame.kind == "end":
            return self._end(job, text)
        phase = self.book.phase(self.tenant, job)
        run = self._starts.get(job) or (2 if phase in ("requeued", "ended") else 1)
        self._report(frame, run)
        if frame.kind != "oom" or run > 1:
            return PASS
        phase = self.book.phase(self.tenant, job)
        if phase is None or phase == "given_up":
            return PASS
        self._awaiting.add(job)
        if phase == "deciding":
            self._held[job] = [text]
        return Verdict(send=False, ends_job=False)

    def _end(self, job: str, text: str) -> Verdict:
        if job not in self._awaiting:
            return PASS
        self._awaiting.discard(job)
        phase = self.book.phase(self.tenant, job)
        if phase == "deciding":
            self._held.setdefault(job, []).append(text)
            return Verdict(send=False, ends_job=True)  # the failed run ended; a retry is tracked anew
        if phase == "given_up" or phase is None:
            return PASS
        return Verdict(send=False, ends_job=False)  # the job runs again under this id: not its end

    def settled(self, job: str, *, relay: bool) -> None:
        held = self._held.pop(job, [])
        if relay:
            for text in held:
                self._later(text)
