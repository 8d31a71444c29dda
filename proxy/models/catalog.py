"""Each tenant's model files and how much of them is in RAM: where its adapter finds them (cached
briefly: it walks directories) plus residency (cached briefly, invalidated by warms). Blocking: call
off the loop."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from proxy.engines import adapter_for
from proxy.engines.model_files import FileHints, Located, ModelFiles, TenantFiles
from proxy.models.pagecache import ModelResidency, PageCacheProbe, ResidencyCache, summed
from proxy.tenants import Registry, Tenant

LOCATE_TTL_S = 10.0  # a model pulled or deleted shows up within this
UNKNOWN_TTL_S = 1.0


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

    # -- where ----------------------------------------------------------------------------------
    def tenant_files(self, tenant: Tenant) -> TenantFiles | None:
        """Where the tenant's adapter says its files are; None: nothing to look for (an engine with no
        layout of its own and no model_paths)."""
        hints = FileHints(self.env, self.home, engine_env=lambda: self.engine_env(tenant),
                          cmdlines=lambda: self.cmdlines(tenant.name))
        return adapter_for(tenant).model_files(hints)

    def all_files(self, fresh: bool = False) -> dict[str, TenantFiles]:
        with self._lock:
            hit = self._located
        if not fresh and hit is not None and self.now() < hit[0]:
            if not any(f.unknown_reason for f in hit[1].values()):
                return hit[1]
            # a tenant whose place was unknown (ComfyUI not seen yet) is looked at again; the others are kept
            out = {n: (self.tenant_files(self.registry.get(n)) or f) if f.unknown_reason else f for n, f in hit[1].items()}
        else:
            out = {t.name: f for t in self.registry if (f := self.tenant_files(t)) is not None}
        # e.g. ComfyUI not seen running yet: look again soon
        ttl = UNKNOWN_TTL_S if any(f.unknown_reason for f in out.values()) else LOCATE_TTL_S
        with self._lock:
            self._located = (self.now() + ttl, out)
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
        candidates = [m for m in self.models(tenant) if m.name in names]
        if not candidates:
            candidates = [m for m in self.all_files(fresh=True).get(tenant, _EMPTY).located.models if m.name in names]
        candidates.sort(key=lambda m: m.folder != "checkpoints")  # a ckpt_name names a checkpoint first
        return candidates[0] if candidates else None

    # -- how much is in RAM ---------------------------------------------------------------------
    def residency_of(self, model: ModelFiles) -> ModelResidency:
        return summed(self.residency.measure(p) for p in model.files)

    def files_changed(self, paths: Sequence[str]) -> None:
        self.residency.invalidate(paths)


_EMPTY = TenantFiles("", None, Located(), ())
