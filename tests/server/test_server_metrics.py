"""Snapshot metrics: engine and transfer stats dicts become Prometheus gauges and
histograms in the worker's own registry (no global state between instances)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.metrics import ServerMetrics

STATS = {
    "bytes_transferred": 923,
    "role": "decode",
    "healthy": True,
    "transfer_latency_seconds": {"sum": 2.0, "count": 3, "buckets": {"0.5": 1, "1": 3, "+Inf": 3}},
    "transfers_failed": {"injected": 2, "timeout": 1},
    "rooms": {"Failed": 0, "Success": 1},
}


def _families(metrics: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_stats_become_gauges_histograms_and_labelled_gauges():
    m = ServerMetrics(
        {"pdserve_kv_transfer": lambda: STATS, "pdserve_engine": lambda: {"num_running": 4}}
    )
    fams = _families(m)
    assert fams["pdserve_engine_num_running"].samples[0].value == 4
    assert fams["pdserve_kv_transfer_bytes_transferred"].samples[0].value == 923
    assert fams["pdserve_kv_transfer_healthy"].samples[0].value == 1
    hist = fams["pdserve_kv_transfer_transfer_latency_seconds"]
    assert hist.type == "histogram"
    assert {s.labels.get("le"): s.value for s in hist.samples if s.name.endswith("_bucket")} == {
        "0.5": 1.0,
        "1": 3.0,
        "+Inf": 3.0,
    }
    failed = {
        s.labels["reason"]: s.value for s in fams["pdserve_kv_transfer_transfers_failed"].samples
    }
    assert failed == {"injected": 2.0, "timeout": 1.0}
    assert {s.labels["state"] for s in fams["pdserve_kv_transfer_rooms"].samples} == {
        "Failed",
        "Success",
    }
    assert not any(name.endswith("_role") for name in fams)


def test_registries_are_independent_and_a_failing_source_is_skipped():
    def broken():
        raise RuntimeError("stats unavailable")

    a = ServerMetrics({"pdserve_engine": broken})
    b = ServerMetrics({"pdserve_engine": lambda: {"num_running": 1}})
    a.requests.labels("/generate", "200").inc()
    assert "pdserve_engine_num_running" not in _families(a)
    assert _families(b)["pdserve_requests"].samples == []
    assert [
        s.value for s in _families(a)["pdserve_requests"].samples if s.name.endswith("_total")
    ] == [1.0]


def test_failed_transfers_are_a_counter_and_every_transfer_stat_has_a_meaning():
    from pdserve.disagg.metrics import TransferMetrics
    from pdserve.server.metric_help import HELP, SKIPPED

    t = TransferMetrics()
    t.record_failure("timeout")
    t.record_failure("timeout")
    stats = dict(t.snapshot(), rooms={"Success": 1}, live_rooms=1, healthy=True)
    assert set(stats) <= set(HELP) | SKIPPED
    text = ServerMetrics({"pdserve_kv_transfer": lambda: stats}).render().decode()
    assert 'pdserve_kv_transfer_transfers_failed_total{reason="timeout"} 2.0' in text
    # one family of that name (the unlabelled sum is not exported: sum() over reasons)
    assert text.count("# TYPE pdserve_kv_transfer_transfers_failed") == 1, text
    fams = _families(ServerMetrics({"pdserve_kv_transfer": lambda: stats}))
    assert fams["pdserve_kv_transfer_transfers_failed"].type == "counter"
    for name, fam in fams.items():
        assert "(from " not in fam.documentation and fam.documentation != name, name
