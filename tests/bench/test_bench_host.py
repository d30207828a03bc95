"""``pdserve bench host``: it times every phase of full decode steps, through the CLI, and
leaves the engine as it found it (the timers are removed, the synthetic executor stays)."""

from __future__ import annotations

import argparse
import json

from pdserve.bench.host import PHASES, measure, synthetic_executor
from pdserve.cli import main
from pdserve.engine.llm import LLM


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
