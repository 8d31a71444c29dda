"""The simulated GPU sees real processes: the speech relay (`python -m proxy.sim.relay`) holds
simulated memory exactly while it lives, and memory that does not fit is refused like cudaMalloc."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path

import httpx

from proxy.sim.gpu import GIB, SimulatedGpu, SimulatedOutOfMemory
from proxy.tasks import poll_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def relay(port: int, gpu_dir: Path, vram_gb: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.sim.relay", "--port", str(port), "--vram-gb", str(vram_gb),
        "--gpu-dir", str(gpu_dir), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def test_a_real_process_holds_simulated_memory_while_it_lives(tmp_path: Path) -> None:
    gpu = SimulatedGpu(total_bytes=8 * GIB, reserved_bytes=0)
    gpu.watch(tmp_path)
    try:
        port = free_port()
        child = await relay(port, tmp_path, 2.0)
        async with asyncio.timeout(20):
            await poll_until(lambda: child.pid in gpu.real_pids())
        snap = gpu.read()
        proc = next(p for p in snap.processes if p.pid == child.pid)
        assert proc.used_bytes == 2 * GIB and f"proxy.sim.relay --port {port}" in proc.cmdline, proc
        assert proc.name.startswith("python"), proc.name
        assert snap.device.free_bytes == 6 * GIB == gpu.free_bytes(), "free = total - reserved - used"
        sim = gpu.spawn("python3", "other", 0)
        try:
            gpu.allocate(sim, 7 * GIB)
            raise AssertionError("a simulated allocation ignored the real process's memory")
        except SimulatedOutOfMemory as exc:
            assert exc.free == 6 * GIB

        async with httpx.AsyncClient(trust_env=False) as http:
            async with asyncio.timeout(20):
                await poll_until(lambda: _answers(port))
            health = (await http.get(f"http://127.0.0.1:{port}/health")).json()
            assert health["vram_bytes"] == 2 * GIB, health
            said = await http.post(f"http://127.0.0.1:{port}/v1/audio/transcriptions", content=b"x" * 10)
            assert said.status_code == 200 and said.json()["bytes"] == 10, said.text

        child.send_signal(signal.SIGTERM)
        # gone from the card once it exits (before or after asyncio reaps it: a zombie counts as gone)
        async with asyncio.timeout(20):
            await poll_until(lambda: child.pid not in gpu.real_pids())
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"{child.pid}."))  # noqa: ASYNC240
        assert gpu.free_bytes() == 8 * GIB and not left, f"memory or files left after the exit: {left}"
        assert await child.wait() == 0, "SIGTERM ends the relay with code 0"
    finally:
        gpu.unwatch()


async def test_memory_that_does_not_fit_is_refused_and_the_relay_exits(tmp_path: Path) -> None:
    gpu = SimulatedGpu(total_bytes=4 * GIB, reserved_bytes=0)
    gpu.spawn("python3", "comfyui", 3 * GIB)
    gpu.watch(tmp_path)
    try:
        child = await relay(free_port(), tmp_path, 2.0)
        async with asyncio.timeout(20):
            _, err = await child.communicate()
        assert child.returncode == 1 and b"CUDA out of memory" in err, err
        assert gpu.free_bytes() == 1 * GIB and gpu.real_pids() == [], "a refused process holds nothing"
    finally:
        gpu.unwatch()


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
