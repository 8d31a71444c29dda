"""`GET /api/gpu`: the GPU's own settings (power limit, clocks, offsets, fans, persistence mode,
temperature, why the clocks are held down), one view per device, and `gpu_profile` against them.

The extension runs the `GpuSettingsKeeper` on its own timer (`gpu_profile.check_interval_s`, else
every 10 s) and feeds the health report (`gpu_health()`, found by the health extension). It writes
to the card only with `gpu_profile.apply: true`: without it the keeper gets no writer at all.

ProxyView attributes used: reader, registry, clock, decisions.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from proxy.admin.health_entry import HealthEntry
from proxy.admin.proxy_view import ProxyView
from proxy.config.settings import GpuProfile
from proxy.gpu.keeper import DeviceView, GpuSettingsKeeper
from proxy.gpu.nvml import NvmlReader
from proxy.gpu.profile import FieldCheck
from proxy.gpu.settings import NvmlSettingsReader, SettingsSource
from proxy.gpu.settings_writer import NvmlSettingsWriter, SettingsWriter
from proxy.tasks import cancel_and_wait

log = logging.getLogger("hyperswap.gpu")

READ_ONLY_INTERVAL_S = 10.0
NAMES = {"power_limit_w": "power limit", "locked_clocks_mhz": "locked clocks", "gpc_clock_offset_mhz":
         "graphics clock offset", "mem_clock_offset_mhz": "memory clock offset", "fan_policy": "fan policy",
         "fan_speed_percent": "fan speed"}


def backend_for(reader: object) -> tuple[SettingsSource | None, SettingsWriter | None, str]:
    """Where the settings come from: the simulated card's own, NVML beside the NVML memory reader,
    else nowhere (with the reason)."""
    card = getattr(reader, "card_settings", None)
    if card is not None:
        return card, card, ""
    if isinstance(reader, NvmlReader):
        # the same pynvml module as the memory reader (one a test injected, else imported on first use)
        return NvmlSettingsReader(nvml=reader._nvml), NvmlSettingsWriter(), ""
    return None, None, "the GPU reader in use cannot read the card's settings (no NVML)"


def _since(at: float, now: float) -> str:
    clock = time.strftime("%H:%M:%S UTC", time.gmtime(at))
    minutes = (now - at) / 60
    return f"since {clock}, {minutes:.0f} min ago" if minutes >= 1 else f"since {clock}"


class GpuSettingsExtension:
    name = "gpu"  # health reads gpu_health() from it: `ProxyView.extension("gpu")`

    def __init__(self, proxy: ProxyView, *, source: SettingsSource | None = None, writer: SettingsWriter | None = None) -> None:
        self.proxy = proxy
        profile = proxy.registry.config.gpu_profile
        found_source, found_writer, why = backend_for(proxy.reader)
        source = source or found_source
        writer = writer or found_writer
        # Nothing is written without gpu_profile.apply: without it the keeper has no writer.
        self.keeper = GpuSettingsKeeper(source, writer if profile is not None and profile.apply else None, profile,
                                        proxy.clock, proxy.decisions, no_source_reason=why)
        self._task: asyncio.Task[None] | None = None

    # -- extension interface ---------------------------------------------------------------------
    def routes(self) -> list[BaseRoute]:
        return [Route("/api/gpu", self.gpu_route, methods=["GET"])]

    async def start(self) -> None:
        if self.keeper.source is not None:
            self._task = asyncio.create_task(self._loop(), name="hyperswap:gpu-settings")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.keeper.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # the next check tries again; /api/gpu keeps the last view
                log.exception("GPU settings check failed")
            await self.proxy.clock.sleep(self.keeper.interval_s if self.keeper.profile else READ_ONLY_INTERVAL_S)

    async def _fresh(self) -> None:
        if self.keeper.checked_at is None and self.keeper.source is not None:
            await self.keeper.check()

    async def gpu_route(self, request: Request) -> Response:
        await self._fresh()
        # what CUDA suspension (release kind cuda_suspend) parked in host RAM, beside the card's settings
        return JSONResponse({**self.keeper.report().model_dump(mode="json"),
                             "host_ram": self.proxy.broker.lifecycles.suspensions.view().model_dump(mode="json")})

    # -- health ----------------------------------------------------------------------------------
    async def gpu_health(self) -> list[HealthEntry]:
        """The profile against the card: one entry per setting that is off, else one summary entry."""
        await self._fresh()
        k, profile = self.keeper, self.keeper.profile
        compared = _compared(k, profile)
        if isinstance(compared, list):
            return compared
        profile, view = compared
        now = k.clock.wall()
        entries = [e for c in view.checks if (e := _setting_entry(k, profile, view, c, now)) is not None]
        apply_error = k.apply_error
        if apply_error is not None:
            entries.append(HealthEntry("gpu profile apply", "failed" if apply_error.kind == "no_permission" else "degraded",
                                       apply_error.message + (f" (attempt {k.apply_failures}; next in "
                                                      f"{max(0.0, k.next_apply_at - k.clock.now()):.0f} s)"),
                                       "the card keeps the settings above instead of the profile's", apply_error.fix))
        if not entries:
            shown = "; ".join(f"{NAMES[c.setting]} {c.note}" for c in view.checks if c.status == "ok")
            verb = "applied and matching" if profile.apply else "matching (compare only, apply is off)"
            entries.append(HealthEntry("gpu profile", "ok", f"GPU {view.index} {verb}: {shown or 'written'}"))
        return entries


def _compared(k: GpuSettingsKeeper, profile: GpuProfile | None) -> list[HealthEntry] | tuple[GpuProfile, DeviceView]:
    """The profile and the card it is compared with, setting by setting; else the entries that say why
    it cannot be (no profile, no reader, no such card, its settings unread)."""
    if profile is None:
        if k.source is None or k.list_error is not None:
            return []  # nothing to compare, and nothing read: the nvml entry says why
        return [HealthEntry("gpu profile", "ok", "no gpu_profile in tenants.json: the card's settings are read "
                            "(GET /api/gpu), never written")]
    if k.source is None or k.list_error is not None:
        err = k.list_error
        why = k.no_source_reason if k.source is None or err is None else f"{err.state}: {err.message}"
        return [HealthEntry("gpu profile", "unknown", f"gpu_profile cannot be compared: {why}",
                            "nobody can tell whether the card runs with the profile's settings",
                            k.list_error.fix if k.list_error else "run the proxy with the NVML GPU reader")]
    view = k.devices.get(profile.device)
    if view is None:
        have = ", ".join(str(i) for i in sorted(k.devices)) or "none"
        return [HealthEntry("gpu profile", "failed", f"gpu_profile.device {profile.device}: no such GPU (NVML sees: {have})",
                            "the profile is neither compared nor applied", "set gpu_profile.device to one of: " + have)]
    if view.error is not None or view.settings is None:
        err = view.error
        return [HealthEntry("gpu profile", "unknown", f"GPU {view.index} settings cannot be read: "
                            + (f"{err.state}: {err.message}" if err else "not read yet"),
                            "nobody can tell whether the card runs with the profile's settings",
                            err.fix if err else "wait for the first check")]
    return profile, view


def _setting_entry(k: GpuSettingsKeeper, profile: GpuProfile, view: DeviceView, c: FieldCheck,
                   now: float) -> HealthEntry | None:
    """One setting of the profile that is off (drifted, unsupported, unreadable); None: it is as the
    profile says, or was written and cannot be read back."""
    name = f"gpu profile {c.setting}"
    if c.status == "drift":
        since = view.drift_since.get(c.setting)
        return HealthEntry(name, "degraded", f"GPU {view.index}: {c.note}" + (f" ({_since(since, now)})" if since else ""),
                           c.cost, _drift_fix(k, profile, c))
    if c.status == "unsupported":
        return HealthEntry(name, "degraded", f"GPU {view.index}: gpu_profile.{c.setting} cannot be used: {c.note}",
                           f"the {NAMES[c.setting]} is never applied", f"remove {c.setting} from gpu_profile in tenants.json")
    if c.status != "unreadable":
        return None
    written = k.last_apply is not None and k.last_apply.ok and any(ch.startswith(c.setting) for ch in k.last_apply.changes)
    if written:
        return None  # written without error and re-written after each suspected reset
    if "permission" in c.note:
        fix = "run the proxy as root: NVML shows this setting only to root"
    elif not profile.apply:
        fix = "set gpu_profile.apply to true: the proxy then sets it at start and after each reset of the card"
    else:
        fix = "wait for the next check; see the gpu profile apply entry"
    return HealthEntry(name, "unknown", f"GPU {view.index}: {c.note}",
                       f"whether the card runs with the profile's {NAMES[c.setting]} is unknown", fix)


def _drift_fix(k: GpuSettingsKeeper, profile: GpuProfile, c: FieldCheck) -> str:
    if not profile.apply:
        return "set gpu_profile.apply to true in tenants.json (the proxy then writes it; needs root)" + \
               (f", or by hand: {c.by_hand}" if c.by_hand else "")
    if k.apply_error is not None:
        return k.apply_error.fix
    return f"none needed: the proxy writes it at the next check (every {profile.check_interval_s:g} s)"


def gpu_extension(proxy: ProxyView) -> GpuSettingsExtension:
    return GpuSettingsExtension(proxy)
