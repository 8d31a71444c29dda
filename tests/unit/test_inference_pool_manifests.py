"""examples/kubernetes/inference-pool.yaml: the objects that put HyperSwap's nodes behind the Gateway API
Inference Extension are valid, offline (core kinds by the kubernetes-validate package; InferencePool and
HTTPRoute by the OpenAPI schemas of the published CRDs, kept in tests/unit/fixtures/crds/; the endpoint
picker's config by the fields its Go types declare), and they fit together and with HyperSwap: the pool
selects the DaemonSet's pods, the engine-type label names the engineConfigs entry, and every metric the
entry maps is one HyperSwap exports for a tenant it has."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from proxy.admin.metrics import LIVE_GAUGES
from proxy.engines.loading import registry_from_dict

ROOT = Path(__file__).resolve().parents[2]
POOL = ROOT / "examples" / "kubernetes" / "inference-pool.yaml"
NODE = ROOT / "examples" / "kubernetes" / "hyperswap.yaml"
GATEWAYS = sorted((ROOT / "examples" / "kubernetes" / "gateways").glob("*.yaml"))
CRDS = Path(__file__).resolve().parent / "fixtures" / "crds"
K8S_VERSION = "1.30.0"
CORE = {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}

# The EndpointPickerConfig is read by the picker at start, not by the API server: no CRD. Its fields, from
# llm-d/llm-d-router v0.10.0 (apix/config/v1alpha1 and the parameters of the plugins used here); an
# unknown field is refused, as a misspelt one would be silently dropped by the picker's JSON decoder.
_STR = {"type": "string"}


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


_ENGINE = _obj({k: _STR for k in ("name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
                                  "cacheInfoSpec", "cacheBlockSizeLabelName", "cacheNumBlocksLabelName",
                                  "cacheBlockSizeSpec", "cacheNumBlocksSpec")}
               | {"customMetrics": {"type": "array", "items": _obj({"attributeKey": _STR, "metricSpec": _STR},
                                                                    ("attributeKey", "metricSpec"))}}, ("name",))
PARAMETERS = {
    "metrics-data-source": _obj({"scheme": {"enum": ["http", "https"]}, "path": _STR, "port": {"type": "integer"},
                                 "insecureSkipVerify": {"type": "boolean"}, "caCertPath": _STR,
                                 "clientCertPath": _STR, "clientKeyPath": _STR, "interval": _STR}),
    "core-metrics-extractor": _obj({"engineLabelKey": _STR, "defaultEngine": _STR,
                                    "engineConfigs": {"type": "array", "items": _ENGINE}}),
    "endpoint-attribute-scorer": _obj({"attributeKey": _STR, "algorithm": _obj({
        "type": {"enum": ["linear_lower_is_better", "linear_higher_is_better"]},
        "normalization": _obj({"fixedRange": _obj({"min": {"type": "number"}, "max": {"type": "number"}}, ("min", "max")),
                               "adaptiveRange": _obj({})})}, ("type",))}, ("attributeKey", "algorithm")),
}
PARAMETERS["utilization-detector"] = _obj({"queueDepthThreshold": {"type": "integer"},
                                          "kvCacheUtilThreshold": {"type": "number"},
                                          "metricsStalenessThreshold": _STR, "headroom": {"type": "number"}})
NO_PARAMETERS = {"queue-scorer", "lora-affinity-scorer", "max-score-picker", "kv-cache-utilization-scorer",
                 "openai-parser", "anthropic-parser", "passthrough-parser"}
_REF = _obj({"pluginRef": _STR}, ("pluginRef",))
PICKER_CONFIG = _obj({
    "apiVersion": {"const": "llm-d.ai/v1alpha1"}, "kind": {"const": "EndpointPickerConfig"},
    "featureGates": {"type": "array", "items": _STR},
    "plugins": {"type": "array", "items": _obj({"name": _STR, "type": _STR, "parameters": {"type": "object"}}, ("type",))},
    "schedulingProfiles": {"type": "array", "items": _obj({"name": _STR, "plugins": {"type": "array", "items": _obj(
        {"pluginRef": _STR, "weight": {"type": "number"}}, ("pluginRef",))}}, ("name", "plugins"))},
    "dataLayer": {"type": "object"},
    "flowControl": _obj({"saturationDetector": _REF, "usageLimitPolicyPluginRef": _STR, "enableEviction": {"type": "boolean"}}),
    "requestHandler": _obj({"parsers": {"type": "array", "items": _REF}}),
    "saturationDetector": {"type": "object"}, "parser": {"type": "object"},
}, ("apiVersion", "kind", "plugins", "schedulingProfiles"))
# The picker's metric selector: name{label="value",...} (its spec.go; quotes optional).
SPEC = re.compile(r'^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?\s*$')
LABEL = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"?([^",]*)"?\s*$')


def load(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in load(path)}


def crd_schema(doc: dict[str, Any]) -> dict[str, Any]:
    """The published schema of the object's kind and version, strict: Kubernetes prunes an unknown field
    silently, so (as kubernetes-validate's strict mode does for core kinds) any field the schema does not
    declare is an error here."""
    group, version = doc["apiVersion"].split("/")
    matches: list[dict[str, Any]] = [json.loads(p.read_text()) for p in CRDS.glob(f"{group}_*_{version}.json")]
    (crd,) = [c for c in matches if c["kind"] == doc["kind"]]
    schema: dict[str, Any] = copy.deepcopy(crd["openAPIV3Schema"])
    for field in ("apiVersion", "kind", "metadata"):  # Istio's schemas declare only spec and status
        schema["properties"].setdefault(field, {"type": "string" if field != "metadata" else "object"})
    _strict(schema)
    return schema


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


def crd_errors(doc: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft7Validator(crd_schema(doc))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def picker_config() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    cm = by_kind(POOL)["ConfigMap"]
    (text,) = cm["data"].values()
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    plugins: list[dict[str, Any]] = config["plugins"]
    (found,) = [p for p in plugins if p["type"] == kind]
    return found


def test_the_core_objects_match_the_kubernetes_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    docs = load(POOL)
    assert CORE <= {d["kind"] for d in docs}
    for doc in docs:
        if doc["kind"] in CORE:
            try:
                kv.validate(doc, K8S_VERSION, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{doc['kind']}: {exc}")


def routes() -> list[dict[str, Any]]:
    """Each Gateway file's HTTPRoute (the route differs per Gateway: GKE refuses `timeouts`)."""
    return [by_kind(path)["HTTPRoute"] for path in GATEWAYS]


# Every object of a Gateway file whose CRD is published in a repository (GKE's policies are not: their
# fields are the router chart's, checked in test_inference_pool_startup.py).
WITH_CRD = {"Gateway", "HTTPRoute", "DestinationRule"}
GATEWAY_OBJECTS = [(p.stem, d) for p in GATEWAYS for d in load(p) if d["kind"] in WITH_CRD]


@pytest.mark.parametrize("doc", [by_kind(POOL)["InferencePool"], *(d for _, d in GATEWAY_OBJECTS)],
                         ids=["InferencePool", *(f"{d['kind']}-{stem}" for stem, d in GATEWAY_OBJECTS)])
def test_the_inference_objects_match_the_published_crd_schemas(doc: dict[str, Any]) -> None:
    errors = crd_errors(doc)
    assert not errors, f"{doc['kind']}: " + "; ".join(errors)


def test_a_misspelt_or_wrong_field_would_fail_the_crd_validation() -> None:
    pool = by_kind(POOL)["InferencePool"]
    misspelt = copy.deepcopy(pool)
    misspelt["spec"]["endpointPickerRef"]["failuremode"] = "FailOpen"
    assert crd_errors(misspelt), "an unknown field passed"
    wrong = copy.deepcopy(pool)
    wrong["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    assert crd_errors(wrong), "a value outside the enum passed"
    route = copy.deepcopy(routes()[0])
    route["spec"]["rules"][0]["backendRefs"][0]["nmae"] = "hyperswap"
    assert crd_errors(route)


def test_the_picker_config_has_only_fields_the_picker_knows() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    config = picker_config()
    jsonschema.validate(config, PICKER_CONFIG)
    for p in config["plugins"]:
        if p["type"] in PARAMETERS:
            jsonschema.validate(p.get("parameters", {}), PARAMETERS[p["type"]])
        else:
            assert p["type"] in NO_PARAMETERS and "parameters" not in p, f"{p['type']}: not a plugin this test knows"
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        refs = [r["pluginRef"] for r in profile["plugins"]]
        assert set(refs) <= names, f"profile {profile['name']} refers to undeclared plugins: {set(refs) - names}"
    bad = copy.deepcopy(plugin(config, "core-metrics-extractor")["parameters"])
    bad["engineConfigs"][0]["queuedRequestSpec"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, PARAMETERS["core-metrics-extractor"])


def test_every_metric_the_engine_config_maps_is_one_hyperswap_exports_for_a_tenant_it_has() -> None:
    config = picker_config()
    extractor = plugin(config, "core-metrics-extractor")["parameters"]
    node = by_kind(NODE)
    registry = registry_from_dict(json.loads(node["ConfigMap"]["data"]["tenants.json"]))
    (engine,) = extractor["engineConfigs"]
    assert extractor["defaultEngine"] == engine["name"]
    specs = [engine[k] for k in ("queuedRequestsSpec", "runningRequestsSpec", "loraSpec")]
    specs += [m["metricSpec"] for m in engine["customMetrics"]]
    assert len(specs) == 4
    for spec in specs:
        m = SPEC.match(spec)
        assert m, f"{spec!r} is not a metric selector the picker parses"
        pairs = [LABEL.match(p) for p in (m.group(2) or "").split(",") if p]
        name, labels = m.group(1), {p.group(1): p.group(2) for p in pairs if p}
        assert len(labels) == len(pairs), f"{spec!r}: a label the picker does not parse"
        assert name in LIVE_GAUGES, f"{name} is not a series /metrics exports"
        assert set(labels) <= set(LIVE_GAUGES[name][1]), f"{spec}: a label the series does not have"
        assert labels["tenant"] in registry.tenants, f"{spec}: no such tenant in hyperswap.yaml's tenants.json"
    lora_spec = SPEC.match(engine["loraSpec"])
    assert lora_spec is not None
    lora = lora_spec.group(1)
    assert {"running_lora_adapters", "waiting_lora_adapters", "max_lora"} <= set(LIVE_GAUGES[lora][1])
    scorer = next(p for p in config["plugins"] if p["type"] == "endpoint-attribute-scorer")
    assert scorer["parameters"]["attributeKey"] == engine["customMetrics"][0]["attributeKey"]
    assert "kvUsageSpec" not in engine, "the memory cost is not KV-cache usage: the saturation detector would shed load"


def test_the_pool_selects_the_daemonsets_pods_and_the_picker_scrapes_the_admin_listener() -> None:
    pool_docs, node = by_kind(POOL), by_kind(NODE)
    pod = node["DaemonSet"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    spec = pool_docs["InferencePool"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    extractor = plugin(picker_config(), "core-metrics-extractor")["parameters"]
    assert labels[extractor["engineLabelKey"]] == extractor["engineConfigs"][0]["name"]

    registry = registry_from_dict(json.loads(node["ConfigMap"]["data"]["tenants.json"]))
    ports = {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    (target,) = spec["targetPorts"]
    listen = registry.get("ollama").listen
    assert listen is not None and target["number"] == int(listen.rsplit(":", 1)[1]) and target["number"] in ports
    scrape = plugin(picker_config(), "metrics-data-source")["parameters"]
    admin_host, _, admin_port = registry.config.admin.listen.rpartition(":")
    assert scrape["port"] == int(admin_port) and scrape["port"] in ports and scrape["path"] == "/metrics"
    assert admin_host == "0.0.0.0", "a wildcard listener answers its pod IP, the Host the picker scrapes with"


def test_the_picker_is_reached_by_the_pool_and_reads_its_config_and_each_route_sends_to_the_pool() -> None:
    d = by_kind(POOL)
    ref = d["InferencePool"]["spec"]["endpointPickerRef"]
    svc = d["Service"]
    assert ref["name"] == svc["metadata"]["name"]
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"]}
    deployment = d["Deployment"]["spec"]
    assert svc["spec"]["selector"].items() <= deployment["template"]["metadata"]["labels"].items()
    (container,) = deployment["template"]["spec"]["containers"]
    args = container["args"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    (key,) = d["ConfigMap"]["data"]
    assert args[args.index("--config-file") + 1] == f"{mount['mountPath']}/{key}"
    assert args[args.index("--pool-name") + 1] == d["InferencePool"]["metadata"]["name"]
    assert deployment["template"]["spec"]["serviceAccountName"] == d["RoleBinding"]["subjects"][0]["name"]
    assert {r["resources"][0] for r in d["Role"]["rules"]} == {"pods", "inferencepools"}
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in d["Role"]["rules"]), "the picker only reads"
    for route in routes():
        (backend,) = route["spec"]["rules"][0]["backendRefs"]
        assert (backend["kind"], backend["name"]) == ("InferencePool", d["InferencePool"]["metadata"]["name"])
