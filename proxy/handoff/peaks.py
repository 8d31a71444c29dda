"""The most memory each load was seen to take while its work ran: a request's peak, learned.

A request's need is estimated before it runs (a checkpoint's configured size, the tenant's
needs_vram_gb, Ollama's model file or footprint), and an estimate can fall short of what the work
really takes: a ComfyUI render samples beside its checkpoint (1.5 GiB for SDXL at 1024x1024), flux
takes 13.8 GiB where needs_vram_gb says 10. Whenever the card is read while a tenant's admitted work
is all of one load, what the tenant holds is a lower bound of that load's peak; the next request for
the same load is planned on the larger of its estimate and that. Owned by the scheduler (one owner).
"""

from __future__ import annotations


class Peaks:
    def __init__(self) -> None:
        self._by_key: dict[str, int] = {}

    def seen(self, key: str, held_bytes: int) -> None:
        """The card showed the tenant of `key` holding this much while only that load's work ran."""
        if held_bytes > self._by_key.get(key, 0):
            self._by_key[key] = held_bytes

    def of(self, key: str) -> int | None:
        return self._by_key.get(key)

    def forget(self, key: str) -> None:
        """The load changed (another model under the same name): what it took is unknown again."""
        self._by_key.pop(key, None)

    def known(self) -> dict[str, int]:
        return dict(self._by_key)
