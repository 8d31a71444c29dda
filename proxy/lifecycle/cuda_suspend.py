"""Release kind `cuda_suspend`: suspend the tenant's CUDA processes into host RAM, restore them
before its next request.

A step of any tenant's release list (`"release": [{"kind": "cuda_suspend"}, {"kind": "process", ...}]`):
the processes attribution gives the tenant are locked and checkpointed by the NVIDIA driver (their
device memory copied into host memory the driver manages, every GPU resource released), the card
is watched until the memory is back (invariant 6), and the app, its model still loaded, is restored
before the next request is forwarded to it: the request waits for the restore as for a load. CPU
threads keep running (a suspended app still answers what needs no CUDA call).

The step is the spec; the proxy runs it through `Suspensions` (`proxy/lifecycle/suspender.py`),
which needs the processes and the driver: `suspends` tells the release path so, never the name.
When the host RAM it needs (what the processes hold on the card, plus `host_ram_margin_gb`) is not
available, or a process is not a CUDA one, the step fails and the next step of the list runs.
Guide: docs/guides/cuda-suspend.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import httpx
from pydantic import Field

from proxy.config.schema import ReleaseFailed, ReleaseSpec, Tenant
from proxy.config.units import GIB


class CudaSuspend(ReleaseSpec):
    """Suspend the tenant's CUDA processes to host RAM (NVIDIA driver 550+, Linux), restore on demand."""

    kind: Literal["cuda_suspend"] = "cuda_suspend"
    via: Literal["driver", "utility"] = Field(
        default="driver", description="kind cuda_suspend: driver (the CUDA driver API through libcuda.so.1, driver "
                                      "570+) or utility (the cuda-checkpoint program, driver 550+)")
    utility: str = Field(default="cuda-checkpoint", min_length=1,
                         description="kind cuda_suspend: the cuda-checkpoint program (a name on PATH or a path), "
                                     "for via utility")
    host_ram_margin_gb: float = Field(default=4.0,
                                      description="kind cuda_suspend: GiB of host RAM a suspend leaves available; "
                                                  "a suspend that would take more falls back to the next step")
    lock_timeout_s: float = Field(default=10.0,
                                  description="kind cuda_suspend: how long the driver may wait for the process's "
                                              "submitted work before the suspend fails (its lock timeout)")

    suspends: ClassVar[bool] = True  # run by the proxy's Suspensions: it needs the processes and the driver

    @property
    def resumes(self) -> bool:
        return True

    @property
    def host_ram_margin_bytes(self) -> int:
        return int(self.host_ram_margin_gb * GIB)

    async def release(self, tenant: Tenant, client: httpx.AsyncClient) -> dict[str, object]:
        raise ReleaseFailed(f"release kind 'cuda_suspend' of tenant {tenant.name!r} is run by the proxy's "
                            "suspensions (it needs the tenant's processes), not as an HTTP call")
