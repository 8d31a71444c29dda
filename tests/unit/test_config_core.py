"""The configuration is wholly core: proxy/config/ imports no engine or lifecycle module, the release
kinds a file may use are a parameter of loading (no global, nothing rewritten at import), so a tenant
validates the same way in a fresh interpreter whatever else was imported.

Before: proxy/config/loading.py imported proxy.engines.release_kinds for its side effect, which
rebuilt `Tenant` and `Config` with the kinds' union; in a fresh interpreter that imported only
proxy.config, `"release": {"kind": "ollama_unload"}` was refused ("Input should be 'none'") until
`import proxy.engines.generic` had run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from proxy.engines.loading import registry_from_dict
from proxy.engines.ollama import OllamaUnload
from proxy.engines.release_kinds import KINDS
from proxy.lifecycle.process import ProcessRelease
from tests.unit.test_layers import LAYERS, layer_of

ROOT = Path(__file__).resolve().parents[2]
OLLAMA = {"upstream": "http://127.0.0.1:11434", "release": {"kind": "ollama_unload"}}


def fresh(script: str) -> list[object]:
    """Run `script` in a fresh interpreter; what it printed, one JSON value a line."""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_importing_all_of_proxy_config_loads_only_core_modules() -> None:
    modules = sorted(p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
                     for p in (ROOT / "proxy" / "config").rglob("*.py"))
    [loaded] = fresh("import importlib, json, sys\n"
                     f"for name in {modules!r}:\n    importlib.import_module(name)\n"
                     "print(json.dumps(sorted(m for m in sys.modules if m.startswith('proxy'))))")
    assert isinstance(loaded, list) and "proxy.config.loading" in loaded and "proxy.config.kinds" in loaded
    later = [m for m in loaded if layer_of(str(m)) != 0]
    assert not later, f"importing proxy.config loads modules of later layers than {LAYERS[0][0]}: {later}"


def test_a_tenant_with_release_kind_ollama_unload_validates_in_a_fresh_interpreter_that_imported_only_proxy_config() -> None:
    """proxy.config validates with the kinds it is given, the same before and after any engine module
    is imported; given Ollama's kind (its module's model, no registry), the tenant validates."""
    out = fresh(f"""
import json, sys
from proxy.config.kinds import ReleaseKinds
from proxy.config.loading import registry_from_dict
from proxy.config.schema import NoRelease
from proxy.errors import ConfigError

tenant = {OLLAMA!r}
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("proxy.engines", "proxy.lifecycle")))))

def refusal():
    try:
        registry_from_dict({{"tenants": {{"llm": tenant}}}}, kinds=ReleaseKinds((NoRelease,)))
    except ConfigError as exc:
        return exc.problems
    return "accepted"

print(json.dumps(refusal()))
import proxy.engines.generic  # the import that used to rebuild the schema
print(json.dumps(refusal()))
from proxy.engines.comfyui import ComfyUIFree  # the shipped defaults' ComfyUI tenant releases with it
from proxy.engines.ollama import OllamaUnload
kinds = ReleaseKinds((NoRelease, OllamaUnload, ComfyUIFree))
step = registry_from_dict({{"tenants": {{"llm": tenant}}}}, kinds=kinds).get("llm").release
print(json.dumps([type(step).__name__, step.kind]))
""")
    assert out[0] == [], "proxy.config loaded an engine or lifecycle module"
    assert isinstance(out[1], list) and "tenants.llm.release.kind: expected 'none'" in out[1], out[1]
    assert out[2] == out[1], "the kinds given decide, not what was imported before"
    assert out[3] == ["OllamaUnload", "ollama_unload"]


def test_every_release_kind_validates_in_a_fresh_interpreter_through_the_applications_entry_point() -> None:
    """Each kind of proxy/engines/release_kinds.py, one tenant each, in one fresh interpreter that
    imported only proxy.engines.loading. A kind listed after this test was written is tried with no
    fields of its own: its own fields may be missing, but its `kind` must be known."""
    bodies: dict[str, dict[str, object]] = {
        "ollama_unload": {}, "comfyui_free": {}, "http": {"url": "/release"}, "none": {},
        "process": {"command": [sys.executable, "-c", "pass"]}, "systemd": {"unit": "app.service"},
        "docker": {"container": "app"}}
    assert set(bodies) <= set(KINDS)
    tenants = {kind: {"upstream": "http://127.0.0.1:8000", "release": {"kind": kind, **bodies.get(kind, {})}}
               for kind in KINDS}
    [steps] = fresh(f"""
import json
from proxy.engines.loading import registry_from_dict
from proxy.errors import ConfigError
out = {{}}
for name, tenant in {json.dumps(tenants)}.items():
    try:
        out[name] = type(registry_from_dict({{"tenants": {{name: tenant}}}}).get(name).release).__name__
    except ConfigError as exc:
        out[name] = exc.problems
print(json.dumps(out))
""")
    assert isinstance(steps, dict)
    assert {kind: steps[kind] for kind in bodies} == {kind: KINDS[kind].__name__ for kind in bodies}
    unknown = {kind: problems for kind, problems in steps.items() if kind not in bodies and isinstance(problems, list)
               and any(str(p).startswith(f"tenants.{kind}.release.kind:") for p in problems)}
    assert not unknown, f"kinds refused as unknown in a fresh interpreter: {unknown}"


def test_mypy_narrows_a_release_step_with_match() -> None:
    """Each kind is its own class: `match` narrows a step to it, and its fields read typed (this module
    type-checks with `mypy --strict`; `step.command` on a bare ReleaseSpec does not)."""
    registry = registry_from_dict({"tenants": {"llm": OLLAMA, "stt": {
        "upstream": "http://127.0.0.1:9000", "release": {"kind": "process", "command": [sys.executable, "-c", "pass"]}}}})
    seen: list[str] = []
    for name in ("llm", "stt"):
        for step in registry.get(name).release_steps:
            match step:
                case ProcessRelease(command=[*_, last]):
                    seen.append(f"{name}: runs {last!r}")
                case OllamaUnload():
                    seen.append(f"{name}: unloads with keep_alive 0, timeout {step.timeout_s}")
                case _:
                    seen.append(f"{name}: {step.kind}")
    assert seen == ["llm: unloads with keep_alive 0, timeout None", "stt: runs 'pass'"]
