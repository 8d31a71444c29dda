"""Each tenant's model files and how much of them is in RAM: locate (cached briefly: it walks
directories) plus residency (cached briefly, invalidated by warms). Blocking: call off the loop."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from proxy.engines import adapter_for
from proxy.models import locate
from proxy.models.locate import Located, LocateProblem, ModelFiles
from proxy.models.pagecache import ModelResidency, PageCacheProbe, ResidencyCache, summed
from proxy.tenants import Registry, Tenant

LOCATE_TTL_S = 10.0  # a model pulled or deleted shows up within this
UNKNOWN_TTL_S = 1.0


@dataclass(frozen=True, slots=True)
class TenantFiles:
    tenant: str
    layout: str | None
    located: Located
    looked_in: tuple[str, ...]
    unknown_reason: str | None = None  # where the files are cannot be said (ComfyUI not seen running)


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
        """None: nothing to look for (a tenant with no known layout and no model_paths)."""
        layout = adapter_for(tenant).model_layout
        paths = [Path(os.path.expanduser(p)) for p in tenant.model_paths]
        if layout == "ollama":
            engine = None if paths else self.engine_env(tenant)
            roots = paths or (locate.ollama_roots(engine) if engine is not None else locate.ollama_roots(self.env, self.home))
            parts = [locate.ollama_store(tenant.name, r) for r in roots if paths or r.exists()]
            found = locate.merge(parts)
            if not parts:
                found.problems.append(LocateProblem(
                    tenant.name, ", ".join(map(str, roots)), f"no Ollama models directory in {', '.join(map(str, roots))}",
                    f"set tenants.{tenant.name}.model_paths to Ollama's models directory (its OLLAMA_MODELS)"))
            return TenantFiles(tenant.name, layout, found, tuple(map(str, roots)))
        if layout == "comfyui":
            if paths:
                return TenantFiles(tenant.name, layout, locate.comfy_folders(tenant.name, paths, {}), tuple(map(str, paths)))
            argv = locate.argv_of(self.cmdlines(tenant.name))
            base, configs = locate.comfy_argv_paths(argv)
            if base is None:
                why = ("its command line was not seen (no process of it on the GPU yet)" if not argv else
                       "its command line names neither --base-directory nor an absolute main.py path")
                return TenantFiles(tenant.name, layout, Located(), (), f"ComfyUI's model folders are unknown: {why}")
            extra: dict[str, list[Path]] = {}
            for config in configs:
                try:
                    parsed = locate.parse_extra_model_paths(config.read_text(), config.parent)
                except OSError:
                    continue  # the default extra_model_paths.yaml is optional; ComfyUI skips a missing one too
                for folder, dirs in parsed.items():
                    extra.setdefault(folder, []).extend(dirs)
            found = locate.comfy_folders(tenant.name, [base / "models"], extra)
            return TenantFiles(tenant.name, layout, found, (str(base / "models"), *map(str, configs)))
        if paths:
            return TenantFiles(tenant.name, layout, locate.plain_files(tenant.name, paths), tuple(map(str, paths)))
        return None

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

    def cached_models(self, tenant: str) -> list[ModelFiles] | None:
        """What the last look found, however old (None: never looked): for the request path, which
        must not walk directories."""
        with self._lock:
            hit = self._located
        if hit is None:
            return None
        found = hit[1].get(tenant)
        return found.located.models if found is not None else []

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
