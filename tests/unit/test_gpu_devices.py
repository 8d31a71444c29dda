"""Which card a tenant's engine uses: pins in tenants.json, discovery from /proc fixtures (environ,
cmdline), and the NVML reader over several devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.engines import adapter_for
from proxy.engines.loading import registry_from_dict
from proxy.errors import ConfigError
from proxy.gpu.devices import (
    DevicePlacer,
    evidence_from,
    flag_value,
    parse_environ,
    parse_visible_devices,
    place,
    read_cuda_env,
)
from proxy.gpu.nvml import NvmlReader
from proxy.gpu.snapshot import DeviceMemory, GpuProcess
from tests.unit.cards import registry
from tests.unit.test_nvml import CLK_TCK, GIB, FakeNvml, entry

CARDS = (DeviceMemory(0, "NVIDIA RTX 4090", 24 * GIB, 0, 0, 24 * GIB, uuid="GPU-8f2c1a00-1111"),
         DeviceMemory(1, "NVIDIA RTX 4090", 24 * GIB, 0, 0, 24 * GIB, uuid="GPU-3b7d9e00-2222"))
MIXED = (CARDS[0], DeviceMemory(1, "NVIDIA RTX 3060", 12 * GIB, 0, 0, 12 * GIB, uuid="GPU-3b7d9e00-2222"))


def proc(pid: int, cmdline: str = "ollama serve", env: dict[str, str] | None = None) -> GpuProcess:
    return GpuProcess(pid, "p", cmdline, GIB, cuda_env=None if env is None else tuple(env.items()))


def write_proc(root: Path, pid: int, ppid: int, comm: str, argv: list[str], environ: dict[str, str] | None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    fields = ["S", str(ppid)] + ["0"] * 17 + ["12345"] + ["0"] * 30
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")
    if environ is not None:
        (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))


# -- parsing -----------------------------------------------------------------------------------------

def test_cuda_visible_devices_is_read_as_cuda_reads_it() -> None:
    assert parse_visible_devices("0,1") == ("0", "1")
    assert parse_visible_devices(" 1 , GPU-8f2c") == ("1", "GPU-8f2c")
    assert parse_visible_devices("1,bogus,2") == ("1",), "CUDA stops at the first entry it cannot parse"
    assert parse_visible_devices("") == () and parse_visible_devices("-1") == (), "no device at all"


def test_environ_keeps_only_the_cuda_device_variables() -> None:
    raw = b"HOME=/root\0CUDA_VISIBLE_DEVICES=1\0SECRET_TOKEN=x\0CUDA_DEVICE_ORDER=PCI_BUS_ID\0"
    assert parse_environ(raw) == (("CUDA_VISIBLE_DEVICES", "1"), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))


def test_environ_unreadable_is_unknown_and_unset_is_empty(tmp_path: Path) -> None:
    write_proc(tmp_path, 10, 1, "ollama", ["ollama", "serve"], {"PATH": "/usr/bin"})
    write_proc(tmp_path, 11, 1, "python3", ["python3", "main.py"], None)
    assert read_cuda_env(tmp_path, 10) == ()
    assert read_cuda_env(tmp_path, 11) is None  # another user's process: no environ to read
    assert read_cuda_env(tmp_path, 99) is None


def test_device_flag_is_read_from_the_command_line() -> None:
    assert flag_value("python3 main.py --listen 0.0.0.0 --cuda-device 1", "--cuda-device") == "1"
    assert flag_value("python3 main.py --cuda-device=2 --port 8188", "--cuda-device") == "2"
    assert flag_value("python3 main.py --cuda-device-extra 3", "--cuda-device") is None
    assert flag_value("python3 main.py --cuda-device", "--cuda-device") is None


def test_comfyuis_flag_wins_over_its_environment_and_other_engines_have_none() -> None:
    comfy = adapter_for(registry().get("comfyui")).device_flag
    assert comfy == "--cuda-device" and adapter_for(registry().get("ollama")).device_flag is None
    both = proc(5, "python3 main.py --cuda-device 1", {"CUDA_VISIBLE_DEVICES": "0"})
    ev = evidence_from(both, comfy)
    assert ev is not None and ev.specs == ("1",) and ev.how == "--cuda-device 1"
    ev = evidence_from(both, None)
    assert ev is not None and ev.specs == ("0",) and ev.how == "CUDA_VISIBLE_DEVICES=0"
    assert evidence_from(proc(6, env={}), None) is None and evidence_from(proc(7), None) is None


# -- placing -----------------------------------------------------------------------------------------

def test_a_pin_by_index_or_uuid_prefix_names_the_card() -> None:
    reg = registry({"ollama": {"devices": [1]}, "comfyui": {"devices": ["GPU-8f2c"]}})
    assert place(reg.get("ollama"), CARDS, None).devices == (1,)
    pinned = place(reg.get("comfyui"), CARDS, None)
    assert pinned.devices == (0,) and pinned.source == "pinned" and "GPU 0" in pinned.detail


def test_a_pin_to_a_card_that_is_not_there_says_so_and_falls_back_to_any() -> None:
    reg = registry({"ollama": {"devices": [3]}})
    p = place(reg.get("ollama"), CARDS, None)
    assert p.devices is None and p.source == "any"
    assert "no such device" in p.detail and "tenants.ollama.devices" in p.detail


def test_discovery_names_the_process_and_warns_when_cuda_order_may_differ() -> None:
    ollama = registry().get("ollama")
    ev = evidence_from(proc(42, env={"CUDA_VISIBLE_DEVICES": "1"}), None)
    same = place(ollama, CARDS, ev)
    assert same.devices == (1,) and same.source == "discovered" and "pid 42" in same.detail
    assert "PCI_BUS_ID" not in same.detail  # identical cards: both orders agree
    mixed = place(ollama, MIXED, ev)
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in mixed.detail
    pci = evidence_from(proc(42, env={"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}), None)
    assert "PCI_BUS_ID" not in place(ollama, MIXED, pci).detail


def test_nothing_known_means_any_card_and_the_view_says_why() -> None:
    p = place(registry().get("ollama"), CARDS, None)
    assert p.devices is None and p.source == "any" and "may use any device" in p.detail
    assert p.allows(0) and p.allows(1)


def test_a_discovery_is_kept_after_the_engine_lets_go_of_the_card() -> None:
    reg = registry()
    placer = DevicePlacer(reg, lambda t: adapter_for(t).device_flag)
    runner = proc(42, "/usr/bin/ollama runner --port 1234", {"CUDA_VISIBLE_DEVICES": "1"})
    assert placer.placements(CARDS, [(runner, "ollama")])["ollama"].devices == (1,)
    later = placer.placements(CARDS, [])  # the runner exited after an idle release
    assert later["ollama"].devices == (1,) and later["comfyui"].source == "any"


# -- tenants.json --------------------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [[0], [0, 1], ["GPU-8f2c1a00-1111"], ["MIG-abc-1"], [1, "GPU-3b7d"]])
def test_devices_accepts_indices_and_uuids(devices: list[Any]) -> None:
    assert registry_from_dict({"tenants": {"ollama": {"devices": devices}}}).get("ollama").devices == devices


@pytest.mark.parametrize(("devices", "says"), [
    ([], "empty list"), ([-1], "counts from 0"), (["gpu0"], "neither a device index nor a UUID"),
    ([0, 0], "listed twice"), ([True], "devices"), ("0", "devices"),
])
def test_devices_rejects_what_names_no_card(devices: Any, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        registry_from_dict({"tenants": {"ollama": {"devices": devices}}})
    text = str(err.value) + " ".join(getattr(err.value, "problems", []) or [])
    assert says in text and "ollama" in text, text


# -- the NVML reader over several cards ------------------------------------------------------------------

class TwoCards(FakeNvml):
    def __init__(self) -> None:
        super().__init__()
        self.per_card: dict[str, list[Any]] = {"handle0": [], "handle1": []}

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return f"GPU-fake-{handle[-1]}"

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return self.per_card[handle]


def test_every_card_is_read_and_each_process_entry_names_its_card(tmp_path: Path) -> None:
    nvml = TwoCards()
    write_proc(tmp_path, 100, 1, "ollama", ["/usr/bin/ollama", "serve"], {"CUDA_VISIBLE_DEVICES": "0,1"})
    write_proc(tmp_path, 101, 100, "ollama", ["/usr/bin/ollama", "runner"], {"CUDA_VISIBLE_DEVICES": "GPU-fake-1"})
    write_proc(tmp_path, 200, 1, "python3", ["python3", "main.py", "--cuda-device", "0"], None)
    nvml.per_card = {"handle0": [entry(101, 3 * GIB), entry(200, 5 * GIB)], "handle1": [entry(101, 4 * GIB)]}
    reader = NvmlReader(nvml=nvml, proc_root=tmp_path, clock=ManualClock(start=1.0), clk_tck=CLK_TCK,
                        fd_links=lambda _: [])
    snap = reader.read()
    assert [d.index for d in snap.devices] == [0, 1] and snap.several_devices
    assert [d.uuid for d in snap.all_devices] == ["GPU-fake-0", "GPU-fake-1"]
    assert sorted((p.pid, p.device, p.used_bytes) for p in snap.processes) == [
        (101, 0, 3 * GIB), (101, 1, 4 * GIB), (200, 0, 5 * GIB)]
    runner = next(p for p in snap.processes if p.pid == 101)
    # the server's setting bounds what its runners may use; the runner's own names one model's card
    assert dict(runner.cuda_env or ()) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert next(p for p in snap.processes if p.pid == 200).cuda_env is None  # environ unreadable
    assert snap.on_device(1).device.index == 1 and [p.pid for p in snap.on_device(1).processes] == [101]
    # a process's environ is the one it started with: read once, not on every snapshot
    (tmp_path / "100" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=1\0")
    again = next(p for p in reader.read().processes if p.pid == 101)
    assert dict(again.cuda_env or ()) == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_a_one_card_host_reads_as_before(tmp_path: Path) -> None:
    nvml = FakeNvml()  # no device count in the binding: card 0 only
    nvml.compute = [entry(300, 2 * GIB)]
    write_proc(tmp_path, 300, 1, "ollama", ["ollama", "serve"], {"CUDA_VISIBLE_DEVICES": "0"})
    snap = NvmlReader(nvml=nvml, proc_root=tmp_path, clock=ManualClock(start=1.0), clk_tck=CLK_TCK,
                      fd_links=lambda _: []).read()
    assert snap.devices == () and not snap.several_devices and snap.all_devices == (snap.device,)
    assert snap.processes[0].cuda_env is None, "environ is only read where there is a card to choose"
    assert snap.on_device(0) is snap
