"""Keeps an eye on the GPU's own settings: reads every card, compares the profile's card with
`gpu_profile`, remembers since when each setting drifts, logs drift as a decision, and, only with
`gpu_profile.apply: true`, writes the profile back through the one `SettingsWriter`.

Writes happen when a setting drifts, and for settings NVML cannot read back (locked clocks) at the
first check and whenever the card looks reset (`profile.reset_reason`). A failed write (no root, a
value the driver refuses, the card gone) backs off: 30 s, then doubling up to 30 min.

Reads and writes are blocking NVML calls: they run in a worker thread; the decision log is only
touched on the event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, TypeAdapter

from proxy.clock import Clock
from proxy.config.settings import GpuProfile
from proxy.decision_base import DecisionSink, FollowUp, Opening
from proxy.encoding import JSONModel, JSONObject
from proxy.gpu.profile import FieldCheck, FieldStatus, compare, plan_changes, reset_reason
from proxy.gpu.settings import GpuSettings, SettingsSource
from proxy.gpu.settings_writer import (
    SettingChange,
    SettingName,
    SettingsWriteError,
    SettingsWriter,
    WriteErrorKind,
)
from proxy.gpu.snapshot import GpuError, GpuReadError

BACKOFF_S = 30.0
BACKOFF_MAX_S = 1800.0
TRIGGER = "gpu settings check"
_CHECKS = TypeAdapter(tuple[FieldCheck, ...])  # a FieldCheck's JSON is its fields




class WriteFailure(JSONModel):
    """A write the driver refused (a `SettingsWriteError`), as /api/gpu and the decision log show it."""

    kind: WriteErrorKind
    error: str
    fix: str

    @classmethod
    def of(cls, exc: SettingsWriteError) -> WriteFailure:
        return cls(kind=exc.kind, error=exc.message, fix=exc.fix)


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuDrift(Opening):
    """Which of a card's settings started or stopped drifting from `gpu_profile`."""

    name = "gpu_drift"
    kind: Literal["gpu_drift"] = "gpu_drift"
    device: int
    drifting: tuple[FieldCheck, ...]  # every setting that drifts now
    started: tuple[str, ...]
    resolved: tuple[str, ...]

    def facts(self) -> JSONObject:
        return {"device": self.device, "drifting": _CHECKS.dump_python(self.drifting, mode="json"),
                "started": list(self.started), "resolved": list(self.resolved)}


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuApplyStarted(Opening):
    """The profile is about to be written to a card (logged before the first write)."""

    name = "gpu_apply_started"
    kind: Literal["gpu_apply"] = "gpu_apply"
    device: int
    changes: tuple[str, ...]

    def facts(self) -> JSONObject:
        return {"device": self.device, "changes": list(self.changes)}


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuApplyFinished(FollowUp):
    """How the writes went, read back from the card."""

    name = "gpu_apply_finished"
    ok: bool
    errors: tuple[WriteFailure, ...]
    still_drifting: tuple[str, ...]
    next_attempt_in_s: float | None  # after a failure: the back-off

    def facts(self) -> JSONObject:
        return {"ok": self.ok, "errors": [e.model_dump(mode="json") for e in self.errors],
                "still_drifting": list(self.still_drifting), "next_attempt_in_s": self.next_attempt_in_s}


@dataclass(slots=True)
class ApplyAttempt:
    """The last write of the profile; its JSON (in /api/gpu) is its fields."""

    at: float  # unix seconds
    reason: str
    changes: list[str]
    ok: bool
    errors: list[WriteFailure]
    still_drifting: list[str]


class ProfileCheck(JSONModel):
    """One setting of the profile's card against `gpu_profile` (a `FieldCheck`), and since when it drifts."""

    setting: SettingName
    status: FieldStatus
    desired: object
    actual: object
    note: str
    cost: str | None
    by_hand: str | None
    since: float | None = Field(description="unix seconds the drift began; null: it does not drift")

    @classmethod
    def of(cls, c: FieldCheck, since: float | None) -> ProfileCheck:
        return cls(setting=c.setting, status=c.status, desired=c.desired, actual=c.actual, note=c.note, cost=c.cost,
                   by_hand=c.by_hand, since=since)


class DeviceReport(JSONModel):
    """One card in /api/gpu: its settings as read, or why they could not be."""

    index: int
    settings: GpuSettings | None
    error: GpuError | None
    profile: list[ProfileCheck] | None = Field(default=None, exclude_if=lambda v: v is None,
                                               description="only the profile's card: each setting checked")


@dataclass(slots=True)
class DeviceView:
    """What the keeper knows about one card."""

    index: int
    settings: GpuSettings | None = None
    error: GpuReadError | None = None
    checks: tuple[FieldCheck, ...] = ()
    drift_since: dict[str, float] = field(default_factory=dict)  # setting -> unix seconds
    read_failed_since_ok: bool = False

    def lost(self, error: GpuReadError) -> None:
        """The card could not be read: what was read before is no longer a claim anyone can make."""
        self.error = error
        self.settings = None
        self.checks = ()
        self.read_failed_since_ok = True

    def report(self, profiled: bool) -> DeviceReport:
        return DeviceReport(index=self.index, settings=self.settings,
                            error=None if self.error is None else GpuError.of(self.error),
                            profile=[ProfileCheck.of(c, self.drift_since.get(c.setting)) for c in self.checks]
                            if profiled else None)


class ApplyReport(JSONModel):
    enabled: bool
    last: ApplyAttempt | None
    error: WriteFailure | None
    failures: int
    next_attempt_in_s: float | None = Field(description="after a failure: the back-off left")


class GpuReport(JSONModel):
    """GET /api/gpu (before `host_ram`): every card's settings, the profile and how applying it goes."""

    checked_at: float | None
    source_error: str | None
    list_error: GpuError | None
    devices: list[DeviceReport]
    profile: GpuProfile | None
    apply: ApplyReport | None


class GpuSettingsKeeper:
    def __init__(self, source: SettingsSource | None, writer: SettingsWriter | None, profile: GpuProfile | None,
                 clock: Clock, decisions: DecisionSink, *, no_source_reason: str = "",
                 backoff_s: float = BACKOFF_S, backoff_max_s: float = BACKOFF_MAX_S) -> None:
        self.source = source
        self.writer = writer
        self.profile = profile
        self.clock = clock
        self.decisions = decisions
        self.no_source_reason = no_source_reason
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.devices: dict[int, DeviceView] = {}
        self.list_error: GpuReadError | None = None
        self.checked_at: float | None = None
        self.last_apply: ApplyAttempt | None = None
        self.apply_error: SettingsWriteError | None = None
        self.apply_failures = 0
        self.next_apply_at = 0.0  # monotonic
        self._profiled_before: GpuSettings | None = None
        self._profiled_checks: tuple[FieldCheck, ...] = ()
        self._rewrite_pending: str | None = None  # a reset seen and not yet answered by a successful apply
        self._lock = asyncio.Lock()

    @property
    def interval_s(self) -> float:
        return self.profile.check_interval_s if self.profile else 30.0

    # -- one check -----------------------------------------------------------------------------
    async def check(self) -> None:
        """Read every card; compare, log and (opt-in) apply for the profile's card. Never raises for
        a card that cannot be read: the failure is kept for /api/gpu and health."""
        async with self._lock:
            await self._check()

    async def _check(self) -> None:
        if self.source is None:
            return
        source = self.source
        try:
            indices = await asyncio.to_thread(source.device_indices)
            self.list_error = None
        except GpuReadError as exc:
            self.list_error = exc
            for view in self.devices.values():
                view.lost(exc)
            return
        for index in indices:
            view = self.devices.setdefault(index, DeviceView(index))
            try:
                settings = await asyncio.to_thread(source.read_settings, index)
            except GpuReadError as exc:
                view.lost(exc)
                continue
            view.error = None
            view.settings = settings
            if self.profile is not None and index == self.profile.device:
                await self._keep(view, self.profile, settings)
            view.read_failed_since_ok = False
        self.checked_at = self.clock.wall()

    async def _keep(self, view: DeviceView, profile: GpuProfile, settings: GpuSettings) -> None:
        checks = compare(profile, settings)
        reset = reset_reason(self._profiled_before, self._profiled_checks, settings, checks,
                             read_failed_between=view.read_failed_since_ok)
        self._track_drift(view, checks)
        if reset is not None:
            self._rewrite_pending = reset
        if profile.apply and self.writer is not None:
            checks = await self._apply(view, profile, settings, checks, self._rewrite_pending)
            self._track_drift(view, checks)
        self._profiled_before = view.settings
        self._profiled_checks = view.checks

    def _track_drift(self, view: DeviceView, checks: tuple[FieldCheck, ...]) -> None:
        now = self.clock.wall()
        before: set[str] = set(view.drift_since)
        drifting: set[str] = {c.setting for c in checks if c.status == "drift"}
        for setting in drifting - before:
            view.drift_since[setting] = now
        for setting in before - drifting:
            del view.drift_since[setting]
        view.checks = checks
        if drifting != before:
            self.decisions.emit(GpuDrift(
                tenant="", trigger=TRIGGER, device=view.index, drifting=tuple(c for c in checks if c.status == "drift"),
                started=tuple(sorted(drifting - before)), resolved=tuple(sorted(before - drifting))))

    async def _apply(self, view: DeviceView, profile: GpuProfile, settings: GpuSettings,
                     checks: tuple[FieldCheck, ...], reset: str | None) -> tuple[FieldCheck, ...]:
        changes = plan_changes(profile, settings, checks, rewrite_unreadable=reset is not None)
        if not changes or self.clock.now() < self.next_apply_at:
            return checks
        drifting = [c.setting for c in checks if c.status == "drift"]
        reason = reset if reset is not None else f"drift: {', '.join(drifting)}"
        started = self.decisions.emit(GpuApplyStarted(tenant="", trigger=f"gpu_profile.apply ({reason})", device=view.index,
                                                      changes=tuple(c.describe() for c in changes)))
        errors = await self._write_all(view.index, changes)
        after = await self._reread(view, profile, checks)
        still: list[str] = [c.setting for c in after if c.status == "drift"]
        ok = not errors and not still
        if ok:
            self._rewrite_pending = None
        self._settle(ok, errors, still, changes, view.index)
        self.last_apply = ApplyAttempt(self.clock.wall(), reason, [c.describe() for c in changes], ok,
                                       [WriteFailure.of(e) for e in errors], still)
        self.decisions.emit(GpuApplyFinished(
            tenant="", trigger=started.trigger, refers_to=started.id, ok=ok, errors=tuple(self.last_apply.errors),
            still_drifting=tuple(still), next_attempt_in_s=None if ok else round(self.next_apply_at - self.clock.now(), 1)))
        return after

    async def _write_all(self, index: int, changes: list[SettingChange]) -> list[SettingsWriteError]:
        """Writes every change in turn; a refused write is collected, the rest still tried."""
        errors: list[SettingsWriteError] = []
        writer = self.writer
        assert writer is not None
        for change in changes:
            try:
                await asyncio.to_thread(writer.write, index, change)
            except SettingsWriteError as exc:
                errors.append(exc)
        return errors

    async def _reread(self, view: DeviceView, profile: GpuProfile,
                      checks: tuple[FieldCheck, ...]) -> tuple[FieldCheck, ...]:
        """The card's settings read back after writing, compared to the profile; the checks before the
        write when the read fails (its error kept on the view)."""
        try:
            reread = await asyncio.to_thread(self.source.read_settings, view.index)  # type: ignore[union-attr]
        except GpuReadError as exc:
            view.error = exc
            return checks
        view.settings = reread
        return compare(profile, reread)

    def _settle(self, ok: bool, errors: list[SettingsWriteError], still: list[str], changes: list[SettingChange],
                index: int) -> None:
        if ok:
            self.apply_failures = 0
            self.apply_error = None
            self.next_apply_at = 0.0
            return
        self.apply_failures += 1
        delay = min(self.backoff_s * 2 ** (self.apply_failures - 1), self.backoff_max_s)
        self.next_apply_at = self.clock.now() + delay
        if errors:
            self.apply_error = errors[0]
        else:
            self.apply_error = SettingsWriteError(
                "failed", f"GPU {index} still shows {', '.join(still)} off the profile after writing it "
                "(the driver clamped or ignored the value)", "check the card's ranges in GET /api/gpu and the profile")

    # -- the view --------------------------------------------------------------------------------
    def report(self) -> GpuReport:
        p = self.profile
        return GpuReport(
            checked_at=self.checked_at,
            source_error=(self.no_source_reason or "no settings reader") if self.source is None else None,
            list_error=None if self.list_error is None else GpuError.of(self.list_error),
            devices=[v.report(p is not None and v.index == p.device) for _, v in sorted(self.devices.items())],
            profile=p,
            apply=None if p is None else ApplyReport(
                enabled=p.apply, last=self.last_apply,
                error=None if self.apply_error is None else WriteFailure.of(self.apply_error),
                failures=self.apply_failures,
                next_attempt_in_s=(round(max(0.0, self.next_apply_at - self.clock.now()), 1)
                                   if self.apply_failures else None)),
        )
