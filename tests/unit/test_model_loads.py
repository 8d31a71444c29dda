"""Load speeds: Ollama's load_duration read off its answer, warm/cold split from this machine's own
loads (not constants), and the health verdict when cold loads dominate."""

from __future__ import annotations

from proxy.engines import adapter_for
from proxy.engines.loading import registry_from_dict
from proxy.models.loads import LoadLog, LoadRecord, classify, cold_share, thresholds

GB = 10**9


def rec(gbps: float, resident: float | None, model: str = "m") -> LoadRecord:
    return LoadRecord(0.0, "ollama", model, 10 * GB, 10 / gbps, resident, "ollama load_duration")


def test_the_ollama_adapter_reads_load_duration_from_the_last_line_of_an_answer() -> None:
    reg = registry_from_dict({"tenants": {"ollama": {"engine": "ollama", "upstream": "http://127.0.0.1:1"}}})
    ollama_load_seconds = adapter_for(reg.get("ollama")).load_seconds
    tail = (b'{"model":"m","response":"x","done":false}\n'
            b'{"model":"m","done":true,"total_duration":9000000000,"load_duration":4250000000,"eval_count":3}\n')
    assert ollama_load_seconds(tail) == 4.25
    assert ollama_load_seconds(b'{"done":false}') is None


def test_the_split_is_the_geometric_mean_of_this_machines_warm_and_cold_medians() -> None:
    t = thresholds([rec(2.6, 1.0), rec(2.4, 0.95), rec(0.6, 0.0), rec(0.65, 0.05), rec(1.0, None)])
    assert t.warm_gbps == 2.5 and t.cold_gbps == 0.625 and t.warm_samples == 2 and t.cold_samples == 2
    assert t.split_gbps is not None and abs(t.split_gbps - 1.25) < 1e-9
    assert classify(rec(1.4, None), t) == "warm" and classify(rec(1.1, 1.0), t) == "cold", "speed decides once split"


def test_a_machine_with_a_fast_disk_gets_a_higher_split_than_a_slow_one() -> None:
    nvme = thresholds([rec(5.0, 1.0), rec(3.0, 0.0)])
    hdd = thresholds([rec(5.0, 1.0), rec(0.2, 0.0)])
    assert nvme.split_gbps and hdd.split_gbps and nvme.split_gbps > 3 * hdd.split_gbps, "no constant threshold"
    assert classify(rec(1.0, None), nvme) == "cold" and classify(rec(1.0, None), hdd) == "warm"


def test_before_both_kinds_were_seen_a_load_is_classified_by_its_own_residency_or_not_at_all() -> None:
    only_warm = thresholds([rec(2.5, 1.0)])
    assert only_warm.split_gbps is None
    assert classify(rec(0.3, 0.0), only_warm) == "cold" and classify(rec(0.3, None), only_warm) is None


def test_health_says_cold_when_most_recent_loads_were_cold() -> None:
    log = LoadLog()
    for r in [rec(2.5, 1.0), rec(0.5, 0.0), rec(0.5, 0.0), rec(0.55, 0.02)]:
        log.add(r)
    verdict = log.verdict()
    assert [r.load_class for r in log.records] == ["warm", "cold", "cold", "cold"]
    assert verdict.dominates and verdict.cold == 3 and verdict.classified == 4
    assert not cold_share([rec(2.5, 1.0)], thresholds([])).dominates, "one load says nothing"
