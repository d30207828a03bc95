"""A worker started with ``--speculative-algorithm ngram``: ``/get_server_info`` reports the
configuration, a greedy ``/v1/completions`` answer equals the same worker's answer with
speculation off for that request's shape (checked against an engine without it), and
``/metrics`` exports the drafted / accepted counters and the acceptance-length histogram."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve_procs import TINY, start_worker, stop, wait_healthy

pytestmark = pytest.mark.timeout(300)

FLAGS = ["--speculative-algorithm", "ngram", "--num-speculative-tokens", "3"]
FLAGS += ["--speculative-ngram-max", "2", "--num-threads", "1"]


@pytest.fixture(scope="module")
def spec_worker(tmp_path_factory):
    proc = start_worker("spec", "mixed", tmp_path_factory.mktemp("spec-logs"), extra=FLAGS)
    try:
        wait_healthy([proc])
        proc.get_info()
        yield proc
    finally:
        stop([proc])


def test_server_info_metrics_and_greedy_output(spec_worker):
    assert spec_worker.info["speculative"] == {
        "speculative_algorithm": "ngram",
        "num_speculative_tokens": 3,
        "speculative_ngram_min": 1,
        "speculative_ngram_max": 2,
    }
    prompt = [5, 6, 7, 8, 9] * 4
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(spec_worker.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]

    from pdserve import LLM, SamplingParams

    plain = LLM(TINY, device="cpu", num_pages=64)
    want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert text == want[0].outputs[0].text

    fams = {
        f.name: f
        for f in text_string_to_metric_families(
            httpx.get(spec_worker.url + "/metrics", timeout=30).text
        )
    }
    drafted = fams["pdserve_engine_spec_draft_tokens"]
    assert drafted.type == "counter" and drafted.samples[0].value > 0
    accepted = fams["pdserve_engine_spec_accepted_tokens"].samples[0].value
    assert 0 <= accepted <= drafted.samples[0].value
    hist = fams["pdserve_engine_spec_acceptance_length"]
    assert hist.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert set(buckets) == {"1", "2", "3", "4", "+Inf"}
    assert buckets["+Inf"] == fams["pdserve_engine_spec_verify_rows"].samples[0].value > 0


def test_bad_speculative_flags_are_refused_naming_the_flag():
    import subprocess
    import sys

    for flags, field in (
        (["--speculative-algorithm", "eagle"], "--speculative-algorithm"),
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--speculative-algorithm", "draft"], "--speculative-model"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "pdserve", "serve", "--model", TINY, *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0 and field in proc.stderr, (flags, proc.stderr[-500:])
