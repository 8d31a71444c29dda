"""Config loading: shipped defaults merged under the user's file, and every bad input named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config.loading import SHIPPED_DEFAULTS, user_config_path
from proxy.config.units import GIB
from proxy.engines.loading import load_registry, registry_from_dict
from proxy.errors import ConfigError


def write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_shipped_defaults_alone_give_the_three_default_tenants() -> None:
    reg = load_registry()
    assert reg.source is None
    assert set(reg.tenants) == {"ollama", "comfyui", "desktop"}
    assert reg.get("ollama").listen == "127.0.0.1:11435"
    assert reg.get("ollama").upstream == "http://127.0.0.1:11434"
    assert reg.get("comfyui").listen == "127.0.0.1:8189"
    assert reg.get("comfyui").upstream == "http://127.0.0.1:8188"
    assert reg.config.admin.listen == "127.0.0.1:11400"
    assert not reg.get("desktop").reclaimable
    assert all(src == "default" for src in reg.provenance["ollama"].values())


def test_ollama_runner_processes_are_matched_by_the_defaults() -> None:
    match = load_registry().get("ollama").match
    assert "llama-server" in match.process_names
    assert any("ollama runner" in p for p in match.cmdline_patterns)


def test_old_config_gains_fields_added_to_the_schema_later(tmp_path: Path) -> None:
    # A config written before release_timeout_s/idle_vram_gb existed: they must get their
    # default values, not 0 (the bug in the system we replace).
    cfg = write(tmp_path / "t.json", {"tenants": {"comfyui": {"priority": 70}}})
    reg = load_registry(cfg)
    comfy = reg.get("comfyui")
    assert comfy.priority == 70
    assert comfy.idle_vram_gb == 0.5
    assert comfy.release_timeout_s == 10.0
    assert comfy.upstream == "http://127.0.0.1:8188"
    assert reg.provenance["comfyui"]["priority"] == "user"
    assert reg.provenance["comfyui"]["idle_vram_gb"] == "default"


def test_user_values_win_field_by_field_inside_nested_objects(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"ollama": {"timeouts": {"read_s": 30.0}}}})
    ollama = load_registry(cfg).get("ollama")
    assert ollama.timeouts.read_s == 30.0
    assert ollama.timeouts.connect_s == 5.0
    prov = load_registry(cfg).provenance["ollama"]
    assert prov["timeouts.read_s"] == "user" and prov["timeouts.connect_s"] == "default"


def test_a_removed_shipped_tenant_stays_removed(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"desktop": None}})
    reg = load_registry(cfg)
    assert "desktop" not in reg
    assert set(reg.tenants) == {"ollama", "comfyui"}


def test_a_third_app_is_registered_as_data(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"stt": {
        "match": {"cmdline_patterns": ["stt_relay\\.py"]}, "priority": 60, "needs_vram_gb": 0.84}}})
    stt = load_registry(cfg).get("stt")
    assert stt.engine == "generic" and stt.listen is None and not stt.reclaimable
    assert stt.needs_vram_bytes == int(0.84 * GIB)


def test_invalid_json_names_file_line_and_column(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", '{\n  "tenants": {\n    "ollama": {priority: 1}\n  }\n}')
    with pytest.raises(ConfigError) as err:
        load_registry(cfg)
    assert f"{cfg}:3:16: invalid JSON" in err.value.message


def test_schema_violations_list_every_offending_path(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {
        "comfyui": {"priority": "high"},
        "ollama": {"needs_vram_gb": "lots", "listen": "nowhere"},
    }})
    with pytest.raises(ConfigError) as err:
        load_registry(cfg)
    problems = err.value.problems
    assert "tenants.comfyui.priority: expected an integer" in problems
    assert "tenants.ollama.needs_vram_gb: expected a number" in problems
    assert any(p.startswith("tenants.ollama.listen: expected host:port") for p in problems)


def test_unknown_keys_are_rejected_with_their_path(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"comfyui": {"priorty": 3}}, "admn": {}})
    with pytest.raises(ConfigError) as err:
        load_registry(cfg)
    paths = [p.split(":")[0] for p in err.value.problems]
    assert "tenants.comfyui.priorty" in paths and "admn" in paths


def test_unknown_engine_kind_is_named(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"x": {"engine": "vllm"}}})
    with pytest.raises(ConfigError) as err:
        load_registry(cfg)
    assert err.value.problems == ["tenants.x.engine: expected 'ollama', 'comfyui' or 'generic'"]


def test_http_release_needs_a_url(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"x": {"release": {"kind": "http"}}}})
    with pytest.raises(ConfigError) as err:
        load_registry(cfg)
    assert "tenants.x.release" in err.value.problems[0] and "url" in err.value.problems[0]


def test_two_tenants_on_one_port_are_refused(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"x": {"listen": "127.0.0.1:11435", "upstream": "http://127.0.0.1:1"}}})
    with pytest.raises(ConfigError) as err:
        load_registry(cfg)
    assert "both listen on 127.0.0.1:11435" in " ".join(err.value.problems)


def test_config_file_is_never_rewritten(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"comfyui": {"priority": 70}}})
    before = cfg.read_bytes(), cfg.stat().st_mtime_ns
    load_registry(cfg)
    assert (cfg.read_bytes(), cfg.stat().st_mtime_ns) == before


def test_lookup_order_is_flag_then_env_then_home(tmp_path: Path) -> None:
    home_cfg = user_config_path()
    home_cfg.parent.mkdir(parents=True)
    write(home_cfg, {"tenants": {"ollama": {"priority": 1}}})
    env_cfg = write(tmp_path / "env.json", {"tenants": {"ollama": {"priority": 2}}})
    flag_cfg = write(tmp_path / "flag.json", {"tenants": {"ollama": {"priority": 3}}})
    assert load_registry(env={}).get("ollama").priority == 1
    assert load_registry(env={"HYPERSWAP_CONFIG": str(env_cfg)}).get("ollama").priority == 2
    assert load_registry(flag_cfg, env={"HYPERSWAP_CONFIG": str(env_cfg)}).get("ollama").priority == 3


def test_the_autouse_fixture_hides_the_operators_home() -> None:
    assert "pytest" in str(user_config_path()) or "tmp" in str(user_config_path())
    assert not user_config_path().exists()


def test_repo_tenants_json_is_the_shipped_defaults() -> None:
    root = Path(__file__).resolve().parents[2] / "tenants.json"
    assert json.loads(root.read_text()) == json.loads(SHIPPED_DEFAULTS.read_text())


# -- the CLI edge -------------------------------------------------------------------------------


def test_cli_tenants_shows_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"comfyui": {"priority": 70}}})
    assert main(["tenants", "--config", str(cfg), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["tenants"]) == {"ollama", "comfyui", "desktop"}
    assert out["tenants"]["comfyui"]["sources"]["priority"] == "user"
    assert out["tenants"]["comfyui"]["config"]["priority"] == 70
    assert main(["tenants", "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert "[user]" in text and "[default]" in text


def test_cli_bad_config_exits_2_with_paths_and_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"comfyui": {"priority": "high"}}})
    assert main(["tenants", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "tenants.comfyui.priority: expected an integer" in err
    assert "Traceback" not in err


def test_cli_missing_config_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tenants", "--config", str(tmp_path / "nope.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_version_and_help_list_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("serve", "demo", "check", "plan", "tenants", "--version"):
        assert cmd in out


# -- nonsense is refused at load (exit 2, the JSON path, no traceback) ---------------------------

def _tenant(body: str) -> str:
    return '{"tenants": {"ollama": {' + body + '}}}'


NONSENSE: list[tuple[str, str, str]] = [
    # (config text, the path the message must name, a word the message must contain)
    (_tenant('"needs_vram_gb": NaN'), "tenants.ollama.needs_vram_gb", "NaN"),
    (_tenant('"needs_vram_gb": Infinity'), "tenants.ollama.needs_vram_gb", "Infinity"),
    (_tenant('"needs_vram_gb": -Infinity'), "tenants.ollama.needs_vram_gb", "Infinity"),
    (_tenant('"needs_vram_gb": 1e300'), "tenants.ollama.needs_vram_gb", "16384"),
    (_tenant('"context_allowance_gb": 1e400'), "tenants.ollama.context_allowance_gb", "Infinity"),
    (_tenant('"model_vram_gb": {"llama3.1:8b": 1e300}'), "tenants.ollama.model_vram_gb", "16384"),
    (_tenant('"release": {"kind": "http", "url": "/free", "body": {"x": NaN}}'), "tenants.ollama.release.body.x", "NaN"),
    (_tenant('"timeouts": {"connect_s": -5}'), "tenants.ollama.timeouts.connect_s", "> 0"),
    (_tenant('"timeouts": {"read_s": -1}'), "tenants.ollama.timeouts.read_s", "> 0"),
    (_tenant('"timeouts": {"read_s": 0}'), "tenants.ollama.timeouts.read_s", "> 0"),
    (_tenant('"release_timeout_s": 0'), "tenants.ollama.release_timeout_s", "> 0"),
    (_tenant('"idle_release_after_s": -1'), "tenants.ollama.idle_release_after_s", ">= 0"),
    (_tenant('"priority": 10000000000'), "tenants.ollama.priority", "1000000"),
    ('{"proxy": {"watchdog_interval_s": 0}}', "proxy.watchdog_interval_s", ">= 0.05"),
    ('{"proxy": {"release_poll_s": 0}}', "proxy.release_poll_s", ">= 0.01"),
    ('{"proxy": {"queue_timeout_s": -1}}', "proxy.queue_timeout_s", ">= 0"),
    (_tenant('"upstream": "http://127.0.0.1:99999"'), "tenants.ollama.upstream", "1-65535"),
    (_tenant('"upstream": "http://127.0.0.1:0"'), "tenants.ollama.upstream", "1-65535"),
    (_tenant('"upstream": "http://exa mple.com"'), "tenants.ollama.upstream", "space"),
    (_tenant('"upstream": "http://127.0.0.1:11434/api"'), "tenants.ollama.upstream", "path"),
    (_tenant('"listen": "127.0.0.1:0"'), "tenants.ollama.listen", "port 0"),
    ('{"admin": {"listen": "127.0.0.1:0"}}', "admin.listen", "port 0"),
    (_tenant('"listen": "exa mple:11435"'), "tenants.ollama.listen", "space"),
    ('{"tenants": {"": {"priority": 1}}}', "tenants", "empty"),
    ('{"tenants": {"my app": {"priority": 1}}}', "tenants", "'my app'"),
    ('{"telemetry": {"retention_days": -1}}', "telemetry.retention_days", "> 0"),
    ('{"telemetry": {"max_rows": 0}}', "telemetry.max_rows", ">= 1"),
    (_tenant('"replay_body_max_mb": 1e9'), "tenants.ollama.replay_body_max_mb", "1024"),
    (_tenant('"priority": 1, "priority": 2'), "tenants.ollama", "'priority' twice"),
    ('{"tenants": {"ollama": {"priority": 1}, "ollama": {"priority": 2}}}', "tenants", "'ollama' twice"),
    ('{"tenants": {}, "tenants": {}}', "(top level)", "'tenants' twice"),
    (_tenant('"release": {"kind": "http", "url": "/free", "body": %s}' % ('{"a": ' * 40 + '1' + '}' * 40)),
     "tenants.ollama.release.body.a.a", "nested deeper than"),
    ('[' * 100_000 + ']' * 100_000, "", "nested too deeply"),
    (_tenant('"priority": 1%s' % ("0" * 5000)), "", "number cannot be read"),
    (_tenant('"priority": 1%s' % ("0" * 400)), "tenants.ollama.priority", "1329-bit integer"),
]


@pytest.mark.parametrize("text,path,word", NONSENSE, ids=[f"{n}-{p or 'deep'}" for n, (_, p, _w) in enumerate(NONSENSE)])
def test_nonsense_is_refused_with_its_path_exit_2_and_no_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, path: str, word: str) -> None:
    cfg = write(tmp_path / "t.json", text)
    assert main(["tenants", "--config", str(cfg)]) == 2, f"accepted: {text[:120]}"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert str(cfg) in err, f"the message names no file: {err}"
    problem = next((line.strip() for line in err.splitlines() if line.strip().startswith(path)), None) if path else err
    assert problem is not None, f"no problem names {path}: {err}"
    assert word in problem, f"{word!r} not in {problem!r}"


def test_nonsense_in_memory_is_refused_too() -> None:
    """Scenarios and tests build registries from dicts: the same checks apply."""
    with pytest.raises(ConfigError) as err:
        registry_from_dict({"tenants": {"ollama": {"needs_vram_gb": float("nan")}}})
    assert any(p.startswith("tenants.ollama.needs_vram_gb") for p in err.value.problems), err.value.problems


def test_bounds_admit_the_sensible_edges(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {
        "proxy": {"queue_timeout_s": 0, "watchdog_interval_s": 0.05, "release_poll_s": 0.01},
        "telemetry": {"retention_days": 0.5, "max_rows": 1},
        "tenants": {"ollama": {"needs_vram_gb": 16384, "idle_release_after_s": 0, "replay_body_max_mb": 0,
                               "upstream": "http://[::1]:11434/", "priority": -1000000},
                    "stt-relay_2.x": {"needs_vram_gb": 0.84}}})
    reg = load_registry(cfg)
    assert reg.get("ollama").upstream == "http://[::1]:11434"
    assert reg.config.proxy.queue_timeout_s == 0


def test_model_files_settings_are_checked_like_the_others(tmp_path: Path) -> None:
    cfg = write(tmp_path / "t.json", {"tenants": {"stt": {"model_paths": ["models/whisper"]}},
                                      "proxy": {"warm_margin_gb": -1, "keep_warm_models": 5000}})
    with pytest.raises(ConfigError) as err:
        load_registry(cfg)
    problems = " | ".join(err.value.problems)
    assert "tenants.stt.model_paths" in problems and "absolute path" in problems, problems
    assert "proxy.warm_margin_gb: must be >= 0" in problems and "proxy.keep_warm_models: must be >= 0 and <= 1000" in problems
    ok = load_registry(write(tmp_path / "ok.json", {"tenants": {"stt": {"model_paths": ["~/models", "/srv/m"]}},
                                                    "proxy": {"warm_margin_gb": 2, "keep_warm_models": 3}}))
    assert ok.get("stt").model_paths == ["~/models", "/srv/m"] and ok.config.proxy.keep_warm_models == 3
    assert ok.config.proxy.warm_during_release is True
