"""Real files standing for the simulated models, so residency, warming and their effect on a load
can be seen on the demo box.

Each model gets a file of 1/1024 of its size (a 16 GiB model: 16 MiB), its blocks allocated but never
written (`posix_fallocate`: no disk writes, no dirty pages; it reads as zeros): a warm reads what a
file occupies on disk, and a sparse file occupies nothing (models/warm.py). Laid
out as the real engine keeps it: an Ollama store (`manifests/...` naming the model's real size,
`blobs/sha256-...`) and ComfyUI's `models/checkpoints/`. A simulated load measures how much of its
file is in the page cache, reads it (as the engine would: it is cached afterwards) and takes
`resident / load_gbps + rest / disk_gbps`. Dropping the files from the cache (`drop_all`) makes the
next load cold again. The directory is created on a disk (not tmpfs, which cannot drop pages) when
one is available, and removed with the box. It names its owner (`.owner`: pid and start time), so a
demo killed -9 (whose box never removed it: 53 MB each, issue 42) leaves nothing for long: the next
box removes every such folder whose owner no longer runs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from proxy.lifecycle import procs
from proxy.models.pagecache import SystemPageCache
from proxy.sim.ollama_wire import blob_digest, normalise_name

SCALE = 1024  # file size = model size / SCALE
DISK_DIRS = ("/var/tmp",)  # tried before the default temp dir: /tmp is often tmpfs


def load_seconds(size_bytes: int, resident: float, load_gbps: float, disk_gbps: float | None, gb: float = 1e9) -> float:
    """A load reads the resident part at memory speed and the rest at disk speed (None: no disk)."""
    if disk_gbps is None:
        return size_bytes / (load_gbps * gb)
    resident = min(1.0, max(0.0, resident))
    return size_bytes * resident / (load_gbps * gb) + size_bytes * (1 - resident) / (disk_gbps * gb)


PREFIX = "hyperswap-models-"
OWNER = ".owner"


def remove_abandoned(base: Path) -> list[Path]:
    """Remove the model folders in `base` whose owner (a box of a demo killed -9) no longer runs; a
    folder with no owner file, or one whose owner runs, is left alone."""
    removed = []
    for folder in base.glob(f"{PREFIX}*"):
        try:
            owner = json.loads((folder / OWNER).read_text())
            pid, started = int(owner["pid"]), owner["start_time"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if started is None or procs.same(pid, int(started)):
            continue  # runs (or cannot be told: left alone)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


class SimModelFiles:
    def __init__(self, root: Path | None = None) -> None:
        if root is None:
            base = next((d for d in DISK_DIRS if os.access(d, os.W_OK)), None)
            remove_abandoned(Path(base or tempfile.gettempdir()))
            root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
            (root / OWNER).write_text(json.dumps({"pid": os.getpid(), "start_time": procs.start_time(os.getpid())}))
        self.root = root
        self.probe = SystemPageCache()
        self.files: list[Path] = []
        self.sizes: dict[str, int] = {}  # path -> the size of the model its stand-in file stands for

    @property
    def ollama_root(self) -> Path:
        return self.root / "ollama"

    @property
    def comfy_base(self) -> Path:
        return self.root / "comfyui"

    # -- writing ----------------------------------------------------------------------------------
    def _sparse(self, path: Path, size_bytes: int) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            size = max(4096, size_bytes // SCALE)
            try:
                os.posix_fallocate(f.fileno(), 0, size)
            except OSError:  # a file system without fallocate: sparse, and warms of it read nothing
                f.truncate(size)
        self.files.append(path)
        self.sizes[str(path)] = size_bytes
        return path

    def model_size(self, path: str) -> int | None:
        """The size of the model a stand-in file stands for (None: not one of these files)."""
        return self.sizes.get(path)

    def ollama_blob(self, name: str) -> Path:
        return self.ollama_root / "blobs" / f"sha256-{blob_digest(name)}"

    def add_ollama_model(self, name: str, size_bytes: int) -> Path:
        name = normalise_name(name)
        model, _, tag = name.rpartition(":")
        parts = model.split("/")
        where = ["registry.ollama.ai", "library", *parts] if len(parts) == 1 else (
            ["registry.ollama.ai", *parts] if len(parts) == 2 else parts)
        manifest = self.ollama_root / "manifests" / Path(*where) / tag
        manifest.parent.mkdir(parents=True, exist_ok=True)
        layer = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{blob_digest(name)}",
                 "size": size_bytes}  # the real model's size; the blob is a 1/SCALE stand-in
        manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [layer]}))
        return self._sparse(self.ollama_blob(name), size_bytes)

    def comfy_checkpoint(self, name: str) -> Path:
        return self.comfy_base / "models" / "checkpoints" / name

    def add_comfy_checkpoint(self, name: str, size_bytes: int) -> Path:
        return self._sparse(self.comfy_checkpoint(name), size_bytes)

    # -- the page cache -----------------------------------------------------------------------------
    def resident(self, path: Path) -> float:
        """Fraction of the file in the page cache (0 when it cannot be measured: the sim loads cold)."""
        reading = self.probe.measure(str(path))
        return reading.fraction or 0.0

    def engine_read(self, path: Path) -> None:
        """What the engine's load does to the cache: the whole file is read."""
        try:
            with open(path, "rb", buffering=0) as f:
                while f.read(8 << 20):
                    pass
        except OSError:
            pass

    def drop_all(self) -> bool:
        """Every file out of the page cache; False when this file system keeps them (tmpfs)."""
        for path in self.files:
            try:
                self.probe.drop(str(path))
            except OSError:
                return False
        return all(self.resident(p) < 0.01 for p in self.files)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
