"""Where one request's time went before the engine answered (invariant 13): the phases of its wait
(queue, release, start, load) for its `Server-Timing` header, and the short progress lines a
streamed request that waits is told while it happens (proxy/relay/progress.py).

The listener opens one `Trace` per HTTP request (`traced`); the GPU gate, deeper in the same task,
finds it with `current()` and records what happened. A request nobody traces (a unit test calling
the gate directly) records nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field

from proxy.handoff.policy import held_swap
from proxy.relay.load_line import Reading

# The order the phases happen in, and the order the header lists them in.
PHASES = ("hold", "queue", "release", "start", "load")

Listener = Callable[[str], None]


@dataclass(slots=True)
class Phase:
    seconds: float
    desc: str


@dataclass(slots=True)
class Trace:
    """One request's phases, and whoever listens to its progress lines (a streamed request that waits)."""

    phases: dict[str, Phase] = field(default_factory=dict)
    listener: Listener | None = None
    waits: bool = False  # it waits for something that takes a while (an app's start): a progress answer commits
    # while the engine loads the request's model: how far it got, read from the card
    loading: Callable[[], Awaitable[Reading | None]] | None = None

    def phase(self, name: str, seconds: float, desc: str) -> None:
        """A phase that happened (a second one of the same name, as a wake then a load can both
        queue, adds its time to the first)."""
        seconds = max(0.0, seconds)
        if name in self.phases:
            kept = self.phases[name]
            self.phases[name] = Phase(kept.seconds + seconds, kept.desc if desc in kept.desc else f"{kept.desc}; {desc}")
        else:
            self.phases[name] = Phase(seconds, desc)

    def say(self, line: str) -> None:
        """A progress line for a client that listens (nothing when none does)."""
        if self.listener is not None:
            self.listener(line)

    def wait(self, line: str) -> None:
        """A progress line that says the request now waits for something slow that is no queue wait
        (an app's start): a streamed request that listens is answered at once, and hears it."""
        self.waits = True
        self.say(line)

    def server_timing(self) -> bytes | None:
        """The `Server-Timing` header's value (RFC: W3C Server Timing), phases in the order they
        happen; None when the request waited for nothing."""
        if not self.phases:
            return None
        order = [n for n in PHASES if n in self.phases] + [n for n in self.phases if n not in PHASES]
        parts = [f'{n};dur={self.phases[n].seconds * 1000:.1f};desc="{_quoted(self.phases[n].desc)}"' for n in order]
        return ", ".join(parts).encode("latin-1", "replace")


def queue_phase(trace: Trace, seconds: float, reason: str, who: str, used_ago: Callable[[str], float | None]) -> None:
    """The queue part of a wait: a `hold` when the scheduler held the swap by choice (its tenants kept
    on the card because they were just used: `kept ollama 1.0 s: used 0.3 s ago`), else a `queue`
    wait for busy work (`waited for comfyui`). `used_ago`: seconds from a tenant's last use to the
    request's arrival (negative: it was used again during the hold; None: unknown)."""
    held = held_swap(reason)
    if held is None:
        trace.phase("queue", seconds, f"waited for {who}" if who else "waited in the queue")
        return
    tenants = held[0]
    ago = [a for a in (used_ago(t.strip()) for t in tenants.split(",")) if a is not None]
    used = ("" if not ago else ": used again during the hold" if min(ago) < 0
            else f": used {min(ago):.1f} s ago")
    trace.phase("hold", seconds, f"kept {tenants} {seconds:.1f} s{used}")


def _quoted(text: str) -> str:
    """A quoted-string's content: no quote, backslash or control characters, latin-1 only."""
    text = text.replace("\\", "/").replace('"', "'")
    return "".join(c if " " <= c <= "~" or "\xa0" <= c <= "\xff" else "?" for c in text)[:200]


_current: ContextVar[Trace | None] = ContextVar("hyperswap_trace", default=None)


def current() -> Trace | None:
    """The trace of the request this task serves, if one is traced."""
    return _current.get()


class traced:  # a context manager read as a function: `with traced(trace):`
    """The request this task serves is traced by `trace` until the block ends. A class, not a
    generator with @contextmanager: it runs once per GPU request, and the generator's machinery
    cost more than the two context-variable calls it wraps."""

    __slots__ = ("_token", "trace")

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def __enter__(self) -> Trace:
        self._token = _current.set(self.trace)
        return self.trace

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)


def stamp(raw_headers: list[tuple[bytes, bytes]], trace: Trace) -> None:
    """Add the trace's `Server-Timing` to an answer's headers (kept beside any the engine sent)."""
    value = trace.server_timing()
    if value is not None:
        raw_headers.append((b"server-timing", value))
