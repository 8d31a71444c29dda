"""Where each tenant's model files are: what an adapter's `model_files()` answers (the models/ layer
caches it and measures how much of it is in RAM).

- Ollama's store: `<root>/manifests/<host>/<namespace>/<model>/<tag>` (JSON: layers with digests)
  and `<root>/blobs/sha256-<hex>`. The root is `OLLAMA_MODELS`, else `~/.ollama/models` and the
  Linux service's `/usr/share/ollama/.ollama/models`.
- ComfyUI's folders: `<base>/models/<folder>` for checkpoints, diffusion_models, vae, clip, loras...,
  the base from `--base-directory` or the directory of its `main.py`, plus every
  `--extra-model-paths-config` YAML on its command line (and `extra_model_paths.yaml` beside main.py).
- Any tenant: `model_paths` in tenants.json replaces what would be found (for Ollama: store roots;
  for ComfyUI: model folders' parent; otherwise files, or directories of files, one model each).

Pure over the file system: paths in, `Located` out; problems (missing or unreadable directories)
are data with a fix, never exceptions. Blocking (it walks directories): call it off the loop.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.tenants import Tenant

OLLAMA_DEFAULT_HOST = "registry.ollama.ai"
OLLAMA_DEFAULT_NAMESPACE = "library"
COMFY_FOLDERS = ("checkpoints", "diffusion_models", "unet", "vae", "clip", "text_encoders", "clip_vision", "loras",
                 "controlnet", "upscale_models", "embeddings", "style_models", "hypernetworks", "gligen", "vae_approx")
MODEL_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pt2", ".pth", ".bin", ".gguf", ".pkl", ".onnx")


@dataclass(frozen=True, slots=True)
class ModelFiles:
    tenant: str
    name: str  # what requests call it: "llama3.2:3b", a checkpoint's name under its folder, a file name
    folder: str  # "ollama", "checkpoints", "vae", ... or "files"
    files: tuple[str, ...]
    size_bytes: int

    @property
    def key(self) -> str:
        return f"{self.tenant}:{self.name}"


@dataclass(frozen=True, slots=True)
class LocateProblem:
    tenant: str
    path: str
    problem: str
    fix: str

    def to_json(self) -> dict[str, str]:
        return {"tenant": self.tenant, "path": self.path, "problem": self.problem, "fix": self.fix}


@dataclass(slots=True)
class Located:
    models: list[ModelFiles] = field(default_factory=list)
    roots: list[str] = field(default_factory=list)
    problems: list[LocateProblem] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TenantFiles:
    tenant: str
    layout: str | None  # how the files are laid out ("ollama", "comfyui"; None: model_paths as given): shown, never compared
    located: Located
    looked_in: tuple[str, ...]
    unknown_reason: str | None = None  # where the files are cannot be said (ComfyUI not seen running)


@dataclass(frozen=True, slots=True)
class FileHints:
    """What an adapter may look at to find its engine's model files. The callables are asked only
    by an adapter that needs them (reading another process's environment is not free)."""

    env: Mapping[str, str]  # the proxy's own environment: the best guess when the engine's cannot be read
    home: Path | None
    engine_env: Callable[[], Mapping[str, str] | None]  # the engine's own environment; None: unreadable
    cmdlines: Callable[[], Sequence[str]]  # command lines of the engine's processes (from the GPU snapshot)


def configured_paths(tenant: Tenant) -> list[Path]:
    """The tenant's model_paths from tenants.json, `~` expanded: they replace what would be found."""
    return [Path(os.path.expanduser(p)) for p in tenant.model_paths]


def plain_tenant_files(tenant: Tenant) -> TenantFiles | None:
    """Only model_paths say (None: nothing to look for)."""
    paths = configured_paths(tenant)
    if not paths:
        return None
    return TenantFiles(tenant.name, None, plain_files(tenant.name, paths), tuple(map(str, paths)))


# -- Ollama ---------------------------------------------------------------------------------------

def ollama_tenant_files(tenant: Tenant, hints: FileHints) -> TenantFiles:
    """The stores under model_paths, else where the engine's environment (else the proxy's) says."""
    paths = configured_paths(tenant)
    engine = None if paths else hints.engine_env()
    roots = paths or (ollama_roots(engine) if engine is not None else ollama_roots(hints.env, hints.home))
    parts = [ollama_store(tenant.name, r) for r in roots if paths or r.exists()]
    found = merge(parts)
    if not parts:
        found.problems.append(LocateProblem(
            tenant.name, ", ".join(map(str, roots)), f"no Ollama models directory in {', '.join(map(str, roots))}",
            f"set tenants.{tenant.name}.model_paths to Ollama's models directory (its OLLAMA_MODELS)"))
    return TenantFiles(tenant.name, "ollama", found, tuple(map(str, roots)))


def ollama_name_parts(name: str) -> tuple[str, str, str, str]:
    """"llama3.2:3b" -> (registry.ollama.ai, library, llama3.2, 3b), as Ollama's model name parser does."""
    last = name.rsplit("/", 1)[-1]
    path, tag = (name.rsplit(":", 1) if ":" in last else (name, "latest"))
    parts = path.split("/")
    if len(parts) == 1:
        return OLLAMA_DEFAULT_HOST, OLLAMA_DEFAULT_NAMESPACE, parts[0], tag
    if len(parts) == 2:
        return OLLAMA_DEFAULT_HOST, parts[0], parts[1], tag
    return parts[-3], parts[-2], parts[-1], tag


def ollama_display_name(host: str, namespace: str, model: str, tag: str) -> str:
    if host == OLLAMA_DEFAULT_HOST:
        return f"{model}:{tag}" if namespace == OLLAMA_DEFAULT_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def blob_path(root: Path, digest: str) -> Path:
    return root / "blobs" / digest.replace(":", "-")


def ollama_manifest_files(root: Path, manifest: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(blob path, size) of every layer (weights, projector, adapters, template) and the config."""
    out = []
    for layer in [*(manifest.get("layers") or []), manifest.get("config") or {}]:
        digest = layer.get("digest") if isinstance(layer, dict) else None
        if isinstance(digest, str) and digest.startswith("sha256:"):
            out.append((str(blob_path(root, digest)), int(layer.get("size") or 0)))
    return out


def ollama_store(tenant: str, root: Path) -> Located:
    found = Located()
    manifests = root / "manifests"
    try:
        hosts = sorted(manifests.iterdir())
    except PermissionError:
        found.problems.append(LocateProblem(tenant, str(manifests), f"permission denied listing {manifests}",
                                            "run the proxy as Ollama's user (or root), or add it to that user's group"))
        return found
    except OSError as exc:
        found.problems.append(LocateProblem(tenant, str(manifests), f"cannot list {manifests}: {exc.strerror or exc}",
                                            f"set tenants.{tenant}.model_paths to Ollama's models directory (OLLAMA_MODELS)"))
        return found
    found.roots.append(str(root))
    for path in _files_under(hosts, depth=3):
        rel = path.relative_to(manifests).parts
        if len(rel) != 4:
            continue
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            found.problems.append(LocateProblem(tenant, str(path), f"unreadable manifest: {exc}",
                                                "run `ollama list`; re-pull the model if it is broken"))
            continue
        files = ollama_manifest_files(root, manifest) if isinstance(manifest, dict) else []
        if not files:
            continue
        found.models.append(ModelFiles(tenant, ollama_display_name(*rel), "ollama", tuple(p for p, _ in files),
                                       sum(s for _, s in files)))
    return found


def ollama_roots(env: Mapping[str, str], home: Path | None = None) -> list[Path]:
    """Where Ollama keeps its models, in the order Ollama would look: OLLAMA_MODELS, else the home of
    the user running it (`home`, else the environment's HOME, else this user's; then the Linux
    service user's)."""
    if env.get("OLLAMA_MODELS"):
        return [Path(env["OLLAMA_MODELS"]).expanduser()]
    home = home or (Path(env["HOME"]) if env.get("HOME") else Path.home())
    return [home / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


# -- ComfyUI ---------------------------------------------------------------------------------------

def comfyui_tenant_files(tenant: Tenant, hints: FileHints) -> TenantFiles:
    """The model folders under model_paths, else the ones its command line names (unknown until seen)."""
    layout = "comfyui"
    paths = configured_paths(tenant)
    if paths:
        return TenantFiles(tenant.name, layout, comfy_folders(tenant.name, paths, {}), tuple(map(str, paths)))
    argv = argv_of(hints.cmdlines())
    base, configs = comfy_argv_paths(argv)
    if base is None:
        why = ("its command line was not seen (no process of it on the GPU yet)" if not argv else
               "its command line names neither --base-directory nor an absolute main.py path")
        return TenantFiles(tenant.name, layout, Located(), (), f"ComfyUI's model folders are unknown: {why}")
    extra: dict[str, list[Path]] = {}
    for config in configs:
        try:
            parsed = parse_extra_model_paths(config.read_text(), config.parent)
        except OSError:
            continue  # the default extra_model_paths.yaml is optional; ComfyUI skips a missing one too
        for folder, dirs in parsed.items():
            extra.setdefault(folder, []).extend(dirs)
    found = comfy_folders(tenant.name, [base / "models"], extra)
    return TenantFiles(tenant.name, layout, found, (str(base / "models"), *map(str, configs)))


def comfy_argv_paths(argv: Sequence[str]) -> tuple[Path | None, list[Path]]:
    """(base directory, extra model path configs) from ComfyUI's command line."""
    base: Path | None = None
    configs: list[Path] = []
    main = next((a for a in argv if a.endswith("main.py")), None)
    if main and os.path.isabs(main):
        base = Path(main).parent
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name == "--base-directory":
            if eq:
                base = Path(value)
            elif i + 1 < len(argv):
                base, i = Path(argv[i + 1]), i + 1
        elif name == "--extra-model-paths-config":
            if eq:
                configs.append(Path(value))
            while i + 1 < len(argv) and not argv[i + 1].startswith("-"):  # nargs="+"
                configs.append(Path(argv[i + 1]))
                i += 1
        i += 1
    if base is not None:
        configs.insert(0, base / "extra_model_paths.yaml")  # ComfyUI loads it when present
    return base, configs


def parse_extra_model_paths(text: str, config_dir: Path) -> dict[str, list[Path]]:
    """ComfyUI's extra_model_paths.yaml: sections with a `base_path` (relative to the file) and
    folder -> one path per line (relative to base_path)."""
    data = _yaml(text)
    out: dict[str, list[Path]] = {}
    if not isinstance(data, dict):
        return out
    for section in data.values():
        if not isinstance(section, dict):
            continue
        base = Path(os.path.expanduser(str(section.get("base_path") or "")))
        if not base.is_absolute():
            base = config_dir / base
        for folder, value in section.items():
            if folder in ("base_path", "is_default") or not isinstance(value, str):
                continue
            for line in value.splitlines():
                line = line.strip()
                if line:
                    out.setdefault(str(folder), []).append(base / os.path.expanduser(line))
    return out


def _yaml(text: str) -> Any:
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - the subset ComfyUI's example uses
        return _tiny_yaml(text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def _tiny_yaml(text: str) -> dict[str, dict[str, str]]:
    """Two levels of `key: value` and `key: |` blocks: the shape of extra_model_paths.yaml."""
    out: dict[str, dict[str, str]] = {}
    section: dict[str, str] | None = None
    block: str | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        key, _, value = line.strip().partition(":")
        if indent == 0:
            section = out.setdefault(key, {})
            block = None
        elif section is not None and block is not None and indent > 4 and ":" not in line.strip():
            section[block] += line.strip() + "\n"
        elif section is not None:
            value = value.strip()
            block = key if value in ("|", ">") else None
            section[key] = "" if block else value
    return out


def comfy_folders(tenant: str, models_dirs: Sequence[Path], extra: Mapping[str, list[Path]]) -> Located:
    found = Located()
    folders: list[tuple[str, Path]] = [(f, d / f) for d in models_dirs for f in COMFY_FOLDERS]
    folders += [(f, p) for f, paths in extra.items() for p in paths]
    for d in models_dirs:
        if not d.is_dir():
            found.problems.append(LocateProblem(tenant, str(d), f"ComfyUI's model directory {d} does not exist",
                                                f"start ComfyUI with --base-directory, or set tenants.{tenant}.model_paths"))
        elif not os.access(d, os.R_OK | os.X_OK):
            found.problems.append(LocateProblem(tenant, str(d), f"permission denied listing {d}",
                                                "run the proxy as ComfyUI's user, or give it read access"))
        else:
            found.roots.append(str(d))
    seen: set[str] = set()
    for folder, path in folders:
        if not path.is_dir():
            continue
        for f in _files_under([path], depth=8):
            if f.suffix.lower() in MODEL_SUFFIXES and str(f) not in seen:
                seen.add(str(f))
                found.models.append(ModelFiles(tenant, str(f.relative_to(path)), folder, (str(f),), _size(f)))
    return found


# -- any tenant --------------------------------------------------------------------------------------

def plain_files(tenant: str, paths: Sequence[Path]) -> Located:
    """model_paths of a tenant without a known layout: a file is a model; a directory holds one per file."""
    found = Located()
    for p in paths:
        if p.is_file():
            found.models.append(ModelFiles(tenant, p.name, "files", (str(p),), _size(p)))
        elif p.is_dir():
            found.roots.append(str(p))
            for f in _files_under([p], depth=8):
                found.models.append(ModelFiles(tenant, str(f.relative_to(p)), "files", (str(f),), _size(f)))
        else:
            found.problems.append(LocateProblem(tenant, str(p), f"{p} does not exist or cannot be read",
                                                f"fix tenants.{tenant}.model_paths in tenants.json"))
    return found


def files_summary(found: Located) -> str:
    """What was found, for a health line: the folders, and model files that lie in none of them
    (model_paths may name a file)."""
    loose = [f for m in found.models for f in m.files
             if not any(f == r or f.startswith(r.rstrip(os.sep) + os.sep) for r in found.roots)]
    n = f"{len(found.models)} model(s)"
    if not found.roots:
        return f"{n}: {', '.join(loose)}" if loose else n
    return f"{n} in {', '.join(found.roots)}" + (f" and {', '.join(loose)}" if loose else "")


def merge(parts: Iterable[Located]) -> Located:
    out = Located()
    for part in parts:
        out.models.extend(part.models)
        out.roots.extend(part.roots)
        out.problems.extend(part.problems)
    return out


def argv_of(cmdlines: Iterable[str]) -> list[str]:
    """The first command line that runs a main.py, split as the shell would (GPU process cmdlines)."""
    for cmdline in cmdlines:
        try:
            argv = shlex.split(cmdline)
        except ValueError:
            argv = cmdline.split()
        if any(a.endswith("main.py") for a in argv) or "--base-directory" in cmdline:
            return argv
    return []


def _files_under(dirs: Iterable[Path], depth: int) -> list[Path]:
    out: list[Path] = []
    for d in dirs:
        if d.is_file():
            out.append(d)
            continue
        for dirpath, dirnames, filenames in os.walk(d, onerror=lambda _e: None):
            if len(Path(dirpath).relative_to(d).parts) >= depth:
                dirnames.clear()
            dirnames.sort()
            out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
    return out


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0
