"""Which release kinds tenants.json accepts: the one place a new kind is listed.

A release kind is one module holding its spec and its effect: a `ReleaseSpec` subclass
(`proxy/config/schema.py`) with `kind` a one-value Literal and its own fields, that implements
`release()` (and `wake()` where it has a resume call), or, for a kind that stops the app, a
`StoppingRelease` (`proxy/lifecycle/controller.py`) that builds its controller. List it with one
line here. `KINDS` is the closed set the proxy loads tenants.json with (proxy/engines/loading.py
hands it to proxy.config.loading as a parameter; nothing is registered globally). Its fields, their
checks and messages, the tenants.json reference and the validation of `release` follow from the
model; nothing in the proxy compares `kind` to a name (a unit test fails on such a comparison).
Guide: docs/guides/adding-an-app.md, "Adding a release kind".
"""

from __future__ import annotations

from proxy.config.kinds import ReleaseKinds
from proxy.config.schema import NoRelease, ReleaseSpec
from proxy.engines.comfyui import ComfyUIFree
from proxy.engines.http_release import HttpRelease
from proxy.engines.ollama import OllamaUnload
from proxy.lifecycle.cuda_suspend import CudaSuspend
from proxy.lifecycle.docker import DockerRelease
from proxy.lifecycle.process import ProcessRelease
from proxy.lifecycle.systemd import SystemdRelease

# In the order the tenants.json reference lists them.
RELEASE_KINDS: tuple[type[ReleaseSpec], ...] = (
    OllamaUnload,
    ComfyUIFree,
    HttpRelease,
    NoRelease,
    ProcessRelease,
    SystemdRelease,
    DockerRelease,
    CudaSuspend,
)

KINDS = ReleaseKinds(RELEASE_KINDS)
