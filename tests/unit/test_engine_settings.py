"""Engine configuration readers: systemd and /proc environ parsing, what each setting means, ComfyUI flags."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from proxy.engines import settings as es


def by_name(items: list[es.Setting]) -> dict[str, es.Setting]:
    return {s.name: s for s in items}


def test_systemd_environment_with_quoted_words_is_split_into_variables() -> None:
    text = 'Environment=OLLAMA_NUM_PARALLEL=1 "OLLAMA_ORIGINS=http://a b" OLLAMA_KEEP_ALIVE=-1\n'
    assert es.parse_systemd_environment(text) == {
        "OLLAMA_NUM_PARALLEL": "1", "OLLAMA_ORIGINS": "http://a b", "OLLAMA_KEEP_ALIVE": "-1"}


def test_empty_systemd_environment_means_nothing_set() -> None:
    assert es.parse_systemd_environment("Environment=\n") == {}
    assert es.parse_systemd_environment("") == {}


def test_proc_environ_is_nul_separated_and_keeps_equals_in_values() -> None:
    data = b"HOME=/root\0OLLAMA_HOST=0.0.0.0:11434\0X=a=b\0\0"
    assert es.parse_environ(data) == {"HOME": "/root", "OLLAMA_HOST": "0.0.0.0:11434", "X": "a=b"}


def test_systemd_reader_passes_the_unit_and_parses_the_answer() -> None:
    seen: list[list[str]] = []

    def fake(argv: Sequence[str], timeout_s: float) -> str:
        seen.append(list(argv))
        return "Environment=OLLAMA_MAX_LOADED_MODELS=1\n"

    read = es.read_systemd_env("ollama", fake)
    assert seen == [["systemctl", "show", "ollama", "--property=Environment"]]
    assert read.values == {"OLLAMA_MAX_LOADED_MODELS": "1"} and read.error is None


@pytest.mark.parametrize("exc, words", [
    (FileNotFoundError("systemctl"), "not installed"),
    (subprocess.TimeoutExpired(["systemctl"], 2.0), "did not answer"),
    (subprocess.CalledProcessError(1, ["systemctl"], stderr="Failed to connect to bus"), "Failed to connect to bus"),
    (PermissionError("denied"), "cannot run systemctl"),
])
def test_systemd_reader_reports_failures_instead_of_raising(exc: Exception, words: str) -> None:
    def fake(argv: Sequence[str], timeout_s: float) -> str:
        raise exc

    read = es.read_systemd_env("ollama", fake)
    assert read.values is None
    assert read.error is not None and words in read.error, read.error


def test_proc_environ_reader_reads_a_fake_proc(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "environ").write_bytes(b"OLLAMA_NUM_PARALLEL=4\0")
    read = es.read_proc_environ(77, tmp_path)
    assert read.values == {"OLLAMA_NUM_PARALLEL": "4"} and read.where == str(tmp_path / "77" / "environ")


def test_proc_environ_reader_reports_a_missing_process(tmp_path: Path) -> None:
    read = es.read_proc_environ(99, tmp_path)
    assert read.values is None and read.error is not None and "does not exist" in read.error


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_proc_environ_reader_reports_permission_denied_with_a_fix(tmp_path: Path) -> None:
    (tmp_path / "5").mkdir()
    path = tmp_path / "5" / "environ"
    path.write_bytes(b"A=1\0")
    path.chmod(0)
    read = es.read_proc_environ(5, tmp_path)
    assert read.values is None and read.error is not None and "permission denied" in read.error


def test_num_parallel_one_is_deferred_not_failed() -> None:
    sd = es.EnvRead("systemd", {"OLLAMA_NUM_PARALLEL": "1"})
    s = by_name(es.ollama_settings(sd, None, "0.12.3"))["OLLAMA_NUM_PARALLEL"]
    assert (s.value, s.source, s.status) == ("1", "systemd", "deferred")
    assert "queues behind" in s.meaning


def test_unset_num_parallel_before_0_10_is_auto() -> None:
    s = by_name(es.ollama_settings(None, es.EnvRead("environ", {}), "0.9.6"))["OLLAMA_NUM_PARALLEL"]
    assert (s.value, s.source) == (None, "default (not set)")
    assert "auto" in s.meaning and s.status != "deferred"


def test_max_loaded_models_one_says_every_swap_evicts() -> None:
    s = by_name(es.ollama_settings(es.EnvRead("systemd", {"OLLAMA_MAX_LOADED_MODELS": "1"}), None, None))[
        "OLLAMA_MAX_LOADED_MODELS"]
    assert s.status == "warn" and "every swap" in s.meaning


def test_the_running_processes_environ_wins_over_the_unit_file() -> None:
    sd = es.EnvRead("systemd", {"OLLAMA_KEEP_ALIVE": "10m", "OLLAMA_FLASH_ATTENTION": "1"})
    env = es.EnvRead("environ", {"OLLAMA_KEEP_ALIVE": "-1"})
    s = by_name(es.ollama_settings(sd, env, "0.12.3"))
    assert (s["OLLAMA_KEEP_ALIVE"].value, s["OLLAMA_KEEP_ALIVE"].source) == ("-1", "environ")
    assert "never unload" in s["OLLAMA_KEEP_ALIVE"].meaning
    # The unit says flash attention, but the process was started without it (unit edited, no restart).
    assert s["OLLAMA_FLASH_ATTENTION"].source == "default (not set)"


def test_unreadable_environ_falls_back_to_systemd() -> None:
    sd = es.EnvRead("systemd", {"OLLAMA_KV_CACHE_TYPE": "q8_0"})
    env = es.EnvRead("environ", None, "permission denied")
    s = by_name(es.ollama_settings(sd, env, None))["OLLAMA_KV_CACHE_TYPE"]
    assert (s.value, s.source) == ("q8_0", "systemd") and "less VRAM" in s.meaning


def test_every_ollama_variable_is_reported_with_a_meaning() -> None:
    out = es.ollama_settings(None, es.EnvRead("environ", {}), None)
    assert [s.name for s in out] == list(es.OLLAMA_VARS)
    assert all(s.meaning and s.source == "default (not set)" for s in out)


def test_settings_nobody_could_read_are_unknown_not_defaults() -> None:
    failed = es.EnvRead("systemd", None, "systemctl is not installed (no systemd here)")
    for systemd, environ in ((None, None), (failed, None), (failed, es.EnvRead("environ", None, "permission denied"))):
        out = es.ollama_settings(systemd, environ, "0.12.3")
        assert [s.name for s in out] == list(es.OLLAMA_VARS)
        wrong = [(s.name, s.source) for s in out if (s.value, s.source, s.status) != (None, "unknown", "unknown")]
        assert not wrong, f"nothing was read, yet these claim a source: {wrong}"
        assert all(s.meaning.startswith("not read") and "if unset:" in s.meaning for s in out), out


def test_gpu_overhead_is_shown_in_gib() -> None:
    s = by_name(es.ollama_settings(es.EnvRead("environ", {"OLLAMA_GPU_OVERHEAD": str(2**30)}), None, None))
    assert "1.00 GiB" in s["OLLAMA_GPU_OVERHEAD"].meaning


def test_version_tuple_reads_release_and_describe_strings() -> None:
    assert es.version_tuple("0.12.3") == (0, 12, 3)
    assert es.version_tuple("v0.2.2-30-gabc") == (0, 2, 2)
    assert es.version_tuple(None) is None and es.version_tuple("dev") is None


def test_trimmed_system_stats_never_breaks_parsing() -> None:
    stats = es.parse_system_stats({"system": {"comfyui_version": "0.3.10"}})
    assert stats.version == "0.3.10"
    assert (stats.python_version, stats.pytorch_version, stats.device_name, stats.argv) == (None, None, None, None)
    assert es.parse_system_stats(None).version is None
    assert es.parse_system_stats({"system": [], "devices": "x"}).argv is None


def test_full_system_stats_fields_are_read() -> None:
    stats = es.parse_system_stats({"system": {"comfyui_version": "0.3.64", "pytorch_version": "2.8.0+cu128",
                                              "python_version": "3.12.3", "argv": ["main.py", "--lowvram"]},
                                   "devices": [{"name": "cuda:0 NVIDIA H200 : cudaMallocAsync"}]})
    assert stats.model_dump(mode="json") == {
        "version": "0.3.64", "pytorch_version": "2.8.0+cu128", "python_version": "3.12.3",
        "device_name": "cuda:0 NVIDIA H200 : cudaMallocAsync", "argv": ["main.py", "--lowvram"]}


def test_highvram_and_gpu_only_warn_that_free_keeps_the_weights() -> None:
    flags = es.comfy_flags(["main.py", "--highvram", "--gpu-only"])
    assert [(f.flag, f.status) for f in flags] == [("--highvram", "warn"), ("--gpu-only", "warn")]
    assert all("/free" in f.meaning for f in flags)


def test_reserve_vram_value_is_read_in_both_spellings() -> None:
    assert es.comfy_flags(["main.py", "--reserve-vram", "2.5"])[0].value == "2.5"
    assert es.comfy_flags(["main.py", "--reserve-vram=1"])[0].value == "1"


def test_smart_memory_and_lowvram_flags_are_explained_and_plain_argv_has_none() -> None:
    names = [f.flag for f in es.comfy_flags(["main.py", "--disable-smart-memory", "--lowvram", "--listen", "0.0.0.0"])]
    assert names == ["--disable-smart-memory", "--lowvram"]
    assert es.comfy_flags(["main.py", "--listen"]) == []
