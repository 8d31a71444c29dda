"""What each engine is configured to do, read from the engine itself, and what that means for arbitration.

Pure parsing and interpretation, plus two small readers whose inputs are injectable (the systemctl
runner, the /proc root) so tests use fake output. Nothing here is a hard-coded claim about a
running engine: every value shown comes from systemd, /proc/<pid>/environ, or the engine's API;
only the defaults (what the engine does when a variable is unset) are knowledge.
"""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from proxy.config.units import GIB
from proxy.encoding import JSONModel

# "unknown": neither the process's environment nor the systemd unit could be read, so the value is
# not known (never presented as a default nobody checked).
SettingSource = Literal["systemd", "environ", "default (not set)", "unknown"]
SettingStatus = Literal["ok", "note", "deferred", "warn", "unknown"]

# (argv, timeout_s) -> stdout; raises OSError / subprocess errors on failure.
CommandRunner = Callable[[Sequence[str], float], str]

OLLAMA_VARS = ("OLLAMA_NUM_PARALLEL", "OLLAMA_MAX_LOADED_MODELS", "OLLAMA_KEEP_ALIVE", "OLLAMA_FLASH_ATTENTION",
               "OLLAMA_KV_CACHE_TYPE", "OLLAMA_CONTEXT_LENGTH", "OLLAMA_GPU_OVERHEAD")


@dataclass(frozen=True, slots=True)
class EnvRead:
    """One attempt to read an engine's environment."""

    source: Literal["systemd", "environ"]
    values: Mapping[str, str] | None  # None: not read (see error)
    error: str | None = None
    where: str = ""  # the unit or /proc path


@dataclass(frozen=True, slots=True)
class Setting:
    """One engine setting as /api/engines shows it (its JSON is its fields)."""

    name: str
    value: str | None
    source: SettingSource
    meaning: str
    status: SettingStatus = "ok"




class EnvSource(JSONModel):
    """Where /api/engines looked for an engine's environment, and whether it could read it (no values shown)."""

    source: Literal["systemd", "environ", "host"]
    where: str
    ok: bool
    error: str | None
    variables: int | None = Field(description="how many variables were read; null: not read")

    @classmethod
    def of(cls, r: EnvRead) -> EnvSource:
        return cls(source=r.source, where=r.where, ok=r.values is not None, error=r.error,
                   variables=None if r.values is None else len(r.values))


class EngineReport(JSONModel):
    """What /api/engines shows of one tenant's engine; each engine that reports about itself adds its own."""

    tenant: str
    engine: str
    upstream: str | None
    reachable: bool = False
    error: str | None = None


class OllamaReport(EngineReport):
    version: str | None
    env_sources: list[EnvSource]
    settings: list[Setting]


# -- parsing -----------------------------------------------------------------------------------------

def parse_systemd_environment(text: str) -> dict[str, str]:
    """`systemctl show --property=Environment` output: `Environment=A=1 "B=two words"` (one line, or several)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("Environment="):
            continue
        try:
            words = shlex.split(line[len("Environment="):])
        except ValueError:  # unbalanced quotes: take the plain words
            words = line[len("Environment="):].split()
        for word in words:
            key, sep, value = word.partition("=")
            if sep and key:
                out[key] = value
    return out


def parse_environ(data: bytes) -> dict[str, str]:
    """/proc/<pid>/environ: NUL-separated KEY=VALUE."""
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.decode("utf-8", "replace").partition("=")
        if sep and key:
            out[key] = value
    return out


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts: list[int] = []
    for piece in version.lstrip("v").split("-")[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts) or None


# -- readers (injectable) -------------------------------------------------------------------------------

def run_command(argv: Sequence[str], timeout_s: float) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=True)
    return done.stdout


def read_systemd_env(unit: str = "ollama", runner: CommandRunner = run_command, timeout_s: float = 2.0) -> EnvRead:
    """The unit's Environment= (what the service is started with). Never raises."""
    where = f"systemctl show {unit}"
    try:
        text = runner(["systemctl", "show", unit, "--property=Environment"], timeout_s)
    except FileNotFoundError:
        return EnvRead("systemd", None, "systemctl is not installed (no systemd here)", where)
    except subprocess.TimeoutExpired:
        return EnvRead("systemd", None, f"systemctl did not answer within {timeout_s:g} s", where)
    except subprocess.CalledProcessError as exc:
        return EnvRead("systemd", None, f"systemctl failed (exit {exc.returncode}): {(exc.stderr or '').strip()[:200]}", where)
    except OSError as exc:
        return EnvRead("systemd", None, f"cannot run systemctl: {exc}", where)
    return EnvRead("systemd", parse_systemd_environment(text), None, where)


def read_proc_environ(pid: int, proc_root: Path = Path("/proc")) -> EnvRead:
    """The running process's environment. Readable only as root or the same user. Never raises."""
    path = proc_root / str(pid) / "environ"
    try:
        data = path.read_bytes()
    except PermissionError:
        return EnvRead("environ", None, f"permission denied reading {path} (run the proxy as the engine's user, or as root)",
                       str(path))
    except FileNotFoundError:
        return EnvRead("environ", None, f"{path} does not exist (process gone, or another PID namespace)", str(path))
    except OSError as exc:
        return EnvRead("environ", None, f"cannot read {path}: {exc}", str(path))
    return EnvRead("environ", parse_environ(data), None, str(path))


@dataclass(slots=True)
class EnvReaders:
    """How /api/engines reads an engine's environment; tests inject fakes.

    host None: read the host (systemd, /proc) only when the GPU reader is NVML (working or not:
    the host is the engines' host either way); with a simulated GPU the pids are fictional and the
    host's services are not the simulated engines."""

    systemctl: CommandRunner = run_command
    proc_root: Path = Path("/proc")
    host: bool | None = None
    timeout_s: float = 2.0


# -- Ollama: what each variable means ------------------------------------------------------------------------

def _truthy(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on", "t")


Meaning = tuple[str, SettingStatus]


def _num_parallel(value: str | None, version: tuple[int, ...] | None) -> Meaning:
    if value is None:
        if version is not None and version < (0, 10):
            return "auto (4, or 1 when memory is tight) before Ollama 0.10: KV cache is sized for that many slots", "note"
        value = "1"
        prefix = "default 1 (Ollama 0.10+): "
    else:
        prefix = ""
    if value.strip() == "1":
        return (prefix + "one request at a time per model: an unload asked for while a generation runs queues behind it "
                "(a release is reported as deferred, not failed)"), "deferred"
    if value.strip() == "0":
        return "auto (pre-0.10 meaning): 4 slots, or 1 when memory is tight", "note"
    return f"{value} parallel slots per model: the KV cache (and the VRAM a load needs) grows {value}x", "note"


def _max_loaded_models(value: str | None, version: tuple[int, ...] | None) -> Meaning:
    if value is None or value.strip() == "0":
        return "default 0 = 3 per GPU: several models stay resident, so one load can push others out", "ok"
    if value.strip() == "1":
        return "1: every swap between models evicts the loaded one (each switch pays a full reload)", "warn"
    return f"at most {value} models resident at once", "ok"


def _keep_alive(value: str | None, version: tuple[int, ...] | None) -> Meaning:
    shown = value if value is not None else "5m"
    v = shown.strip()
    if v.startswith("-"):
        return "models never unload by themselves: only the proxy's releases give their VRAM back", "note"
    if v in ("0", "0s", "0m"):
        return "models unload right after each request: nothing stays resident, every request reloads", "note"
    return (f"a model stays loaded {shown} after its last request; the proxy releases it sooner when another "
            "tenant needs the memory"), "ok"


def _flash_attention(value: str | None, version: tuple[int, ...] | None) -> Meaning:
    if value is None:
        return "off unless the model enables it: the KV cache stays f16 and quantised KV types are ignored", "ok"
    return ("on: smaller attention buffers, and OLLAMA_KV_CACHE_TYPE can shrink the KV cache" if _truthy(value)
            else "off: KV cache stays f16"), "ok"


def _kv_cache_type(value: str | None, version: tuple[int, ...] | None) -> Meaning:
    if value is None or value.strip() in ("", "f16"):
        return "f16 KV cache (default): context_allowance_gb should cover the full-precision cache", "ok"
    return (f"{value} KV cache (needs flash attention): context takes less VRAM than f16, so "
            "context_allowance_gb can be smaller"), "note"


def _context_length(value: str | None, version: tuple[int, ...] | None) -> Meaning:
    if value is None or value.strip() == "0":
        return "default: context sized by Ollama (4096 in 0.9-0.15, VRAM-tiered later); context_allowance_gb covers it", "ok"
    return (f"every load gets a {value}-token context (x NUM_PARALLEL): check that context_allowance_gb "
            "covers its KV cache"), "note"


def _gpu_overhead(value: str | None, version: tuple[int, ...] | None) -> Meaning:
    if value is None or value.strip() == "0":
        return "0 bytes kept back per GPU (default)", "ok"
    try:
        return f"{int(value) / GIB:.2f} GiB per GPU kept back by Ollama: loads plan with that much less free memory", "note"
    except ValueError:
        return f"{value!r} is not a byte count: Ollama ignores it", "warn"


# What each OLLAMA_* variable's value means for sharing the card (value None: not set).
_OLLAMA_MEANINGS: dict[str, Callable[[str | None, tuple[int, ...] | None], Meaning]] = {
    "OLLAMA_NUM_PARALLEL": _num_parallel,
    "OLLAMA_MAX_LOADED_MODELS": _max_loaded_models,
    "OLLAMA_KEEP_ALIVE": _keep_alive,
    "OLLAMA_FLASH_ATTENTION": _flash_attention,
    "OLLAMA_KV_CACHE_TYPE": _kv_cache_type,
    "OLLAMA_CONTEXT_LENGTH": _context_length,
    "OLLAMA_GPU_OVERHEAD": _gpu_overhead,
}


def _ollama_meaning(name: str, value: str | None, version: tuple[int, ...] | None) -> Meaning:
    meaning = _OLLAMA_MEANINGS.get(name)
    return meaning(value, version) if meaning is not None else ("", "ok")


def ollama_settings(systemd: EnvRead | None, environ: EnvRead | None, version: str | None) -> list[Setting]:
    """Each OLLAMA_* variable with where its value came from. The running process's environ wins
    when it could be read (it is what the process actually has); else the systemd unit's; with
    neither read, every setting is unknown."""
    vt = version_tuple(version)
    read = [r for r in (environ, systemd) if r is not None and r.values is not None]
    if not read:
        return [_unknown_setting(name, vt) for name in OLLAMA_VARS]
    out: list[Setting] = []
    for name in OLLAMA_VARS:
        value: str | None = None
        source: SettingSource = "default (not set)"
        if environ is not None and environ.values is not None:
            if name in environ.values:
                value, source = environ.values[name], "environ"
        elif systemd is not None and systemd.values is not None and name in systemd.values:
            value, source = systemd.values[name], "systemd"
        meaning, status = _ollama_meaning(name, value, vt)
        out.append(Setting(name, value, source, meaning, status))
    return out


def _unknown_setting(name: str, version: tuple[int, ...] | None) -> Setting:
    default, _ = _ollama_meaning(name, None, version)
    return Setting(name, None, "unknown", f"not read (neither Ollama's environment nor its systemd unit could be "
                   f"read); if unset: {default}", "unknown")


# -- ComfyUI --------------------------------------------------------------------------------------------

class ComfyStats(BaseModel):
    """What ComfyUI's /system_stats says about itself."""

    model_config = ConfigDict(frozen=True)
    version: str | None
    pytorch_version: str | None
    python_version: str | None
    device_name: str | None
    argv: tuple[str, ...] | None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def parse_system_stats(data: object) -> ComfyStats:
    """Tolerant: any field may be missing or of another type (older builds, trimmed payloads)."""
    system = data.get("system") if isinstance(data, dict) else None
    system = system if isinstance(system, dict) else {}
    devices = data.get("devices") if isinstance(data, dict) else None
    first = devices[0] if isinstance(devices, list) and devices and isinstance(devices[0], dict) else {}
    argv = system.get("argv")
    return ComfyStats(
        version=_str(system.get("comfyui_version")),
        pytorch_version=_str(system.get("pytorch_version")),
        python_version=_str(system.get("python_version")),
        device_name=_str(first.get("name")),
        argv=tuple(str(a) for a in argv) if isinstance(argv, list) else None,
    )


@dataclass(frozen=True, slots=True)
class Flag:
    """A memory-relevant flag ComfyUI was started with (its JSON is its fields)."""

    flag: str
    value: str | None
    meaning: str
    status: SettingStatus


class ComfyReport(ComfyStats, EngineReport):
    """EngineReport's fields, then ComfyStats', then the flags."""

    model_config = ConfigDict(frozen=True, extra="allow")
    flags: list[Flag]
    flags_note: str | None = Field(default=None, exclude_if=lambda v: v is None,
                                   description="why the start flags are unknown (an older ComfyUI)")


def comfy_flags(argv: Sequence[str]) -> list[Flag]:
    """The memory-relevant flags ComfyUI was started with."""
    args = list(argv)
    out: list[Flag] = []

    def value_of(flag: str) -> str | None:
        for i, a in enumerate(args):
            if a == flag and i + 1 < len(args):
                return args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    for flag in ("--highvram", "--gpu-only"):
        if flag in args:
            out.append(Flag(flag, None, "the offload device is the GPU itself: POST /free with unload_models keeps the "
                            "weights in VRAM, so a release frees little; drop the flag for HyperSwap to reclaim ComfyUI", "warn"))
    if "--disable-smart-memory" in args:
        out.append(Flag("--disable-smart-memory", None, "ComfyUI unloads every model after each prompt: little to reclaim "
                        "when idle, but every prompt reloads its checkpoint", "note"))
    reserve = value_of("--reserve-vram")
    if reserve is not None or "--reserve-vram" in args:
        out.append(Flag("--reserve-vram", reserve, f"ComfyUI keeps {reserve} GiB of the card unused for others: "
                        "it plans with that much less free memory", "note"))
    for flag in ("--lowvram", "--novram"):
        if flag in args:
            out.append(Flag(flag, None, "models load partially and stream weights: smaller VRAM footprint, slower prompts",
                            "note"))
    if "--cpu" in args:
        out.append(Flag("--cpu", None, "ComfyUI runs on the CPU: it holds no VRAM to reclaim", "note"))
    return out
