"""Model files handled safely (issue 25): regular files only, opened without blocking or following a
link; never outside the folder a file was found in; Ollama digests checked; warms bounded by size,
allocation and time; unknown names never re-walk the folders; shutdown never waits on a read."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from proxy.engines.loading import registry_from_dict
from proxy.engines.model_files import NotRegular, comfy_folders, ollama_store, open_regular, plain_files
from proxy.models.catalog import ModelCatalog
from proxy.models.fileio import FileWork, FileWorkBusy
from proxy.models.pagecache import SystemPageCache
from proxy.models.warm import WarmJob, warm_files
from proxy.tasks import poll_until

BOUND_S = 5.0  # only turns a hang into a failure
PLENTY = 1 << 50  # MemAvailable that never stops a warm


T = TypeVar("T")


def within(fn: Callable[[], T]) -> T:
    """fn() on a daemon thread; fails (instead of hanging the suite) if it is not back within BOUND_S."""
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(BOUND_S)
    assert out, f"{fn} blocked for more than {BOUND_S} s"
    return out[0]


def checkpoints(tmp_path: Path) -> Path:
    ck = tmp_path / "models" / "checkpoints"
    ck.mkdir(parents=True)
    (ck / "real.safetensors").write_bytes(b"w" * 8192)
    return ck


# -- regular files only --------------------------------------------------------------------------

def test_a_fifo_is_neither_waited_on_nor_read_and_is_named_with_its_reason(tmp_path: Path) -> None:
    ck = checkpoints(tmp_path)
    os.mkfifo(ck / "trap.safetensors")
    found = within(lambda: comfy_folders("comfyui", [tmp_path / "models"], {}))
    assert [m.name for m in found.models] == ["real.safetensors"]
    assert any("FIFO" in k.reason for k in found.skipped), found.skipped
    reading = within(lambda: SystemPageCache().measure(str(ck / "trap.safetensors")))
    assert reading.cached_bytes is None and "FIFO" in (reading.unknown_reason or ""), reading
    job = WarmJob("comfyui:trap", (str(ck / "trap.safetensors"),), 1 << 30, "test")
    within(lambda: warm_files(job, 0, lambda: PLENTY))
    assert job.state == "skipped" and job.read_bytes == 0 and "FIFO" in (job.stop_reason or ""), job


def test_a_device_is_skipped_not_read(tmp_path: Path) -> None:
    with pytest.raises(NotRegular, match="character device"):
        open_regular("/dev/zero")
    job = WarmJob("x:zero", ("/dev/zero",), 1 << 40, "test")
    within(lambda: warm_files(job, 0, lambda: PLENTY))
    assert job.state == "skipped" and job.read_bytes == 0, job
    # named in model_paths (the operator allowed the place), still not a regular file
    os.symlink("/dev/zero", tmp_path / "zero.bin")
    found = plain_files("stt", [tmp_path / "zero.bin"])
    assert found.models == [] and "character device" in found.skipped[0].reason, found


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a device node needs root (CI runs as root)")
def test_a_device_node_made_inside_a_model_folder_is_skipped(tmp_path: Path) -> None:
    ck = checkpoints(tmp_path)
    os.mknod(ck / "dev.safetensors", 0o600 | 0o020000, os.makedev(1, 5))  # a character device: /dev/zero's numbers
    found = comfy_folders("comfyui", [tmp_path / "models"], {})
    assert [m.name for m in found.models] == ["real.safetensors"]
    assert any("character device" in k.reason for k in found.skipped), found.skipped


# -- never outside the folders --------------------------------------------------------------------

def test_a_link_to_a_file_outside_the_folder_is_skipped_and_named(tmp_path: Path) -> None:
    ck = checkpoints(tmp_path / "c")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "shadow").write_text("root:$6$x:19000::::::\n")
    os.symlink(secret / "shadow", ck / "leak.safetensors")
    os.symlink(ck / "real.safetensors", ck / "alias.safetensors")  # a link that stays inside is fine
    found = comfy_folders("comfyui", [tmp_path / "c" / "models"], {})
    assert sorted(m.name for m in found.models) == ["alias.safetensors", "real.safetensors"]
    (skip,) = found.skipped
    assert skip.path.endswith("leak.safetensors") and "outside" in skip.reason and "model_paths" in skip.reason
    reading = SystemPageCache().measure(str(ck / "leak.safetensors"))
    assert reading.cached_bytes is None, "a link is never opened (O_NOFOLLOW), even when asked directly"


def test_a_link_into_a_folder_listed_in_model_paths_is_allowed(tmp_path: Path) -> None:
    from proxy.engines.model_files import Fence
    ck = checkpoints(tmp_path / "c")
    other = tmp_path / "big-disk"
    other.mkdir()
    (other / "flux.safetensors").write_bytes(b"f" * 4096)
    os.symlink(other / "flux.safetensors", ck / "flux.safetensors")
    found = comfy_folders("comfyui", [tmp_path / "c" / "models"], {}, Fence("comfyui", [tmp_path / "c", other]))
    flux = next(m for m in found.models if m.name == "flux.safetensors")
    assert flux.files == (str(other.resolve() / "flux.safetensors"),) and found.skipped == []


def test_ollama_digests_are_checked_before_a_path_is_built(tmp_path: Path) -> None:
    outside = tmp_path / "etc"
    outside.mkdir()
    (outside / "shadow").write_text("secret")
    m = tmp_path / "store" / "manifests" / "registry.ollama.ai" / "library" / "evil" / "latest"
    m.parent.mkdir(parents=True)
    m.write_text(json.dumps({"layers": [{"digest": "sha256:../../etc/shadow", "size": 6}]}))
    found = ollama_store("ollama", tmp_path / "store")
    assert found.models == [] and "digest" in found.problems[0].problem, found


def test_an_ollama_blob_that_is_a_link_out_of_the_store_is_skipped(tmp_path: Path) -> None:
    digest = "a" * 64
    m = tmp_path / "store" / "manifests" / "registry.ollama.ai" / "library" / "evil" / "latest"
    m.parent.mkdir(parents=True)
    m.write_text(json.dumps({"layers": [{"digest": f"sha256:{digest}", "size": 6}]}))
    (tmp_path / "store" / "blobs").mkdir()
    (tmp_path / "shadow").write_text("secret")
    os.symlink(tmp_path / "shadow", tmp_path / "store" / "blobs" / f"sha256-{digest}")
    found = ollama_store("ollama", tmp_path / "store")
    assert found.models == [] and "outside" in found.skipped[0].reason, found


# -- bounded warms ---------------------------------------------------------------------------------

def test_a_sparse_file_is_warmed_only_as_far_as_it_occupies_the_disk(tmp_path: Path) -> None:
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as f:
        f.truncate(256 << 20)  # 256 MiB of holes, no blocks
    allocated = os.stat(path).st_blocks * 512
    job = WarmJob("c:sparse", (str(path),), 256 << 20, "test")
    warm_files(job, 0, lambda: PLENTY, chunk_bytes=1 << 20)
    assert job.state == "done" and job.read_bytes <= allocated, (job, allocated)


def test_a_warm_reads_no_more_than_the_manifest_says(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (3 << 20))
    job = WarmJob("o:m", (str(path),), 1 << 20, "test", sizes=(1 << 20,))
    warm_files(job, 0, lambda: PLENTY, chunk_bytes=256 << 10)
    assert job.state == "done" and job.read_bytes == 1 << 20, job


def test_a_warm_ends_at_its_time_bound(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (4 << 20))
    ticks = iter(range(100))
    job = WarmJob("o:m", (str(path),), 4 << 20, "test")
    warm_files(job, 0, lambda: PLENTY, chunk_bytes=1 << 20, now=lambda: float(next(ticks)), max_s=2.5)
    assert job.state == "timeout" and job.read_bytes < 4 << 20 and "time bound" in (job.stop_reason or ""), job


def test_the_margin_is_checked_before_every_chunk(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (4 << 20))
    left = [6 << 20]

    def available() -> int:
        left[0] -= 1 << 20
        return left[0]
    job = WarmJob("o:m", (str(path),), 4 << 20, "test")
    warm_files(job, 2 << 20, available, chunk_bytes=1 << 20)
    assert job.state == "margin" and 0 < job.read_bytes < 4 << 20, job


# -- bounded locating ------------------------------------------------------------------------------

def test_unknown_names_never_walk_the_folders_again(tmp_path: Path) -> None:
    ck = checkpoints(tmp_path)
    for i in range(2000):
        (ck / f"f{i:04}.safetensors").touch()
    reg = registry_from_dict({"tenants": {"comfyui": {"model_paths": [str(tmp_path / "models")]}}})
    clock = [0.0]
    catalog = ModelCatalog(reg, SystemPageCache(), cmdlines=lambda _t: [], now=lambda: clock[0])
    assert catalog.find("comfyui", "real.safetensors") is not None
    started = time.process_time()
    assert all(catalog.find("comfyui", f"nope{i}.safetensors") is None for i in range(500))
    assert catalog.walks == 1, f"{catalog.walks} walks for 500 unknown names: one per TTL at most"
    assert time.process_time() - started < 1.0
    clock[0] += 60  # past the TTL: one walk, then the names are looked up in it
    (ck / "new.safetensors").touch()
    assert catalog.find("comfyui", "new.safetensors") is not None and catalog.walks == 2


def test_a_walk_is_capped_in_entries_and_says_so(tmp_path: Path) -> None:
    from proxy.engines.model_files import Located, _files_under
    for i in range(50):
        (tmp_path / f"f{i}.bin").touch()
    found = Located()
    assert len(_files_under([tmp_path], depth=8, found=found, tenant="t", max_entries=10)) <= 50
    assert found.skipped and "more than 10 entries" in found.skipped[0].reason


# -- the threads ------------------------------------------------------------------------------------

async def test_closing_the_model_file_threads_never_waits_on_a_stuck_read() -> None:
    work = FileWork("test", workers=1, max_queued=1)
    stuck, began = threading.Event(), threading.Event()

    def stuck_read() -> None:
        began.set()
        stuck.wait()

    running = asyncio.ensure_future(work.run(stuck_read))
    async with asyncio.timeout(5):
        await poll_until(began.is_set)  # the one worker holds it
    queued = asyncio.ensure_future(work.run(lambda: None))
    await asyncio.sleep(0)
    with pytest.raises(FileWorkBusy):
        await work.run(lambda: None)  # the queue is full: refused at once, not piled up
    started = time.monotonic()
    work.close()
    for f in (running, queued):
        with pytest.raises(FileWorkBusy):
            await asyncio.wait_for(f, BOUND_S)
    assert time.monotonic() - started < 1.0
    assert all(t.daemon for t in work._threads), "a thread left inside a read must not keep the process alive"
    stuck.set()
