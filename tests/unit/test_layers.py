"""The layers of proxy/ are true: a module imports only from its own layer or earlier ones.

core -> gpu -> engines -> models -> handoff -> relay -> admin and verify -> deploy -> service, cli, demo
(docs/design.md, "Layers"). Every import counts, as in test_imports.py (whose graph this reads): module
level, inside functions, under `if TYPE_CHECKING:`. An import the other way (a back-edge) means the
earlier layer cannot be understood, tested or replaced without the later one. `proxy/sim/` stands
beside the layers: it may use what a simulated engine needs (up to relay's servers), and only the demo
may import it (test_imports.py checks that side).
"""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_imports import ROOT, Edge, import_edges, modules

# First to last. A module belongs to the first layer with a prefix that is its name or a package of it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("proxy.config", "proxy.errors", "proxy.clock", "proxy.tasks", "proxy.tls", "proxy.hosts",
              "proxy.decision_base", "proxy.encoding", "proxy.memo")),
    ("gpu", ("proxy.gpu",)),
    # lifecycle: how an engine is started and stopped (its release kinds are listed with the engines')
    ("engines", ("proxy.engines", "proxy.lifecycle")),
    ("models", ("proxy.models",)),
    ("handoff", ("proxy.handoff",)),
    ("relay", ("proxy.relay",)),
    ("admin and verify", ("proxy.admin", "proxy.verify")),
    ("deploy", ("proxy.deploy",)),
    ("service, cli, demo", ("proxy.service", "proxy.cli", "proxy.demo", "proxy.demo_check")),
)
SIM = "proxy.sim"
SIM_SEES_UP_TO = "relay"  # the simulators serve HTTP with relay's servers; nothing above that

# Back-edges known and left to their owner, each with why: (importer, imported). The test fails on any
# other, and when one of these is gone (then delete its line here). Empty this; never add to it.
KNOWN_BACK_EDGES: set[tuple[str, str]] = set()  # none: an edge allowed here must say why, and go


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    """The index of the module's layer in LAYERS (the longest prefix wins); None: in no layer."""
    if module == "proxy":
        return 0  # the package's own __init__ (its version): core, and not a prefix of everything
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _under(module, p) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def _statements(edges: list[Edge]) -> list[Edge]:
    """One edge per imported module: the package `__init__`s an import also runs are not repeated."""
    seen = {(e.source, e.line, e.target) for e in edges}
    out = {(e.source, e.line, e.target): e for e in edges
           if not any(s == e.source and ln == e.line and t.startswith(e.target + ".") for s, ln, t in seen)}
    return sorted(out.values(), key=lambda e: (e.source, e.line, e.target))


def back_edges(edges: list[Edge]) -> list[tuple[Edge, str, str]]:
    """Imports from a later layer, as (edge, importer's layer, imported's layer)."""
    sim_limit = next(i for i, (name, _) in enumerate(LAYERS) if name == SIM_SEES_UP_TO)
    out = []
    for e in _statements(edges):
        if _under(e.target, SIM):
            continue  # into the simulators: test_imports.py (only the demo)
        target = layer_of(e.target)
        if target is None:
            continue  # test_every_module_is_in_a_layer names it
        if _under(e.source, SIM):
            if target > sim_limit:
                out.append((e, "sim", LAYERS[target][0]))
            continue
        source = layer_of(e.source)
        if source is not None and target > source:
            out.append((e, LAYERS[source][0], LAYERS[target][0]))
    return out


def describe(found: list[tuple[Edge, str, str]]) -> str:
    return "\n".join(f"  {e.source}:{e.line} ({src}) imports {e.target} ({dst})"
                     f"{'' if e.module_level else ' inside a function'}" for e, src, dst in found)


def test_every_module_under_proxy_is_in_a_layer() -> None:
    lost = sorted(m for m in modules(ROOT) if layer_of(m) is None and not _under(m, SIM))
    assert not lost, f"modules in no layer: add each to LAYERS in tests/unit/test_layers.py (and to the design's list): {lost}"


def test_no_module_imports_from_a_later_layer() -> None:
    edges = import_edges()
    assert len(edges) > 100, f"the walk found only {len(edges)} imports: it is not reading the package"
    found = back_edges(edges)
    new = [f for f in found if (f[0].source, f[0].target) not in KNOWN_BACK_EDGES]
    assert not new, ("imports against the layer order (core -> gpu -> engines -> models -> handoff -> relay -> "
                     "admin and verify -> deploy -> service, cli, demo): move what is shared down to the "
                     "earlier layer, or ask an adapter or a callback instead:\n" + describe(new))
    gone = KNOWN_BACK_EDGES - {(e.source, e.target) for e, _, _ in found}
    assert not gone, f"these back-edges are gone: remove them from KNOWN_BACK_EDGES: {sorted(gone)}"


def test_the_layer_check_finds_a_back_edge_wherever_the_import_sits(tmp_path: Path) -> None:
    pkg = tmp_path / "proxy"
    for sub in ("engines", "relay", "models", "sim"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "relay" / "hosts.py").write_text("from proxy.engines.base import x\n")  # forward: fine
    (pkg / "engines" / "base.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from proxy.relay.hosts import HostPolicy\n")
    (pkg / "engines" / "ollama.py").write_text("def f():\n    from ..models import loads\n")
    (pkg / "models" / "loads.py").write_text("")
    (pkg / "sim" / "box.py").write_text("from proxy.relay import hosts\n")  # a simulator may use relay
    found = [(e.source, e.target, src, dst, e.module_level) for e, src, dst in back_edges(import_edges(tmp_path))]
    assert found == [("proxy.engines.base", "proxy.relay.hosts", "engines", "relay", True),
                     ("proxy.engines.ollama", "proxy.models.loads", "engines", "models", False)], found
    assert layer_of("proxy.newthing") is None and layer_of("proxy.hosts") == 0 and layer_of("proxy.verify.x") == 6
