"""The simulated GPU box: one scenario file -> a simulated GPU (or several: `gpus`), its extra
processes, the two simulated engines on loopback (each on the card `engines` names), and optionally
a speech relay the proxy itself starts and stops (`relay`: a real child process, proxy/sim/relay.py,
holding simulated memory while it runs). Used by `hyperswap demo` and by the integration tests."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.clock import Clock, SystemClock
from proxy.errors import ConfigError
from proxy.relay.servers import RunningServer
from proxy.sim.checkpoint import SimulatedCheckpointer
from proxy.sim.comfyui import ComfySim, ComfySimConfig
from proxy.sim.gpu import GIB, SimulatedDevice, SimulatedGpu
from proxy.sim.gpu_settings import SimulatedCardSettings, SimulatedSettingsSpec
from proxy.sim.model_files import SimModelFiles
from proxy.sim.ollama import OllamaSim, OllamaSimConfig
from proxy.sim.ports import loose_port

SCENARIOS = Path(__file__).with_name("scenarios")


class _GpuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "Simulated RTX 4090"
    total_gb: float = 24.0
    reserved_gb: float = 0.3
    settings: SimulatedSettingsSpec = Field(default_factory=SimulatedSettingsSpec)  # power limit, clocks, fans


class _ProcessSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    cmdline: str
    vram_gb: float
    pid: int | None = None
    unknown_memory: bool = False
    gpu: int = Field(default=0, ge=0)  # the card it holds memory on (an index into `gpus`)


class _EngineSpec(BaseModel):
    """Where a simulated engine runs on a box with several cards, and what its process environment
    says (CUDA_VISIBLE_DEVICES, as /proc/<pid>/environ would show it)."""
    model_config = ConfigDict(extra="forbid")
    gpu: int = Field(default=0, ge=0)
    env: dict[str, str] = Field(default_factory=dict)


class _RelaySpec(BaseModel):
    """The speech relay as a `process` tenant: the proxy runs `python -m proxy.sim.relay` (through
    sys.executable) on the first request to the tenant's listener and stops it when its memory is
    needed. The tenant's other fields (listen, priority, ...) come from the scenario's `tenants`."""
    model_config = ConfigDict(extra="forbid")
    tenant: str = "stt"
    vram_gb: float = Field(gt=0)
    load_s: float = Field(default=1.0, ge=0)  # its model load, before it registers its memory and listens
    port: int = Field(default=28300, ge=0, le=65535)  # the app's own port (the tenant's upstream); 0: a free one
    model: str = "whisper-large-v3"
    transcribe_s: float = Field(default=0.2, ge=0)  # one POST /v1/audio/transcriptions


class _SuspendSpec(BaseModel):
    """The host side of CUDA suspension (release kind cuda_suspend, proxy/sim/checkpoint.py)."""
    model_config = ConfigDict(extra="forbid")
    host_ram_gb: float = Field(default=64.0, gt=0)  # the host's RAM a suspend may fill
    copy_gbps: float = Field(default=12.0, gt=0)  # host <-> device copy rate (PCIe 4.0 x16 pinned: ~12-25 GB/s)


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")
    description: str = ""
    gpu: _GpuSpec = Field(default_factory=_GpuSpec)
    gpus: list[_GpuSpec] = Field(default_factory=list)  # several cards: replaces `gpu` (index 0 first)
    engines: dict[Literal["ollama", "comfyui"], _EngineSpec] = Field(default_factory=dict)
    processes: list[_ProcessSpec] = Field(default_factory=list)
    ollama: dict[str, Any] | None = Field(default_factory=dict)  # None: no Ollama in this box
    comfyui: dict[str, Any] | None = Field(default_factory=dict)
    tenants: dict[str, Any] = Field(default_factory=dict)  # merged over the registry like a user tenants.json
    settings: dict[str, Any] = Field(default_factory=dict)  # other tenants.json sections: admin, proxy, telemetry
    model_files: bool = True  # back the models with real (sparse, 1/1024) files: residency and warming show
    relay: _RelaySpec | None = None  # a speech relay the proxy starts and stops (release kind `process`)
    suspend: _SuspendSpec = Field(default_factory=_SuspendSpec)  # host RAM and copy rate of a CUDA suspend


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.json"))


def load_scenario(name_or_path: str) -> Scenario:
    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIOS / f"{name_or_path}.json"
    if not path.exists():
        raise ConfigError(f"no scenario {name_or_path!r}",
                          fix=f"use one of: {', '.join(scenario_names())}, or a path to a scenario file")
    try:
        return Scenario.model_validate(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"scenario {path} does not match the schema", problems=problems) from None


FAST_SWAP_HOLD_S = 0.01  # the swap hold scaled with the engines: a hold is a share of a reload, ~100x faster here


def fast_scenario(name: str, **changes: Any) -> Scenario:
    """A shipped scenario with the engines' delays cut to milliseconds (tests, benches), plus
    changes per section: `fast_scenario("default", comfyui={"stale_running_entry": True})`. The
    proxy's swap hold is scaled down with them (`FAST_SWAP_HOLD_S`) unless a change sets it."""
    data = load_scenario(name).model_dump()
    data["ollama"].update({"load_gbps": 200.0, "disk_gbps": None, "unload_delay_s": 0.15, "token_rate": 2000.0})
    data["comfyui"].update({"free_delay_s": 0.15, "load_gbps": 200.0, "disk_gbps": None, "step_time_s": 0.002})
    if data.get("relay"):
        data["relay"].update({"load_s": 0.05, "transcribe_s": 0.01})
    data["suspend"]["copy_gbps"] *= 100  # scaled like the loads (2 -> 200 GB/s): a restore stays ~6x a load
    for section, values in changes.items():
        if isinstance(data.get(section), dict):
            data[section].update(values)
        else:
            data[section] = values
    proxy = data.setdefault("settings", {}).setdefault("proxy", {})
    if isinstance(proxy, dict):
        proxy.setdefault("swap_hold_s", FAST_SWAP_HOLD_S)
    return Scenario.model_validate(data)


@dataclass(slots=True)
class SimBox:
    scenario: Scenario
    clock: Clock = field(default_factory=SystemClock)  # both simulators' time (model loads, steps, keep-alive)
    gpu: SimulatedGpu = field(init=False)
    ollama: OllamaSim | None = field(init=False, default=None)
    comfyui: ComfySim | None = field(init=False, default=None)
    servers: dict[str, RunningServer] = field(init=False, default_factory=dict)
    files: SimModelFiles | None = field(init=False, default=None)
    relay_port: int | None = field(init=False, default=None)  # the speech relay's own port, once the box started
    gpu_dir: Path | None = field(init=False, default=None)  # where real processes register their memory
    checkpointer: SimulatedCheckpointer = field(init=False)  # CUDA suspend on this card (release kind cuda_suspend)

    def __post_init__(self) -> None:
        cards = self.scenario.gpus or [self.scenario.gpu]
        g = cards[0]
        self.gpu = SimulatedGpu(total_bytes=int(g.total_gb * GIB), reserved_bytes=int(g.reserved_gb * GIB), name=g.name)
        for more in cards[1:]:
            self.gpu.add_device(int(more.total_gb * GIB), int(more.reserved_gb * GIB), more.name)
        self.gpu.card_settings = SimulatedCardSettings(name=g.name, spec=g.settings)  # card 0's power limit, clocks, fans
        host = self.scenario.suspend
        self.checkpointer = SimulatedCheckpointer(self.gpu, self.clock, host_ram_bytes=int(host.host_ram_gb * GIB),
                                                  copy_gbps=host.copy_gbps)
        try:
            for p in self.scenario.processes:
                self.gpu.device(p.gpu).spawn(p.name, p.cmdline, int(p.vram_gb * GIB), pid=p.pid,
                                             unknown_memory=p.unknown_memory)
            if self.scenario.ollama is not None:
                self.ollama = OllamaSim(self._card("ollama"), OllamaSimConfig.from_scenario(self.scenario.ollama),
                                        clock=self.clock)
            if self.scenario.comfyui is not None:
                self.comfyui = ComfySim(self._card("comfyui"), ComfySimConfig.from_scenario(self.scenario.comfyui),
                                        clock=self.clock)
        except (ValueError, TypeError, ValidationError) as exc:
            raise ConfigError(f"scenario does not match the simulators' schema: {exc}") from None

    def _card(self, engine: Literal["ollama", "comfyui"]) -> SimulatedGpu | SimulatedDevice:
        """The whole GPU on a one-card box (as before); on several, the card the scenario names."""
        spec = self.scenario.engines.get(engine)
        if self.gpu.device_count == 1 and spec is None:
            return self.gpu
        spec = spec or _EngineSpec()
        env = tuple(sorted(spec.env.items())) or None
        return self.gpu.device(spec.gpu, cuda_env=env)

    async def start(self, host: str = "127.0.0.1", ollama_port: int = 0, comfyui_port: int = 0,
                    relay_port: int | None = None) -> None:
        """`relay_port`: the speech relay's own port (None: the scenario's; 0: a free one now)."""
        try:
            if self.scenario.relay is not None:
                self._prepare_relay(host, self.scenario.relay.port if relay_port is None else relay_port)
            if self.scenario.model_files:
                self.files = self._write_model_files()
                self.gpu.model_file_sizes = self.files.model_size
            if self.ollama is not None:
                self.servers["ollama"] = await self._start(self.ollama, host, ollama_port)
            if self.comfyui is not None:
                self.servers["comfyui"] = await self._start(self.comfyui, host, comfyui_port)
        except BaseException:
            await self.stop()
            raise

    @staticmethod
    async def _start(sim: OllamaSim | ComfySim, host: str, port: int) -> RunningServer:
        try:
            return await sim.start(host, port)
        except OSError as exc:
            raise ConfigError(f"cannot start the {type(sim).__name__} simulator on {host}:{port}: {exc.strerror}",
                              fix="another demo (or the real engine) holds that port: stop it first") from None

    async def stop(self) -> None:
        """Both simulators stop together, each draining its own listener; the first error is raised
        once both are done."""
        sims = [sim for sim in (self.comfyui, self.ollama) if sim is not None]
        outcomes = await asyncio.gather(*(sim.stop() for sim in sims), return_exceptions=True)
        self.servers.clear()
        self.gpu.unwatch()
        if self.gpu_dir is not None:
            shutil.rmtree(self.gpu_dir, ignore_errors=True)
            self.gpu_dir = None
        if self.files is not None:
            self.files.cleanup()
            self.files = None
            self.gpu.model_file_sizes = None
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _write_model_files(self) -> SimModelFiles:
        """Stand-in files for every model, out of the page cache (cold, as after a reboot). ComfyUI
        is started with --base-directory there, as a real one would be, so the proxy finds its
        folders from its command line; Ollama's store is named by model_paths (tenant_overrides)."""
        files = SimModelFiles()
        if self.ollama is not None:
            for m in self.ollama.config.models:
                files.add_ollama_model(m.name, m.size_bytes)
            self.ollama.files = files
        if self.comfyui is not None:
            for name, size in self.comfyui.config.checkpoints.items():
                files.add_comfy_checkpoint(name, size)
            argv = (*self.comfyui.config.argv, "--base-directory", str(files.comfy_base))
            self.comfyui.config = replace(self.comfyui.config, argv=argv)
            self.comfyui.files = files
        files.drop_all()
        return files

    def _prepare_relay(self, host: str, port: int) -> None:
        """The folder the card watches for the relay's memory, and the relay's port (the proxy starts
        the relay itself, later). A free port is picked and let go: the relay binds it when started."""
        self.gpu_dir = Path(tempfile.mkdtemp(prefix="hyperswap-gpu-"))
        self.gpu.watch(self.gpu_dir)
        self.relay_port = port or loose_port(host)  # 0: one outside the ephemeral range (proxy/sim/ports.py)

    def relay_tenant(self, host: str = "127.0.0.1") -> dict[str, Any]:
        """The speech relay's tenants.json entry: a generic app the proxy runs (release kind `process`),
        ready when its /health answers 200, needing the memory it registers."""
        spec = self.scenario.relay
        assert spec is not None and self.relay_port is not None and self.gpu_dir is not None, "start the box first"
        command = [sys.executable, "-m", "proxy.sim.relay", "--host", host, "--port", str(self.relay_port),
                   "--vram-gb", f"{spec.vram_gb:g}", "--load-s", f"{spec.load_s:g}", "--gpu-dir", str(self.gpu_dir),
                   "--model", spec.model, "--transcribe-s", f"{spec.transcribe_s:g}"]
        return {"engine": "generic", "upstream": f"http://{host}:{self.relay_port}",
                "match": {"process_names": [], "cmdline_patterns": [rf"proxy\.sim\.relay .*--port {self.relay_port}\b"]},
                "needs_vram_gb": spec.vram_gb, "ready": {"path": "/health"},
                "release": {"kind": "process", "command": command, "stop_timeout_s": 5}}

    def tenant_overrides(self) -> dict[str, Any]:
        """A tenants.json fragment pointing each engine tenant at its simulator, plus the scenario's tenants."""
        tenants: dict[str, Any] = {name: body for name, body in self.scenario.tenants.items()}
        if self.scenario.relay is not None and self.relay_port is not None:
            name = self.scenario.relay.tenant
            tenants[name] = {**self.relay_tenant(), **(tenants.get(name) or {})}
        for name, server in self.servers.items():
            tenants.setdefault(name, {})
            if isinstance(tenants[name], dict):
                tenants[name] = {**tenants[name], "upstream": server.url}
        if self.files is not None and "ollama" in self.servers and isinstance(tenants["ollama"], dict):
            tenants["ollama"].setdefault("model_paths", [str(self.files.ollama_root)])
        return {**self.scenario.settings, "tenants": tenants}
