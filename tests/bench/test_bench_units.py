"""Pure functions of the serving benchmark: percentiles, stats, workloads, schedules."""

from __future__ import annotations

import math
import statistics

import pytest

from pdserve.bench.arrivals import parse_rates, poisson_arrivals
from pdserve.bench.metrics import LatencyStats, percentile, ratio, summarize
from pdserve.bench.openai_client import StreamResult, normalize_base_url
from pdserve.bench.prompts import sample_lengths
from pdserve.bench.report import json_safe
from pdserve.bench.runner import Target, block_order, request_body, split_blocks
from pdserve.bench.workload import InterferenceSpec, WorkloadSpec, build_requests


def test_percentile_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)  # 1 + 0.9 * 3 = rank 2.7 → 3.7
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be"):
        percentile(values, 101)


def test_latency_stats_in_ms():
    stats = LatencyStats.of_seconds([0.001, 0.002, 0.003])
    assert stats.count == 3
    assert stats.mean == pytest.approx(2.0)
    assert stats.median == pytest.approx(2.0)
    assert stats.p99 == pytest.approx(2.98)
    empty = LatencyStats.of_seconds([])
    assert empty.count == 0 and math.isnan(empty.median)


def _ok(ttft: float, itl: list[float], out: int, prompt: int = 10) -> StreamResult:
    latency = ttft + sum(itl)
    return StreamResult(
        ok=True, ttft=ttft, itl=itl, latency=latency, prompt_tokens=prompt, output_tokens=out
    )


def test_summarize_counts_throughput_and_errors():
    results = [
        _ok(0.1, [0.01, 0.03], 3),
        _ok(0.2, [0.02], 2),
        StreamResult(ok=False, error="HTTP 500: boom", latency=0.5),
        StreamResult(ok=False, error="HTTP 500: boom", latency=0.5),
        StreamResult(ok=False, error="ConnectError: refused", latency=0.1),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.num_requests, s.completed, s.failed) == (5, 2, 3)
    assert s.errors == ("HTTP 500: boom", "ConnectError: refused")
    assert s.total_output_tokens == 5 and s.total_input_tokens == 20
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(2.5)
    assert s.ttft.median == pytest.approx(150.0)
    assert s.itl.count == 3 and s.itl.median == pytest.approx(20.0)
    # TPOT: (latency - ttft) / (out - 1) per request = 20 ms and 20 ms
    assert s.tpot.median == pytest.approx(20.0)
    assert s.e2e.p99 == pytest.approx(
        statistics.quantiles([140.0, 220.0], n=100, method="inclusive")[98]
    )


def test_ratio_and_json_safe():
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))
    assert json_safe({"a": [math.nan, math.inf, 1.5], "b": (2, "x")}) == {
        "a": [None, None, 1.5],
        "b": [2, "x"],
    }


def test_poisson_schedule_is_seeded_and_has_the_right_rate():
    a = poisson_arrivals(2000, 4.0, seed=7)
    assert a == poisson_arrivals(2000, 4.0, seed=7)
    assert a != poisson_arrivals(2000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    mean_gap = a[-1] / (len(a) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.08)  # 1/rate; std error ~2.2% at n=2000
    assert poisson_arrivals(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        poisson_arrivals(3, 0.0, seed=0)


def test_parse_rates():
    assert parse_rates("1, 2.5,inf") == (1.0, 2.5, math.inf)
    for bad in ("0", "-1", "x", "1,,2"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rates(bad)


def test_lengths_and_random_workload_are_deterministic():
    import random

    lens = sample_lengths(random.Random(0), 100, 0.5, 500)
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20
    assert sample_lengths(random.Random(0), 100, 0.0, 5) == [100] * 5
    spec = WorkloadSpec(num_requests=6, input_len=40, output_len=8, range_ratio=0.25, seed=3)
    reqs = build_requests(spec)
    assert reqs == build_requests(spec)
    assert reqs != build_requests(
        WorkloadSpec(num_requests=6, input_len=40, output_len=8, range_ratio=0.25, seed=4)
    )
    assert [len(r.prompt.split()) for r in reqs] == [r.expected_input_len for r in reqs]
    assert all(30 <= r.expected_input_len <= 50 and 6 <= r.max_tokens <= 10 for r in reqs)
    assert len({r.prompt for r in reqs}) == 6
    assert spec.resolved_endpoint == "completions"


def test_gsm8k_workload_uses_questions_and_chat():
    spec = WorkloadSpec(dataset="gsm8k", num_requests=3, output_len=16)
    reqs = build_requests(spec)
    assert spec.resolved_endpoint == "chat"
    assert "Janet" in reqs[0].prompt and all(r.max_tokens == 16 for r in reqs)
    body = request_body(reqs[0], "m", spec)
    assert body["messages"] == [{"role": "user", "content": reqs[0].prompt}]
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and "prompt" not in body
    no_eos = WorkloadSpec(num_requests=1, ignore_eos=False)
    assert "ignore_eos" not in request_body(build_requests(no_eos)[0], "m", no_eos)


def test_shared_prefix_workload_groups_share_a_system_prompt_in_random_order():
    spec = WorkloadSpec(
        dataset="shared-prefix", num_requests=16, input_len=5, system_prompt_len=30, seed=2
    )
    reqs = build_requests(spec)
    assert reqs == build_requests(spec)
    systems = [r.system for r in reqs]
    assert len(set(systems)) == 4 and all(systems.count(x) == 4 for x in set(systems))
    assert all(len(x.split()) == 30 for x in systems)
    order = [sorted(set(systems)).index(x) for x in systems]
    assert order != [i % 4 for i in range(16)]  # not round-robin order
    assert len({r.prompt for r in reqs}) == 16
    body = request_body(reqs[0], "m", spec)
    assert body["prompt"] == reqs[0].system + "\n\n" + reqs[0].prompt
    chat = WorkloadSpec(dataset="shared-prefix", num_requests=2, endpoint="chat")
    r0 = build_requests(chat)[0]
    assert request_body(r0, "m", chat)["messages"] == [
        {"role": "system", "content": r0.system},
        {"role": "user", "content": r0.prompt},
    ]


def test_multi_turn_workload_is_chat_with_history():
    spec = WorkloadSpec(dataset="multi-turn", num_requests=6, num_turns=3, input_len=4)
    reqs = build_requests(spec)
    assert spec.resolved_endpoint == "chat"
    assert [(r.conversation, r.turn) for r in reqs] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = request_body(reqs[1], "m", spec, history=history)
    assert body["messages"] == history + [{"role": "user", "content": reqs[1].prompt}]
    with pytest.raises(ValueError, match="chat"):
        WorkloadSpec(dataset="multi-turn", endpoint="completions")


def test_summary_reports_cache_hit_rate_and_kv_bytes_per_request():
    a, b = _ok(0.1, [], 4, prompt=100), _ok(0.1, [], 4, prompt=100)
    a.cached_tokens, b.cached_tokens = 0, 80
    s = summarize([a, b], 1.0, kv_bytes=3000)
    assert s.total_cached_tokens == 80 and s.cache_hit_rate == pytest.approx(0.4)
    assert s.kv_bytes_per_request == pytest.approx(1500)
    assert math.isnan(summarize([_ok(0.1, [], 4)], 1.0).cache_hit_rate)


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("num_turns", {"num_turns": 0}),
        ("system_prompt_len", {"system_prompt_len": 0}),
        ("dataset", {"dataset": "mmlu"}),
        ("num_requests", {"num_requests": 0}),
        ("input_len", {"input_len": 0}),
        ("output_len", {"output_len": 0}),
        ("range_ratio", {"range_ratio": 1.0}),
        ("endpoint", {"endpoint": "embeddings"}),
        ("temperature", {"temperature": -1.0}),
    ],
)
def test_workload_spec_validation_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        WorkloadSpec(**kwargs)


def test_interference_spec_validation():
    with pytest.raises(ValueError, match="long_input_len"):
        InterferenceSpec(long_input_len=0)
    with pytest.raises(ValueError, match="long_request_rate"):
        InterferenceSpec(long_request_rate=0)


def test_blocks_and_abba_order():
    assert split_blocks(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert split_blocks(2, 4) == [range(0, 1), range(1, 2)]
    assert sum(len(b) for b in split_blocks(37, 5)) == 37
    a, b = Target("target", "http://a", "m"), Target("compare", "http://b", "m")
    assert [block_order([a, b], i)[0].name for i in range(4)] == [
        "target",
        "compare",
        "target",
        "compare",
    ]
    with pytest.raises(ValueError, match="num_blocks"):
        split_blocks(3, 0)


def test_normalize_base_url():
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"
    assert normalize_base_url(" https://h:1 ") == "https://h:1"
    with pytest.raises(ValueError, match="url"):
        normalize_base_url("h:1")


def test_bench_sampler_times_every_case_and_reports_ratios(tmp_path):
    from pdserve.bench.sampler import measure

    r = measure(vocab=500, batch=4, prompt_len=20, output_len=5, repeats=2, device="cpu")
    assert set(r["ms"]) == {"greedy", "unseeded", "seeded", "penalties"}
    assert all(v > 0 for v in r["ms"].values())
    assert r["unseeded_over_seeded"] == r["ms"]["unseeded"] / r["ms"]["seeded"]
    assert r["penalties_over_greedy"] == r["ms"]["penalties"] / r["ms"]["greedy"]


def test_bench_offline_takes_serves_engine_flags():
    """Each engine flag of ``bench offline`` is ``serve``'s (ENGINE_FLAGS): same option
    strings, type, default, action and help (plus a bench note), parsed to the same value."""
    import argparse

    from pdserve.cli import build_parser, split_help
    from pdserve.server.engine_args import ENGINE_FLAGS

    def actions(*command: str) -> dict[str, argparse.Action]:
        parser = build_parser()
        for name in command:
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            parser = sub.choices[name]
        return {a.option_strings[0]: a for a in parser._actions if a.option_strings}

    serve, offline = actions("serve"), actions("bench", "offline")
    shared = [flag for flag, *_ in ENGINE_FLAGS if flag in offline]
    assert {"--model", "--dtype", "--device", "--page-size", "--enforce-eager"} <= set(shared)
    assert "--tensor-parallel-size" in shared and "--overlap-schedule" in shared
    # bench offline's step budget follows its largest row when unset (offline.batched_tokens_for)
    budget = offline["--max-num-batched-tokens"]
    assert budget.default is None and serve["--max-num-batched-tokens"].default == 2048
    assert "16 x the most prompts of a row" in (budget.help or "")
    for flag in shared:
        a, b = serve[flag], offline[flag]
        if flag == "--max-num-batched-tokens":
            continue
        assert (a.option_strings, a.type, a.default, type(a)) == (
            b.option_strings,
            b.type,
            b.default,
            type(b),
        ), flag
        (head, default), (text, default_b) = split_help(a.help or ""), split_help(b.help or "")
        assert text.startswith(head) and default == default_b, flag
    args = build_parser().parse_args(
        ["bench", "offline", "--tp", "2", "--no-enforce-eager", "--page-size", "32"]
    )
    assert (args.tensor_parallel_size, args.enforce_eager, args.page_size) == (2, False, 32)


def test_transfer_bench_bootstrap_wait_has_a_deadline():
    from pdserve.bench.transfer import wait_bootstrapped
    from pdserve.disagg.base import KVArgs, KVLayout, KVPoll
    from pdserve.disagg.fake import FakeKVManager

    args = KVArgs((0,), (4096,), (512,), 0, 1024, 256, KVLayout("m", "float32", 4, 1, 1, 8))
    prefill = FakeKVManager(args, "prefill", scripted=True)  # rooms stay Bootstrapping
    stuck = prefill.create_sender(5)
    with pytest.raises(RuntimeError, match=r"room 5: decode did not bootstrap within 0.05 s"):
        wait_bootstrapped(stuck, 5, wait_s=0.05)
    assert stuck.aborted
    ready = prefill.create_sender(6)
    ready.advance(KVPoll.WaitingForInput)
    wait_bootstrapped(ready, 6, wait_s=0.05)  # returns at once
