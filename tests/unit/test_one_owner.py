"""Design invariant 11, one owner: no module but the scheduler keeps admission state.

Admission state is what decides who runs: the waiters, the admission of a request as its tenant's
work, the memory promised to loads on their way, the loads known to be on the card, the engines'
own reads, the latest card, the releases under way. The deadlock of issue 32 came from that state
spread over many owners (a waiter counted as work by the listener, reservations and residency on
`GpuBroker`, a lock beside the scheduler's own "one at a time"). This check reads every module of
proxy/ and fails, naming the module and the line, where another one constructs a piece of that
state, keeps an attribute of that name, or admits a request as work.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from tests.unit.source_tree import SourceFile, nodes_of, python_files

ROOT = Path(__file__).resolve().parents[2]
OWNER = "proxy/handoff/scheduler.py"
STATE_TYPES = {"Reservations", "Residency", "EngineReads", "Lock"}  # Lock: a second "one at a time"
STATE_ATTRIBUTES = {"_tickets", "_waiters", "_underway", "_reservations", "reservations", "residency",
                    "engine_reads", "_queue_reads", "_unreachable_since", "cpu_tenants", "handoff_lock",
                    "last_snapshot", "card", "_settlers", "_settle_on_idle"}
# Where else a request may become work without the scheduler: a listener with no gate at all (no
# scheduler exists). An unload and a body too large to keep go through the scheduler too (one door).
ADMITS_WITHOUT_SCHEDULER = {"proxy/relay/listener.py"}
# A lock in the handoff layer is a second "one at a time" beside the scheduler's; the reader's one
# GPU read at a time guards no admission state. Locks elsewhere (a cache, a walk) are not looked at.
HANDOFF = ("proxy/handoff/", "proxy/relay/gpu_gate.py")
OTHER_LOCKS = {"proxy/handoff/card_reader.py"}
# The same names for other things: the page cache's residency of model files (not the card's), the
# HTTP client's connection-pool waiters.
SAME_NAME_OTHER_THING = {("proxy/models/catalog.py", "residency"), ("proxy/relay/http1.py", "_waiters")}


def violations(source: str | SourceFile, module: str) -> list[str]:
    """Where `module` (a path relative to the repository) keeps or writes admission state."""
    if module == OWNER:
        return []
    out = []
    for node in nodes_of(source, module):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else \
                node.func.attr if isinstance(node.func, ast.Attribute) else ""
            lock_elsewhere = name == "Lock" and (module in OTHER_LOCKS or not module.startswith(HANDOFF))
            if name in STATE_TYPES and not lock_elsewhere:
                out.append(f"{module}:{node.lineno} constructs {name}")
            if name == "admit" and isinstance(node.func, ast.Attribute) and module not in ADMITS_WITHOUT_SCHEDULER:
                receiver = ast.unparse(node.func.value)
                if "inflight" in receiver or "traffic" in receiver:
                    out.append(f"{module}:{node.lineno} admits a request as work ({receiver}.admit)")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self" \
                    and target.attr in STATE_ATTRIBUTES and module not in _PARTS \
                    and (module, target.attr) not in SAME_NAME_OTHER_THING:
                out.append(f"{module}:{target.lineno} keeps self.{target.attr}")
    return out


_PARTS = {"proxy/handoff/reservations.py", "proxy/handoff/residency.py", "proxy/handoff/evidence.py"}  # the owner's parts


def found_in_proxy(check: Callable[[SourceFile, str], list[str]]) -> list[str]:
    """What `check` finds in every module of proxy/ but the simulators."""
    return [v for source in python_files(ROOT / "proxy") if "/sim/" not in source.rel()
            for v in check(source, source.rel())]


def test_no_module_but_the_scheduler_keeps_admission_state() -> None:
    found = found_in_proxy(violations)
    assert not found, "admission state outside the scheduler (design invariant 11):\n" + "\n".join(found)


def test_the_check_finds_what_the_old_code_did() -> None:
    """What issue 32 found, written again: the check must name each of them."""
    old = '''
class GpuBroker:
    def __init__(self):
        self.residency = Residency(clock)
        self.handoff_lock = asyncio.Lock()
        self._reservations = {}

class TenantApp:
    async def _gpu(self, request):
        token = self.inflight.begin(tenant.name)
        self.inflight.admit(token)
'''
    found = violations(old, "proxy/handoff/somewhere.py")
    assert any("constructs Residency" in f for f in found), found
    assert any("constructs Lock" in f for f in found), found
    assert any("keeps self._reservations" in f for f in found), found
    assert any("admits a request as work" in f for f in found), found


# -- one door (design invariant 14): the request side reaches the scheduler only through `Door` --------

REQUEST_SIDE = "proxy/relay/"


def door_violations(source: str | SourceFile, module: str) -> list[str]:
    """Where `module` reaches past the door: it imports the scheduler module (its class, its
    internals) from outside the handoff layer, or, on the request side, calls through a `.scheduler`
    attribute instead of the `Door` it was given (`proxy/handoff/door.py`)."""
    out = []
    for node in nodes_of(source, module):
        if isinstance(node, ast.ImportFrom) and node.module == "proxy.handoff.scheduler" \
                and not module.startswith("proxy/handoff/"):
            out.append(f"{module}:{node.lineno} imports proxy.handoff.scheduler (take the Door, or the data in tickets.py)")
        if module.startswith(REQUEST_SIDE) and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "scheduler":
            out.append(f"{module}:{node.lineno} calls {ast.unparse(node)} past the door")
    return out


def test_the_request_side_reaches_the_scheduler_only_through_the_door() -> None:
    found = found_in_proxy(door_violations)
    assert not found, "past the one door (design invariant 14):\n" + "\n".join(found)


def test_the_door_check_finds_a_way_around_it() -> None:
    around = '''
from proxy.handoff.scheduler import Scheduler

class GpuGate:
    def handle(self):
        self.broker.scheduler.reservations.reserve("k", plan)
        return self.broker.scheduler.admit_at_once(tenant, key, need)
'''
    found = door_violations(around, "proxy/relay/gpu_gate.py")
    assert any("imports proxy.handoff.scheduler" in f for f in found), found
    assert sum("past the door" in f for f in found) == 2, found
    assert not door_violations(around.replace("proxy.handoff.scheduler", "proxy.handoff.door"), "proxy/admin/x.py")
