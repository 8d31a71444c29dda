"""Cost of attribution by port: the /proc socket scan and the attribution that uses it.

Run: python bench/attribution.py [--runs N] [--procs N]
Builds a fixture /proc tree in a temporary folder (never this machine's /proc): about 200 processes
with 5-60 fds each, 10 GPU processes (an engine and its three runners, a ComfyUI, a display server,
a compositor, three other apps), 24 listening sockets among 200 connections in /proc/net/tcp{,6}.
Then this machine's own listening sockets, over netlink and from /proc/net (read-only).
Prints a table and writes bench/results/attribution.json. Fixture files live on the temporary
folder's file system, not procfs: the kernel builds real /proc files on each read, so real costs differ.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.timing import timed  # noqa: E402  (bench/timing.py: the shared loop)
from proxy.engines.loading import registry_from_dict  # noqa: E402
from proxy.gpu.attribution import Attributor  # noqa: E402
from proxy.gpu.proctree import ProcTreeReader, read_fd_links, read_listeners, read_process_tree  # noqa: E402
from proxy.gpu.snapshot import GpuProcess  # noqa: E402
from proxy.gpu.sockdiag import read_listeners_netlink  # noqa: E402
from tests.unit.proctrees import FakeProc, gpu_proc, snapshot  # noqa: E402  (the fixture /proc builder the tests use)


def build(root: Path, n_procs: int) -> list[GpuProcess]:
    """A desktop-like tree: init's children, a shell or two, the engines, filler processes."""
    rng = random.Random(14)
    fp = FakeProc(root)
    ollama = fp.listen("127.0.0.1", 11434, uid=997)
    comfy = fp.listen("0.0.0.0", 8188)
    for port in range(22):  # other services' listeners
        fp.listen("127.0.0.1" if port % 2 else "::", 20000 + port)
    for _ in range(200):  # established connections the parser has to skip
        fp.listen("127.0.0.1", rng.randrange(30000, 60000), state="01")
    fp.write_net()
    fp.process(2, "systemd", ["/usr/lib/systemd/systemd", "--user"], other_fds=60)
    fp.process(3, "gnome-shell", ["/usr/bin/gnome-shell"], ppid=2, other_fds=60)
    fp.process(4, "Xorg", ["/usr/lib/xorg/Xorg", "vt2"], other_fds=60)
    fp.process(5, "bash", ["bash"], ppid=3, other_fds=5)
    fp.process(10, "ollama", ["/usr/bin/ollama", "serve"], sockets=[ollama], other_fds=25)
    for r in (11, 12, 13):
        fp.process(r, "ollama", ["/usr/bin/ollama", "runner", "--model", f"m{r}"], ppid=10, other_fds=20)
    fp.process(20, "python", ["python", "main.py"], ppid=5, sockets=[comfy], other_fds=40)
    for a in (30, 31, 32):
        fp.process(a, "python", ["python", f"app{a}.py"], ppid=5, other_fds=15)
    for pid in range(100, 100 + n_procs - 15):  # the rest of the machine: not GPU processes
        fp.process(pid, f"proc{pid}", [f"/usr/bin/proc{pid}"], ppid=rng.choice([1, 2, 3, 5]),
                   other_fds=rng.randrange(5, 60))
    gpu = [gpu_proc(11, "ollama", "/usr/bin/ollama runner --model m11"),
           gpu_proc(12, "ollama", "/usr/bin/ollama runner --model m12"),
           gpu_proc(13, "ollama", "/usr/bin/ollama runner --model m13"),
           gpu_proc(10, "ollama", "/usr/bin/ollama serve"),
           gpu_proc(20, "python", "python main.py"),
           gpu_proc(4, "Xorg", "/usr/lib/xorg/Xorg vt2"),
           gpu_proc(3, "gnome-shell", "/usr/bin/gnome-shell")]
    gpu += [gpu_proc(a, "python", f"python app{a}.py") for a in (30, 31, 32)]
    return gpu


def full_scan(root: Path) -> dict[int, int]:
    """What an every-process owner map (`ss -p`, lsof) costs: every pid's fds, for comparison."""
    inodes = {listener.inode for listener in read_listeners(root)}
    owners: dict[int, int] = {}
    for d in root.iterdir():
        if d.name.isdigit():
            for link in read_fd_links(f"{d}/fd"):
                if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                    owners[int(link[8:-1])] = int(d.name)
    return owners


def live(results: dict[str, dict[str, float]], runs: int) -> None:
    """This machine's own listeners, both ways: only this read depends on the machine's size."""
    proc = Path("/proc")
    try:
        n = len(read_listeners_netlink())
    except OSError as exc:
        print(f"netlink sock_diag not available here ({exc}): live rows skipped")
        return
    results[f"this machine: listeners over netlink sock_diag ({n})"] = timed(read_listeners_netlink, runs)
    results[f"this machine: listeners from /proc/net/tcp + tcp6 ({n})"] = timed(lambda: read_listeners(proc),
                                                                              max(20, runs // 10))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--procs", type=int, default=200)
    args = ap.parse_args()
    reg = registry_from_dict({"tenants": {}})
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "proc"
        gpu = build(root, args.procs)
        pids = [p.pid for p in gpu]
        tree = read_process_tree(root, pids)
        warm = Attributor(reg)
        snap = warm.attribute(snapshot(*gpu, tree=tree))
        by = {p.process.pid: (p.tenant, p.by) for p in snap.processes}
        assert by[11] == ("ollama", "port") and by[20] == ("comfyui", "port"), by
        steady = ProcTreeReader(root)
        tree_fds = sum(len(list((root / str(pid) / "fd").iterdir())) for pid in tree.nodes)
        n_fds = sum(len(list((root / d.name / "fd").iterdir())) for d in root.iterdir() if d.name.isdigit())
        results = {
            "/proc/net/tcp + tcp6 parse (224 lines)": timed(lambda: read_listeners(root), args.runs),
            f"socket scan, cold: {len(gpu)} GPU processes + ancestors ({len(tree.nodes)} nodes, {tree_fds} fds)":
                timed(lambda: read_process_tree(root, pids), args.runs),
            "socket scan, steady state (fds remembered per process while no listener changes)":
                timed(lambda: steady.read(pids), args.runs),
            f"for comparison: every process's fds ({args.procs} processes, {n_fds} fds)":
                timed(lambda: full_scan(root), max(20, args.runs // 10)),
            "attribute with the tree, cache warm": timed(lambda: warm.attribute(snapshot(*gpu, tree=tree)), args.runs),
            "attribute with the tree, cache cold (new Attributor)":
                timed(lambda: Attributor(reg).attribute(snapshot(*gpu, tree=tree)), args.runs),
            "attribute without a tree (simulated path), cache warm":
                timed(lambda: warm.attribute(snapshot(*gpu)), args.runs),
        }
    live(results, args.runs)
    width = max(len(k) for k in results)
    print(f"{'case':<{width}}  {'median ms':>10}  {'p99 ms':>8}  {'max ms':>8}  runs")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['median_ms']:>10.4f}  {r['p99_ms']:>8.4f}  {r['max_ms']:>8.4f}  {int(r['runs'])}")
    out = ROOT / "bench" / "results" / "attribution.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"processes": args.procs, "gpu_processes": len(gpu), "python": platform.python_version(),
                               "machine": platform.machine(), "results": results}, indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
