"""What an earlier run left (`lifecycle/leftovers.py`): only what its record proves is its own."""

from __future__ import annotations

import os

import pytest

from proxy.lifecycle import procs
from proxy.lifecycle.leftovers import leftovers, orphan

pytestmark = pytest.mark.skipif(procs.start_time(os.getpid()) is None, reason="reads /proc (Linux)")


def own_record(**changes: object) -> dict[str, object]:
    pid = os.getpid()
    record: dict[str, object] = {"pid": pid, "start_time": procs.start_time(pid), "command": ["python"],
                                 "cmdline": list(procs.cmdline(pid) or ()), "boot_id": procs.boot_id(),
                                 "marker": "", "descendants": []}
    record.update(changes)
    return record


def test_a_record_from_another_boot_names_nothing_that_runs_now() -> None:
    assert leftovers(own_record(boot_id="another-boot")) == {}


def test_a_leader_whose_command_line_differs_matches_only_in_part_and_is_never_signalled() -> None:
    assert leftovers(own_record(cmdline=["not", "this", "process"])) is None


def test_a_leader_that_matches_in_full_is_the_runs_own() -> None:
    found = leftovers(own_record())
    assert found is not None and found[os.getpid()] == procs.start_time(os.getpid())


def test_an_orphan_is_the_recorded_pid_with_its_start_time_and_nothing_else() -> None:
    assert orphan(own_record()) == {"pid": os.getpid(), "command": ["python"]}
    assert orphan(own_record(start_time=1)) is None, "its number belongs to another process now"
    assert orphan(None) is None
