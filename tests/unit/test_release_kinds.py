"""The release-kind seam: a kind is one module plus one line in proxy/engines/release_kinds.py, the
set of kinds is a parameter of loading (no global: proxy/config/ imports no kind), and nothing in
proxy/ compares a `kind` to a release kind's name (each kind's model carries what differs)."""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

import httpx
import pytest

from docs.gen.config import render
from proxy.config.kinds import ReleaseKinds
from proxy.config.schema import NoRelease, ReleaseSpec
from proxy.engines import adapter_for
from proxy.engines.loading import registry_from_dict
from proxy.engines.release_kinds import KINDS, RELEASE_KINDS
from proxy.errors import ConfigError
from proxy.lifecycle.controller import StoppingRelease
from tests.unit.release_kind_example import UnloadEach
from tests.unit.source_tree import SourceFile, nodes_of, python_files

ROOT = Path(__file__).resolve().parents[2]
PROXY = ROOT / "proxy"
GUIDE = ROOT / "docs" / "guides" / "adding-an-app.md"
EXAMPLE = Path(__file__).with_name("release_kind_example.py")


# ---------------------------------------------------------------------------------------------
# The check: no switch on a release kind's name


def _kind_valued(node: ast.expr, names: set[str]) -> bool:
    """`x.kind`, `d["kind"]`, `d.get("kind")`, or a name assigned from one of them (`kind = step.kind`)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "kind"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind"
    return isinstance(node, ast.Name) and node.id in names


def _strings(node: ast.expr) -> list[str]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a module or function, without those of the functions defined in it."""
    out: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack += ast.iter_child_nodes(node)
    return out


def kind_switches(source: str | SourceFile, where: str, kinds: frozenset[str]) -> list[str]:
    """Comparisons (==, !=, in, not in) and `match` cases of a kind-valued expression against a
    release kind's name, as `where:line: code`, in line order."""
    out: dict[tuple[int, str], None] = {}
    for scope in nodes_of(source, where):
        if not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = _own_nodes(scope)
        names = {t.id for n in nodes if isinstance(n, ast.Assign) and _kind_valued(n.value, set())
                 for t in n.targets if isinstance(t, ast.Name)}
        for node in nodes:
            if isinstance(node, ast.Compare):
                sides = (node.left, *node.comparators)
                if any(_kind_valued(s, names) for s in sides) and kinds.intersection(v for s in sides for v in _strings(s)):
                    out[(node.lineno, ast.unparse(node))] = None
            elif isinstance(node, ast.Match) and _kind_valued(node.subject, names):
                out.update({(case.pattern.lineno, f"case {ast.unparse(case.pattern)}"): None for case in node.cases
                            if kinds.intersection(n.value for n in ast.walk(case.pattern) if isinstance(n, ast.Constant))})
    return [f"{where}:{line}: {code}" for line, code in sorted(out)]


def test_no_module_in_proxy_switches_on_a_release_kind() -> None:
    kinds = frozenset(KINDS)
    offenders = [hit for source in python_files(PROXY) for hit in kind_switches(source, source.rel(), kinds)]
    assert not offenders, ("a comparison of a `kind` to a release kind's name is a kind switch: give the kind's "
                           "model (ReleaseSpec) a method or a class attribute that says what it means "
                           "(docs/guides/adding-an-app.md, Adding a release kind):\n" + "\n".join(offenders))


def test_the_check_finds_every_form_of_kind_switch() -> None:
    src = ('kind = step.kind\nif kind == "ollama_unload":\n    pass\n'            # 2: the old engines/common.py chain
           'if spec.kind in ("process", "docker") or "http" != s.kind:\n    pass\n'  # 4: two comparisons
           'if d.get("kind") == "systemd" or d["kind"] != "none":\n    pass\n'     # 6: two comparisons
           'match step.kind:\n    case "docker":\n        pass\n'                 # 9
           'def asgi(scope):\n    kind = scope["type"]\n    if kind == "http" or t.engine == "process":\n'
           '        pass\n'                                                      # an ASGI scope's type: left alone
           'if event.kind == "plan":\n    pass\n')                                # a decision kind: left alone
    found = kind_switches(src, "x.py", frozenset(KINDS))
    assert [f.split(":")[1] for f in found] == ["2", "4", "4", "6", "6", "9"], found


# ---------------------------------------------------------------------------------------------
# The registry


def test_every_registered_kind_is_one_model_with_its_own_effect() -> None:
    assert list(KINDS) == [m.kind_name() for m in RELEASE_KINDS], "KINDS is the list, in its order"
    assert list(KINDS) == ["ollama_unload", "comfyui_free", "http", "none", "process", "systemd", "docker",
                           "cuda_suspend"]
    for model in RELEASE_KINDS:
        name = model.kind_name()
        assert model.model_fields["kind"].annotation == typing.Literal[name], model
        if model.stops:
            assert issubclass(model, StoppingRelease) and "controller" in vars(model), \
                f"{name} stops the app: it must build its own controller"
        elif model.reclaims:
            assert model.release is not ReleaseSpec.release, f"{name} gives memory back: it must implement release()"
    assert KINDS["none"] is NoRelease and not NoRelease.reclaims


def test_a_set_of_kinds_naming_one_twice_or_without_none_is_refused() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        ReleaseKinds((*RELEASE_KINDS, NoRelease))
    with pytest.raises(ValueError, match="'none' must be among the kinds"):
        ReleaseKinds((UnloadEach,))
    with pytest.raises(TypeError, match="a release kind is a ReleaseSpec"):
        ReleaseKinds((NoRelease, ReleaseSpec))  # `kind: str`: no name of its own


def test_an_unknown_kind_names_every_registered_kind_at_its_path() -> None:
    with pytest.raises(ConfigError) as info:
        registry_from_dict({"tenants": {"x": {"upstream": "http://127.0.0.1:1", "release": [{"kind": "unload_each"}]}}})
    assert info.value.problems == ["tenants.x.release.0.kind: expected 'ollama_unload', 'comfyui_free', 'http', "
                                   "'none', 'process', 'systemd', 'docker' or 'cuda_suspend'"]


# ---------------------------------------------------------------------------------------------
# A new kind from a test module: one module (release_kind_example.py) and one line in a set of kinds


async def test_a_kind_from_a_test_module_validates_releases_and_is_documented() -> None:
    tenant_json = {"upstream": "http://127.0.0.1:8000",
                   "release": {"kind": "unload_each", "unload_url": "/models/{model}/unload"}}
    kinds = KINDS.adding(UnloadEach)  # as the one line in RELEASE_KINDS does
    tenant = registry_from_dict({"tenants": {"lm": tenant_json}}, kinds=kinds).get("lm")
    step = tenant.release_steps[0]
    assert isinstance(step, UnloadEach) and step.models_url == "/v1/models" and tenant.reclaimable

    # its checks and messages come with it, in the words every kind uses
    for release, problem in [
        ({"kind": "unload_each"}, "tenants.lm.release.unload_url: release kind 'unload_each' needs 'unload_url'"),
        ({"kind": "unload_each", "unload_url": "/unload"},
         "tenants.lm.release.unload_url: '/unload' does not say where the model goes: write {model} in it"),
        ({"kind": "http", "url": "/x", "unload_url": "/u/{model}"},
         "tenants.lm.release.unload_url: only release kind 'unload_each' takes 'unload_url' (this release is kind "
         "'http')"),
    ]:
        with pytest.raises(ConfigError) as info:
            registry_from_dict({"tenants": {"lm": {**tenant_json, "release": release}}}, kinds=kinds)
        assert info.value.problems == [problem]

    assert list(KINDS) == [m.kind_name() for m in RELEASE_KINDS], "KINDS is the list, in its order"
    assert list(KINDS) == ["ollama_unload", "comfyui_free", "http", "none", "process", "systemd", "docker",
                           "cuda_suspend"]

    # the proxy releases through it: the same path an idle release or a handoff takes (the adapter)
    calls: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        calls.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}]})
        return httpx.Response(200, json={})

    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        asked = await adapter_for(tenant).release(client)
    assert asked == {"call": "POST /models/{model}/unload", "models": ["a", "b"]}
    assert calls == ["GET /v1/models", "POST /models/a/unload", "POST /models/b/unload"]

    with pytest.raises(ConfigError, match="does not match the schema"):
        registry_from_dict({"tenants": {"lm": tenant_json}})  # the proxy's own kinds do not know it
    assert "unload_each" not in render()


# ---------------------------------------------------------------------------------------------
# The guide shows that module, word for word, and the registry line


def _guide_section() -> str:
    text = GUIDE.read_text()
    start = text.index("## Adding a release kind")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_guide_shows_the_tested_example_and_how_to_register_it() -> None:
    section = _guide_section()
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks and blocks[0] == EXAMPLE.read_text(), \
        "the guide's worked example must be tests/unit/release_kind_example.py as it is (copy it over)"
    registry = (PROXY / "engines" / "release_kinds.py").read_text()
    assert "RELEASE_KINDS: tuple[type[ReleaseSpec], ...] = (" in registry and "RELEASE_KINDS" in section
    for name in ("ReleaseSpec", "StoppingRelease", "proxy/engines/release_kinds.py", "release()", "controller("):
        assert name in section, f"the guide's section should name {name}"
