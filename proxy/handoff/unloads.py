"""Unloads that passed through the proxy and the card does not show done yet. Owned by the scheduler.

An engine answers an unload before the memory is back (engine-wire-facts: both Ollama and ComfyUI
free asynchronously). Until a reading shows the tenant holding less, what it holds is on its way
out: a request of that tenant planned meanwhile must not count it as its own (a chat did, reserved
nothing, a render took the memory as it came back, and the chat's reload ran out of it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.gpu.attribution import AttributedSnapshot
from proxy.handoff.busy import CONFIRM_SLACK_BYTES


@dataclass(frozen=True, slots=True)
class _Unload:
    at: float  # when it was admitted
    held: int  # what the tenant held then, on the latest reading


class Unloads:
    def __init__(self) -> None:
        self._by_tenant: dict[str, _Unload] = {}

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._by_tenant

    def begun(self, tenant: str, at: float, held: int) -> None:
        self._by_tenant[tenant] = _Unload(at, held)

    def seen(self, snap: AttributedSnapshot, read_at: float, now: float, timeout_of: Callable[[str], float],
             floor_of: Callable[[str], int]) -> bool:
        """Forget the unloads `snap` (read at `read_at`) shows done, and those past their tenant's
        release timeout (then planned as the card says). True when any was forgotten.

        Done: a reading taken after the unload began shows the tenant holding less than it did then,
        or only its idle floor (`floor_of`). The latter is what a reading shows when the one the unload
        began from never showed the model (its load reached the card after that reading): less than
        that is nothing, and the next request waited the whole release timeout (bench/handoff.py)."""
        def gone(t: str, u: _Unload) -> bool:
            held = snap.held_by(t)
            return held + CONFIRM_SLACK_BYTES < u.held or held <= floor_of(t) + CONFIRM_SLACK_BYTES
        done = [t for t, u in self._by_tenant.items()
                if (read_at >= u.at and gone(t, u)) or now - u.at >= timeout_of(t)]
        for tenant in done:
            del self._by_tenant[tenant]
        return bool(done)
