"""A load's progress as a person reads it (invariant 13, issue 41): "loading gemma3:27b: 8.1 of 16.2
GiB, about 4 s left", a line a second, smooth.

The card is read about once a second, and what it shows moves in steps: an engine allocates its
weights in chunks (the demo's Ollama 4 GiB at a time), and shows nothing for the first second or two
while it reads the file's header. Told as read, a load said "0.0 of 16.2 GiB" for two seconds, then
jumped. So between readings the figure moves on at the load's expected rate: the rate the card
showed when it last moved (what the tenant gained over the time since the load began), counted from the reading
that first showed the card's figure as it stands (a reading that shows the same says nothing new), or,
before the card
showed any growth, `hold.RELOAD_BYTES_PER_S` (2 GB/s: a local NVMe read and the copy to the card).
The figure never goes back (a later reading below the estimate holds it where it is), never passes
the need, and never claims the load done: that is the engine's first byte ("... loaded in 8.8 s").
Every figure is an estimate and the line says so in words ("about"); a load that runs past its
estimate says how long it took so far instead of a time left.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.handoff.hold import RELOAD_BYTES_PER_S

GIB = 1 << 30
SHOWN_AT_MOST = 0.99  # of the need, until the engine answers: the figure never reads "done" before it is
MOVED_SHARE = 0.01  # of the need: a reading that grew less says nothing new (an engine's small allocations)


@dataclass(frozen=True, slots=True)
class Reading:
    """One card reading of a load under way: what its tenant gained since it began, of the need."""

    model: str
    on_card_bytes: int
    need_bytes: int
    began_at: float  # the injected clock's now() when the load began
    read_at: float  # ... and when the card was read

    @property
    def elapsed_s(self) -> float:
        return max(0.0, self.read_at - self.began_at)


class LoadEstimate:
    """The smooth figure of one load between card readings (one per streamed request that hears it)."""

    def __init__(self, default_rate: float = RELOAD_BYTES_PER_S) -> None:
        self.default_rate = default_rate
        self.last: Reading | None = None
        self.moved: Reading | None = None  # the reading that first showed the card's figure as it is now
        self.shown = 0.0  # bytes: the figure told last (it never goes back)

    def observe(self, reading: Reading) -> None:
        if self.moved is None or reading.on_card_bytes - self.moved.on_card_bytes > MOVED_SHARE * reading.need_bytes:
            self.moved = reading  # an unchanged reading says nothing new: the estimate runs on from the change
        self.last = reading
        self.shown = max(self.shown, float(min(reading.on_card_bytes, reading.need_bytes)))

    def rate(self) -> float:
        """Bytes a second: what the card showed when its figure last moved, over the time since the
        load began (a reading on a plateau between an engine's allocations would halve it and make the
        time left jump up), else the default."""
        moved = self.moved
        if moved is None or moved.on_card_bytes <= 0 or moved.elapsed_s <= 0:
            return self.default_rate
        return moved.on_card_bytes / moved.elapsed_s

    def line(self, now: float) -> str | None:
        """The line at `now` (the injected clock's; None: no reading yet)."""
        last, moved = self.last, self.moved
        if last is None or moved is None:
            return None
        elapsed_s = max(0.0, now - last.began_at)
        rate = self.rate()
        need = float(last.need_bytes)
        ahead = moved.on_card_bytes + rate * max(0.0, now - moved.read_at)
        self.shown = min(need * SHOWN_AT_MOST, max(self.shown, ahead))
        left = (need - self.shown) / rate if rate > 0 else None
        figures = f"{self.shown / GIB:.1f} of {need / GIB:.1f} GiB"
        if left is None or self.shown >= need * SHOWN_AT_MOST:
            return f"loading {last.model}: {figures}, taking longer than expected ({elapsed_s:.0f} s so far)"
        return f"loading {last.model}: {figures}, about {max(1, round(left))} s left"
