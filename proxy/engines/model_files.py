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

The rules (issue 25: a FIFO froze the proxy, a symlink read /etc/shadow, a walk per unknown name):
- Regular files only. Anything else (FIFO, device, socket, directory) is skipped with the reason;
  files are opened with `O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC` and checked with `fstat` on the open
  descriptor (`open_regular`), so a FIFO's open returns at once and a file swapped for a link or a
  FIFO after it was listed is refused, not read.
- Inside the folder a file was found in: each path is resolved and must stay inside that folder
  (resolved too: a folder that is itself a link is the operator's choice), or inside a folder the
  tenant lists in `model_paths`. A link that leaves is skipped and named (`Skipped`).
- Ollama digests are `sha256:` + 64 hex digits before a blob path is built from one.
- A walk is bounded: at most `MAX_DEPTH` levels and `MAX_ENTRIES` entries per folder; what was
  left unlisted is said.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from proxy.config.schema import Tenant

OLLAMA_DEFAULT_HOST = "registry.ollama.ai"
OLLAMA_DEFAULT_NAMESPACE = "library"
COMFY_FOLDERS = ("checkpoints", "diffusion_models", "unet", "vae", "clip", "text_encoders", "clip_vision", "loras",
                 "controlnet", "upscale_models", "embeddings", "style_models", "hypernetworks", "gligen", "vae_approx")
MODEL_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pt2", ".pth", ".bin", ".gguf", ".pkl", ".onnx")
MAX_DEPTH = 8  # folder levels below a model folder
MAX_ENTRIES = 50_000  # files and directories listed per folder (a walk of 100,000 files took 2.3 s of CPU)
MAX_MANIFEST_BYTES = 1 << 20  # an Ollama manifest is a few hundred bytes
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class ModelFiles:
    tenant: str
    name: str  # what requests call it: "llama3.2:3b", a checkpoint's name under its folder, a file name
    folder: str  # "ollama", "checkpoints", "vae", ... or "files"
    files: tuple[str, ...]  # resolved paths, each inside the folder it was found in
    size_bytes: int
    sizes: tuple[int, ...] = ()  # per file: the size the manifest gives (Ollama), else the size listed; () unknown

    @property
    def key(self) -> str:
        return f"{self.tenant}:{self.name}"


@dataclass(frozen=True, slots=True)
class LocateProblem:
    """A place the model files should be and cannot be read (its JSON in /api/models is its fields)."""

    tenant: str
    path: str
    problem: str
    fix: str


@dataclass(frozen=True, slots=True)
class Skipped:
    """A file the proxy will not list, measure or read, and why (health and `hyperswap check` name it)."""

    tenant: str
    path: str
    reason: str


@dataclass(slots=True)
class Located:
    models: list[ModelFiles] = field(default_factory=list)
    roots: list[str] = field(default_factory=list)
    problems: list[LocateProblem] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


class NotRegular(OSError):
    """`open_regular` refused a path: its message says what it is instead of a regular file."""


def file_kind(mode: int) -> str | None:
    """None for a regular file, else what it is (the reason it is skipped)."""
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """Open `path` for reading without blocking and without following a link in its last part, and
    only if it is a regular file: (fd, fstat). O_NONBLOCK makes the open of a FIFO return at once (for
    reading it never waits for a writer); on a regular file it changes nothing. Raises NotRegular
    (with what it is) or the OSError of the open. The caller closes the fd."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegular(errno.ELOOP, f"{path} is a symbolic link (not followed)") from None
        raise
    try:
        st = os.fstat(fd)
        kind = file_kind(st.st_mode)
        if kind is not None:
            raise NotRegular(errno.EINVAL, f"{path} is {kind}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small(path: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """A small regular file's bytes (a manifest, a YAML config), never more than `limit`."""
    fd, st = open_regular(path)
    try:
        if st.st_size > limit:
            raise NotRegular(errno.EFBIG, f"{path} is {st.st_size} bytes, more than {limit} for a file of this kind")
        return os.read(fd, limit + 1)[:limit]
    finally:
        os.close(fd)


def inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


class Fence:
    """Where a tenant's files may resolve to: the folder each was found in, or a folder its
    model_paths lists (the operator said so). Resolves each path once."""

    def __init__(self, tenant: str, allowed: Sequence[Path] = ()) -> None:
        self.tenant = tenant
        self.allowed = [_real(p) for p in allowed]

    def admit(self, path: Path, folder: Path, found: Located) -> Path | None:
        """The resolved path when it is a regular file inside `folder` (resolved) or an allowed folder;
        else None, with the skip recorded."""
        real = _real(path)
        home = _real(folder)
        if not inside(real, home) and not any(inside(real, a) for a in self.allowed):
            found.skipped.append(Skipped(self.tenant, str(path), f"a link to {real}, outside {home} (add the target's "
                                         f"folder to tenants.{self.tenant}.model_paths to allow it)"))
            return None
        try:
            mode = os.stat(real).st_mode  # stat never blocks on a FIFO; the open checks again (fstat)
        except OSError as exc:
            found.skipped.append(Skipped(self.tenant, str(path), f"cannot stat it: {exc.strerror or exc}"))
            return None
        kind = file_kind(mode)
        if kind is not None:
            found.skipped.append(Skipped(self.tenant, str(path), f"{kind}, not a regular file"))
            return None
        return real


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


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
    return TenantFiles(tenant.name, None, plain_files(tenant.name, paths, Fence(tenant.name, paths)), tuple(map(str, paths)))


# -- Ollama ---------------------------------------------------------------------------------------

def ollama_tenant_files(tenant: Tenant, hints: FileHints) -> TenantFiles:
    """The stores under model_paths, else where the engine's environment (else the proxy's) says."""
    paths = configured_paths(tenant)
    engine = None if paths else hints.engine_env()
    roots = paths or (ollama_roots(engine) if engine is not None else ollama_roots(hints.env, hints.home))
    fence = Fence(tenant.name, paths)
    parts = [ollama_store(tenant.name, r, fence) for r in roots if paths or r.exists()]
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


def ollama_manifest_files(root: Path, manifest: Mapping[str, object]) -> list[tuple[str, int]]:
    """(blob path, size) of every layer (weights, projector, adapters, template) and the config.
    Raises ValueError on a digest that is not `sha256:` + 64 hex digits: no path is built from it."""
    out = []
    layers = manifest.get("layers")
    for layer in [*(layers if isinstance(layers, list) else []), manifest.get("config") or {}]:
        digest = layer.get("digest") if isinstance(layer, dict) else None
        if digest is None:
            continue
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise ValueError(f"a layer's digest {str(digest)[:80]!r} is not sha256: and 64 hex digits")
        size = layer.get("size")
        out.append((str(blob_path(root, digest)), size if isinstance(size, int) and size >= 0 else 0))
    return out


def ollama_store(tenant: str, root: Path, fence: Fence | None = None) -> Located:
    found = Located()
    fence = fence or Fence(tenant)
    manifests = root / "manifests"
    if not _listable(tenant, manifests, found):
        return found
    found.roots.append(str(root))
    for path in _files_under([manifests], depth=3, found=found, tenant=tenant):
        rel = path.relative_to(manifests).parts
        if len(rel) != 4:
            continue
        real = fence.admit(path, manifests, found)
        if real is None:
            continue
        files = _manifest_files(tenant, root, path, real, found)
        if files is None:
            continue
        blobs = _admitted_blobs(fence, root, files, found)
        if not blobs or len(blobs) != len(files):
            continue  # a model with a skipped blob is skipped whole: its residency would be a partial sum
        found.models.append(ModelFiles(tenant, ollama_display_name(*rel), "ollama", tuple(p for p, _ in blobs),
                                       sum(s for _, s in blobs), tuple(s for _, s in blobs)))
    return found


def _listable(tenant: str, manifests: Path, found: Located) -> bool:
    """Whether Ollama's manifests folder can be listed; a problem with its fix where not."""
    try:
        os.listdir(manifests)
    except PermissionError:
        found.problems.append(LocateProblem(tenant, str(manifests), f"permission denied listing {manifests}",
                                            "run the proxy as Ollama's user (or root), or add it to that user's group"))
        return False
    except OSError as exc:
        found.problems.append(LocateProblem(tenant, str(manifests), f"cannot list {manifests}: {exc.strerror or exc}",
                                            f"set tenants.{tenant}.model_paths to Ollama's models directory (OLLAMA_MODELS)"))
        return False
    return True


def _manifest_files(tenant: str, root: Path, path: Path, real: Path, found: Located) -> list[tuple[str, int]] | None:
    """The blobs a manifest names, with their sizes; None (skipped, or a problem with its fix) where it
    cannot be read."""
    try:
        manifest = json.loads(read_small(str(real)))
        return ollama_manifest_files(root, manifest) if isinstance(manifest, dict) else []
    except NotRegular as exc:
        found.skipped.append(Skipped(tenant, str(path), exc.strerror or str(exc)))
    except (OSError, ValueError) as exc:
        found.problems.append(LocateProblem(tenant, str(path), f"unreadable manifest: {exc}",
                                            "run `ollama list`; re-pull the model if it is broken"))
    return None


def _admitted_blobs(fence: Fence, root: Path, files: list[tuple[str, int]], found: Located) -> list[tuple[str, int]]:
    """The blobs the fence admits, in order, up to the first it does not (the model is then skipped whole)."""
    blobs: list[tuple[str, int]] = []
    for blob, size in files:
        admitted = fence.admit(Path(blob), root / "blobs", found)
        if admitted is None:
            break
        blobs.append((str(admitted), size))
    return blobs


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
        return TenantFiles(tenant.name, layout, comfy_folders(tenant.name, paths, {}, Fence(tenant.name, paths)),
                           tuple(map(str, paths)))
    argv = argv_of(hints.cmdlines())
    base, configs = comfy_argv_paths(argv)
    if base is None:
        why = ("its command line was not seen: it is read from ComfyUI's process on the GPU, and there is none "
               "(not started yet, or running with --cpu, which never has one)" if not argv else
               "its command line names neither --base-directory nor an absolute main.py path")
        return TenantFiles(tenant.name, layout, Located(), (),
                           f"ComfyUI's model folders are unknown: {why}; set tenants.{tenant.name}.model_paths "
                           "to its models folder")
    extra: dict[str, list[Path]] = {}
    for config in configs:
        try:
            parsed = parse_extra_model_paths(read_small(str(config)).decode("utf-8", "replace"), config.parent)
        except OSError:
            continue  # the default extra_model_paths.yaml is optional; ComfyUI skips a missing one too
        for folder, dirs in parsed.items():
            extra.setdefault(folder, []).extend(dirs)
    found = comfy_folders(tenant.name, [base / "models"], extra, Fence(tenant.name))
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


def _yaml(text: str) -> object:
    try:
        import yaml
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


def comfy_folders(tenant: str, models_dirs: Sequence[Path], extra: Mapping[str, list[Path]],
                  fence: Fence | None = None) -> Located:
    found = Located()
    fence = fence or Fence(tenant)
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
        for f in _files_under([path], depth=MAX_DEPTH, found=found, tenant=tenant):
            if f.suffix.lower() not in MODEL_SUFFIXES or str(f) in seen:
                continue
            seen.add(str(f))
            real = fence.admit(f, path, found)
            if real is not None:
                size = _size(real)
                found.models.append(ModelFiles(tenant, str(f.relative_to(path)), folder, (str(real),), size, (size,)))
    return found


# -- any tenant --------------------------------------------------------------------------------------

def plain_files(tenant: str, paths: Sequence[Path], fence: Fence | None = None) -> Located:
    """model_paths of a tenant without a known layout: a file is a model; a directory holds one per file."""
    found = Located()
    fence = fence or Fence(tenant, paths)
    for p in paths:
        if p.is_dir():
            found.roots.append(str(p))
            for f in _files_under([p], depth=MAX_DEPTH, found=found, tenant=tenant):
                real = fence.admit(f, p, found)
                if real is not None:
                    size = _size(real)
                    found.models.append(ModelFiles(tenant, str(f.relative_to(p)), "files", (str(real),), size, (size,)))
        elif os.path.lexists(p):
            real = fence.admit(p, p.parent, found)  # a file named in model_paths is allowed where it points
            if real is not None:
                size = _size(real)
                found.models.append(ModelFiles(tenant, p.name, "files", (str(real),), size, (size,)))
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
        out.skipped.extend(part.skipped)
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


def _files_under(dirs: Iterable[Path], depth: int, found: Located | None = None, tenant: str = "",
                 max_entries: int | None = None) -> list[Path]:
    """Every entry below each directory that is not a directory (links to directories are not
    walked into; entries that are links are returned for the fence to judge), at most `depth`
    levels down and `max_entries` entries per directory given: past that the walk stops and says so."""
    cap = MAX_ENTRIES if max_entries is None else max_entries
    out: list[Path] = []
    for d in dirs:
        seen = 0
        for dirpath, dirnames, filenames in os.walk(d, onerror=lambda _e: None):  # never follows links
            if len(Path(dirpath).relative_to(d).parts) >= depth:
                if dirnames and found is not None:
                    found.skipped.append(Skipped(tenant, str(Path(dirpath)), f"folders deeper than {depth} levels "
                                                 f"below {d} are not listed"))
                dirnames.clear()
            seen += len(dirnames) + len(filenames)
            dirnames.sort()
            out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
            if seen > cap:
                if found is not None:
                    found.skipped.append(Skipped(tenant, str(d), f"more than {cap} entries: the rest of {d} "
                                                 "is not listed"))
                break
    return out


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0
