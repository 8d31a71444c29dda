"""The metrics reference, from the Prometheus registry `/metrics` serves (proxy/admin/metrics.py): every
family with its type, labels and help, the histograms' buckets, and the module's notes on how each
series is counted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

import proxy.admin.metrics as metrics_module
from docs.gen.md import code, table
from proxy.admin.metrics import Metrics
from proxy.admin.proxy_view import ProxyView

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}


def _labels(obj: object) -> tuple[str, ...]:
    # prometheus_client keeps a metric's label names here, on wrappers and families alike
    return tuple(getattr(obj, "_labelnames", ()))


def families() -> list[tuple[Metric, tuple[str, ...], tuple[float, ...]]]:
    """(family, labels, buckets) for everything the registry of one proxy can expose."""
    no_tenants = SimpleNamespace(registry=[], broker=SimpleNamespace(
        lifecycles=SimpleNamespace(machines=dict)))
    m = Metrics(cast(ProxyView, no_tenants))
    out = [(f, _labels(f), ()) for f in m.live.describe()]
    for wrapper in vars(m).values():
        if isinstance(wrapper, MetricWrapperBase):
            family = next(iter(wrapper.describe()))
            bounds = tuple(b for b in getattr(wrapper, "_upper_bounds", ()) if b != float("inf"))
            out.append((family, _labels(wrapper), bounds))
    return sorted(out, key=lambda item: item[0].name)


def _series(family: Metric) -> str:
    return ", ".join(code(family.name + s) for s in SUFFIXES.get(family.type, ("",)))


def notes() -> str:
    """The module docstring's list of series, as Markdown."""
    doc = metrics_module.__doc__ or ""
    series = doc.split("Series:", 1)[1] if "Series:" in doc else ""
    return "\n".join(line.rstrip() for line in series.strip().splitlines())


def render() -> str:
    fams = families()
    rows = [[_series(f), f.type, ", ".join(code(label) for label in labels), f.documentation]
            for f, labels, _ in fams]
    buckets = [[code(f.name), ", ".join(f"{b:g}" for b in bounds)] for f, _, bounds in fams if bounds]
    return "\n\n".join([
        "## Series\n\n" + table(("series", "type", "labels", "help"), rows),
        "## Histogram buckets\n\nUpper bounds (`le`), then `+Inf`.\n\n" + table(("histogram", "buckets"), buckets),
        "## How each series is counted\n\nFrom the notes in `proxy/admin/metrics.py`.\n\n" + notes(),
    ])
