"""Pod attribution: cgroup paths (v1, v2; containerd, CRI-O, Docker) -> container id -> the node's pod list -> tenant."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
import pytest
import respx

from proxy.clock import ManualClock
from proxy.config.registry import Registry
from proxy.engines.loading import registry_from_dict
from proxy.errors import ConfigError
from proxy.gpu.attribution import Attributor
from proxy.gpu.pods import (
    ContainerRef,
    InClusterPods,
    PodAwareReader,
    PodListError,
    PodResolver,
    container_from_cgroup,
    in_cluster_source,
    index_pods,
    with_pods,
)
from proxy.gpu.snapshot import DeviceMemory, GpuProcess, GpuSnapshot, PodRef, ProcessTree

FIXTURES = Path(__file__).with_name("fixtures")
A = "3b8f0f1e5c0d4a7f9e2b6c1d8a4f7e3b2c9d0e1f5a6b7c8d9e0f1a2b3c4d5e6f"  # containerd (ollama pod)
B = "9f8e7d6c5b4a39281706f5e4d3c2b1a0ffeeddccbbaa99887766554433221100"  # CRI-O (comfyui pod)
C = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"  # Docker
POD_UID = "6e1f6a51-2f33-4c5e-9f0a-7d2b1c3e4f50"


def cgroup(name: str) -> str:
    return (FIXTURES / "cgroup" / name).read_text()


def pod_list() -> dict[str, Any]:
    pods: dict[str, Any] = json.loads((FIXTURES / "pods" / "node-pods.json").read_text())
    return pods


@pytest.mark.parametrize(("fixture", "expected"), [
    ("containerd-v2-systemd.txt", ContainerRef(A, "containerd", POD_UID)),
    ("containerd-v2-cgroupfs.txt", ContainerRef(A, None, POD_UID)),
    ("containerd-v1-cgroupfs.txt", ContainerRef(A, None, POD_UID)),
    ("crio-v2-systemd.txt", ContainerRef(B, "cri-o", POD_UID)),
    ("crio-v1-systemd.txt", ContainerRef(B, "cri-o", POD_UID)),
    ("docker-v1.txt", ContainerRef(C, None, None)),
    ("docker-v2-systemd.txt", ContainerRef(C, "docker", None)),
    ("dockershim-v1-kubepods.txt", ContainerRef(C, None, POD_UID)),
])
def test_container_id_from_cgroup_paths(fixture: str, expected: ContainerRef) -> None:
    assert container_from_cgroup(cgroup(fixture)) == expected


@pytest.mark.parametrize("fixture", ["host-session-v2.txt", "host-service-v2.txt", "crio-conmon-v2.txt"])
def test_processes_outside_a_container_have_none(fixture: str) -> None:
    assert container_from_cgroup(cgroup(fixture)) is None, "conmon and host processes are no container"


def test_empty_and_root_cgroups_have_none() -> None:
    assert container_from_cgroup("") is None
    assert container_from_cgroup("0::/\n") is None


def test_index_maps_every_runtimes_container_id_to_its_pod() -> None:
    index = index_pods(pod_list())
    ollama = index.find(ContainerRef(A))
    assert ollama is not None and (ollama.namespace, ollama.name, ollama.container) == ("ai", "ollama-7d9c5b8f6-x2k4p", "ollama")
    assert dict(ollama.labels) == {"app": "ollama", "pod-template-hash": "7d9c5b8f6"}
    comfy = index.find(ContainerRef(B, "cri-o"))
    assert comfy is not None and (comfy.namespace, comfy.name) == ("images", "comfyui-0")
    init = index.find(ContainerRef("a" * 64))
    assert init is not None and init.container == "fetch-models"
    assert index.find(ContainerRef(C)) is None, "a container on no pod of the node"


def test_a_container_not_listed_yet_is_found_by_its_pod_uid() -> None:
    pod = index_pods(pod_list()).find(ContainerRef("f" * 64, "containerd", POD_UID))
    assert pod is not None and pod.name == "ollama-7d9c5b8f6-x2k4p" and pod.container is None


def test_malformed_pod_lists_index_nothing() -> None:
    for body in ({}, {"items": None}, {"items": [{"metadata": "x"}, {"metadata": {"name": 3}}]}):
        assert index_pods(body).by_container == {}


class FakeSource:
    def __init__(self, bodies: list[Mapping[str, Any] | Exception]) -> None:
        self.bodies = bodies
        self.calls = 0

    def pod_list(self) -> Mapping[str, Any]:
        body = self.bodies[min(self.calls, len(self.bodies) - 1)]
        self.calls += 1
        if isinstance(body, Exception):
            raise body
        return body


def resolver(source: FakeSource, cgroups: dict[int, str], clock: ManualClock) -> PodResolver:
    return PodResolver(source, refresh_s=30, min_refresh_s=5, now=clock.now,
                       cgroup=lambda root, pid: cgroups.get(pid, ""))


async def test_resolver_reads_the_pod_list_once_per_refresh_period() -> None:
    clock, source = ManualClock(), FakeSource([pod_list()])
    r = resolver(source, {10: cgroup("containerd-v2-systemd.txt"), 11: cgroup("host-session-v2.txt")}, clock)
    pods = r.resolve([10, 11])
    assert set(pods) == {10} and pods[10].name == "ollama-7d9c5b8f6-x2k4p"
    await clock.advance(10)
    r.resolve([10, 11])
    assert source.calls == 1, "a known container needs no new read"
    await clock.advance(25)
    r.resolve([10])
    assert source.calls == 2, "the list is read again after refresh_s"


async def test_a_new_container_rereads_the_list_at_most_every_min_refresh() -> None:
    clock = ManualClock()
    source = FakeSource([{"items": []}, pod_list()])
    r = resolver(source, {10: cgroup("containerd-v2-systemd.txt")}, clock)
    assert r.resolve([10]) == {} and source.calls == 1
    await clock.advance(1)
    assert r.resolve([10]) == {} and source.calls == 1, "not sooner than min_refresh_s"
    await clock.advance(5)
    assert r.resolve([10])[10].namespace == "ai" and source.calls == 2


def test_no_container_processes_never_read_the_list() -> None:
    source = FakeSource([pod_list()])
    assert resolver(source, {1: cgroup("host-service-v2.txt")}, ManualClock()).resolve([1]) == {}
    assert source.calls == 0


async def test_a_failed_read_keeps_the_last_index_and_says_why() -> None:
    clock = ManualClock()
    source = FakeSource([pod_list(), PodListError("listing the pods of node n answered 403")])
    r = resolver(source, {10: cgroup("containerd-v2-systemd.txt")}, clock)
    assert 10 in r.resolve([10]) and r.error is None
    await clock.advance(31)
    assert 10 in r.resolve([10]) and r.error is not None and "403" in r.error


# -- the API server -----------------------------------------------------------------------------
def sa_dir(tmp_path: Path) -> Path:
    (tmp_path / "token").write_text("tok-123\n")
    return tmp_path


@respx.mock
def test_in_cluster_source_lists_the_nodes_pods_with_the_service_account_token(tmp_path: Path) -> None:
    route = respx.get("https://10.96.0.1:443/api/v1/pods").mock(return_value=httpx.Response(200, json=pod_list()))
    source = in_cluster_source({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443",
                                "NODE_NAME": "gpu-node-1"}, sa_dir(tmp_path))
    assert source is not None
    listed = source.pod_list()
    assert isinstance(listed, dict) and listed["items"][0]["metadata"]["name"] == "ollama-7d9c5b8f6-x2k4p"
    request = route.calls.last.request
    assert request.url.params["fieldSelector"] == "spec.nodeName=gpu-node-1"
    assert request.headers["authorization"] == "Bearer tok-123"


@respx.mock
def test_a_refused_pod_list_raises_with_the_status(tmp_path: Path) -> None:
    respx.get("https://k8s:6443/api/v1/pods").mock(return_value=httpx.Response(403, text='{"reason":"Forbidden"}'))
    with pytest.raises(PodListError, match="answered 403"):
        InClusterPods("gpu-node-1", host="k8s", port="6443", sa_dir=sa_dir(tmp_path)).pod_list()


@respx.mock
def test_an_unreachable_api_server_raises(tmp_path: Path) -> None:
    respx.get("https://k8s:6443/api/v1/pods").mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(PodListError, match="cannot list the pods of node gpu-node-1"):
        InClusterPods("gpu-node-1", host="k8s", port="6443", sa_dir=sa_dir(tmp_path)).pod_list()


def test_outside_kubernetes_the_reader_is_unchanged(tmp_path: Path) -> None:
    reader = object()
    assert with_pods(reader, {}, tmp_path) is reader  # type: ignore[arg-type]
    assert with_pods(reader, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, sa_dir(tmp_path)) is reader, "no NODE_NAME"
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "NODE_NAME": "n"}
    assert in_cluster_source(env, tmp_path / "none") is None, "no service-account token mounted"
    assert isinstance(with_pods(reader, env, sa_dir(tmp_path)), PodAwareReader)


# -- attribution ----------------------------------------------------------------------------------
DEVICE = DeviceMemory(0, "GPU", 24 << 30, 0, 8 << 30, 16 << 30)
OLLAMA_POD = PodRef("ai", "ollama-7d9c5b8f6-x2k4p", "ollama", MappingProxyType({"app": "ollama"}))
OTHER_POD = PodRef("ai", "chat-ui-1", "ui", MappingProxyType({"app": "chat-ui"}))


def registry() -> Registry:
    return registry_from_dict({"tenants": {
        "llm": {"engine": "generic", "match": {"pod": {"namespace": "ai", "labels": {"app": "ollama"}}}},
        "images": {"engine": "generic", "match": {"pod": {"namespace": "images"}}},
    }})


def test_a_tenant_is_matched_by_its_pods_namespace_and_labels() -> None:
    procs = (GpuProcess(10, "ollama", "/bin/ollama runner", 4 << 30, 1.0),
             GpuProcess(11, "python", "python app.py", 1 << 30, 1.0), GpuProcess(12, "python", "python main.py", 2 << 30, 1.0))
    comfy = PodRef("images", "comfyui-0", "comfyui", MappingProxyType({}))
    snap = GpuSnapshot(DEVICE, procs, tree=ProcessTree(), pods={10: OLLAMA_POD, 11: OTHER_POD, 12: comfy})
    out = {p.process.pid: (p.tenant, p.by, p.pod) for p in Attributor(registry()).attribute(snap).processes}
    # "ollama" (the comm) is also a shipped name rule of the ollama tenant: the pod rule comes first
    assert out[10] == ("llm", "pod", OLLAMA_POD)
    assert out[11] == ("unmanaged", None, OTHER_POD), "label app=chat-ui is not app=ollama"
    assert out[12][:2] == ("images", "pod")


def test_a_pod_learnt_later_overrides_a_cached_name_verdict() -> None:
    attributor = Attributor(registry())
    proc = GpuProcess(10, "ollama", "/bin/ollama runner", 4 << 30, 1.0)
    first = attributor.attribute(GpuSnapshot(DEVICE, (proc,), tree=ProcessTree()))
    assert first.processes[0].tenant == "ollama"  # by the shipped name rule
    later = attributor.attribute(GpuSnapshot(DEVICE, (proc,), tree=ProcessTree(), pods={10: OLLAMA_POD}))
    assert (later.processes[0].tenant, later.processes[0].by) == ("llm", "pod")


def test_an_empty_pod_rule_is_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        registry_from_dict({"tenants": {"x": {"match": {"pod": {}}}}})
    problems = exc.value.details["problems"]
    assert isinstance(problems, list)
    assert any("tenants.x.match.pod: name a namespace or at least one label" in p for p in problems), problems
    with pytest.raises(ConfigError):
        registry_from_dict({"tenants": {"x": {"match": {"pod": {"namespace": "a", "label": {}}}}}})


class StaticReader:
    def __init__(self, snap: GpuSnapshot) -> None:
        self.snap = snap

    def read(self) -> GpuSnapshot:
        return self.snap


def test_the_pod_aware_reader_adds_pods_and_notes_a_failed_list() -> None:
    snap = GpuSnapshot(DEVICE, (GpuProcess(10, "ollama", "", 1, 1.0),), source="nvml", tree=ProcessTree())
    source = FakeSource([PodListError("cannot list the pods of node n: refused")])
    reader = PodAwareReader(StaticReader(snap), resolver(source, {10: cgroup("containerd-v2-systemd.txt")}, ManualClock()))
    out = reader.read()
    assert dict(out.pods) == {} and out.notes == ("pods: cannot list the pods of node n: refused",)
    simulated = GpuSnapshot(DEVICE, (GpuProcess(10, "ollama", "", 1, 1.0),), source="simulated")
    assert PodAwareReader(StaticReader(simulated), reader.resolver).read() is simulated
