"""Process -> tenant by the registry's match rules, cached by (pid, start time)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from proxy.config.registry import Registry
from proxy.config.units import GIB
from proxy.engines.loading import registry_from_dict
from proxy.gpu.attribution import UNMANAGED, Attributor
from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot


def registry(extra: Mapping[str, Any] | None = None) -> Registry:
    return registry_from_dict({"tenants": copy.deepcopy(dict(extra or {}))})


def proc(pid: int, name: str, cmdline: str, used: int | None = GIB, start: float | None = 100.0) -> GpuProcess:
    return GpuProcess(pid=pid, name=name, cmdline=cmdline, used_bytes=used, start_time=start)


def snapshot(*procs: GpuProcess) -> GpuSnapshot:
    return GpuSnapshot(DeviceMemory(0, "card", 24 * GIB, 0, 0, 24 * GIB), tuple(procs))


def test_shipped_rules_attribute_ollama_comfyui_and_desktop() -> None:
    a = Attributor(registry())
    assert a.tenant_of(proc(1, "ollama", "/usr/local/bin/ollama serve")) == "ollama"
    assert a.tenant_of(proc(2, "python3", "python3 /opt/ComfyUI/main.py --listen 0.0.0.0")) == "comfyui"
    assert a.tenant_of(proc(3, "Xorg", "/usr/lib/xorg/Xorg vt2")) == "desktop"
    assert a.tenant_of(proc(4, "python", "python stt_relay.py")) == UNMANAGED


def test_argv0_basename_matches_a_process_name() -> None:
    a = Attributor(registry())
    # comm was renamed by the process, argv[0] still names the binary
    assert a.tenant_of(proc(1, "worker", "/usr/bin/llama-server --port 5000")) == "ollama"


def test_truncated_comm_matches_a_long_process_name() -> None:
    a = Attributor(registry())
    assert a.tenant_of(proc(1, "ollama_llama_se", "")) == "ollama"  # Linux keeps 15 chars of comm
    assert a.tenant_of(proc(2, "ollama_llama_xx", "")) == UNMANAGED


def test_exact_name_beats_an_earlier_tenants_pattern() -> None:
    # "grabby" comes first in registry order but only by pattern; "mine" names the process exactly
    reg = registry({"grabby": {"match": {"cmdline_patterns": ["serve"]}, "priority": 1},
                    "mine": {"match": {"process_names": ["myapp"]}, "priority": 2}})
    a = Attributor(reg)
    assert a.tenant_of(proc(1, "myapp", "myapp serve")) == "mine"
    assert a.tenant_of(proc(2, "other", "other serve")) == "grabby"


def test_first_tenant_in_registry_order_wins_among_patterns() -> None:
    reg = registry({"first": {"match": {"cmdline_patterns": ["shared"]}},
                    "second": {"match": {"cmdline_patterns": ["shared"]}}})
    assert Attributor(reg).tenant_of(proc(1, "x", "x --shared")) == "first"


def test_reused_pid_with_new_start_time_is_attributed_afresh() -> None:
    a = Attributor(registry())
    old = proc(4242, "python", "python ComfyUI/main.py --listen", start=1000.0)
    assert a.tenant_of(old) == "comfyui"
    new = proc(4242, "python", "python stt_relay.py", start=2000.0)
    assert a.tenant_of(new) == UNMANAGED
    assert a.tenant_of(old) == "comfyui"  # cached: the same identity is not matched again
    assert a.hits == 1 and a.misses == 2


def test_cache_hit_skips_matching() -> None:
    a = Attributor(registry())
    p = proc(1, "ollama", "ollama serve")
    a.tenant_of(p)
    a.tenant_of(p)
    assert (a.hits, a.misses) == (1, 1)


def test_process_without_start_time_is_never_cached() -> None:
    a = Attributor(registry())
    assert a.tenant_of(proc(7, "python", "python ComfyUI/main.py", start=None)) == "comfyui"
    assert a.tenant_of(proc(7, "python", "python stt_relay.py", start=None)) == UNMANAGED
    assert a.cache_len == 0


def test_cache_is_bounded_lru() -> None:
    a = Attributor(registry(), cache_size=2)
    p1, p2, p3 = (proc(i, "ollama", "ollama serve", start=float(i)) for i in (1, 2, 3))
    a.tenant_of(p1)
    a.tenant_of(p2)
    a.tenant_of(p1)  # p1 most recently used
    a.tenant_of(p3)  # evicts p2
    assert a.cache_len == 2
    hits = a.hits
    a.tenant_of(p1)
    assert a.hits == hits + 1
    a.tenant_of(p2)
    assert a.hits == hits + 1  # p2 was evicted: a miss


def test_attributed_snapshot_helpers_sum_known_bytes() -> None:
    a = Attributor(registry())
    s = a.attribute(snapshot(
        proc(1, "ollama", "ollama serve", used=GIB),
        proc(2, "llama-server", "llama-server -m x", used=3 * GIB),
        proc(3, "llama-server", "llama-server -m y", used=None),
        proc(4, "python", "python stt_relay.py", used=2 * GIB),
    ))
    assert s.held_by("ollama") == 4 * GIB  # unknown memory is not counted as zero-or-more, just not summed
    assert [p.process.pid for p in s.processes_of("ollama")] == [1, 2, 3]
    assert [p.process.pid for p in s.unmanaged()] == [4]
    assert s.held_by("comfyui") == 0
    assert s.snapshot.device.total_bytes == 24 * GIB


COMFYUI_COMMAND_LINES = [
    "python main.py --cpu --listen 127.0.0.1",
    "python main.py --port 8188",
    "python3 main.py --highvram --listen",
    "/opt/comfy/main.py",
    "python main.py --listen=0.0.0.0",
    "/usr/bin/python3 ./main.py --lowvram --preview-method auto",
    "python main.py --reserve-vram 1.5",
    "python /srv/comfy-portable/main.py",
    "python3 /opt/ComfyUI/main.py --listen 127.0.0.1 --port 28188",  # the simulator's
]

NOT_COMFYUI_COMMAND_LINES = [
    "python main.py",  # any project's entry point: only its port can tell (attribution by port)
    "python main.py --port 9000",
    "python main.py --port 81880",
    "python main.py --cpu",
    "python main.py --host 0.0.0.0 --port 8080",
    "python /home/u/project/main.py --epochs 10",
    "python train_main.py --listen",
    "python domain.py --listen",
    "uvicorn main:app --port 8188",
    "python webui.py --listen",
]


def test_shipped_comfyui_patterns_match_common_comfyui_command_lines() -> None:
    a = Attributor(registry())
    missed = [c for c in COMFYUI_COMMAND_LINES if a.match(proc(1, "python3", c)) != "comfyui"]
    assert missed == [], f"ComfyUI command lines the shipped patterns miss: {missed}"


def test_shipped_comfyui_patterns_leave_unrelated_main_py_scripts_alone() -> None:
    a = Attributor(registry())
    taken = [c for c in NOT_COMFYUI_COMMAND_LINES if a.match(proc(1, "python", c)) != UNMANAGED]
    assert taken == [], f"unrelated command lines the shipped comfyui patterns claim: {taken}"
