"""The telemetry store: what the proxy saw over time, in one SQLite file.

Per-tenant VRAM (downsampled to one row per tenant per window with min/max/last), decisions,
releases with measured freed bytes and durations, 507s, OOM retries, and model loads inferred from
a tenant's VRAM growth between samples. Read by `GET /api/history`, the health check (`min_vram`)
and the dashboard.

sqlite3 never runs on the event loop: writes go through a queue drained by one writer thread
(batched into transactions); reads run in `asyncio.to_thread` on their own connection (WAL mode
lets them run beside the writer). `close()` drains the queue fully before closing, so rows handed
in just before shutdown are kept. A full queue drops rows (counted) rather than block traffic;
health tells such a loss, or failing writes, as current until a write succeeds, then as past with
when. The one read on the loop: the newest decision id, once at construction, before anything
listens, so decision ids continue across restarts.

Path: `HYPERSWAP_TELEMETRY` (a path; empty or "off" disables), else
`$XDG_STATE_HOME/hyperswap/telemetry.sqlite3` (`~/.local/state/...`); a proxy on the simulated
GPU defaults to `telemetry-sim.sqlite3` beside it; `hyperswap demo` gives each run a file of its own
in its own folder (proxy/demo.py), removed when it stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.proxy_view import ProxyView
from proxy.admin.query import integer, optional_number
from proxy.admin.telemetry_rows import COLUMNS, KINDS, SCHEMA, WITH_DECISION_ID, Kind, decision_rows
from proxy.clock import Clock
from proxy.config.units import MIB
from proxy.decision_base import DecisionEvent
from proxy.errors import HyperSwapError
from proxy.tasks import cancel_and_wait

if TYPE_CHECKING:
    from proxy.gpu.attribution import AttributedSnapshot

log = logging.getLogger("hyperswap.telemetry")

ENV_VAR = "HYPERSWAP_TELEMETRY"
DEFAULT_RETENTION_DAYS = 30.0
DEFAULT_MAX_ROWS = 500_000  # per table; about 10 s samples of 5 tenants for 100 days
DEFAULT_WINDOW_S = 10.0
DEFAULT_QUEUE_MAX = 100_000
RECENT_HORIZON_S = 3600.0  # min_vram looks back at most this far, from memory
LOAD_GROWTH_MIN_BYTES = 256 * MIB  # growth between two samples above this counts as a model load
PRUNE_EVERY_ROWS = 5_000
HISTORY_LIMIT_MAX = 10_000  # rows per kind in one /api/history answer



def default_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the store lives, or None when the operator turned it off."""
    env = os.environ if env is None else env
    raw = env.get(ENV_VAR)
    if raw is not None:
        raw = raw.strip()
        return None if raw in ("", "off") else Path(raw).expanduser()
    state = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", str(Path.home()))) / ".local" / "state")
    return Path(state) / "hyperswap" / "telemetry.sqlite3"


@dataclass(frozen=True, slots=True)
class _Flush:
    done: threading.Event


@dataclass(slots=True)
class Loss:
    """One episode of dropped rows (a full queue, or failing writes), over once a write succeeds."""

    cause: str
    rows: int
    first_at: float  # wall seconds
    last_at: float
    ended_at: float | None = None  # the first successful write after it


def when(at: float) -> str:
    """A wall time as people read it in health: local, with its offset."""
    return datetime.fromtimestamp(at).astimezone().isoformat(timespec="seconds")


_STOP = object()


class TelemetryStore:
    """The SQLite file and its writer thread. `submit` is safe from any thread and never blocks."""

    def __init__(self, path: Path, *, retention_days: float = DEFAULT_RETENTION_DAYS,
                 max_rows: int = DEFAULT_MAX_ROWS, queue_max: int = DEFAULT_QUEUE_MAX,
                 wall: Clock | None = None) -> None:
        self.path = path
        self.retention_days = retention_days
        self.max_rows = max_rows
        self._wall = wall
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_max)
        self._thread: threading.Thread | None = None
        self._closed = False
        self.dropped = 0
        self.written = 0
        self.last_error: str | None = None
        self.loss: Loss | None = None  # the current or the last episode of dropped rows
        self._loss_lock = threading.Lock()  # submit (the loop) and the writer thread both count

    # -- lifecycle ----------------------------------------------------------------------------
    def open(self) -> None:
        """Create the file and tables (blocking: call off the loop) and start the writer."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = self._connect()
        try:
            with conn:
                for kind, schema in SCHEMA.items():
                    conn.execute(f"CREATE TABLE IF NOT EXISTS {kind} ({schema})")
                    conn.execute(f"CREATE INDEX IF NOT EXISTS {kind}_at ON {kind} (at)")
                for kind in WITH_DECISION_ID:  # last_decision_id() at the next start
                    conn.execute(f"CREATE INDEX IF NOT EXISTS {kind}_decision ON {kind} (decision_id)")
            self._prune(conn)
        finally:
            conn.close()
        self._thread = threading.Thread(target=self._run, name="hyperswap-telemetry", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write everything submitted so far, then close (blocking)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self._queue.put(_STOP)  # blocks only if full: shutdown waits for the writer, never drops
        self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    # -- writing ------------------------------------------------------------------------------
    def submit(self, kind: Kind, row: Mapping[str, object]) -> bool:
        """Queue one row; False (and counted) if the store is closed or the queue is full."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            self._queue.put_nowait((kind, tuple(row.get(c) for c in COLUMNS[kind])))
        except queue.Full:
            self._lose(1, "queue full: the writer could not keep up")
            return False
        return True

    def _lose(self, rows: int, cause: str) -> None:
        with self._loss_lock:
            self.dropped += rows
            now = self._now_wall()
            loss = self.loss
            if loss is None or loss.ended_at is not None:
                self.loss = Loss(cause, rows, now, now)
            else:
                loss.rows += rows
                loss.last_at = now
                loss.cause = cause

    def _wrote(self) -> None:
        self.last_error = None
        if self.loss is not None and self.loss.ended_at is None:
            with self._loss_lock:
                if self.loss is not None and self.loss.ended_at is None:
                    self.loss.ended_at = self._now_wall()

    def health(self) -> tuple[bool, str]:
        """(ok, what to show): a loss going on now fails; one that ended is told as past, with when."""
        loss = self.loss
        if self.last_error is not None:
            since = f" since {when(loss.first_at)}" if loss is not None else ""
            rows = f" ({loss.rows} {_rows(loss.rows)} dropped)" if loss is not None else ""
            return False, f"telemetry writes failing{since}: {self.last_error}{rows}"
        if loss is not None and loss.ended_at is None:
            return False, (f"telemetry dropping rows since {when(loss.first_at)}: {loss.cause}, "
                           f"{loss.rows} {_rows(loss.rows)} so far")
        text = f"telemetry writing to {self.path} ({self.written} rows)"
        if loss is not None:
            span = (f"at {when(loss.first_at)}" if when(loss.first_at) == when(loss.last_at)
                    else f"from {when(loss.first_at)} to {when(loss.last_at)}")
            text += (f"; earlier {loss.rows} {_rows(loss.rows)} dropped {span} ({loss.cause}); "
                     f"writes succeed again since {when(loss.ended_at or loss.last_at)}")
        return True, text

    def last_decision_id(self) -> int:
        """The newest decision id stored (0: none, or no file yet). Blocking; read-only."""
        if not self.path.exists():
            return 0
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            ids = [conn.execute(f"SELECT MAX(decision_id) FROM {kind}").fetchone()[0]
                   for kind in WITH_DECISION_ID if kind in tables]
        finally:
            conn.close()
        return max((int(i) for i in ids if i is not None), default=0)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every row submitted before this call is written (blocking)."""
        if not self.alive:
            return False
        marker = _Flush(threading.Event())
        try:
            self._queue.put(marker, timeout=timeout_s)
        except queue.Full:
            return False
        return marker.done.wait(timeout_s)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=10.0)
        conn.execute("PRAGMA journal_mode=WAL")  # readers beside the writer
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _run(self) -> None:
        conn = self._connect()
        since_prune = 0
        try:
            stop = False
            while not stop:
                rows: dict[str, list[tuple[object, ...]]] = {}
                flushes: list[_Flush] = []
                stop = self._sort(self._take_batch(), rows, flushes)
                if stop:  # rows that raced in after STOP (submit checked _closed just before) are kept too
                    self._drain_after_stop(rows, flushes)
                since_prune = self._write(conn, rows, since_prune)
                for f in flushes:
                    f.done.set()
        finally:
            conn.close()

    def _take_batch(self) -> list[object]:
        """The next item (waiting for it), and whatever else is queued already, up to 1000: one
        transaction per burst."""
        batch = [self._queue.get()]
        while len(batch) < 1000:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    @staticmethod
    def _sort(batch: list[object], rows: dict[str, list[tuple[object, ...]]], flushes: list[_Flush]) -> bool:
        """Files a batch's rows by kind and its flush markers; True when it holds the STOP (the rest of
        the batch is still written: nothing after STOP was accepted)."""
        stop = False
        for item in batch:
            if item is _STOP:
                stop = True
            elif isinstance(item, _Flush):
                flushes.append(item)
            else:
                queued_kind, queued_row = cast(tuple[str, tuple[object, ...]], item)  # what submit() queues
                rows.setdefault(queued_kind, []).append(queued_row)
        return stop

    def _drain_after_stop(self, rows: dict[str, list[tuple[object, ...]]], flushes: list[_Flush]) -> None:
        """Takes what is left in the queue without waiting: rows and flush markers that raced in after STOP."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                rows.setdefault(item[0], []).append(item[1])
            elif isinstance(item, _Flush):
                flushes.append(item)

    def _write(self, conn: sqlite3.Connection, rows: dict[str, list[tuple[object, ...]]], since_prune: int) -> int:
        """Writes the rows in one transaction and prunes once enough were written since the last prune;
        returns the rows written since then. A failed write (a full disk) is counted and logged, never
        raised: it must not kill the writer."""
        try:
            with conn:
                for kind, values in rows.items():
                    cols = COLUMNS[kind]  # type: ignore[index]
                    conn.executemany(f"INSERT INTO {kind} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                                     values)
            n = sum(len(v) for v in rows.values())
            self.written += n
            if n:
                self._wrote()  # health tells a loss that ended as past, not as now
            since_prune += n
            if since_prune >= PRUNE_EVERY_ROWS:
                self._prune(conn)
                since_prune = 0
        except sqlite3.Error as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._lose(sum(len(v) for v in rows.values()), f"writes failed: {self.last_error}")
            log.warning("telemetry write failed: %s", self.last_error)
        return since_prune

    def _prune(self, conn: sqlite3.Connection) -> None:
        """Bounded retention: rows older than retention_days, then the oldest beyond max_rows."""
        cutoff = self._now_wall() - self.retention_days * 86400.0
        with conn:
            for kind in KINDS:
                conn.execute(f"DELETE FROM {kind} WHERE at < ?", (cutoff,))
                conn.execute(f"DELETE FROM {kind} WHERE rowid <= (SELECT MAX(rowid) FROM {kind}) - ?", (self.max_rows,))

    def _now_wall(self) -> float:
        return self._wall.wall() if self._wall is not None else time.time()

    # -- reading (blocking: call off the loop) -------------------------------------------------
    def query(self, kind: Kind, since: float = 0.0, limit: int = 1000, tenant: str | None = None) -> list[dict[str, object]]:
        """Rows of one kind at or after `since` (unix seconds), oldest first, at most `limit` (the newest)."""
        cols = COLUMNS[kind]
        sql = f"SELECT {', '.join(cols)} FROM {kind} WHERE at >= ?"
        args: list[str | float] = [since]
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        sql += " ORDER BY at DESC, rowid DESC LIMIT ?"
        args.append(limit)
        conn = sqlite3.connect(self.path, timeout=10.0)
        try:
            rows = conn.execute(sql, args).fetchall()
        finally:
            conn.close()
        out = []
        for values in reversed(rows):
            row = dict(zip(cols, values, strict=True))
            for key in ("outcome", "blockers"):
                if isinstance(row.get(key), str):
                    row[key] = json.loads(row[key])
            for key in ("ok", "confirmed"):
                if row.get(key) is not None:
                    row[key] = bool(row[key])
            out.append(row)
        return out

    def count(self, kind: Kind) -> int:
        conn = sqlite3.connect(self.path, timeout=10.0)
        try:
            return int(conn.execute(f"SELECT COUNT(*) FROM {kind}").fetchone()[0])
        finally:
            conn.close()


@dataclass(slots=True)
class _Window:
    start: float  # wall seconds, aligned to the window
    samples: int
    min_bytes: int
    max_bytes: int
    last_bytes: int


@dataclass(slots=True)
class _Growth:
    started_at: float  # wall
    started_mono: float
    start_bytes: int
    last_mono: float
    last_bytes: int


class VramRecorder:
    """Turns snapshots into downsampled VRAM rows, recent minima and inferred model loads.

    Runs on the loop (pure bookkeeping); only finished rows go to the store. A model load is a run
    of consecutive samples where the tenant's VRAM grew by more than LOAD_GROWTH_MIN_BYTES each;
    its speed is the growth over the time between the first and last samples of the run, so it is
    as coarse as the sampling (a load shorter than one interval reads as one interval)."""

    def __init__(self, store: TelemetryStore | None, clock: Clock, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.store = store
        self.clock = clock
        self.window_s = window_s
        self._windows: dict[str, _Window] = {}
        self._recent: dict[str, deque[tuple[float, int]]] = {}  # tenant -> (mono, bytes)
        self._prev: dict[str, tuple[float, int]] = {}
        self._growth: dict[str, _Growth] = {}
        self._last_taken: float | None = None

    def observe_snapshot(self, snap: AttributedSnapshot, tenants: Sequence[str]) -> None:
        """Record every named tenant's VRAM from a snapshot (once per snapshot)."""
        if self._last_taken is not None and snap.snapshot.taken_at == self._last_taken:
            return
        self._last_taken = snap.snapshot.taken_at
        for name in tenants:
            self.observe(name, snap.held_by(name))

    def observe(self, tenant: str, held: int) -> None:
        mono, wall = self.clock.now(), self.clock.wall()
        recent = self._recent.setdefault(tenant, deque())
        recent.append((mono, held))
        while recent and recent[0][0] < mono - RECENT_HORIZON_S:
            recent.popleft()
        self._track_load(tenant, mono, wall, held)
        start = wall - (wall % self.window_s)
        w = self._windows.get(tenant)
        if w is not None and w.start != start:
            self._emit(tenant, w)
            w = None
        if w is None:
            self._windows[tenant] = _Window(start, 1, held, held, held)
        else:
            w.samples += 1
            w.min_bytes = min(w.min_bytes, held)
            w.max_bytes = max(w.max_bytes, held)
            w.last_bytes = held

    def flush(self) -> None:
        """Write the open windows and loads (at shutdown)."""
        for tenant, w in self._windows.items():
            self._emit(tenant, w)
        self._windows.clear()
        for tenant in list(self._growth):
            self._end_load(tenant)

    def min_vram(self, tenant: str, window_s: float) -> int | None:
        cutoff = self.clock.now() - window_s
        values = [b for t, b in self._recent.get(tenant, ()) if t >= cutoff]
        return min(values) if values else None

    def _track_load(self, tenant: str, mono: float, wall: float, held: int) -> None:
        prev = self._prev.get(tenant)
        self._prev[tenant] = (mono, held)
        if prev is None:
            return
        growing = held - prev[1] > LOAD_GROWTH_MIN_BYTES
        g = self._growth.get(tenant)
        if growing and g is None:
            self._growth[tenant] = _Growth(wall - (mono - prev[0]), prev[0], prev[1], mono, held)
        elif growing and g is not None:
            g.last_mono, g.last_bytes = mono, held
        elif g is not None:
            self._end_load(tenant)

    def _end_load(self, tenant: str) -> None:
        g = self._growth.pop(tenant)
        duration = g.last_mono - g.started_mono
        grown = g.last_bytes - g.start_bytes
        if self.store is not None:
            self.store.submit("model_loads", {
                "at": g.started_at + duration, "tenant": tenant, "started_at": g.started_at, "duration_s": duration,
                "grown_bytes": grown, "gbps": grown / 1e9 / duration if duration > 0 else None})

    def _emit(self, tenant: str, w: _Window) -> None:
        if self.store is not None:
            self.store.submit("vram", {"at": w.start, "tenant": tenant, "window_s": self.window_s, "samples": w.samples,
                                       "min_bytes": w.min_bytes, "max_bytes": w.max_bytes, "last_bytes": w.last_bytes})


class Telemetry:
    """The extension: samples VRAM from the proxy's snapshots, records decisions, serves /api/history.

    Looked up by name (`name == "telemetry"`) by the health check, which uses `healthy()` and
    `min_vram()`."""

    name = "telemetry"

    def __init__(self, proxy: ProxyView, path: Path | Literal["default"] | None = "default", *,
                 sample_interval_s: float = 1.0, window_s: float = DEFAULT_WINDOW_S,
                 retention_days: float = DEFAULT_RETENTION_DAYS, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        self.proxy = proxy
        self.path = default_path() if path == "default" else path
        if path == "default" and self.path is not None and proxy.simulated_gpu and ENV_VAR not in os.environ:
            # The demo's simulated card must not mix into the history of the operator's real one.
            self.path = self.path.with_name("telemetry-sim.sqlite3")
        self.sample_interval_s = sample_interval_s
        self.store: TelemetryStore | None = None
        if self.path is not None:
            self.store = TelemetryStore(self.path, retention_days=retention_days, max_rows=max_rows, wall=proxy.clock)
            self._continue_decision_ids(self.store)
        self.recorder = VramRecorder(self.store, proxy.clock, window_s)
        self.open_error: str | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._task: asyncio.Task[None] | None = None

    def _continue_decision_ids(self, store: TelemetryStore) -> None:
        """Ids restarted at 1 on every start, so the store held one id for several decisions and a
        release joined to the wrong one. Continue after the store's newest instead (ids stay small
        integers, in time order). Read here, at construction, before any listener exists, so no
        decision takes an id first: one blocking read of an index, the only one on the loop."""
        try:
            last = store.last_decision_id()
        except (OSError, sqlite3.Error) as exc:  # start() reports a file it cannot use
            log.warning("telemetry: cannot read the last decision id from %s: %s", store.path, exc)
            return
        self.proxy.decisions.continue_after(last)

    # -- extension ------------------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        return [Route("/api/history", self.history, methods=["GET"])]

    async def start(self) -> None:
        if self.store is not None:
            try:
                await asyncio.to_thread(self.store.open)
            except (OSError, sqlite3.Error) as exc:  # telemetry never stops the proxy; health reports it
                self.open_error = f"cannot open {self.path}: {exc}"
                log.warning("telemetry off: %s", self.open_error)
                self.store = None
                self.recorder.store = None
        self._unsubscribe = self.proxy.decisions.subscribe(self.on_decision)
        self._task = asyncio.get_running_loop().create_task(self._sample_loop(), name="telemetry-sampler")

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        await cancel_and_wait(self._task)
        self._task = None
        self.sample()
        self.recorder.flush()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    # -- for the health check ---------------------------------------------------------------------
    def healthy(self) -> tuple[bool, str]:
        if self.path is None:
            return True, f"telemetry off ({ENV_VAR}=off)"
        if self.open_error is not None:
            return False, self.open_error
        if self.store is None or not self.store.alive:
            return False, "telemetry writer is not running"
        return self.store.health()

    def min_vram(self, tenant: str, window_s: float) -> int | None:
        """The tenant's smallest VRAM over the last window_s seconds of samples (kept in memory, up to an hour)."""
        return self.recorder.min_vram(tenant, window_s)

    # -- observing ----------------------------------------------------------------------------------
    def sample(self) -> None:
        snap = self.proxy.broker.last_snapshot
        if snap is not None:
            self.recorder.observe_snapshot(snap, [t.name for t in self.proxy.registry])

    async def _sample_loop(self) -> None:
        # Reads the snapshot the request path and the watchdog already took: no GPU reads of its own.
        while True:
            self.sample()
            await self.proxy.clock.sleep(self.sample_interval_s)

    def on_decision(self, event: DecisionEvent) -> None:
        self.sample()  # VRAM around every decision
        if self.store is None:
            return
        for kind, row in decision_rows(event, self.proxy.decisions.view_of(event)):
            self.store.submit(kind, row)

    # -- /api/history ---------------------------------------------------------------------------------
    async def history(self, request: Request) -> Response:
        q = request.query_params
        example = "GET /api/history?since=1796000000&kind=releases&limit=100"
        try:
            since = optional_number(q, "since", low=0, example=f"unix seconds, like {example}") or 0.0
            limit = integer(q, "limit", 1000, low=1, high=HISTORY_LIMIT_MAX, example=example)
        except HyperSwapError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        kinds = [k.strip() for k in q.get("kind", ",".join(KINDS)).split(",") if k.strip()]
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            return JSONResponse({"error": f"unknown history kind(s): {', '.join(unknown)}",
                                 "fix": f"use one or more of: {', '.join(KINDS)}"}, status_code=400)
        if self.store is None:
            return JSONResponse({"error": "telemetry is off", "reason": self.open_error or f"{ENV_VAR}=off",
                                 "fix": f"unset {ENV_VAR} (or point it at a writable file) and restart"}, status_code=503)
        tenant = q.get("tenant")
        store = self.store

        def read() -> dict[str, list[dict[str, object]]]:
            store.flush()  # read what was submitted before this request
            return {k: store.query(k, since, limit, tenant) for k in kinds}  # type: ignore[arg-type]

        rows = await asyncio.to_thread(read)
        return JSONResponse({"since": since, "kinds": kinds, "rows": rows})


def _rows(n: int) -> str:
    return "row" if n == 1 else "rows"


def telemetry_extension(proxy: ProxyView) -> Telemetry:
    """tenants.json `telemetry` wins over $HYPERSWAP_TELEMETRY, which wins over the default path."""
    spec = proxy.registry.config.telemetry
    if spec.path is None:
        path: Path | Literal["default"] | None = "default"
    elif spec.path.strip().lower() in ("", "off"):
        path = None
    else:
        path = Path(spec.path).expanduser()
    return Telemetry(proxy, path, retention_days=spec.retention_days, max_rows=spec.max_rows)
