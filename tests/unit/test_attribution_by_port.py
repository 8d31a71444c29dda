"""Attribution by the tenant's upstream port: the socket's owner and its descendants, from fixture
/proc trees; the match rules as the fallback (VRAM-only tenants, unreadable fds, remote upstreams)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from proxy.config.registry import Registry
from proxy.engines.loading import registry_from_dict
from proxy.gpu.attribution import UNMANAGED, Attributor
from proxy.gpu.proctree import read_process_tree
from proxy.gpu.snapshot import ProcessTree
from proxy.hosts import IpAddress
from tests.unit.proctrees import FakeProc, gpu_proc, snapshot

OLLAMA_UID = 997  # Ollama's service user


def registry(extra: Mapping[str, Any] | None = None) -> Registry:
    return registry_from_dict({"tenants": copy.deepcopy(dict(extra or {}))})


def no_local_address(ip: IpAddress) -> bool:
    return False  # hermetic: no address but loopback is this machine's


def attributor(reg: Registry | None = None) -> Attributor:
    return Attributor(reg or registry(), probe=no_local_address, hostname=lambda: "testbox")


@pytest.fixture
def fp(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def tree(fp: FakeProc, *pids: int, denied: frozenset[int] = frozenset()) -> ProcessTree:
    fp.write_net()

    def fd_links(fd_dir: str) -> list[str]:
        if int(Path(fd_dir).parent.name) in denied:
            raise PermissionError(13, "Permission denied", fd_dir)
        return [str(p.readlink()) for p in Path(fd_dir).iterdir()]

    return read_process_tree(fp.root, pids, fd_links=fd_links)


def test_socket_owner_and_its_child_runner_belong_to_the_tenant_by_port(fp: FakeProc) -> None:
    # command lines no shipped pattern or name matches: only the port can tell
    ollama_port = fp.listen("127.0.0.1", 11434)
    comfy_port = fp.listen("0.0.0.0", 8188)
    fp.process(700, "bash", ["bash"])
    fp.process(800, "llmd", ["/opt/llm/llmd", "--serve"], ppid=700, sockets=[ollama_port])
    fp.process(801, "llmd-worker", ["/opt/llm/llmd-worker", "--model", "x"], ppid=800)
    fp.process(802, "llmd-worker", ["/opt/llm/llmd-worker", "--model", "y"], ppid=800)
    fp.process(900, "python", ["python", "main.py"], ppid=700, sockets=[comfy_port])
    fp.process(950, "python", ["python", "train.py"], ppid=700)  # a sibling: same shell, no port
    procs = [gpu_proc(801, "llmd-worker", "/opt/llm/llmd-worker --model x"),
             gpu_proc(802, "llmd-worker", "/opt/llm/llmd-worker --model y"),
             gpu_proc(900, "python", "python main.py"),
             gpu_proc(950, "python", "python train.py")]
    snap = attributor().attribute(snapshot(*procs, tree=tree(fp, 801, 802, 900, 950)))
    assert [(p.process.pid, p.tenant, p.by) for p in snap.processes] == [
        (801, "ollama", "port"), (802, "ollama", "port"), (900, "comfyui", "port"), (950, UNMANAGED, None)]
    assert snap.snapshot.notes == (), "every socket was readable: nothing to say"


def test_vram_only_tenant_is_found_by_pattern_beside_port_owners(fp: FakeProc) -> None:
    reg = registry({"stt": {"match": {"cmdline_patterns": [r"stt_relay\.py"]}, "priority": 60}})
    port = fp.listen("127.0.0.1", 11434)
    fp.process(800, "ollama", ["ollama", "serve"], sockets=[port])
    fp.process(801, "ollama", ["ollama", "runner"], ppid=800)
    fp.process(850, "python", ["python", "stt_relay.py"])
    snap = attributor(reg).attribute(snapshot(gpu_proc(801, "ollama", "ollama runner"),
                                              gpu_proc(850, "python", "python stt_relay.py"), tree=tree(fp, 801, 850)))
    assert [(p.tenant, p.by) for p in snap.processes] == [("ollama", "port"), ("stt", "pattern")]


def test_unreadable_fd_dirs_fall_back_to_patterns_and_say_so(fp: FakeProc) -> None:
    port = fp.listen("127.0.0.1", 11434, uid=OLLAMA_UID)
    fp.process(800, "ollama", ["/usr/bin/ollama", "serve"], sockets=[port], uid=OLLAMA_UID)
    fp.process(801, "ollama", ["/usr/bin/ollama", "runner", "--model", "x"], ppid=800, uid=OLLAMA_UID)
    fp.process(802, "mystery", ["/opt/mystery"], ppid=800, uid=OLLAMA_UID)  # under the hidden owner, matches nothing
    t = tree(fp, 801, 802, denied=frozenset({800, 801, 802}))
    procs = (gpu_proc(801, "ollama", "/usr/bin/ollama runner --model x"), gpu_proc(802, "mystery", "/opt/mystery"))
    snap = attributor().attribute(snapshot(*procs, tree=t))
    assert [(p.tenant, p.by) for p in snap.processes] == [("ollama", "name"), (UNMANAGED, None)]
    (note,) = snap.snapshot.notes
    assert "pid 800 (ollama)" in note and "pid 801 (ollama)" in note and "pattern" in note, note


def test_an_unreadable_process_of_another_uid_than_the_unplaced_socket_is_not_noted(fp: FakeProc) -> None:
    # as a normal user the root-owned Xorg's fds are unreadable, but Ollama's socket belongs to uid 997:
    # Xorg cannot be hiding it, so its name match is no fallback worth a note
    port = fp.listen("127.0.0.1", 11434, uid=OLLAMA_UID)
    fp.process(800, "ollama", ["ollama", "serve"], sockets=[port], uid=OLLAMA_UID)
    fp.process(600, "Xorg", ["/usr/lib/xorg/Xorg", "vt2"], uid=0)
    t = tree(fp, 600, denied=frozenset({600}))
    snap = attributor().attribute(snapshot(gpu_proc(600, "Xorg", "/usr/lib/xorg/Xorg vt2"), tree=t))
    assert snap.processes[0].tenant == "desktop" and snap.snapshot.notes == ()


def test_upstream_on_another_host_falls_back_to_patterns_and_says_so(fp: FakeProc) -> None:
    reg = registry({"ollama": {"upstream": "http://192.0.2.10:11434"}})
    port = fp.listen("0.0.0.0", 11434)  # a local engine on the same port: not the tenant's, which is elsewhere
    fp.process(800, "llmd", ["/opt/llm/llmd"], sockets=[port])
    fp.process(801, "llmd-worker", ["/opt/llm/llmd-worker"], ppid=800)
    fp.process(820, "ollama", ["ollama", "runner"])
    snap = attributor(reg).attribute(snapshot(gpu_proc(801, "llmd-worker", "/opt/llm/llmd-worker"),
                                              gpu_proc(820, "ollama", "ollama runner"), tree=tree(fp, 801, 820)))
    assert [(p.tenant, p.by) for p in snap.processes] == [(UNMANAGED, None), ("ollama", "name")]
    assert any("ollama" in n and "192.0.2.10" in n and "not this machine" in n for n in snap.snapshot.notes), \
        snap.snapshot.notes


def test_a_listener_on_another_local_address_does_not_serve_a_loopback_upstream(fp: FakeProc) -> None:
    other = fp.listen("192.168.7.5", 11434)  # bound to one interface: 127.0.0.1:11434 never reaches it
    fp.process(800, "llmd", ["/opt/llm/llmd"], sockets=[other])
    snap = attributor().attribute(snapshot(gpu_proc(800, "llmd", "/opt/llm/llmd"), tree=tree(fp, 800)))
    assert snap.processes[0].tenant == UNMANAGED


def test_cache_keyed_by_pid_and_start_time_is_not_fooled_by_pid_reuse(fp: FakeProc, tmp_path: Path) -> None:
    a = attributor()
    port = fp.listen("127.0.0.1", 11434)
    fp.process(800, "llmd", ["/opt/llm/llmd"], sockets=[port])
    fp.process(500, "llmd-worker", ["/opt/llm/llmd-worker"], ppid=800, starttime=10000)
    first = gpu_proc(500, "llmd-worker", "/opt/llm/llmd-worker", start=100.0)
    assert a.attribute(snapshot(first, tree=tree(fp, 500))).processes[0].tenant == "ollama"

    # pid 500 exits and is reused by an unrelated job under a shell, with a later start time
    later = FakeProc(tmp_path / "later")
    port = later.listen("127.0.0.1", 11434)
    later.process(800, "llmd", ["/opt/llm/llmd"], sockets=[port])
    later.process(700, "bash", ["bash"])
    later.process(500, "python", ["python", "train.py"], ppid=700, starttime=20000)
    reused = gpu_proc(500, "python", "python train.py", start=200.0)
    assert a.attribute(snapshot(reused, tree=tree(later, 500))).processes[0].tenant == UNMANAGED
    # and the first identity keeps its port verdict without a lineage to walk (the owner may be gone)
    assert a.attribute(snapshot(first, tree=ProcessTree())).processes[0].tenant == "ollama"


def test_a_process_that_binds_its_port_after_taking_vram_is_attributed_once_it_listens(fp: FakeProc,
                                                                                      tmp_path: Path) -> None:
    a = attributor()
    comfy = gpu_proc(900, "python", "python main.py")  # CUDA is up before the server binds 8188
    fp.process(900, "python", ["python", "main.py"])
    fp.listen("127.0.0.1", 11434)  # someone else's socket: the step runs, finds nothing for 900
    assert a.attribute(snapshot(comfy, tree=tree(fp, 900))).processes[0].tenant == UNMANAGED
    bound = FakeProc(tmp_path / "bound")
    port = bound.listen("127.0.0.1", 8188)
    bound.process(900, "python", ["python", "main.py"], sockets=[port])
    assert a.attribute(snapshot(comfy, tree=tree(bound, 900))).processes[0].tenant == "comfyui"


def test_a_service_manager_holding_a_port_does_not_claim_everything_it_started(fp: FakeProc) -> None:
    # systemd --user socket-activates the engine: it holds the socket, and so does the engine it started
    port = fp.listen("127.0.0.1", 11434)
    fp.process(1500, "systemd", ["/usr/lib/systemd/systemd", "--user"], sockets=[port])
    fp.process(1600, "gnome-shell", ["/usr/bin/gnome-shell"], ppid=1500)
    fp.process(1700, "llmd", ["/opt/llm/llmd"], ppid=1500, sockets=[port])
    fp.process(1701, "llmd-worker", ["/opt/llm/llmd-worker"], ppid=1700)
    snap = attributor().attribute(snapshot(gpu_proc(1600, "gnome-shell", "/usr/bin/gnome-shell"),
                                           gpu_proc(1701, "llmd-worker", "/opt/llm/llmd-worker"),
                                           tree=tree(fp, 1600, 1701)))
    assert [(p.tenant, p.by) for p in snap.processes] == [("desktop", "name"), ("ollama", "port")]


def test_port_evidence_beats_a_name_match(fp: FakeProc) -> None:
    # a process named like Ollama's binary, but started by the ComfyUI server (a custom node's helper)
    port = fp.listen("127.0.0.1", 8188)
    fp.process(900, "python", ["python", "main.py"], sockets=[port])
    fp.process(901, "llama-server", ["llama-server", "-m", "x.gguf"], ppid=900)
    snap = attributor().attribute(snapshot(gpu_proc(901, "llama-server", "llama-server -m x.gguf"), tree=tree(fp, 901)))
    assert (snap.processes[0].tenant, snap.processes[0].by) == ("comfyui", "port")


def test_without_a_tree_the_simulated_path_goes_by_rules_and_says_nothing() -> None:
    snap = attributor().attribute(snapshot(gpu_proc(4001, "ollama_llama_server", "/x/ollama_llama_server runner"),
                                           gpu_proc(4002, "python3", "python3 /opt/ComfyUI/main.py --listen 127.0.0.1")))
    assert [(p.tenant, p.by) for p in snap.processes] == [("ollama", "name"), ("comfyui", "pattern")]
    assert snap.snapshot.notes == ()


async def test_the_proxys_snapshot_attributes_by_port_and_carries_the_notes(fp: FakeProc) -> None:
    # the whole path the admission and the admin API use: NVML reader on a fixture /proc -> GpuBroker
    from proxy.clock import ManualClock
    from proxy.gpu.nvml import NvmlReader
    from proxy.handoff.broker import GpuBroker
    from proxy.handoff.decisions import DecisionLog
    from proxy.handoff.inflight import InFlight
    from tests.unit.test_nvml import CLK_TCK, FakeNvml, entry

    reg = registry({"ollama": {"upstream": "http://127.0.0.1:11434"},
                    "comfyui": {"upstream": "http://192.0.2.10:8188"}})  # TEST-NET: never this machine
    port = fp.listen("127.0.0.1", 11434)
    fp.process(800, "llmd", ["/opt/llm/llmd"], sockets=[port])
    fp.process(801, "llmd-worker", ["/opt/llm/llmd-worker"], ppid=800)
    fp.write_net()
    nvml = FakeNvml()
    nvml.compute = [entry(801, 3 * 2**30)]
    clock = ManualClock(start=50.0)
    broker = GpuBroker(reg, NvmlReader(nvml=nvml, proc_root=fp.root, clock=clock, clk_tck=CLK_TCK),
                      InFlight(clock), clock, DecisionLog(clock))
    try:
        snap = await broker.snapshot()
    finally:
        await broker.aclose()
    assert [(p.tenant, p.by) for p in snap.processes] == [("ollama", "port")]
    assert snap.held_by("ollama") == 3 * 2**30
    assert any("comfyui" in n and "not this machine" in n for n in snap.snapshot.notes), snap.snapshot.notes
