"""The NVML reader against a fake pynvml module and a fake /proc: no GPU, no driver."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from proxy.clock import ManualClock
from proxy.gpu.nvml import CONTAINER_NOTE, NvmlReader
from proxy.gpu.snapshot import GpuReadError
from tests.unit.fake_pynvml import FakePynvmlBase

GIB = 2**30
CLK_TCK = 100


class FakeNvml(FakePynvmlBase):
    """The slice of pynvml the reader uses (errors and init/shutdown counts from FakePynvmlBase)."""

    def __init__(self) -> None:
        super().__init__()
        self.NVMLLibraryMismatchError = type("NVMLLibraryMismatchError", (Exception,), {})
        self.nvmlMemory_v2 = 0x02000028
        self.mem_error: Exception | None = None
        self.v2_supported = True
        self.compute: list[Any] = []
        self.graphics: list[Any] = []
        self.mem = types.SimpleNamespace(total=24 * GIB, reserved=300 * 2**20, used=10 * GIB, free=14 * GIB - 300 * 2**20)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle{index}"

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"NVIDIA Fake 4090"

    def nvmlDeviceGetUUID(self, handle: str) -> str:
        return "GPU-fake"

    def nvmlDeviceGetMemoryInfo(self, handle: str, version: int | None = None) -> Any:
        if self.mem_error is not None:
            raise self.mem_error
        if version is not None:
            if not self.v2_supported:
                raise self.NVMLError_FunctionNotFound("Function Not Found")
            return self.mem
        return types.SimpleNamespace(total=self.mem.total, used=self.mem.used, free=self.mem.free)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return self.compute

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: str) -> list[Any]:
        return self.graphics


def entry(pid: int, used: int | None) -> Any:
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


def fake_proc(root: Path, pid: int, comm: str, argv: list[str], starttime: int = 12345) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    fields = ["S"] + ["0"] * 18 + [str(starttime)] + ["0"] * 30  # field 3 .. ; field 22 is index 19
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    return root


def reader(nvml: FakeNvml, proc_root: Path) -> NvmlReader:
    return NvmlReader(nvml=nvml, proc_root=proc_root, clock=ManualClock(start=50.0), clk_tck=CLK_TCK)


def test_reads_device_memory_v2(nvml: FakeNvml, proc_root: Path) -> None:
    snap = reader(nvml, proc_root).read()
    assert snap.device.total_bytes == 24 * GIB
    assert snap.device.reserved_bytes == 300 * 2**20
    assert snap.device.name == "NVIDIA Fake 4090" and snap.device.uuid == "GPU-fake"
    assert snap.source == "nvml" and snap.taken_at == 50.0


def test_memory_falls_back_to_v1_when_v2_is_not_supported(nvml: FakeNvml, proc_root: Path) -> None:
    nvml.v2_supported = False
    r = reader(nvml, proc_root)
    snap = r.read()
    assert snap.device.total_bytes == 24 * GIB and snap.device.reserved_bytes == 0
    assert snap.device.free_bytes == nvml.mem.free
    assert r.read().device.total_bytes == 24 * GIB  # and keeps using v1


def test_compute_and_graphics_processes_merge_by_pid(nvml: FakeNvml, proc_root: Path) -> None:
    fake_proc(proc_root, 10, "python", ["python", "main.py"])
    fake_proc(proc_root, 11, "Xorg", ["/usr/lib/xorg/Xorg", ":0"])
    nvml.compute = [entry(10, 4 * GIB), entry(11, GIB)]
    nvml.graphics = [entry(11, GIB), entry(12, 512 * 2**20)]
    snap = reader(nvml, proc_root).read()
    assert [(p.pid, p.kind, p.used_bytes) for p in snap.processes] == [
        (10, "compute", 4 * GIB), (11, "both", GIB), (12, "graphics", 512 * 2**20)]


def test_unknown_process_memory_stays_unknown_not_zero(nvml: FakeNvml, proc_root: Path) -> None:
    fake_proc(proc_root, 10, "python", ["python"])
    nvml.compute = [entry(10, None), entry(10, None)]
    nvml.graphics = [entry(10, None)]
    (p,) = reader(nvml, proc_root).read().processes
    assert p.used_bytes is None and p.kind == "both"


def test_proc_entries_give_name_cmdline_and_start_time(nvml: FakeNvml, proc_root: Path) -> None:
    fake_proc(proc_root, 4242, "we (ird) name", ["python", "ComfyUI/main.py", "--listen"], starttime=250)
    nvml.compute = [entry(4242, GIB)]
    (p,) = reader(nvml, proc_root).read().processes
    assert p.name == "we (ird) name"
    assert p.cmdline == "python ComfyUI/main.py --listen"
    assert p.start_time == 2.5  # 250 ticks at 100 Hz: seconds since boot


def test_unreadable_proc_entries_never_raise(nvml: FakeNvml, proc_root: Path) -> None:
    d = proc_root / "20"
    d.mkdir()
    (d / "stat").write_text("garbage")
    fake_proc(proc_root, 21, "ok", ["ok"])
    nvml.compute = [entry(20, GIB), entry(21, GIB)]
    p20, _ = reader(nvml, proc_root).read().processes
    assert (p20.name, p20.cmdline, p20.start_time) == ("", "", None)


def test_container_note_when_no_nvml_pid_is_visible(nvml: FakeNvml, proc_root: Path) -> None:
    nvml.compute = [entry(9001, GIB), entry(9002, GIB)]
    snap = reader(nvml, proc_root).read()
    assert CONTAINER_NOTE in snap.notes
    assert "--pid=host" in CONTAINER_NOTE and "hostPID: true" in CONTAINER_NOTE


def test_no_container_note_when_some_pid_is_visible(nvml: FakeNvml, proc_root: Path) -> None:
    fake_proc(proc_root, 9001, "x", ["x"])
    nvml.compute = [entry(9001, GIB), entry(9002, GIB)]
    assert CONTAINER_NOTE not in reader(nvml, proc_root).read().notes


def test_no_container_note_without_processes(nvml: FakeNvml, proc_root: Path) -> None:
    assert reader(nvml, proc_root).read().notes == ()


@pytest.mark.parametrize(("error", "state", "fix_word"), [
    ("NVMLError_LibraryNotFound", "library_missing", "install"),
    ("NVMLError_DriverNotLoaded", "driver_not_loaded", "driver"),
    ("NVMLError_NoPermission", "no_permission", "user"),
    ("NVMLError_GpuIsLost", "gpu_lost", "reboot"),
    ("NVMLLibraryMismatchError", "driver_mismatch", "reboot after the driver update"),
    ("NVMLError_Unknown", "unknown", "nvidia-smi"),
])
def test_nvml_errors_map_to_health_states(nvml: FakeNvml, proc_root: Path, error: str, state: str, fix_word: str) -> None:
    nvml.init_error = getattr(nvml, error)("boom")
    with pytest.raises(GpuReadError) as info:
        reader(nvml, proc_root).read()
    assert info.value.state == state
    assert fix_word in info.value.fix


def test_version_mismatch_is_recognised_by_its_message(nvml: FakeNvml, proc_root: Path) -> None:
    nvml.init_error = nvml.NVMLError_Unknown("Driver/library version mismatch")
    with pytest.raises(GpuReadError) as info:
        reader(nvml, proc_root).read()
    assert info.value.state == "driver_mismatch"


def test_errors_after_init_map_too_and_the_next_read_inits_again(nvml: FakeNvml, proc_root: Path) -> None:
    r = reader(nvml, proc_root)
    r.read()
    nvml.mem_error = nvml.NVMLError_GpuIsLost("GPU is lost")
    with pytest.raises(GpuReadError) as info:
        r.read()
    assert info.value.state == "gpu_lost"
    nvml.mem_error = None
    r.read()
    assert nvml.init_calls == 2 and nvml.shutdown_calls == 1


def test_init_is_retried_on_the_next_read_after_a_failure(nvml: FakeNvml, proc_root: Path) -> None:
    r = reader(nvml, proc_root)
    nvml.init_error = nvml.NVMLError_DriverNotLoaded("Driver Not Loaded")
    with pytest.raises(GpuReadError):
        r.read()
    nvml.init_error = None
    assert r.read().device.total_bytes == 24 * GIB
    r.read()
    assert nvml.init_calls == 2  # once failed, once succeeded, then kept


def test_missing_pynvml_module_is_library_missing(monkeypatch: pytest.MonkeyPatch, proc_root: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(GpuReadError) as info:
        NvmlReader(proc_root=proc_root).read()
    assert info.value.state == "library_missing"
    assert "nvidia-ml-py" in info.value.message


def test_lazy_import_uses_the_pynvml_module(monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml, proc_root: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert NvmlReader(proc_root=proc_root).read().device.name == "NVIDIA Fake 4090"


def test_lazily_imported_module_errors_are_mapped_by_their_class(monkeypatch: pytest.MonkeyPatch, nvml: FakeNvml,
                                                                  proc_root: Path) -> None:
    nvml.init_error = nvml.NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with pytest.raises(GpuReadError) as info:
        NvmlReader(proc_root=proc_root).read()
    assert info.value.state == "library_missing"


def test_snapshot_carries_the_process_tree_with_socket_owners(nvml: FakeNvml, proc_root: Path) -> None:
    from tests.unit.proctrees import FakeProc

    fp = FakeProc(proc_root)
    port = fp.listen("127.0.0.1", 11434)
    fp.process(800, "llmd", ["/opt/llmd", "serve"], sockets=[port])
    fp.process(801, "llmd-worker", ["/opt/llmd-worker"], ppid=800)
    fp.write_net()
    nvml.compute = [entry(801, GIB)]
    snap = reader(nvml, proc_root).read()
    assert snap.tree is not None and [n.pid for n in snap.tree.lineage(801)] == [801, 800]
    assert snap.tree.nodes[800].sockets == frozenset({port})
    assert snap.notes == ()


def test_a_failing_process_tree_read_costs_the_tree_not_the_snapshot(nvml: FakeNvml, proc_root: Path) -> None:
    from tests.unit.proctrees import FakeProc

    fp = FakeProc(proc_root)
    fp.listen("127.0.0.1", 11434)
    fp.process(801, "worker", ["worker"])
    fp.write_net()
    nvml.compute = [entry(801, GIB)]

    def broken(fd_dir: str) -> list[str]:
        raise RuntimeError("unexpected")

    snap = NvmlReader(nvml=nvml, proc_root=proc_root, clock=ManualClock(start=50.0), clk_tck=CLK_TCK,
                      fd_links=broken).read()
    assert snap.tree is None and [p.pid for p in snap.processes] == [801]
    assert any("process tree unreadable" in n for n in snap.notes), snap.notes
