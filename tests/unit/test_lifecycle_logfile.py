"""Bounded logs (issue 42): the output file rotated past the tenant's size, the last lines found
across a cut, followers that read on after a cut, skip ahead when far behind, and are bounded in
number."""

from __future__ import annotations

import os
from pathlib import Path

from proxy.clock import ManualClock
from proxy.lifecycle.logfile import LogFile
from proxy.lifecycle.logs import BEHIND_MAX, MAX_FOLLOWERS, LogFollower

MIB = 2**20


def on_disk(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.iterdir() if p.is_file())


def test_the_file_is_rotated_past_its_size_and_the_disk_stays_bounded(tmp_path: Path) -> None:
    log = LogFile("app", lambda: tmp_path / "app.log", MIB, ManualClock())
    fd = log.open_run()
    chunk = (b"x" * 1023 + b"\n") * 256  # 256 KiB of lines
    for n in range(80):  # 20 MiB, as an app writing fast would
        os.write(fd, chunk)
        log.rotate_if_big()  # what the periodic check does
        assert on_disk(tmp_path) <= 2 * MIB + 2 * len(chunk), f"after {n + 1} chunks: {on_disk(tmp_path)} bytes"
    assert log.cuts > 0 and (tmp_path / "app.log.1").exists()
    os.write(fd, b"last line\n")
    assert log.lines(3, None)[-1] == "last line" and len(log.lines(3, None)) == 3, "earlier lines come from .1"
    log.close()
    again = LogFile("app", lambda: tmp_path / "app.log", MIB, ManualClock())
    again.open_run()
    assert not (tmp_path / "app.log.1").exists() and (tmp_path / "app.log").stat().st_size == 0, \
        "a new run starts with nothing of the old ones"
    again.close()


class Source:
    def __init__(self, log: LogFile) -> None:
        self.log = log
        self.hide: str | None = None
        self.followers = 0

    def open_log(self) -> tuple[int, int] | None:
        return self.log.dup()


async def test_a_follower_reads_on_after_a_cut_without_a_new_run_and_skips_when_far_behind(tmp_path: Path) -> None:
    log = LogFile("app", lambda: tmp_path / "app.log", MIB, ManualClock())
    fd = log.open_run()
    follower = LogFollower(Source(log))
    os.write(fd, b"one\n" * 300_000)  # 1.2 MB
    await follower.back(0)
    log.rotate_if_big()
    os.write(fd, b"after the cut\n")
    chunk = await follower.new()
    assert chunk.lines == ["after the cut"] and chunk.new_run is None, chunk
    os.write(fd, b"y" * 99 + b"\n" * 1)
    os.write(fd, (b"z" * 99 + b"\n") * (BEHIND_MAX // 100 + 5000))
    chunk = await follower.new()
    assert chunk.lines[0].startswith("[hyperswap: ") and "bytes of output skipped" in chunk.lines[0], chunk.lines[:2]
    assert all(line == "z" * 99 for line in chunk.lines[1:]), "whole lines from the recent part"
    log.close()


def test_at_most_max_followers_follow_one_tenant_and_a_closed_one_frees_its_place(tmp_path: Path) -> None:
    source = Source(LogFile("app", lambda: tmp_path / "app.log", MIB, ManualClock()))
    followers = [LogFollower(source) for _ in range(MAX_FOLLOWERS + 1)]
    assert [f.admit() for f in followers] == [True] * MAX_FOLLOWERS + [False]
    followers[0].close()
    followers[0].close()  # twice: given back once
    assert source.followers == MAX_FOLLOWERS - 1 and followers[-1].admit()
