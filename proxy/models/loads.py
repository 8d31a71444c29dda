"""Model load speeds, and whether a load read its file from RAM (warm) or from disk (cold).

Every load the proxy sees is a `LoadRecord`: bytes, seconds, GB/s and the residency of the model's
files just before it. Warm and cold are told apart by this machine's own loads, not by constants:
loads whose files were at least 90 % resident are the warm samples, at most 10 % the cold ones,
and the threshold is the geometric mean of the two medians. Until both kinds were seen, a load is
classified by its own residency when that was measured, else it stays unclassified (None).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import ConfigDict, Field

from proxy.encoding import JSONModel

LoadClass = Literal["warm", "cold"]
WARM_RESIDENT = 0.9
COLD_RESIDENT = 0.1
MIN_LOAD_S = 0.05  # an engine may time every answer's load (Ollama: load_duration); below this no file was read
COLD_DOMINATES = 0.5  # health: more than half of the recent classified loads were cold


@dataclass(frozen=True, slots=True)
class LoadRecord:
    at: float  # wall, when it ended
    tenant: str
    model: str
    size_bytes: int
    seconds: float
    resident_before: float | None  # fraction of the files in the page cache before the load; None unknown
    source: str  # "ollama load_duration", "comfyui execution frames"
    load_class: LoadClass | None = None

    @property
    def gbps(self) -> float:
        return self.size_bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0



class MeasuredLoad(JSONModel):
    """A load as /api/models/loads and the decision log show it (rounded for people)."""

    model_config = ConfigDict(extra="allow", serialize_by_alias=True)  # JSONModel's, and "class" for load_class
    at: float
    tenant: str
    model: str
    size_bytes: int
    seconds: float
    gbps: float
    resident_before_percent: float | None
    source: str
    load_class: LoadClass | None = Field(serialization_alias="class")

    @classmethod
    def of(cls, r: LoadRecord) -> MeasuredLoad:
        return cls(at=round(r.at, 3), tenant=r.tenant, model=r.model, size_bytes=r.size_bytes,
                   seconds=round(r.seconds, 4), gbps=round(r.gbps, 3),
                   resident_before_percent=None if r.resident_before is None else round(100 * r.resident_before, 1),
                   source=r.source, load_class=r.load_class)


@dataclass(frozen=True, slots=True)
class Thresholds:
    warm_gbps: float | None  # median of this machine's warm loads
    cold_gbps: float | None
    warm_samples: int
    cold_samples: int

    @property
    def split_gbps(self) -> float | None:
        if self.warm_gbps is None or self.cold_gbps is None or self.warm_gbps <= self.cold_gbps:
            return None
        return math.sqrt(self.warm_gbps * self.cold_gbps)



class LoadSplit(JSONModel):
    """Where warm loads end and cold ones begin on this machine, as /api/models/loads shows it."""

    warm_median_gbps: float | None
    cold_median_gbps: float | None
    warm_samples: int
    cold_samples: int
    split_gbps: float | None
    basis: str

    @classmethod
    def of(cls, t: Thresholds) -> LoadSplit:
        split = t.split_gbps
        return cls(warm_median_gbps=_r(t.warm_gbps), cold_median_gbps=_r(t.cold_gbps), warm_samples=t.warm_samples,
                   cold_samples=t.cold_samples, split_gbps=_r(split),
                   basis=("loads measured on this machine: files >= 90 % resident are warm samples, <= 10 % cold; "
                          "the split is the geometric mean of the two medians") if split else
                   "not enough loads of both kinds measured yet: loads are classified by their own residency")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def thresholds(records: Iterable[LoadRecord]) -> Thresholds:
    records = list(records)
    warm = [r.gbps for r in records if r.resident_before is not None and r.resident_before >= WARM_RESIDENT]
    cold = [r.gbps for r in records if r.resident_before is not None and r.resident_before <= COLD_RESIDENT]
    return Thresholds(statistics.median(warm) if warm else None, statistics.median(cold) if cold else None,
                      len(warm), len(cold))


def classify(record: LoadRecord, t: Thresholds) -> LoadClass | None:
    split = t.split_gbps
    if split is not None:
        return "warm" if record.gbps >= split else "cold"
    if record.resident_before is None:
        return None
    return "warm" if record.resident_before >= 0.5 else "cold"


@dataclass(frozen=True, slots=True)
class ColdVerdict:
    cold: int
    classified: int
    cold_gbps: float | None
    warm_gbps: float | None

    @property
    def dominates(self) -> bool:
        return self.classified >= 3 and self.cold / self.classified > COLD_DOMINATES


def cold_share(records: Sequence[LoadRecord], t: Thresholds, last: int = 20) -> ColdVerdict:
    recent = [r for r in records[-last:] if r.load_class is not None]
    cold = sum(1 for r in recent if r.load_class == "cold")
    return ColdVerdict(cold, len(recent), t.cold_gbps, t.warm_gbps)


class LoadLog:
    """The recent loads in memory (the telemetry store keeps them for longer, through the decision log)."""

    def __init__(self, kept: int = 500) -> None:
        self.records: deque[LoadRecord] = deque(maxlen=kept)

    def add(self, record: LoadRecord) -> LoadRecord:
        t = thresholds([*self.records, record])
        record = replace(record, load_class=classify(record, t))
        self.records.append(record)
        return record

    def thresholds(self) -> Thresholds:
        return thresholds(list(self.records))

    def verdict(self) -> ColdVerdict:
        return cold_share(list(self.records), self.thresholds())
