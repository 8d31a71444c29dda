"""Page-cache residency on real files with the real page cache: dropped reads ~0 %, warmed ~100 %,
the cached reading follows a warm, an unreadable file is unknown (never 0 %), and warming stops at
the memory margin. tmpfs and some overlay file systems keep pages whatever DONTNEED says: those
directories are skipped, and the test is skipped with the reason when no directory can drop pages."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.models.pagecache import FileResidency, ResidencyCache, ResidentFile, SystemPageCache, summed
from proxy.models.warm import Warmer, WarmJob, may_read, read_mem_available, warm_files

MIB = 2**20
SIZE = 8 * MIB
ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, size: int = SIZE) -> Path:
    with open(path, "wb") as f:
        f.write(os.urandom(size))  # real blocks, not holes: the read goes through the file system
        f.flush()
        os.fsync(f.fileno())  # dirty pages cannot be dropped
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose file system really drops pages on POSIX_FADV_DONTNEED."""
    tried = []
    for parent in (tmp_path, Path("/var/tmp"), ROOT):
        try:
            d = Path(tempfile.mkdtemp(prefix="hs-pagecache-", dir=parent))
        except OSError as exc:
            tried.append(f"{parent}: {exc.strerror}")
            continue
        probe = _write(d / "probe")
        SystemPageCache().drop(str(probe))
        left = SystemPageCache().measure(str(probe)).fraction
        if left is not None and left < 0.05:
            try:
                yield d
            finally:
                subprocess.run(["rm", "-rf", str(d)], check=False)
            return
        tried.append(f"{parent}: {100 * (left or 0):.0f} % still cached after DONTNEED")
        subprocess.run(["rm", "-rf", str(d)], check=False)
    pytest.skip("no directory here drops pages on POSIX_FADV_DONTNEED (tmpfs/overlay?): " + "; ".join(tried))


@pytest.mark.parametrize("cachestat", [True, False], ids=["cachestat", "mincore"])
def test_a_dropped_file_reads_about_0_percent_and_a_read_one_about_100(model_dir: Path, cachestat: bool) -> None:
    probe = SystemPageCache(use_cachestat=cachestat)
    f = str(_write(model_dir / "model.gguf"))
    probe.drop(f)
    cold = probe.measure(f)
    assert cold.method == ("cachestat" if cachestat else "mincore")
    assert cold.size_bytes == SIZE and cold.fraction is not None and cold.fraction < 0.05, cold
    with open(f, "rb") as fh:
        fh.read()
    warm = probe.measure(f)
    assert warm.fraction is not None and warm.fraction > 0.95, warm


def test_the_cached_reading_is_invalidated_by_a_warm(model_dir: Path) -> None:
    probe = SystemPageCache()
    f = str(_write(model_dir / "model.safetensors"))
    probe.drop(f)
    now = [0.0]
    cache = ResidencyCache(probe, lambda: now[0], ttl_s=60.0)
    assert (cache.measure(f).fraction or 0) < 0.05

    async def warm() -> WarmJob | None:
        warmer = Warmer(lambda: 0, lambda: 1 << 50, on_files_changed=cache.invalidate)
        warmer.start("t:m", [f], SIZE, "test")
        return await warmer.wait("t:m")

    job = asyncio.run(warm())
    assert job is not None and job.state == "done" and job.read_bytes == SIZE, job
    after = cache.measure(f)  # no time has passed: only the invalidation makes this a new reading
    assert after.fraction is not None and after.fraction > 0.95, f"the cache kept the pre-warm reading: {after}"


def test_a_kept_reading_is_served_until_its_ttl_when_nothing_warmed(model_dir: Path) -> None:
    probe = SystemPageCache()
    f = str(_write(model_dir / "m"))
    probe.drop(f)
    now = [0.0]
    cache = ResidencyCache(probe, lambda: now[0], ttl_s=5.0)
    first = cache.measure(f)
    with open(f, "rb") as fh:
        fh.read()
    assert cache.measure(f) is first, "within its TTL the reading is reused"
    now[0] = 6.0
    assert (cache.measure(f).fraction or 0) > 0.95


def _measure_as_nobody(path: str) -> dict[str, object]:
    """Root reads every file: measure in a child that became `nobody`, as a proxy that does not run as
    the files' owner (Ollama's service user keeps its blobs to itself)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = json.dumps(ResidentFile.of(SystemPageCache().measure(path)).model_dump(mode="json"))
        except BaseException as exc:
            out = json.dumps({"child_error": repr(exc)})
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return dict(json.loads(data))


def test_an_unreadable_file_is_unknown_with_the_reason_never_0_percent(tmp_path: Path) -> None:
    f = _write(tmp_path / "blob", MIB)
    f.chmod(0)
    if os.geteuid() == 0:
        reading = _measure_as_nobody(str(f))
    else:
        reading = ResidentFile.of(SystemPageCache().measure(str(f))).model_dump(mode="json")
    assert "child_error" not in reading, reading
    assert reading["cached_bytes"] is None and reading["resident_percent"] is None, reading
    assert "permission denied" in str(reading["unknown_reason"]), reading


def test_a_model_with_one_unknown_file_is_unknown_not_a_partial_sum() -> None:
    files = [FileResidency("/a", 100, 100, "cachestat"), FileResidency("/b", 100, None, None, "permission denied opening /b")]
    model = summed(files)
    assert model.cached_bytes is None and model.fraction is None and "permission denied" in (model.unknown_reason or "")
    assert summed(files[:1]).fraction == 1.0


def test_warming_stops_at_the_memory_margin(model_dir: Path) -> None:
    f = str(_write(model_dir / "big", 4 * MIB))
    SystemPageCache().drop(f)
    available = [10 * MIB]

    def mem() -> int:
        available[0] -= MIB  # each chunk read takes a MiB of the machine's available memory
        return available[0]

    job = warm_files(WarmJob("t:m", (f,), 4 * MIB, "test"), margin_bytes=7 * MIB, mem_available=mem, chunk_bytes=MIB)
    assert job.state == "margin" and "below the margin" in (job.stop_reason or ""), job
    # MemAvailable read 9, 8, then 7 MiB: a third chunk would leave 6 MiB, under the 7 MiB margin
    assert job.read_bytes == 2 * MIB, f"read {job.read_bytes} of 4 MiB: the margin was not kept"


def test_warming_does_not_start_when_memavailable_cannot_be_read() -> None:
    assert "cannot be read" in (may_read(None, MIB, 0) or "")
    assert may_read(10 * MIB, MIB, 9 * MIB) is None
    assert may_read(10 * MIB, 2 * MIB, 9 * MIB) is not None


def test_a_warm_can_be_stopped(model_dir: Path) -> None:
    f = str(_write(model_dir / "m", 4 * MIB))
    job = WarmJob("t:m", (f,), 4 * MIB, "test")
    job.stop_flag.set()
    assert warm_files(job, 0, lambda: 1 << 50, chunk_bytes=MIB).state == "stopped"
    assert job.read_bytes == 0


def test_memavailable_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   22000000 kB\n")
    assert read_mem_available(meminfo) == 22000000 * 1024
    assert read_mem_available(tmp_path / "missing") is None


def test_the_warm_line_of_a_sparse_stand_in_says_all_its_data_was_read_not_a_fraction(tmp_path: Path) -> None:
    f = tmp_path / "sparse.gguf"
    with open(f, "wb") as out:
        out.write(os.urandom(MIB))
        out.truncate(64 * MIB)  # 1 MiB of data, 63 MiB of hole: the demo's stand-in files are like this
    job = warm_files(WarmJob("t:m", (str(f),), 64 * MIB, "test"), 0, lambda: 1 << 50, chunk_bytes=MIB)
    assert job.state == "done" and job.read_bytes <= 2 * MIB, job
    line = job.summary()
    assert "all the data the files hold" in line and "64.0 MiB in size" in line, line
    assert "%" not in line, f"a done warm must not read as a small percentage: {line}"


def test_the_warm_line_of_a_stopped_warm_gives_the_share_read() -> None:
    job = WarmJob("t:m", ("f",), 4 * MIB, "test", state="margin", read_bytes=MIB, stop_reason="below the margin")
    assert job.summary() == "margin after reading 1.0 MiB of 4.0 MiB (25 %): below the margin"
