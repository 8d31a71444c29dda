"""`hyperswap check --ready-within S`: the unit's start gate waits for the proxy, then never fails on a dependency."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from proxy.clock import ManualClock
from proxy.deploy import gate


def plain_sleep(clock: ManualClock) -> Callable[[float], None]:
    """The gate runs before any event loop (systemd's ExecStartPost): its sleep is a plain call."""
    return lambda seconds: asyncio.run(clock.advance(seconds))


def test_waits_until_the_admin_api_answers() -> None:
    clock, calls = ManualClock(start=0.0), []

    def get(url: str) -> int:
        calls.append(clock.now())
        if clock.now() < 1.0:
            raise httpx.ConnectError("refused")
        return 200

    assert gate.wait_answering("http://127.0.0.1:1/api/health", 30, get=get, sleep=plain_sleep(clock), now=clock.now)
    assert len(calls) == 5 and calls[-1] == 1.0


def test_gives_up_after_the_deadline() -> None:
    clock = ManualClock(start=0.0)

    def get(url: str) -> int:
        raise httpx.ConnectError("refused")

    assert not gate.wait_answering("http://x", 2, get=get, sleep=plain_sleep(clock), now=clock.now)
    assert clock.now() == pytest.approx(2.0)


@pytest.mark.parametrize(("check_rc", "gate_rc"), [(0, 0), (1, 0), (2, 2)])
def test_a_failed_dependency_does_not_fail_the_start(monkeypatch: pytest.MonkeyPatch, check_rc: int, gate_rc: int) -> None:
    monkeypatch.setattr(gate, "wait_answering", lambda url, s: True)
    monkeypatch.setattr(gate, "check_main", lambda config, admin, as_json: check_rc)
    assert gate.ready_gate(None, "127.0.0.1:9", False, 1) == gate_rc


def test_no_answer_fails_the_start(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(gate, "wait_answering", lambda url, s: False)
    assert gate.ready_gate(None, "127.0.0.1:9", False, 1) == 2
    assert "no HyperSwap proxy answered at http://127.0.0.1:9 within 1 s" in capsys.readouterr().out
