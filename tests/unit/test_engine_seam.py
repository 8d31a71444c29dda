"""The engine seam: only proxy/engines/ knows engines by name; everything else asks an adapter."""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import httpx
import respx

from proxy.config.schema import EngineKind
from proxy.engines import ADAPTERS, AdapterCache, EngineAdapter, adapter_for
from proxy.engines.loading import registry_from_dict
from proxy.engines.ports import JobFrame, JobReplay, Requeued
from tests.unit.source_tree import SourceFile, nodes_of, python_files, text_of

PROXY = Path(__file__).resolve().parents[2] / "proxy"


def engine_switches(source: str | SourceFile, where: str) -> list[str]:
    """`x.engine == ...`, `!=`, `in`, `not in` (either side), as `where:line: code`."""
    out = []
    for node in nodes_of(source, where):
        if not isinstance(node, ast.Compare):
            continue
        names_engine = any(isinstance(s, ast.Attribute) and s.attr == "engine" for s in (node.left, *node.comparators))
        if names_engine and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    out += [f"{where}:{i}: {line.strip()}" for i, line in enumerate(text_of(source).splitlines(), 1) if "engine ==" in line]
    return sorted(set(out))


# An adapter's attributes that name a kind of engine (or of its files): comparing one to a string is a
# switch on the engine, whatever string it is.
KIND_ATTRIBUTES = frozenset({"model_layout", "layout"})
# Strings that name an engine kind: every kind tenants.json accepts.
KIND_NAMES = frozenset(typing.get_args(EngineKind))


def _strings(node: ast.expr) -> list[str]:
    """The string literals a compared operand is or lists (`"x"`, `("x", "y")`, `{"x"}`)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def kind_switches(source: str | SourceFile, where: str) -> list[str]:
    """The other shapes of the same switch, as `where:line: code`: an adapter's kind attribute
    (`adapter.model_layout == "comfyui"`) compared to any string, and anything compared to (or matched
    against) an engine kind's name (`layout = adapter.model_layout; if layout == "ollama"`)."""
    out = []
    for node in nodes_of(source, where):
        if isinstance(node, ast.Compare):
            sides = (node.left, *node.comparators)
            strings = [v for s in sides for v in _strings(s)]
            names_kind = any(isinstance(s, ast.Attribute) and s.attr in KIND_ATTRIBUTES for s in sides)
            if (names_kind and strings) or KIND_NAMES.intersection(strings):
                out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.match_case) and KIND_NAMES.intersection(
                n.value for n in ast.walk(node.pattern) if isinstance(n, ast.Constant)):
            out.append(f"{where}:{node.pattern.lineno}: case {ast.unparse(node.pattern)}")
    return sorted(set(out))


# The adapters are where engine names belong; `hyperswap verify` asks them too (`verify_role`).
CLIENTS = (PROXY / "engines",)
# The simulators are engines by name, and the demo runs them under tenants named after them.
SIMULATED = (PROXY / "sim", PROXY / "demo.py", PROXY / "demo_check.py")


def test_no_module_outside_engines_switches_on_an_engine_name() -> None:
    offenders = [hit for source in python_files(PROXY) if not any(source.path.is_relative_to(c) for c in CLIENTS)
                 for hit in engine_switches(source, source.rel())]
    assert not offenders, "ask the tenant's adapter (proxy/engines/) instead of switching on its name:\n" + "\n".join(offenders)


def test_no_module_outside_engines_compares_an_adapter_kind_or_an_engine_name() -> None:
    offenders = [hit for source in python_files(PROXY)
                 if not any(source.path.is_relative_to(c) for c in (*CLIENTS, *SIMULATED))
                 for hit in kind_switches(source, source.rel())]
    assert not offenders, ("a comparison of an adapter's kind or an engine's name is an engine switch: give the "
                           "adapter a method or an attribute that says what it means (proxy/engines/):\n"
                           + "\n".join(offenders))


def test_the_grep_of_the_issue_finds_nothing_outside_engines_dashboard_included() -> None:
    hits = [f"{path}:{i}" for path in sorted(PROXY.rglob("*")) if path.suffix in (".py", ".js", ".html")
            and not path.is_relative_to(PROXY / "engines")
            for i, line in enumerate(path.read_text().splitlines(), 1) if "engine ==" in line]
    assert not hits, hits


def test_the_check_finds_every_form_of_switch() -> None:
    src = 'if tenant.engine == "ollama" or "comfyui" != t.engine or t.engine in ("a",):\n    pass\n'
    found = engine_switches(src, "x.py")
    assert len(found) == 3 + 1, found  # three comparisons, and the line the grep finds


def test_the_check_finds_every_form_of_kind_switch() -> None:
    src = ('if adapter.model_layout == "comfyui" or found.layout in ("a", "b"):\n    pass\n'
           'layout = adapter.model_layout\nif layout == "ollama" or "generic" != x:\n    pass\n'
           'match layout:\n    case "comfyui":\n        pass\n'
           'if d.kind == "rejection" or name in {"x"}:\n    pass\n')  # not a kind: left alone
    found = kind_switches(src, "x.py")
    assert [f.split(":")[1] for f in found] == ["1", "1", "4", "4", "7"], found  # two each on lines 1 and 4


def test_every_engine_kind_tenants_json_accepts_has_an_adapter_and_no_more() -> None:
    assert set(ADAPTERS) == set(typing.get_args(EngineKind)), "registry.ADAPTERS and tenants.EngineKind must list the same kinds"
    for kind, cls in ADAPTERS.items():
        assert issubclass(cls, EngineAdapter) and cls.kind == kind, (kind, cls)


def test_adapter_cache_keeps_one_adapter_per_tenant_until_its_config_changes() -> None:
    reg = registry_from_dict({"tenants": {"ollama": {"engine": "ollama", "upstream": "http://127.0.0.1:1"}}})
    cache = AdapterCache()
    tenant = reg.get("ollama")
    first = cache(tenant)
    assert cache(tenant) is first, "what an adapter learns (model sizes) must be kept"
    assert cache(tenant.model_copy()) is not first, "a new configuration object gets a new adapter"
    assert type(adapter_for(tenant)).__name__ == "OllamaAdapter"


async def test_generic_adapter_reports_nothing_it_cannot_see() -> None:
    reg = registry_from_dict({"tenants": {"app": {"engine": "generic", "upstream": "http://127.0.0.1:1"}}})
    adapter = adapter_for(reg.get("app"))

    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a generic adapter must not call its engine: {request.url}")

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        assert await adapter.self_reported_bytes(client) is None, "unknown is None, never 0"
        assert await adapter.device_report(client) is None
        assert await adapter.catalog(client, 1.0) is None
        assert await adapter.settings_view(client, None, None, False) is None  # type: ignore[arg-type]
        assert adapter.placements_path is None and adapter.queue_path() is None
        assert adapter.job_frame('{"type":"execution_error","data":{"prompt_id":"p"}}') is None
        assert not adapter.response_is_oom(500, b'{"error":"out of memory"}'), "a generic app's 500 is passed through"


async def test_comfyui_adapter_replays_a_failed_prompt_under_its_own_id_from_its_history() -> None:
    reg = registry_from_dict({"tenants": {"comfyui": {"engine": "comfyui", "upstream": "http://127.0.0.1:8188"}}})
    adapter = adapter_for(reg.get("comfyui"))
    graph = {"3": {"class_type": "KSampler", "inputs": {}}}
    entry = {"p1": {"prompt": [7, "p1", graph, {"client_id": "c9"}, []], "status": {"messages": [
        ["execution_error", {"prompt_id": "p1", "exception_type": "torch.OutOfMemoryError"}]]}}}
    with respx.mock(assert_all_called=True) as mock:
        mock.get("http://127.0.0.1:8188/history/p1").respond(200, json=entry)
        posted = mock.post("http://127.0.0.1:8188/prompt").respond(200, json={"prompt_id": "p1", "number": 8})
        async with httpx.AsyncClient() as client:
            replay = await adapter.job_replay(client, "p1")
            assert replay is not None and json.loads(replay.body) == {"prompt": graph}
            assert await adapter.resubmit(client, replay) == Requeued("p1", 200, "8")
    assert json.loads(posted.calls.last.request.content) == {"prompt": graph, "extra_data": {"client_id": "c9"},
                                                             "prompt_id": "p1", "client_id": "c9"}, \
        "the same client sees the retry, under the prompt id it holds"
    body = json.dumps(entry).encode()
    assert adapter.oom_in_history("p1", body) and adapter.history_outcome("p1", body) == "oom"


def test_comfyui_history_without_the_failed_run_reads_as_the_engine_answers_a_prompt_not_finished() -> None:
    reg = registry_from_dict({"tenants": {"comfyui": {"engine": "comfyui", "upstream": "http://127.0.0.1:8188"}}})
    adapter = adapter_for(reg.get("comfyui"))
    history = {"a": {"prompt": [3, "a", {}, {}, []], "status": {"status_str": "success"}},
               "b": {"prompt": [4, "b", {}, {}, []], "status": {"status_str": "error"}}}
    body = json.dumps(history).encode()
    assert adapter.history_without(body, lambda job, mark: job == "b" and mark == "4") == json.dumps(
        {"a": history["a"]}).encode()
    assert adapter.history_without(body, lambda job, mark: job == "b" and mark == "9") is None, "the new run's record shows"
    only_b = json.dumps({"b": history["b"]}).encode()
    assert adapter.history_without(only_b, lambda job, mark: True) == b"{}", "/history/{id} of a prompt not finished"
    assert adapter.history_outcome("a", body) == "success" and adapter.history_outcome("b", body) == "error"
    assert adapter.job_view("GET", "/api/history/b") == "history" and adapter.job_view("GET", "/history") == "history"
    assert adapter.job_view("GET", "/queue") == "queue" and adapter.job_view("GET", "/api/queue/") == "queue"
    assert adapter.job_view("POST", "/history") is None and adapter.job_view("GET", "/historyx") is None


def test_comfyui_jobs_api_hides_the_failed_run_and_reads_the_job_as_pending() -> None:
    reg = registry_from_dict({"tenants": {"comfyui": {"engine": "comfyui", "upstream": "http://127.0.0.1:8188"}}})
    adapter = adapter_for(reg.get("comfyui"))
    assert adapter.job_view("GET", "/api/jobs") == "jobs" and adapter.job_view("GET", "/api/jobs/p") == "jobs"
    failed = {"id": "p", "status": "failed", "priority": 7, "create_time": 5, "outputs_count": 0}
    others = [{"id": "q", "status": "pending", "priority": 9, "outputs_count": 0}, failed]
    listing = json.dumps({"jobs": others, "pagination": {"offset": 0, "limit": None, "total": 2, "has_more": False}})

    def hidden(job: str, mark: str | None) -> bool:
        return job == "p" and mark == "7"
    row = [7, "p", {}, {"client_id": "c", "create_time": 5}, []]
    assert json.loads(adapter.jobs_without(listing.encode(), hidden, []) or b"") == {
        "jobs": [others[0]], "pagination": {"offset": 0, "limit": None, "total": 1, "has_more": False}}
    assert json.loads(adapter.jobs_without(json.dumps(failed).encode(), hidden, [JobReplay(b"", {}, "p", row)]) or b"") \
        == {"id": "p", "status": "pending", "priority": 7, "create_time": 5, "outputs_count": 0}
    done = {**failed, "status": "completed", "priority": 8}
    assert adapter.jobs_without(json.dumps(done).encode(), hidden, []) is None, "the new run's record shows"


def test_comfyui_queue_lists_a_prompt_whose_retry_is_decided_as_pending() -> None:
    reg = registry_from_dict({"tenants": {"comfyui": {"engine": "comfyui", "upstream": "http://127.0.0.1:8188"}}})
    adapter = adapter_for(reg.get("comfyui"))
    row = [7, "p", {"3": {}}, {"client_id": "c"}, ["9"]]
    waiting = JobReplay(b"{}", {}, "p", row)
    empty = json.dumps({"queue_running": [], "queue_pending": []}).encode()
    assert json.loads(adapter.queue_with(empty, [waiting]) or b"") == {"queue_running": [], "queue_pending": [row]}
    queued = json.dumps({"queue_running": [[8, "p", {}, {}, []]], "queue_pending": []}).encode()
    assert adapter.queue_with(queued, [waiting]) is None, "queued again already: the engine's own row"


def test_comfyui_job_frames_name_each_run_of_a_prompt() -> None:
    reg = registry_from_dict({"tenants": {"comfyui": {"engine": "comfyui", "upstream": "http://127.0.0.1:8188"}}})
    adapter = adapter_for(reg.get("comfyui"))

    def frame(kind: str, **data: object) -> str:
        return json.dumps({"type": kind, "data": {"prompt_id": "p", **data}})
    assert adapter.job_frame(frame("execution_start", timestamp=1)) == JobFrame("start", "p")
    assert adapter.job_frame(frame("execution_success")) == JobFrame("success", "p")
    assert adapter.job_frame(frame("execution_error", exception_type="torch.OutOfMemoryError")) == JobFrame("oom", "p")
    assert adapter.job_frame(frame("execution_error", exception_type="RuntimeError")) == JobFrame("error", "p")
    assert adapter.job_frame(frame("execution_interrupted")) == JobFrame("error", "p")
    assert adapter.job_frame(frame("executing", node=None)) == JobFrame("end", "p")
    assert adapter.job_frame(frame("executing", node="3")) is None
    assert adapter.job_frame(frame("progress", value=1, max=2)) is None
