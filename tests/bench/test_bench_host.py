"""``pdserve bench host``: it times every phase of full decode steps, through the CLI, and
leaves the engine as it found it (the timers are removed, the synthetic executor stays)."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.bench.host import PHASES, install_stub, measure, synthetic_executor
from pdserve.cli import main
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams


def test_bench_host_cli_writes_every_phase(tmp_path, capsys):
    out = tmp_path / "host.json"
    argv = ["bench", "host", "--num-prompts", "1,3", "--max-tokens", "6", "--prompt-len", "5"]
    argv += ["--repeats", "1", "--stop", "zz", "--logprobs", "1", "--clock", "cpu"]
    assert main(argv + ["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["num_prompts"] for r in data["results"]] == [1, 3]
    for r in data["results"]:
        assert r["host_us"] > 0 and r["host_us_per_row"] == r["host_us"] / r["num_prompts"]
        assert all(f"{ph}_us" in r for ph in PHASES)
        assert r["append_us"] > 0 and r["output_us"] > 0 and r["schedule_us"] > 0
    assert data["workload"]["stop"] == ["zz"]
    assert "host/row" in capsys.readouterr().out


def test_measure_restores_the_engine():
    llm = LLM("random:tiny", device="cpu", num_pages=32)
    engine = llm.engine
    execute = synthetic_executor(engine.vocab_size, engine.eos_token_ids, None)
    engine.executor.execute = execute
    args = argparse.Namespace(
        max_tokens=4, prompt_len=3, stop=None, logprobs=None, repeats=1, clock="wall"
    )
    res = measure(engine, 2, args)
    assert res["num_prompts"] == 2 and res["host_us"] > 0
    assert engine.executor.execute is execute  # the synthetic executor is back, not a timer
    assert "_append_token" not in vars(engine) and "_make_output" not in vars(engine)
    assert "schedule" not in vars(engine.scheduler) and "poll" not in vars(engine.pd)
    assert not engine.has_unfinished_requests()
    llm.shutdown()


def test_bench_host_stub_times_the_first_token(tmp_path, capsys):
    """The stub executor runs the real runner (eager graph replays): the first token's
    phases are there, prefill takes the steps the budget asks, and execute is host work."""
    out = tmp_path / "stub.json"
    argv = ["bench", "host", "--executor", "stub", "--graphs", "--backend", "triton"]
    argv += ["--page-size", "16", "--budget", "64", "--num-prompts", "3", "--prompt-len", "40"]
    argv += ["--max-tokens", "5", "--repeats", "1", "--clock", "cpu", "--json", str(out)]
    assert main(argv) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["prefill_steps"] == 2  # 3 x 40 prompt tokens at 64 a step
    assert r["intake_us"] > 0 and r["prefill_us"] > 0
    assert r["first_us"] == pytest.approx(r["intake_us"] + r["prefill_us"])  # one run
    assert r["execute_us"] > 0 and r["host_us"] > r["execute_us"]  # execute counted in host
    assert "+ graphs" in capsys.readouterr().out


def test_stub_model_tokens_and_graph_replays():
    """Under the stub, greedy picks STUB_FIRST + row index mod 64: a prefill step's sampling
    rows, and a decode step's graph rows (replayed eagerly through the graph runner)."""
    llm = LLM("random:tiny", device="cpu", num_pages=64, max_num_batched_tokens=64)
    stub = install_stub(llm.engine, backend="triton", graphs=True)
    runner = llm.engine.executor.rank0.runner
    assert runner.model is stub and runner.graphs is not None and runner.graphs.eager
    replays = []
    replay = runner.graphs.replay
    runner.graphs.replay = lambda *a, **k: replays.append(len(a[0])) or replay(*a, **k)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9]], params)
    # prefill: one step, the two rows sample at hidden rows 2 and 4 (last of each prompt):
    # the LM head gets the gathered rows 0 and 1; decode: graph rows 0 and 1
    assert [o.outputs[0].token_ids for o in outs] == [[256] * 3, [257] * 3]
    assert all(o.outputs[0].text for o in outs)  # text tokens, not skipped special ones
    assert replays == [2, 2]
    llm.shutdown()


def test_bench_host_rejects_graphs_without_stub(capsys):
    assert main(["bench", "host", "--graphs", "--num-prompts", "1"]) == 2
    assert "--graphs needs --executor stub" in capsys.readouterr().out
