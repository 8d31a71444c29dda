"""examples/kubernetes: the manifests are valid Kubernetes objects (the API's JSON schemas, offline, from the
kubernetes-validate package), and say what the README promises: one proxy per GPU node that sees the
node's processes, read-only RBAC for pods, a node-local Service, and a tenants.json matching pods."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.engines.loading import registry_from_dict

MANIFESTS = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "hyperswap.yaml"
K8S_VERSION = "1.30.0"


def docs() -> dict[str, dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    out = {}
    for doc in yaml.safe_load_all(MANIFESTS.read_text()):
        assert {"apiVersion", "kind", "metadata"} <= set(doc), doc
        out[doc["kind"]] = doc
    return out


def test_every_manifest_matches_the_kubernetes_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for kind, doc in docs().items():
        try:
            kv.validate(doc, K8S_VERSION, strict=True)  # strict: an unknown or misspelt field fails
        except kv.ValidationError as exc:
            pytest.fail(f"{kind}: {exc}")


def test_a_misspelt_field_would_fail_validation() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    bad = docs()["DaemonSet"]
    bad["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def test_one_proxy_per_gpu_node_that_sees_the_nodes_processes() -> None:
    pod = docs()["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["runtimeClassName"] == "nvidia"
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    assert "resources" in container and "nvidia.com/gpu" not in json.dumps(container["resources"]), \
        "the proxy reads the card through NVML; requesting a GPU would take one from the engines"


def test_rbac_is_read_only_for_pods_and_bound_to_the_daemonsets_account() -> None:
    d = docs()
    (rule,) = d["ClusterRole"]["rules"]
    assert rule["resources"] == ["pods"] and set(rule["verbs"]) <= {"get", "list", "watch"}
    binding = d["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == d["ClusterRole"]["metadata"]["name"]
    account = d["DaemonSet"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert {"kind": "ServiceAccount", "name": account, "namespace": "hyperswap"} in binding["subjects"]
    assert d["ServiceAccount"]["metadata"]["name"] == account


def test_the_service_is_node_local_and_targets_the_containers_ports() -> None:
    d = docs()
    svc = d["Service"]["spec"]
    assert svc["internalTrafficPolicy"] == "Local"
    pod = d["DaemonSet"]["spec"]["template"]
    assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in svc["ports"]} <= names


def test_the_configmaps_tenants_json_loads_and_matches_engines_by_pod() -> None:
    d = docs()
    registry = registry_from_dict(json.loads(d["ConfigMap"]["data"]["tenants.json"]))
    container = d["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"] for p in container["ports"]}
    for tenant in registry:
        if tenant.listen:
            assert tenant.match.pod is not None, f"{tenant.name} is not matched by pod"
            assert int(tenant.listen.rsplit(":", 1)[1]) in ports, f"{tenant.name}'s port is not a container port"
    assert int(registry.config.admin.listen.rsplit(":", 1)[1]) in ports
    assert registry.config.admin.token_env in {e["name"] for e in container["env"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tenants")
    assert container["args"][-1] == mount["mountPath"] + "/tenants.json"
