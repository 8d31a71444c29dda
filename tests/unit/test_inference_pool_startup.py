"""The shipped Inference Extension manifests start and route, beyond their field names: the picker accepts
every plugin it is given (each type's stability from the pinned upstream list in
tests/unit/fixtures/epp/plugin_stability.json, an Alpha one only with --allow-experimental-plugins),
every path an OpenAI client sends reaches the pool and a request parser (Ollama's own /api/* does not
reach the pool), the saturation detector does not call every scrape stale, and each Gateway file in
examples/kubernetes/gateways/ reaches the picker the way that Gateway connects to it (TLS, routes, health).

No picker or Gateway runs here: the picker's start checks and its request dispatch are modelled from its
source at the commit the fixtures name, and each test also shows that the model refuses the mistake it
guards against (a manifest without the flag, without the fallback parser, ...)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
POOL = ROOT / "examples" / "kubernetes" / "inference-pool.yaml"
GATEWAYS = ROOT / "examples" / "kubernetes" / "gateways"
EPP = Path(__file__).resolve().parent / "fixtures" / "epp"
STABILITY: dict[str, Any] = json.loads((EPP / "plugin_stability.json").read_text())
PARSERS: dict[str, Any] = json.loads((EPP / "parsers.json").read_text())
FLAG = "allow-experimental-plugins"

# What clients send. Bodies: a GET has none (the picker sends it to a random node before any parser).
CLIENT_PATHS = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/v1/audio/transcriptions"),
    ("GET", "/v1/models"), ("GET", "/v1/models/gemma3:27b"),
]
# Ollama's own API: pulls and deletes must reach the node they name, not one the picker draws.
OFF_POOL = ["/api/chat", "/api/generate", "/api/pull", "/api/delete", "/api/tags", "/api/ps", "/", "/v1x"]

# How each Gateway reaches the picker, and where that fact is from.
SERVICE_FQDN = "hyperswap-epp.hyperswap.svc.cluster.local"
PIECES: dict[str, dict[str, Any]] = {
    # llm-d-router v0.10.0 config/charts/llm-d-router-gateway/templates/istio.yaml
    "istio": {"tls": "DestinationRule", "route_timeouts": True},
    # agentgateway 75b4e6ce controller/pkg/agentgateway/plugins/inference_plugin.go: TLS, verification off
    "agentgateway": {"tls": "controller", "route_timeouts": True},
    # llm-d-router v0.10.0 templates/gke.yaml and httproute.yaml (no timeouts on GKE)
    "gke-l7-regional-external-managed": {"tls": "controller", "route_timeouts": False,
                                          "policies": {"HealthCheckPolicy", "GCPBackendPolicy"}},
}


def load(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def picker_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    (text,) = one(docs, "ConfigMap")["data"].values()
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def picker_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


def flag(args: list[str], name: str) -> bool | None:
    """A Go bool flag as pflag reads it: `--name` or `--name=true` sets it, `--name=false` clears it."""
    value = None
    for arg in args:
        if arg == f"--{name}":
            value = True
        elif arg.startswith(f"--{name}="):
            value = arg.split("=", 1)[1].lower() in {"true", "1", "t"}
    return value


def startup_errors(docs: list[dict[str, Any]]) -> list[str]:
    """Why the pinned picker would refuse to start with this Deployment and config (runner.go's order:
    each plugin type must be registered; then ValidatePluginStability refuses Alpha without the flag)."""
    config, args = picker_config(docs), picker_container(docs)["args"]
    errors = [f"plugin type {p['type']!r} is not registered at {STABILITY['source']}"
              for p in config["plugins"] if p["type"] not in STABILITY["stability"]]
    if not flag(args, FLAG):
        errors += [f"plugin '{p.get('name', p['type'])}' (type: '{p['type']}') has Alpha stability level, but "
                   f"command line flag --{FLAG} is not set"
                   for p in config["plugins"] if STABILITY["stability"].get(p["type"]) == "Alpha"]
    return errors


def parsers(config: dict[str, Any]) -> list[str]:
    """The parser types in the picker's order: the configured list, or the default when there is none."""
    types = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    refs = [r["pluginRef"] for r in (config.get("requestHandler") or {}).get("parsers", [])]
    return [types.get(r, r) for r in refs] if refs else list(PARSERS["default"])


def suffix(path: str, claim: str) -> bool:
    return path.strip().rstrip("/").endswith(claim.strip().strip("/"))


def dispatch(config: dict[str, Any], method: str, path: str) -> str:
    """What the picker does with a request on this path: a parser's type, 'random' or '400'."""
    if method == "GET":
        return "random"
    for kind in parsers(config):
        claims = PARSERS["claims"][kind]
        if not claims or any(suffix(path, c) for c in claims):
            return str(kind)
    return "400"


def route_backend(route: dict[str, Any], path: str) -> str | None:
    """The backend of the rule whose path match is the most specific (Gateway API: Exact, then the
    longest PathPrefix, whole path elements only), or None when no rule matches."""
    best: tuple[int, str] | None = None
    for rule in route["spec"]["rules"]:
        for match in rule.get("matches", [{"path": {"type": "PathPrefix", "value": "/"}}]):
            assert set(match) == {"path"}, f"{match}: this test reads path matches only"
            kind, value = match["path"]["type"], match["path"]["value"]
            prefix = value.rstrip("/")
            hit = path == value if kind == "Exact" else path == prefix or path.startswith(prefix + "/")
            rank = (1 << 20) if kind == "Exact" else len(prefix)
            if hit and (best is None or rank > best[0]):
                (backend,) = rule["backendRefs"]
                best = (rank, f"{backend['kind']}/{backend['name']}")
    return best[1] if best else None


def seconds(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", text)
    assert m, f"{text!r} is not a duration this test reads"
    return float(m.group(1)) * units[m.group(2)]


def gateway_files() -> list[Path]:
    files = sorted(GATEWAYS.glob("*.yaml"))
    assert files, "no Gateway files"
    return files


def test_the_image_is_the_release_the_pinned_lists_come_from() -> None:
    image = picker_container(load(POOL))["image"]
    tag = image.rsplit(":", 1)[1]
    for pinned in (STABILITY["source"], PARSERS["source"]):
        assert f"llm-d/llm-d-router {tag} " in pinned, f"{image} but the fixtures are from {pinned}: re-extract them"


def test_the_picker_starts_with_every_plugin_it_is_given() -> None:
    docs = load(POOL)
    assert startup_errors(docs) == []
    alpha = [p["type"] for p in picker_config(docs)["plugins"] if STABILITY["stability"][p["type"]] == "Alpha"]
    assert alpha == ["endpoint-attribute-scorer"], "the Alpha plugins changed: say why in the manifest"


def test_an_alpha_plugin_without_the_flag_would_stop_the_picker() -> None:
    docs = load(POOL)
    for args in ([a for a in picker_container(docs)["args"] if FLAG not in a],
                 [*picker_container(docs)["args"], f"--{FLAG}=false"]):
        broken = copy.deepcopy(docs)
        picker_container(broken)["args"] = args
        assert any("has Alpha stability level" in e for e in startup_errors(broken)), args
    unknown = copy.deepcopy(docs)
    picker_config_doc = one(unknown, "ConfigMap")
    (key,) = picker_config_doc["data"]
    picker_config_doc["data"][key] = picker_config_doc["data"][key].replace("type: queue-scorer", "type: queue-scorrer")
    assert any("queue-scorrer" in e for e in startup_errors(unknown))


@pytest.mark.parametrize("gateway", gateway_files(), ids=lambda p: p.stem)
def test_every_client_path_reaches_the_pool_and_a_parser(gateway: Path) -> None:
    config, pool = picker_config(load(POOL)), one(load(POOL), "InferencePool")["metadata"]["name"]
    route = one(load(gateway), "HTTPRoute")
    for method, path in CLIENT_PATHS:
        assert route_backend(route, path) == f"InferencePool/{pool}", f"{gateway.name}: {path} does not reach the pool"
        assert dispatch(config, method, path) != "400", f"{method} {path}: the picker answers 400, no parser claims it"
    for path in OFF_POOL:
        assert route_backend(route, path) is None, f"{gateway.name}: {path} would reach the pool"


def test_the_model_name_is_read_where_a_client_names_one() -> None:
    config = picker_config(load(POOL))
    assert dispatch(config, "POST", "/v1/chat/completions") == "openai-parser"
    assert dispatch(config, "POST", "/v1/messages") == "anthropic-parser"
    assert dispatch(config, "POST", "/v1/audio/transcriptions") == "passthrough-parser"


def test_without_the_fallback_parser_an_unclaimed_path_would_get_400() -> None:
    config = picker_config(load(POOL))
    config["requestHandler"]["parsers"] = [r for r in config["requestHandler"]["parsers"]
                                           if r["pluginRef"] != "passthrough-parser"]
    assert dispatch(config, "POST", "/v1/audio/transcriptions") == "400"
    del config["requestHandler"]
    assert parsers(config) == PARSERS["default"]
    assert dispatch(config, "POST", "/v1/audio/transcriptions") == "400", "the v0.10.0 default has no fallback"


def staleness_and_interval(config: dict[str, Any]) -> tuple[float, float]:
    names = {p.get("name", p["type"]): p for p in config["plugins"]}
    scrape = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")
    interval = seconds(scrape.get("parameters", {}).get("interval") or PARSERS["metrics_data_source"]["default_interval"])
    ref = ((config.get("flowControl") or {}).get("saturationDetector") or {}).get("pluginRef")
    detector = names.get(ref or PARSERS["saturation_detector"]["default_plugin"], {})
    threshold = (detector.get("parameters") or {}).get("metricsStalenessThreshold")
    return seconds(threshold or PARSERS["saturation_detector"]["default_staleness"]), interval


def test_the_saturation_detector_does_not_call_every_scrape_stale() -> None:
    config = picker_config(load(POOL))
    staleness, interval = staleness_and_interval(config)
    assert staleness >= 2 * interval, f"metrics older than {staleness}s are stale, scraped every {interval}s"
    del config["flowControl"]
    config["plugins"] = [p for p in config["plugins"] if p["type"] != "utilization-detector"]
    staleness, interval = staleness_and_interval(config)
    assert staleness < interval, "the default detector would have passed: the test proves nothing"


@pytest.mark.parametrize("gateway", gateway_files(), ids=lambda p: p.stem)
def test_each_gateway_file_holds_its_gateway_route_and_pieces(gateway: Path) -> None:
    docs, pool_docs = load(gateway), load(POOL)
    gw, route = one(docs, "Gateway"), one(docs, "HTTPRoute")
    pieces = PIECES.get(gw["spec"]["gatewayClassName"])
    assert pieces, f"{gateway.name}: {gw['spec']['gatewayClassName']} is not a Gateway this test knows the pieces of"
    pool = one(pool_docs, "InferencePool")
    assert {d["metadata"]["namespace"] for d in docs} == {pool["metadata"]["namespace"]}
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", gw["metadata"]["name"])
    timeouts = [r for r in route["spec"]["rules"] if "timeouts" in r]
    assert bool(timeouts) == pieces["route_timeouts"], f"{gateway.name}: route timeouts"
    for kind in pieces.get("policies", set()):
        target = one(docs, kind)["spec"]["targetRef"]
        assert (target["kind"], target["name"]) == ("InferencePool", pool["metadata"]["name"]), kind
    kinds = {d["kind"] for d in docs} - {"Gateway", "HTTPRoute"}
    expected = pieces.get("policies", set()) | ({"DestinationRule"} if pieces["tls"] == "DestinationRule" else set())
    assert kinds == expected, f"{gateway.name}: pieces {kinds}, expected {expected}"


@pytest.mark.parametrize("gateway", gateway_files(), ids=lambda p: p.stem)
def test_each_gateway_reaches_the_picker_over_tls(gateway: Path) -> None:
    docs, pool_docs = load(gateway), load(POOL)
    args = picker_container(pool_docs)["args"]
    assert flag(args, "secure-serving") is not False, "every shipped Gateway speaks TLS to the picker"
    pieces = PIECES[one(docs, "Gateway")["spec"]["gatewayClassName"]]
    if pieces["tls"] == "DestinationRule":
        rule = one(docs, "DestinationRule")["spec"]
        service = one(pool_docs, "Service")["metadata"]
        assert rule["host"] == f"{service['name']}.{service['namespace']}.svc.cluster.local" == SERVICE_FQDN
        assert rule["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}, \
            "the picker's certificate is self-signed: Istio must originate TLS and not verify it"


def test_the_gke_health_check_asks_the_port_the_pool_serves() -> None:
    (gke,) = [p for p in gateway_files() if one(load(p), "Gateway")["spec"]["gatewayClassName"].startswith("gke-")]
    check = one(load(gke), "HealthCheckPolicy")["spec"]["default"]["config"]
    (target,) = one(load(POOL), "InferencePool")["spec"]["targetPorts"]
    assert check["type"] == "HTTP" and check["httpHealthCheck"]["port"] == target["number"]
    assert one(load(gke), "GCPBackendPolicy")["spec"]["default"]["timeoutSec"] >= 300, "a cold load outlasts GKE's 30 s"


def test_the_metrics_reader_lets_a_token_read_the_pickers_metrics_and_nothing_else() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    docs, pool_docs = load(ROOT / "examples" / "kubernetes" / "epp-metrics-reader.yaml"), load(POOL)
    for doc in docs:
        kv.validate(doc, "1.30.0", strict=True)
    picker = one(pool_docs, "ServiceAccount")["metadata"]
    bindings = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRoleBinding"}
    delegator = next(b for b in bindings.values() if b["roleRef"]["name"] == "system:auth-delegator")
    assert delegator["subjects"] == [{"kind": "ServiceAccount", "name": picker["name"], "namespace": picker["namespace"]}]
    assert flag(picker_container(pool_docs)["args"], "metrics-endpoint-auth") is not False, "metrics stay behind a token"
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
