"""Where a tenant's engine runs on a host with several GPUs: the fact the attributed snapshot carries.

Its own module because both sides use it: `proxy.gpu.devices` decides placements and
`proxy.gpu.attribution` carries them in each snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PlacementSource = Literal["pinned", "discovered", "any"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a tenant's engine runs. `devices` None: any device of the host."""

    tenant: str
    devices: tuple[int, ...] | None
    source: PlacementSource
    detail: str

    def allows(self, index: int) -> bool:
        return self.devices is None or index in self.devices
