"""Where model files are: Ollama's manifests -> blobs, ComfyUI's folders from its command line and
extra_model_paths.yaml, model_paths for any tenant; missing or unreadable directories as problems."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from proxy.engines import adapter_for
from proxy.engines.loading import registry_from_dict
from proxy.engines.model_files import (
    FileHints,
    argv_of,
    comfy_argv_paths,
    comfy_folders,
    files_summary,
    ollama_name_parts,
    ollama_roots,
    ollama_store,
    parse_extra_model_paths,
    plain_files,
)
from proxy.lifecycle import procs
from proxy.models.catalog import ModelCatalog
from proxy.models.pagecache import FileResidency
from proxy.sim.model_files import OWNER, PREFIX, remove_abandoned


def hexd(short: str) -> str:
    """A valid digest's 64 hex digits for a short tag."""
    return hashlib.sha256(short.encode()).hexdigest()


def manifest(root: Path, where: str, layers: dict[str, int]) -> None:
    path = root / "manifests" / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schemaVersion": 2, "config": {"digest": f"sha256:{hexd('c0')}", "size": 10},
                                "layers": [{"mediaType": "application/vnd.ollama.image.model",
                                            "digest": f"sha256:{hexd(d)}", "size": s} for d, s in layers.items()]}))
    for digest, size in [*layers.items(), ("c0", 10)]:
        blob = root / "blobs" / f"sha256-{hexd(digest)}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(b"x" * size)


def test_ollama_names_resolve_as_ollama_parses_them() -> None:
    assert ollama_name_parts("llama3.2") == ("registry.ollama.ai", "library", "llama3.2", "latest")
    assert ollama_name_parts("llama3.2:3b") == ("registry.ollama.ai", "library", "llama3.2", "3b")
    assert ollama_name_parts("me/tuned:q4") == ("registry.ollama.ai", "me", "tuned", "q4")
    assert ollama_name_parts("hf.co/org/repo:Q8") == ("hf.co", "org", "repo", "Q8")


def test_an_ollama_store_lists_each_model_with_its_blobs_and_manifest_sizes(tmp_path: Path) -> None:
    manifest(tmp_path, "registry.ollama.ai/library/llama3.2/3b", {"aa": 100, "ab": 5})
    manifest(tmp_path, "registry.ollama.ai/me/tuned/latest", {"bb": 50})
    manifest(tmp_path, "hf.co/org/repo/Q8", {"cc": 7})
    found = ollama_store("ollama", tmp_path)
    by_name = {m.name: m for m in found.models}
    assert set(by_name) == {"llama3.2:3b", "me/tuned:latest", "hf.co/org/repo:Q8"}, by_name
    llama = by_name["llama3.2:3b"]
    assert llama.size_bytes == 115 and str(tmp_path / "blobs" / f"sha256-{hexd('aa')}") in llama.files
    assert str(tmp_path / "blobs" / f"sha256-{hexd('c0')}") in llama.files and llama.key == "ollama:llama3.2:3b"
    assert found.problems == []


def test_ollama_roots_follow_ollama_models_else_the_home_and_the_service_user(tmp_path: Path) -> None:
    assert ollama_roots({"OLLAMA_MODELS": "/srv/models"}) == [Path("/srv/models")]
    assert ollama_roots({}, home=tmp_path) == [tmp_path / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def test_a_missing_ollama_store_is_a_problem_with_a_fix(tmp_path: Path) -> None:
    found = ollama_store("ollama", tmp_path / "nope")
    assert found.models == [] and found.problems and "model_paths" in found.problems[0].fix


def test_comfyui_base_and_extra_configs_come_from_its_command_line() -> None:
    base, configs = comfy_argv_paths(["python3", "/opt/ComfyUI/main.py", "--listen", "--extra-model-paths-config",
                                      "/etc/a.yaml", "/etc/b.yaml", "--port", "8188"])
    assert base == Path("/opt/ComfyUI")
    assert configs == [Path("/opt/ComfyUI/extra_model_paths.yaml"), Path("/etc/a.yaml"), Path("/etc/b.yaml")]
    base, _ = comfy_argv_paths(["python", "main.py", "--base-directory=/data/comfy"])
    assert base == Path("/data/comfy")
    assert comfy_argv_paths(["python", "main.py"]) == (None, []), "a relative main.py says nothing"
    assert argv_of(["ollama serve", "python3 /opt/ComfyUI/main.py --listen"])[1] == "/opt/ComfyUI/main.py"


def test_extra_model_paths_yaml_resolves_against_base_path_and_the_file(tmp_path: Path) -> None:
    text = ("a111:\n    base_path: /srv/sd/\n    checkpoints: models/Stable-diffusion\n"
            "    loras: |\n        models/Lora\n        models/LyCORIS\n"
            "other:\n    base_path: rel\n    is_default: true\n    vae: vae\n")
    out = parse_extra_model_paths(text, tmp_path)
    assert out["checkpoints"] == [Path("/srv/sd/models/Stable-diffusion")]
    assert out["loras"] == [Path("/srv/sd/models/Lora"), Path("/srv/sd/models/LyCORIS")]
    assert out["vae"] == [tmp_path / "rel" / "vae"]


def test_comfyui_folders_list_model_files_with_their_names_under_the_folder(tmp_path: Path) -> None:
    (tmp_path / "models" / "checkpoints" / "sdxl").mkdir(parents=True)
    (tmp_path / "models" / "checkpoints" / "sdxl" / "base.safetensors").write_bytes(b"1" * 30)
    (tmp_path / "models" / "checkpoints" / "put_checkpoints_here").write_text("")
    extra = tmp_path / "elsewhere"
    extra.mkdir()
    (extra / "detail.safetensors").write_bytes(b"2" * 3)
    found = comfy_folders("comfyui", [tmp_path / "models"], {"loras": [extra]})
    assert {(m.folder, m.name, m.size_bytes) for m in found.models} == {
        ("checkpoints", "sdxl/base.safetensors", 30), ("loras", "detail.safetensors", 3)}
    missing = comfy_folders("comfyui", [tmp_path / "gone"], {})
    assert missing.problems and "does not exist" in missing.problems[0].problem


def test_model_paths_of_any_tenant_are_files_or_directories_of_files(tmp_path: Path) -> None:
    (tmp_path / "whisper.bin").write_bytes(b"w")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.onnx").write_bytes(b"aa")
    found = plain_files("stt", [tmp_path / "whisper.bin", tmp_path / "d", tmp_path / "nope"])
    assert {m.name for m in found.models} == {"whisper.bin", "a.onnx"}
    assert len(found.problems) == 1 and "model_paths" in found.problems[0].fix


def test_each_adapter_locates_its_own_files_and_asks_only_what_it_needs(tmp_path: Path) -> None:
    manifest(tmp_path / "store", "registry.ollama.ai/library/gemma3/latest", {"g1": 10})
    (tmp_path / "comfy" / "checkpoints").mkdir(parents=True)
    (tmp_path / "comfy" / "checkpoints" / "sd.safetensors").write_bytes(b"s")
    (tmp_path / "whisper.bin").write_bytes(b"w")
    reg = registry_from_dict({"tenants": {
        "ollama": {"model_paths": [str(tmp_path / "store")]},
        "comfyui": {"model_paths": [str(tmp_path / "comfy")]},
        "stt": {"engine": "generic", "upstream": "http://127.0.0.1:1", "model_paths": [str(tmp_path / "whisper.bin")]},
        "app": {"engine": "generic", "upstream": "http://127.0.0.1:2"}}})

    def not_asked() -> list[str]:
        raise AssertionError("model_paths replace what would be found: the engine's environment and command line are not read")

    hints = FileHints({}, tmp_path, engine_env=not_asked, cmdlines=not_asked)  # type: ignore[arg-type]
    found = {t.name: adapter_for(t).model_files(hints) for t in reg}
    layouts = {name: (f.layout, [m.name for m in f.located.models]) for name, f in found.items() if f is not None}
    assert layouts["ollama"] == ("ollama", ["gemma3:latest"]), layouts
    assert layouts["comfyui"] == ("comfyui", ["sd.safetensors"]), layouts
    assert layouts["stt"] == (None, ["whisper.bin"]), layouts
    assert found["app"] is None, "a generic tenant without model_paths has nothing to look for"
    flags = {t.name: adapter_for(t).load_timed_from_frames for t in reg}
    assert flags["comfyui"] and not flags["ollama"] and not flags["stt"], "ComfyUI's loads run after its answer"


class _Probe:
    def measure(self, path: str) -> FileResidency:
        return FileResidency(path, 1, 1, "cachestat")

    def drop(self, path: str) -> None:
        pass


def test_the_catalog_finds_models_per_tenant_by_the_name_a_request_uses(tmp_path: Path) -> None:
    manifest(tmp_path / "ollama", "registry.ollama.ai/library/gemma3/latest", {"g1": 10})
    (tmp_path / "comfy" / "models" / "checkpoints").mkdir(parents=True)
    (tmp_path / "comfy" / "models" / "checkpoints" / "sd.safetensors").write_bytes(b"s")
    reg = registry_from_dict({"tenants": {"ollama": {"model_paths": [str(tmp_path / "ollama")]}}})
    cmdlines = {"comfyui": [f"python3 /x/main.py --base-directory {tmp_path / 'comfy'}"]}
    catalog = ModelCatalog(reg, _Probe(), cmdlines=lambda t: cmdlines.get(t, []), env={}, home=tmp_path)
    gemma = catalog.find("ollama", "gemma3")
    assert gemma is not None and gemma.name == "gemma3:latest"
    assert catalog.find("comfyui", "sd.safetensors") is not None
    assert catalog.find("ollama", "absent") is None
    files = catalog.all_files()
    assert files["ollama"].located.problems == []
    assert "desktop" not in files, "a VRAM-only tenant without model_paths has nothing to list"
    cmdlines.clear()
    unseen = ModelCatalog(reg, _Probe(), cmdlines=lambda t: [], env={}, home=tmp_path).all_files()["comfyui"]
    assert unseen.unknown_reason and "not seen" in unseen.unknown_reason


def test_ollamas_own_environment_says_where_its_models_are_not_the_proxys(tmp_path: Path) -> None:
    manifest(tmp_path / "theirs", "registry.ollama.ai/library/gemma3/latest", {"g1": 10})
    manifest(tmp_path / "ours", "registry.ollama.ai/library/llama3.2/latest", {"l1": 10})
    manifest(tmp_path / "svc-home" / ".ollama" / "models", "registry.ollama.ai/library/qwen3/latest", {"q1": 10})
    reg = registry_from_dict({})
    proxy_env = {"OLLAMA_MODELS": str(tmp_path / "ours")}
    engine: dict[str, dict[str, str] | None] = {"ollama": {"OLLAMA_MODELS": str(tmp_path / "theirs")}}

    def catalog() -> ModelCatalog:
        return ModelCatalog(reg, _Probe(), cmdlines=lambda t: [], env=proxy_env, home=tmp_path,
                            engine_env=lambda tenant: engine.get(tenant.name))

    assert [m.name for m in catalog().models("ollama")] == ["gemma3:latest"]
    engine["ollama"] = {"HOME": str(tmp_path / "svc-home")}  # no OLLAMA_MODELS: its user's home
    assert [m.name for m in catalog().models("ollama")] == ["qwen3:latest"]
    engine["ollama"] = None  # unreadable (not on the card, no permission): the proxy's environment is the guess
    assert [m.name for m in catalog().models("ollama")] == ["llama3.2:latest"]


def test_the_models_extension_reads_the_engines_environment_only_from_this_hosts_processes(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from proxy.admin.models_api import ModelsExtension
    from proxy.gpu.attribution import AttributedProcess, AttributedSnapshot
    from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot, ProcessTree

    (tmp_path / "proc" / "700").mkdir(parents=True)  # a runner whose environ this user may not read: none here
    (tmp_path / "proc" / "701").mkdir(parents=True)
    (tmp_path / "proc" / "701" / "environ").write_bytes(b"HOME=/srv/ollama\0OLLAMA_MODELS=/data/models\0")
    reg = registry_from_dict({})
    card = DeviceMemory(0, "card", 24 * 2**30, 0, 0, 24 * 2**30)
    procs = tuple(AttributedProcess(GpuProcess(pid, "ollama", "ollama runner", 2**30), "ollama") for pid in (700, 701))

    def ext_seeing(tree: ProcessTree | None) -> ModelsExtension:
        snap = AttributedSnapshot(GpuSnapshot(card, tuple(p.process for p in procs), tree=tree), procs)
        view = SimpleNamespace(registry=reg, broker=SimpleNamespace(last_snapshot=snap))
        return ModelsExtension(view, probe=_Probe(), env={}, home=tmp_path, proc_root=tmp_path / "proc")  # type: ignore[arg-type]

    ollama = reg.tenants["ollama"]
    assert ext_seeing(ProcessTree())._engine_env(ollama) == {"HOME": "/srv/ollama", "OLLAMA_MODELS": "/data/models"}
    # a reader that does not see this host's /proc (simulated GPU, engines' estimates): its pids are not these
    assert ext_seeing(None)._engine_env(ollama) is None
    files = ext_seeing(ProcessTree()).catalog.tenant_files(ollama)
    assert files is not None and files.looked_in == ("/data/models",)


def test_the_health_text_names_a_model_file_given_as_model_paths_not_a_dash(tmp_path: Path) -> None:
    (tmp_path / "whisper.bin").write_bytes(b"w")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.onnx").write_bytes(b"aa")
    one_file = plain_files("stt", [tmp_path / "whisper.bin"])
    assert files_summary(one_file) == f"1 model(s): {tmp_path / 'whisper.bin'}"
    both = plain_files("stt", [tmp_path / "d", tmp_path / "whisper.bin"])
    assert files_summary(both) == f"2 model(s) in {tmp_path / 'd'} and {tmp_path / 'whisper.bin'}"
    assert files_summary(plain_files("stt", [tmp_path / "d"])) == f"1 model(s) in {tmp_path / 'd'}"


def test_a_model_folder_whose_demo_was_killed_is_removed_by_the_next_box(tmp_path: Path) -> None:
    """Issue 42: each demo killed -9 left its 53 MB hyperswap-models-* folder for good."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = procs.start_time(gone.pid)
    gone.wait()
    for name, owner in (("dead", {"pid": gone.pid, "start_time": started}),
                        ("live", {"pid": os.getpid(), "start_time": procs.start_time(os.getpid())})):
        (tmp_path / f"{PREFIX}{name}").mkdir()
        (tmp_path / f"{PREFIX}{name}" / OWNER).write_text(json.dumps(owner))
    (tmp_path / f"{PREFIX}unowned").mkdir()
    assert remove_abandoned(tmp_path) == [tmp_path / f"{PREFIX}dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{PREFIX}live", f"{PREFIX}unowned"]
