"""Where a `process` tenant's record and log live: one instance, one state (its own records only).

Two proxies on one machine (a demo beside a `serve`, two demos in network namespaces of their own,
a test's proxies) must never touch each other's apps. Issue 42 found a second proxy with the same
tenant names ending the first's running app at its start ("left behind by an earlier run"), and a
stop deleting a record the other still needed. So:

- Each instance has a folder of its own: `instance_dir(base, admin_listen)`, named by the address its
  admin API listens on (`127.0.0.1-11400`), the one thing no two proxies that can see each other's
  ports share. A proxy restarted with the same address finds its predecessor's records there.
- Inside it, each tenant's files are a *slot* held with an advisory lock (`flock` on `<tenant>.lock`)
  by the one live controller that uses it, taken when the controller is built and let go at its
  `aclose` (or by the kernel when the proxy dies, even by `kill -9`). A controller whose slot is held
  by a live proxy (the same address in another network namespace, two proxies in one test process)
  takes the next one (`<tenant>.2.lock`, ...). So a record in a held slot was written by its holder or
  by a holder that died: it is read, acted on and removed only by that slot's holder, never by
  another instance.
- The record also names its writer (pid and start time of the proxy) for the operator reading it.

Blocking file calls: the controller makes them at construction and stop, as before (a few
microseconds each on a local disk).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from pathlib import Path

from proxy.lifecycle import procs
from proxy.lifecycle.controller import JSON

SLOTS = 9  # live proxies with one admin address on one machine, each with a slot of its own; past it: no record
UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def instance_dir(base: Path, admin_listen: str) -> Path:
    """The folder of the proxy whose admin API listens on `admin_listen` (`127.0.0.1:11400` ->
    `base/127.0.0.1-11400`; `[::1]:11400` -> `base/--1-11400`)."""
    name = UNSAFE.sub("-", admin_listen.replace(":", "-")).strip(".") or "default"
    return base / name


def writer() -> JSON:
    """This proxy, as a record names it."""
    return {"pid": os.getpid(), "start_time": procs.start_time(os.getpid())}


class Slot:
    """One tenant's files in an instance's folder, held by one live controller at a time."""

    def __init__(self, state_dir: Path, name: str) -> None:
        self.state_dir = state_dir
        self.name = name
        self.number = 0  # 0: none held (every slot taken, or the folder cannot be written)
        self._fd: int | None = None
        self._claim()

    def _stem(self, number: int) -> str:
        return self.name if number <= 1 else f"{self.name}.{number}"

    def _claim(self) -> None:
        with contextlib.suppress(OSError):
            self.state_dir.mkdir(parents=True, exist_ok=True)
        for number in range(1, SLOTS + 1):
            try:
                fd = os.open(self.state_dir / f"{self._stem(number)}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                return  # not writable: no record, as without a state directory
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)  # a live proxy holds it: its files are not ours to read or touch
                continue
            self._fd, self.number = fd, number
            return

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def record_path(self) -> Path | None:
        return self.state_dir / f"{self._stem(self.number)}.process.json" if self.held else None

    @property
    def log_path(self) -> Path | None:
        return self.state_dir / f"{self._stem(self.number)}.log" if self.held else None

    def read(self) -> JSON | None:
        path = self.record_path
        if path is None:
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None

    def write(self, record: JSON) -> None:
        path = self.record_path
        if path is None:
            return
        with contextlib.suppress(OSError):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({**record, "writer": writer()}))
            tmp.replace(path)

    def remove(self) -> None:
        path = self.record_path
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()

    def release(self) -> None:
        """Let the slot go (the proxy's shutdown): a later controller may take it and its record."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd, self.number = None, 0
