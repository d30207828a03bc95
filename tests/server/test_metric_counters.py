"""Cumulative counts on ``/metrics`` are Prometheus counters (type ``counter``, sample
``<name>_total``), never gauges: a rate() over a gauge is meaningless to Prometheus, and
the type is what scrapers and dashboards go by. Levels (running requests, free pages)
stay gauges. Checked on a real worker's ``/metrics`` after it served requests, and on the
help table every scrape-time stat is typed by."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench.kv_probe import BYTES_METRIC
from pdserve.server.metric_help import COUNTER, GAUGE, HELP
from pdserve.server.metrics import ServerMetrics

pytestmark = pytest.mark.timeout(300)

ENGINE_COUNTERS = (
    "steps",
    "generation_tokens",
    "finished_requests",
    "prompt_tokens_computed",
    "num_preemptions",
    "overlap_launched_steps",
    "overlap_ahead_steps",
    "prefix_cache_query_tokens",
    "prefix_cache_hit_tokens",
    "prefix_cache_evicted_pages",
)


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_a_workers_cumulative_counts_are_counters_with_total_samples(worker):  # conftest's
    prompt = "the same long prompt for the prefix cache " * 6
    for _ in range(2):
        r = httpx.post(
            worker.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    text = httpx.get(worker.url + "/metrics", timeout=30).text
    fams = _families(text)
    for key in ENGINE_COUNTERS:
        name = f"pdserve_engine_{key}"
        fam = fams[name]
        assert fam.type == "counter", (name, fam.type)
        assert [s.name for s in fam.samples] == [f"{name}_total"], fam.samples
        assert f"# TYPE {name}_total counter" in text  # prometheus-client's text format
    value = {k: fams[f"pdserve_engine_{k}"].samples[0].value for k in ENGINE_COUNTERS}
    assert value["finished_requests"] >= 2 and value["generation_tokens"] >= 8, value
    assert value["steps"] >= 8 and value["prefix_cache_hit_tokens"] > 0, value
    for key in ("num_running", "num_waiting", "num_free_pages", "num_total_pages"):
        assert fams[f"pdserve_engine_{key}"].type == "gauge", key
    # garbage collection: the start-up heap frozen, each pause in a histogram, counts by
    # generation (a real worker's process: conftest starts it as its own process)
    gc_fams = {
        k: fams[f"pdserve_gc_{k}"] for k in ("frozen_objects", "collections", "pause_seconds")
    }
    assert gc_fams["frozen_objects"].samples[0].value > 10_000
    assert gc_fams["collections"].type == "counter"
    assert {s.labels["generation"] for s in gc_fams["collections"].samples} == {"0", "1", "2"}
    assert gc_fams["pause_seconds"].type == "histogram"
    info = httpx.get(worker.url + "/get_server_info", timeout=30).json()["gc"]
    assert info["frozen_objects"] > 10_000 and info["pause_seconds"]["count"] >= 0
    # Triton compilations (pdserve/triton_watch.py; on CPU nothing compiles) and the
    # start-up warm-up (engine/core/warmup.py) that ran before /health said ready
    assert fams["pdserve_triton_compilations_after_startup"].type == "counter"
    assert fams["pdserve_triton_compilations_after_startup"].samples[0].value == 0
    server = httpx.get(worker.url + "/get_server_info", timeout=30).json()
    assert server["triton"]["compilations_after_startup"] == 0, server["triton"]
    assert server["warmup"]["steps"] == 2, server["warmup"]
    # no gauge of the worker is a count since start
    for name, fam in fams.items():
        if name.startswith("pdserve_") and fam.type == "gauge":
            assert "cumulative" not in fam.documentation, (name, fam.documentation)


def test_every_cumulative_stat_is_typed_counter():
    wrong = [
        key
        for key, (doc, kind) in HELP.items()
        if "cumulative" in doc and "cumulative buckets" not in doc and kind != COUNTER
    ]
    assert not wrong, wrong
    assert HELP["num_free_pages"][1] == GAUGE and HELP["live_rooms"][1] == GAUGE


def test_transfer_counters_keep_their_family_names():
    """``bytes_transferred`` is ``pdserve_kv_transfer_bytes_transferred_total`` in the text;
    the family ``bench/kv_probe.py`` sums keeps its name."""
    stats = {"bytes_transferred": 4096, "pages_transferred": 2, "transfers_succeeded": 1}
    text = ServerMetrics({"pdserve_kv_transfer": lambda: stats}).render().decode()
    assert "pdserve_kv_transfer_bytes_transferred_total 4096.0" in text, text
    fam = _families(text)[BYTES_METRIC]
    assert fam.type == "counter" and sum(s.value for s in fam.samples) == 4096
