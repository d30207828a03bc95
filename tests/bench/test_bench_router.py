"""``pdserve bench router`` end to end at a small scale: its stub workers, a real router
process over them and the report's fields (latencies of both paths, the added latency as
their difference, req/s and the router's CPU per request)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)


def test_bench_router_reports_both_paths_and_the_router_cost(tmp_path):
    out = tmp_path / "router.json"
    args = ["--seconds", "0.5", "--rate", "40", "--concurrency", "4", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "router", *args],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(run.stdout) == report
    argv = report["router_argv"]  # both legs for every request (selective PD off)
    assert argv[argv.index("--pd-min-prefill-tokens") + 1] == "0"
    lat = report["latency"]
    assert lat["requests"] == 20
    for path in ("direct", "router"):
        assert 0 < lat[path]["p50_ms"] <= lat[path]["p99_ms"]
    assert lat["added_p50_ms"] == pytest.approx(lat["router"]["p50_ms"] - lat["direct"]["p50_ms"])
    through = report["throughput_router"]
    assert through["requests"] > 0 and through["req_per_s"] > 0
    assert through["router_cpu_ms_per_request"] > 0
    assert report["throughput_stub"]["requests"] > 0


def _bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "router", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "flag,value",
    [("--seconds", "0"), ("--rate", "-5"), ("--concurrency", "0"), ("--rate", "inf")],
)
def test_bad_numbers_are_usage_errors_naming_the_flag(flag, value):
    run = _bench(flag, value)
    assert run.returncode == 2, run.stderr
    assert f"argument {flag}: expected a number > 0, got '{value}'" in run.stderr


def test_a_missing_report_folder_is_refused_before_measuring(tmp_path):
    run = _bench("--json", str(tmp_path / "nowhere" / "r.json"), timeout=20)
    assert run.returncode == 2 and "no such folder" in run.stderr, run.stderr


def test_a_router_that_refuses_its_arguments_ends_the_bench_at_once():
    run = _bench("--router-arg=--bogus", timeout=50)  # not after waiting 60 s for its health
    assert run.returncode == 1, run.stderr
    assert "unrecognized arguments: --bogus" in run.stderr
    assert "the router process exited with code 2 before serving" in run.stderr
