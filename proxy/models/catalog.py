"""Each tenant's model files and how much of them is in RAM: where its adapter finds them (cached
briefly: it walks directories) plus residency (cached briefly, invalidated by warms). Blocking: call
off the loop, on `work` (the model-file threads, never asyncio's default pool).

Locating is bounded (issue 25: each unknown name re-walked the folders, 2.3 s of CPU a request):
the folders are walked at most once per `LOCATE_TTL_S` (one walk at a time; callers meanwhile share
its result), a name not found is remembered until the next walk (`MAX_NEGATIVE` names at most), and
each walk is capped in depth and entries (engines/model_files.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from proxy.config.registry import Registry
from proxy.config.schema import Tenant
from proxy.engines import adapter_for
from proxy.engines.model_files import FileHints, Located, ModelFiles, TenantFiles
from proxy.models.fileio import FileWork
from proxy.models.pagecache import ModelResidency, PageCacheProbe, ResidencyCache, summed

LOCATE_TTL_S = 10.0  # a model pulled or deleted shows up within this
UNKNOWN_TTL_S = 1.0
MAX_NEGATIVE = 4096  # names remembered as not found (until the next walk)


class ModelCatalog:
    def __init__(self, registry: Registry, probe: PageCacheProbe, *, cmdlines: Callable[[str], Sequence[str]],
                 env: Mapping[str, str] | None = None, home: Path | None = None,
                 engine_env: Callable[[Tenant], Mapping[str, str] | None] = lambda tenant: None,
                 now: Callable[[], float] = time.monotonic, residency_ttl_s: float = 5.0) -> None:
        self.registry = registry
        self.cmdlines = cmdlines  # tenant -> command lines of its processes (from the GPU snapshot)
        # The engine's own environment decides where it keeps its models (OLLAMA_MODELS, HOME); when
        # it cannot be read (None), the proxy's environment is the best guess.
        self.engine_env = engine_env
        self.env = dict(os.environ if env is None else env)
        self.home = home
        self.now = now
        self.residency = ResidencyCache(probe, now, residency_ttl_s)
        self._located: tuple[float, dict[str, TenantFiles]] | None = None  # (expires at, found)
        self._lock = threading.Lock()
        self._walking = threading.Lock()  # one walk at a time; a caller that waited uses its result
        self._missing: dict[tuple[str, str], None] = {}  # (tenant, name) not found by the current walk
        self._walked_at = float("-inf")
        self.walks = 0  # how many times the folders were walked (tests, benches)
        self.work = FileWork("model-files", workers=2, max_queued=32)

    # -- where ----------------------------------------------------------------------------------
    def tenant_files(self, tenant: Tenant) -> TenantFiles | None:
        """Where the tenant's adapter says its files are; None: nothing to look for (an engine with no
        layout of its own and no model_paths)."""
        hints = FileHints(self.env, self.home, engine_env=lambda: self.engine_env(tenant),
                          cmdlines=lambda: self.cmdlines(tenant.name))
        return adapter_for(tenant).model_files(hints)

    def all_files(self, fresh: bool = False) -> dict[str, TenantFiles]:
        """Every tenant's files: walked again only once the last walk is `LOCATE_TTL_S` old (or
        `fresh`: a test, or an operator's explicit refresh), never by a name not found."""
        with self._lock:
            hit = self._located
        unknown = hit is not None and any(f.unknown_reason for f in hit[1].values())
        if not fresh and hit is not None and self.now() < hit[0] and not unknown:
            return hit[1]
        with self._walking:
            with self._lock:
                again = self._located
            if again is not hit and again is not None and self.now() < again[0] and not fresh:
                return again[1]  # walked while this caller waited
            if hit is not None and not fresh and self.now() < self._walked_at + LOCATE_TTL_S and unknown:
                # only a tenant whose place was unknown (ComfyUI not seen yet: its command line is
                # looked at, nothing walked until it is known) is looked at again
                out = {n: (self.tenant_files(self.registry.get(n)) or f) if f.unknown_reason else f
                       for n, f in hit[1].items()}
            else:
                out = {t.name: f for t in self.registry if (f := self.tenant_files(t)) is not None}
                self.walks += 1
                self._walked_at = self.now()
            # e.g. ComfyUI not seen running yet: look again soon
            ttl = UNKNOWN_TTL_S if any(f.unknown_reason for f in out.values()) else LOCATE_TTL_S
            with self._lock:
                self._located = (self.now() + ttl, out)
                self._missing.clear()
        return out

    def stale(self) -> bool:
        with self._lock:
            hit = self._located
        return hit is None or self.now() >= hit[0]

    def models(self, tenant: str | None = None) -> list[ModelFiles]:
        return [m for name, f in self.all_files().items() if tenant in (None, name) for m in f.located.models]

    def find(self, tenant: str, model: str) -> ModelFiles | None:
        """The files of `model` as a request names it ("gemma3" is "gemma3:latest"; a checkpoint by its name)."""
        names = {model}
        if ":" not in model.rsplit("/", 1)[-1]:
            names.add(f"{model}:latest")
        found = self.all_files()  # walks only when the last walk is old: an unknown name never forces one
        with self._lock:
            if (tenant, model) in self._missing:
                return None
        candidates = [m for m in found.get(tenant, _EMPTY).located.models if m.name in names]
        if not candidates:
            with self._lock:
                self._missing[(tenant, model)] = None
                while len(self._missing) > MAX_NEGATIVE:
                    del self._missing[next(iter(self._missing))]
            return None
        candidates.sort(key=lambda m: m.folder != "checkpoints")  # a ckpt_name names a checkpoint first
        return candidates[0] if candidates else None

    # -- how much is in RAM ---------------------------------------------------------------------
    def residency_of(self, model: ModelFiles) -> ModelResidency:
        return summed(self.residency.measure(p) for p in model.files)

    def files_changed(self, paths: Sequence[str]) -> None:
        self.residency.invalidate(paths)


_EMPTY = TenantFiles("", None, Located(), ())
