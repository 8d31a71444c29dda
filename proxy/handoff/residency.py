"""Loads known to be on the card, so a request for one goes straight through.

A request for a model its engine already holds needs no plan: reading the card and planning for it
only added latency (with no GPU reader, two engine calls per request). A load is resident after the
proxy admitted it and the engine answered it, or when the engine itself lists it fully on the GPU
(Ollama's `/api/ps`, read by the watchdog), and stops being resident the moment anything may have
taken it off the card: a release of its tenant, an unload passing through, an OOM, the tenant seen
at its idle floor, the engine's own keep-alive deadline, or the engine no longer listing it.

What the proxy cannot see (a client unloading the model directly at the engine) is bounded by
`fresh_s`: a load not confirmed again within it (by another answer, or by the watchdog reading the
engine's list every tick) stops being resident, and the next request is planned for as usual.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.clock import Clock


def slot(key: str) -> str:
    """A load key may name a variant after "?" (`tenant:model?d=<digest>&num_ctx=32768`): an engine holds
    one variant of a slot at a time (Ollama reloads a model whose content or load options differ), so
    the loads of one slot exclude each other."""
    return key.partition("?")[0]


class Residency:
    def __init__(self, clock: Clock, fresh_s: float = 2.0) -> None:
        self.clock = clock
        self.fresh_s = fresh_s
        self._loads: dict[str, dict[str, float]] = {}  # tenant -> load key -> resident until (monotonic)

    def holds(self, tenant: str, key: str) -> bool:
        return self._loads.get(tenant, {}).get(key, 0.0) > self.clock.now()

    def loaded(self, tenant: str, key: str) -> None:
        """The engine answered an admitted request for this load: it is on the card now, and no other
        variant of its slot is (see `slot`)."""
        loads = self._loads.setdefault(tenant, {})
        for other in [k for k in loads if k != key and slot(k) == slot(key)]:
            del loads[other]
        loads[key] = self.clock.now() + self.fresh_s

    def observe(self, tenant: str, loads: Mapping[str, float]) -> None:
        """The engine's own list of what it holds (key -> its own unload deadline): it replaces ours."""
        cap = self.clock.now() + self.fresh_s
        self._loads[tenant] = {key: min(until, cap) for key, until in loads.items()}

    def forget(self, tenant: str, key: str | None = None) -> None:
        """The load `key` may have left the card (a slot without a variant: every variant of it; None:
        every load of the tenant)."""
        if key is None:
            self._loads.pop(tenant, None)
            return
        loads = self._loads.get(tenant, {})
        for k in [k for k in loads if k == key or ("?" not in key and slot(k) == key)]:
            del loads[k]

    def keys(self, tenant: str) -> list[str]:
        return [k for k in self._loads.get(tenant, {}) if self.holds(tenant, k)]
