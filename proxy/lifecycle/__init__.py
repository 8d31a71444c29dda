"""Tenants the proxy stops and starts (release kinds process, systemd, docker): controllers at the
edge, readiness probes, and one state machine per tenant. See `state.py` for how the scheduler and
the listeners use it."""

from __future__ import annotations

from proxy.lifecycle.build import controller_for, lifecycle_for
from proxy.lifecycle.controller import Controller, LifecycleError, Status
from proxy.lifecycle.docker import DockerController
from proxy.lifecycle.process import ProcessController
from proxy.lifecycle.ready import Readiness, ReadyProbe, probe_for, probe_readiness, wait_ready
from proxy.lifecycle.state import Backoff, Lifecycle, LifecycleReport, LifecycleState, TenantLifecycle
from proxy.lifecycle.systemd import SystemdController

__all__ = ["Backoff", "Controller", "DockerController", "Lifecycle", "LifecycleError", "LifecycleReport",
           "LifecycleState", "ProcessController", "Readiness", "ReadyProbe", "Status", "SystemdController",
           "TenantLifecycle", "controller_for", "lifecycle_for", "probe_for", "probe_readiness", "wait_ready"]
