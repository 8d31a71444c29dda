"""Which Kubernetes pod a GPU process runs in: /proc/<pid>/cgroup -> container id -> the node's pod list.

On a GPU node the proxy runs as a DaemonSet with `hostPID: true`, so NVML's pids are the node's and
their /proc entries are visible. Each container's processes sit in a cgroup whose path ends in the
container id, in one of these shapes (cgroup v2 has one `0::` line; v1 one line per controller):

    systemd driver:  /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope
                     .../crio-<id>.scope (CRI-O), .../docker-<id>.scope (Docker, cri-dockerd)
    cgroupfs driver: /kubepods/burstable/pod<uid>/<id>
    plain Docker:    /docker/<id> (v1), /system.slice/docker-<id>.scope (v2)

The pod list (`GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`, read with the pod's service
account) maps `status.containerStatuses[].containerID` (`containerd://<id>`, `cri-o://<id>`,
`docker://<id>`) to the pod's namespace, name and labels. It is read in the GPU reader's thread
(`PodAwareReader`), kept for `refresh_s`, and read again sooner (at most every `min_refresh_s`)
when a container it does not list appears. A pod that cannot be found is simply absent: the
process is then attributed by the other rules, never guessed.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import httpx

from proxy.encoding import as_object
from proxy.gpu.snapshot import GpuReader, GpuSnapshot, PodRef

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_ID = r"[0-9a-f]{64}"
# the last path component that names a container: optional runtime prefix, 64 hex digits, optional .scope
_CONTAINER = re.compile(rf"^(?:(cri-containerd|containerd|crio|docker|libpod)-)?({_ID})(?:\.scope)?$")
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$")
_RUNTIME = {"cri-containerd": "containerd", "containerd": "containerd", "crio": "cri-o", "docker": "docker", "libpod": "podman"}


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """What a process's cgroup says: its container id, the runtime's prefix if any, and the pod uid if shown."""

    container_id: str
    runtime: str | None = None  # "containerd", "cri-o", "docker": from the cgroup name; None for the cgroupfs layout
    pod_uid: str | None = None


def container_from_cgroup(text: str) -> ContainerRef | None:
    """The container of a process from the text of /proc/<pid>/cgroup (v1 or v2); None outside a container.

    CRI-O's `crio-conmon-<id>.scope` is the container monitor, not the container: it never matches."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        parts = [p for p in path.split("/") if p]
        for i in range(len(parts) - 1, -1, -1):
            m = _CONTAINER.match(parts[i])
            if m is None:
                continue
            pod_uid = None
            for parent in reversed(parts[:i]):
                pm = _POD_UID.search(parent)
                if pm:
                    pod_uid = pm.group(1).replace("_", "-")
                    break
            return ContainerRef(m.group(2), _RUNTIME.get(m.group(1) or ""), pod_uid)
    return None


@dataclass(frozen=True, slots=True)
class PodIndex:
    """The node's pods by container id and by pod uid."""

    by_container: Mapping[str, PodRef]
    by_uid: Mapping[str, PodRef]

    def find(self, ref: ContainerRef) -> PodRef | None:
        return self.by_container.get(ref.container_id) or (self.by_uid.get(ref.pod_uid) if ref.pod_uid else None)


EMPTY_INDEX = PodIndex({}, {})


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


def index_pods(pod_list: Mapping[str, object]) -> PodIndex:
    """A PodIndex from the API server's PodList JSON; malformed items are skipped, never fatal."""
    by_container: dict[str, PodRef] = {}
    by_uid: dict[str, PodRef] = {}
    for item in map(as_object, _list(pod_list.get("items"))):
        meta = as_object(item.get("metadata"))
        name, uid = meta.get("name"), meta.get("uid")
        if not isinstance(name, str):
            continue
        labels = as_object(meta.get("labels"))
        pod = PodRef(str(meta.get("namespace") or "default"), name, None,
                     MappingProxyType({str(k): str(v) for k, v in labels.items()}))
        if isinstance(uid, str):
            by_uid[uid] = pod
        status = as_object(item.get("status"))
        for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for cs in map(as_object, _list(status.get(key))):
                cid = cs.get("containerID")
                if isinstance(cid, str) and "://" in cid:
                    by_container[cid.split("://", 1)[1]] = replace(pod, container=str(cs.get("name") or "") or None)
    return PodIndex(MappingProxyType(by_container), MappingProxyType(by_uid))


class PodSource(Protocol):
    """Reads the node's pod list (blocking). Raises `PodListError` when it cannot."""

    def pod_list(self) -> Mapping[str, object]: ...


class PodListError(Exception):
    pass


class InClusterPods:
    """The node's pods from the API server, with the pod's service-account token (read-only RBAC:
    list pods). NODE_NAME comes from the downward API (`spec.nodeName`)."""

    def __init__(self, node: str, *, host: str, port: str, sa_dir: Path = SA_DIR,
                 transport: httpx.BaseTransport | None = None, timeout_s: float = 5.0) -> None:
        self.node = node
        self.url = f"https://{host}:{port}/api/v1/pods"
        self.sa_dir = sa_dir
        ca = sa_dir / "ca.crt"
        self._client = httpx.Client(verify=str(ca) if ca.exists() else True, timeout=timeout_s, trust_env=False,
                                    transport=transport)

    def pod_list(self) -> Mapping[str, object]:
        try:
            token = (self.sa_dir / "token").read_text().strip()  # rotated by the kubelet: read each time
            r = self._client.get(self.url, params={"fieldSelector": f"spec.nodeName={self.node}"},
                                 headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
        except (OSError, httpx.HTTPError) as exc:
            raise PodListError(f"cannot list the pods of node {self.node}: {exc}") from None
        if r.status_code != 200:
            raise PodListError(f"listing the pods of node {self.node} answered {r.status_code}: {r.text[:200]}")
        try:
            body = r.json()
        except ValueError:
            raise PodListError("the pod list is not JSON") from None
        if not isinstance(body, dict):
            raise PodListError("the pod list is not a JSON object")
        return body


def in_cluster_source(env: Mapping[str, str] = os.environ, sa_dir: Path = SA_DIR) -> InClusterPods | None:
    """The API server of the cluster this pod runs in, or None outside Kubernetes (no service host,
    no NODE_NAME from the downward API, or no service-account token mounted)."""
    host, port, node = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443"), env.get("NODE_NAME")
    if not host or not node or not (sa_dir / "token").exists():
        return None
    return InClusterPods(node, host=f"[{host}]" if ":" in host else host, port=port, sa_dir=sa_dir)


def read_cgroup(proc_root: Path, pid: int) -> str:
    try:
        with open(f"{proc_root}/{pid}/cgroup", "rb") as f:
            return f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return ""


class PodResolver:
    """pid -> PodRef, with the pod list cached (see the module doc). Blocking: call from the reader's thread."""

    def __init__(self, source: PodSource, *, proc_root: Path = Path("/proc"), refresh_s: float = 30.0,
                 min_refresh_s: float = 5.0, now: Callable[[], float] = time.monotonic,
                 cgroup: Callable[[Path, int], str] = read_cgroup) -> None:
        self.source = source
        self.proc_root = proc_root
        self.refresh_s, self.min_refresh_s = refresh_s, min_refresh_s
        self._now = now
        self._cgroup = cgroup
        self._index = EMPTY_INDEX
        self._read_at: float | None = None
        self._lock = threading.Lock()
        self.error: str | None = None  # the last pod-list failure, for the snapshot's notes
        self.reads = 0

    def _refresh(self, force: bool) -> None:
        now = self._now()
        age = None if self._read_at is None else now - self._read_at
        if age is not None and age < (self.min_refresh_s if force else self.refresh_s):
            return
        self._read_at = now
        self.reads += 1
        try:
            self._index = index_pods(self.source.pod_list())
            self.error = None
        except PodListError as exc:
            self.error = str(exc)  # keep the last good index: pods rarely move under a running process

    def resolve(self, pids: Iterable[int]) -> dict[int, PodRef]:
        with self._lock:
            refs = {pid: ref for pid in pids if (ref := container_from_cgroup(self._cgroup(self.proc_root, pid)))}
            if not refs:
                return {}
            self._refresh(force=False)
            if any(self._index.find(r) is None for r in refs.values()):
                self._refresh(force=True)  # a container started since the last read
            return {pid: pod for pid, ref in refs.items() if (pod := self._index.find(ref)) is not None}


class PodAwareReader:
    """A GPU reader whose snapshots also say which pod each process runs in (`GpuSnapshot.pods`)."""

    def __init__(self, inner: GpuReader, resolver: PodResolver) -> None:
        self.inner = inner
        self.resolver = resolver

    def read(self) -> GpuSnapshot:
        snap = self.inner.read()
        if snap.tree is None and snap.source != "nvml":
            return snap  # simulated or estimated: no /proc of these pids to read
        pods = self.resolver.resolve(p.pid for p in snap.processes)
        notes = snap.notes + ((f"pods: {self.resolver.error}",) if self.resolver.error else ())
        return replace(snap, pods=MappingProxyType(pods), notes=notes)

    def __getattr__(self, name: str) -> Any:  # close(), device figures...: the inner reader's
        return getattr(self.inner, name)


def with_pods(reader: GpuReader, env: Mapping[str, str] = os.environ, sa_dir: Path = SA_DIR) -> GpuReader:
    """`reader`, naming each process's pod when running in a Kubernetes pod (see `in_cluster_source`)."""
    source = in_cluster_source(env, sa_dir)
    if source is None:
        return reader
    logging.getLogger(__name__).info("in Kubernetes on node %s: GPU processes are matched to the node's pods", source.node)
    return PodAwareReader(reader, PodResolver(source))
