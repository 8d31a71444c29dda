"""examples/prometheus: every hyperswap_* metric the Grafana dashboard queries is in a live /metrics answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.boxes import DemoFactory, proxy_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prometheus"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def queried_metrics() -> dict[str, list[str]]:
    """metric name -> titles of the panels whose queries use it."""
    dash = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    out: dict[str, list[str]] = {}
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    exprs += [("variable " + v["name"], v["definition"]) for v in dash["templating"]["list"]]
    for title, expr in exprs:
        for name in re.findall(r"\bhyperswap_[a-z_]+", expr):
            out.setdefault(name, []).append(title)
    return out


def exported(text: str) -> set[str]:
    """Names a PromQL query can use: every sample, and a labelled counter's or histogram's series before its first sample."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def test_the_dashboard_queries_every_panel_with_a_metric() -> None:
    dash = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    assert dash["panels"], "no panels"
    for p in dash["panels"]:
        assert p["targets"] and all("hyperswap_" in t["expr"] for t in p["targets"]), p["title"]
    assert len(queried_metrics()) >= 15


async def test_every_metric_the_dashboard_queries_is_exported(box: DemoFactory, http: httpx.AsyncClient) -> None:
    demo = await box("default")
    r = await http.get(proxy_of(demo).url("admin") + "/metrics")
    assert r.status_code == 200
    have = exported(r.text)
    missing = {name: panels for name, panels in queried_metrics().items() if name not in have}
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"


def test_the_scrape_config_targets_the_admin_listener() -> None:
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:11400"]  # admin.listen's default in tenants.json
    shipped = json.loads((Path(__file__).resolve().parents[2] / "tenants.json").read_text())
    assert shipped["admin"]["listen"] == "127.0.0.1:11400"
