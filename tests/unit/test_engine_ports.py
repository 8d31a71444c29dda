"""The engine ports (proxy/engines/ports.py): every member of the adapter contract sits in exactly one
small port, the generic adapter answers each port itself, an engine kind overrides only port members,
and outside proxy/engines/ only the holders of the adapter caches name the whole adapter."""

from __future__ import annotations

import ast
from pathlib import Path

from proxy.engines import ADAPTERS, EngineAdapter
from proxy.engines.loading import registry_from_dict
from proxy.engines.ports import PORTS
from tests.unit.source_tree import SourceFile, nodes_of, python_files

PROXY = Path(__file__).resolve().parents[2] / "proxy"
# Members of the adapter that no part of the proxy asks through a port: its registry key and a
# helper of its Host rule.
NOT_ASKED = frozenset({"kind", "listen_host"})
# A port stays small enough to read at once: the point of cutting the contract into ports.
MOST_MEMBERS = 10
# Outside proxy/engines/, the modules that may name the whole adapter: they hold or hand out the
# per-tenant adapters (each caller of theirs asks one port), or read class facts of every kind.
WHOLE_ADAPTER = frozenset({"proxy/relay/forward.py", "proxy/admin/models_api.py", "proxy/verify/roles.py"})


def members(port: type) -> set[str]:
    """The names a port declares: its methods and properties, and its annotated attributes."""
    return {n for n in (*vars(port), *getattr(port, "__annotations__", {})) if not n.startswith("_")}


def adapter() -> EngineAdapter:
    reg = registry_from_dict({"tenants": {"app": {"engine": "generic", "upstream": "http://127.0.0.1:1"}}})
    return EngineAdapter(reg.get("app"))


def test_every_member_of_the_adapter_is_in_exactly_one_port() -> None:
    owners: dict[str, list[str]] = {}
    for port in PORTS:
        for name in members(port):
            owners.setdefault(name, []).append(port.__name__)
    twice = {n: ps for n, ps in owners.items() if len(ps) > 1}
    assert not twice, f"a member in several ports: {twice}"
    public = {n for n in (*vars(EngineAdapter), *vars(adapter())) if not n.startswith("_")} - {"tenant"}
    outside = sorted(public - set(owners) - NOT_ASKED)
    assert not outside, (f"EngineAdapter members in no port (proxy/engines/ports.py): {outside}; put each in the "
                         "port of its concern, so a caller can ask for it by its port")


def test_the_generic_adapter_answers_every_port_itself() -> None:
    """An adapter that inherits a protocol's stub would answer None silently: each member is its own."""
    generic = adapter()
    missing = sorted(f"{port.__name__}.{name}" for port in PORTS for name in members(port)
                     if name not in vars(EngineAdapter) and name not in vars(generic))
    assert not missing, f"EngineAdapter does not define these port members (the protocol's stub would answer): {missing}"
    assert set(PORTS) <= set(EngineAdapter.__mro__), "EngineAdapter names every port among its bases"


def test_ports_stay_small() -> None:
    large = {port.__name__: len(members(port)) for port in PORTS if len(members(port)) > MOST_MEMBERS}
    assert not large, f"ports above {MOST_MEMBERS} members (split by concern): {large}"


def test_an_engine_kind_overrides_only_port_members() -> None:
    """What an engine kind adds beside the ports is private: a public extra would be asked of the whole adapter."""
    asked = set().union(*(members(port) for port in PORTS)) | {"kind"}
    extra = {kind: sorted(n for n in vars(cls) if not n.startswith("_") and n not in asked)
             for kind, cls in ADAPTERS.items()}
    assert not any(extra.values()), f"public adapter members outside every port: {extra}"


def test_outside_engines_only_the_adapter_holders_name_the_whole_adapter() -> None:
    named = []
    for source in python_files(PROXY):
        path, where = source.path, source.rel()
        if path.is_relative_to(PROXY / "engines") or path.is_relative_to(PROXY / "sim") or where in WHOLE_ADAPTER:
            continue
        named += [f"{where}:{n.lineno}" for n in source.nodes if isinstance(n, ast.Name) and n.id == "EngineAdapter"]
        named += [f"{where}:{n.lineno}" for n in source.nodes if isinstance(n, ast.ImportFrom)
                  and any(a.name == "EngineAdapter" for a in n.names)]
    assert not named, ("type against the port you ask (proxy/engines/ports.py), not the whole adapter: "
                       + ", ".join(named))


def brokers_adapters_asked(source: str | SourceFile, where: str = "<sample>") -> list[int]:
    """Lines that ask an engine through the broker's adapters (`broker.adapter`, `self.broker.adapter`)."""
    return [n.lineno for n in nodes_of(source, where) if isinstance(n, ast.Attribute) and n.attr == "adapter"
            and ((isinstance(n.value, ast.Name) and n.value.id == "broker")
                 or (isinstance(n.value, ast.Attribute) and n.value.attr == "broker"))]


def test_each_part_holds_the_adapters_by_its_own_ports_not_through_the_broker() -> None:
    """The broker's adapters are typed for what the broker asks (`BrokerPorts`); a part that asks an engine
    something else holds the proxy's adapters itself (`Proxy.engines`), typed to its own ports."""
    asked = [f"{source.rel()}:{line}" for source in python_files(PROXY)
             for line in brokers_adapters_asked(source, source.rel())]
    assert not asked, "hold the adapters typed to the ports you ask (proxy/engines/ports.py): " + ", ".join(asked)


def test_the_check_finds_an_engine_asked_through_the_broker() -> None:
    sample = "async def f(self, t):\n    await self.broker.adapter(t).runs_on_cpu(c)\n    return broker.adapter(t)\n"
    assert sorted(brokers_adapters_asked(sample)) == [2, 3]


def test_the_check_finds_a_use_of_the_whole_adapter() -> None:
    tree = ast.parse("from proxy.engines import EngineAdapter\ndef f(a: EngineAdapter) -> None: ...\n")
    assert [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "EngineAdapter"] == [2]


def test_the_design_docs_worked_example_is_a_working_engine() -> None:
    """docs/design.md's "How to extend: an engine" example runs as written and keeps to the rules above."""
    text = (PROXY.parent / "docs" / "design.md").read_text()
    section = text[text.index("### An engine"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    space: dict[str, object] = {}
    exec(compile(code, "docs/design.md", "exec"), space)
    cls = space["SpeechAdapter"]
    assert isinstance(cls, type) and issubclass(cls, EngineAdapter)
    asked = set().union(*(members(port) for port in PORTS)) | {"kind"}
    assert not [n for n in vars(cls) if not n.startswith("_") and n not in asked]
    speech = cls(adapter().tenant)
    assert speech.classify("POST", "/v1/audio/speech") == "gpu" and speech.classify("GET", "/health") == "passthrough"
    assert speech.answers_oom and speech.response_is_oom(500, b'{"detail": "CUDA out of memory"}')
    assert not speech.response_is_oom(500, b"other"), "only the OOM answer is retried"
    assert speech.captures_job("POST", "/v1/audio/speech") is False, "the rest stays the generic answer"
