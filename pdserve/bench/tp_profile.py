"""``pdserve bench tp-profile``: decode tokens/s at TP=1 and TP=N in one run, and where a
TP=N step's time goes.

Both engines live in this process (TP=1 whole, TP=N as rank 0 + N-1 rank processes) and run
the same greedy workload interleaved, ``--repeats`` times after a warm-up (BENCHMARKS.md: a
ratio measured in one run). Then one more TP=N run is timed with probes: on rank 0 the
engine step, the executor's step, the staging of the plan, the plan's send to the other
ranks, the forward + logits (``run_staged``) and, inside it, every collective
(``all_reduce_`` / ``all_gather``); on rank 1 (through ``Executor.call_rank``) its
forward + logits and its collectives. A collective's time is its communication plus the wait
for the slowest rank, so rank 1's collective time includes rank 0's serial work (scheduling,
sampling, the send). On CUDA the probes synchronise the device, which slows the step they
measure; read them as a breakdown, not as the speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from pdserve.bench.cli import add_json_flag, write_json
from pdserve.config import ModelConfig, default_of

_PROBES = ("step", "execute", "stage", "send", "run_staged", "all_reduce_", "all_gather")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench tp-profile``."""
    p = subparsers.add_parser(
        "tp-profile",
        help="decode tok/s at TP=1 and TP=N in one run, and a TP=N step's time breakdown",
    )
    p.add_argument(
        "--model",
        default=default_of(ModelConfig, "model"),
        help="HF folder, .gguf file, random:<preset> or the embedded id",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--tp", type=int, default=2, help="the TP size compared with 1 (default 2)")
    p.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch CPU threads of each rank (and of the TP=1 engine) (default %(default)s)",
    )
    p.add_argument(
        "--num-prompts", default="1,8", help="comma-separated concurrencies (default 1,8)"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (default 3)")
    add_json_flag(p)
    p.set_defaults(func=run_tp_profile)


class Probes:
    """Wall-time totals (seconds) and counts of named calls, in one process."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.total: dict[str, float] = dict.fromkeys(_PROBES, 0.0)
        self.count: dict[str, int] = dict.fromkeys(_PROBES, 0)
        self.on = False

    def wrap(self, obj: Any, name: str, key: str | None = None) -> None:
        """Replace ``obj.name`` (a bound method or callable attribute) by a timed one (an
        instance attribute), counted under ``key`` (default ``name``)."""
        inner = getattr(obj, name)
        key = key or name

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            if self.sync is not None:
                self.sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                self.total[key] += time.perf_counter() - t0
                self.count[key] += 1

        setattr(obj, name, timed)

    def snapshot(self) -> dict[str, Any]:
        return {"total_s": dict(self.total), "count": dict(self.count)}


def _sync_of(device: Any) -> Callable[[], None] | None:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def _instrument_rank(ctx: Any) -> None:
    """In a rank's process: time its collectives and its ``run_staged`` (``call_rank``)."""
    probes = Probes(_sync_of(ctx.device))
    probes.wrap(ctx.tp, "all_reduce_")
    probes.wrap(ctx.tp, "all_gather")
    probes.wrap(ctx.runner, "run_staged")
    ctx.profile_probes = probes


def _switch_rank(ctx: Any, on: bool) -> dict[str, Any]:
    """In a rank's process: turn its probes on (reset) or off; returns what they hold."""
    probes: Probes = ctx.profile_probes
    if on:
        probes.total = dict.fromkeys(_PROBES, 0.0)
        probes.count = dict.fromkeys(_PROBES, 0)
    probes.on = on
    return probes.snapshot()


def _decode(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - t0


def profile_step(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One probed run of ``llm`` (TP > 1): per engine step, milliseconds of each part on
    rank 0 and on rank 1 (see the module docstring), and the steps counted."""
    core = llm.engine
    ex = core.executor
    rank0 = ex.rank0
    probes = Probes(_sync_of(rank0.device))
    probes.wrap(core, "step")
    probes.wrap(ex, "execute")
    probes.wrap(rank0.runner, "stage")
    probes.wrap(rank0.tp, "all_reduce_")
    probes.wrap(rank0.tp, "all_gather")
    probes.wrap(rank0.runner, "run_staged")
    probes.wrap(rank0.runner, "on_staged", "send")  # the executor's send of the plan
    ex.call_rank(1, _instrument_rank)
    ex.call_rank(1, _switch_rank, True)
    probes.on = True
    _decode(llm, prompts, max_tokens)
    probes.on = False
    remote = ex.call_rank(1, _switch_rank, False)
    steps = max(1, probes.count["execute"])
    ms = {k: 1e3 * v / steps for k, v in probes.total.items()}
    r1 = {k: 1e3 * v / steps for k, v in remote["total_s"].items()}
    coll0 = ms["all_reduce_"] + ms["all_gather"]
    coll1 = r1["all_reduce_"] + r1["all_gather"]
    return {
        "steps": steps,
        "collectives_per_step": (probes.count["all_reduce_"] + probes.count["all_gather"]) / steps,
        "rank0_ms": {
            "engine_step": ms["step"],
            "scheduler_and_outputs": ms["step"] - ms["execute"],
            "execute": ms["execute"],
            "stage_plan": ms["stage"],
            "send_plan": ms["send"],
            "forward_and_logits": ms["run_staged"],
            "collectives": coll0,
            "compute": ms["run_staged"] - coll0,
            "sampling": ms["execute"] - ms["run_staged"] - ms["stage"] - ms["send"],
        },
        "rank1_ms": {
            "forward_and_logits": r1["run_staged"],
            "collectives": coll1,
            "compute": r1["run_staged"] - coll1,
        },
    }


def run_tp_profile(args: argparse.Namespace) -> int:
    """Run the comparison and the probed run; print a table; 2 on bad arguments."""
    import torch

    from pdserve.bench.offline import _parse_counts, _random_prompts
    from pdserve.engine.llm import LLM

    try:
        counts = _parse_counts(args.num_prompts)
        if args.tp < 2 or args.num_threads < 1 or args.max_tokens < 1 or args.repeats < 1:
            raise ValueError("--tp must be >= 2; --num-threads, --max-tokens, --repeats >= 1")
        torch.set_num_threads(args.num_threads)  # rank processes take rank 0's count
        kw = dict(device=args.device, max_running_requests=max(counts))
        one = LLM(args.model, **kw)
        many = LLM(args.model, tensor_parallel_size=args.tp, **kw)
    except ValueError as exc:
        print(f"pdserve bench tp-profile: {exc}", file=sys.stderr)
        return 2
    try:
        rows = []
        print(
            f"model {args.model}  device {args.device}  threads/rank {args.num_threads}  "
            f"max_tokens {args.max_tokens}  repeats {args.repeats}"
        )
        for n in counts:
            prompts = _random_prompts(one.engine.vocab_size, n, 32, seed=n)
            _decode(one, prompts, args.max_tokens)
            _decode(many, prompts, args.max_tokens)
            tp1, tpn = [], []
            for _ in range(args.repeats):
                tp1.append(n * args.max_tokens / _decode(one, prompts, args.max_tokens))
                tpn.append(n * args.max_tokens / _decode(many, prompts, args.max_tokens))
            row = {
                "num_prompts": n,
                "tp1_tok_s": statistics.median(tp1),
                f"tp{args.tp}_tok_s": statistics.median(tpn),
                "tp1_runs": tp1,
                f"tp{args.tp}_runs": tpn,
                "profile": profile_step(many, prompts, args.max_tokens),
            }
            row["ratio"] = row[f"tp{args.tp}_tok_s"] / row["tp1_tok_s"]
            rows.append(row)
            p = row["profile"]
            print(
                f"{n:>3} prompts: TP1 {row['tp1_tok_s']:.1f} tok/s, TP{args.tp} "
                f"{row[f'tp{args.tp}_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}; "
                f"{p['collectives_per_step']:.0f} collectives a step"
            )
            for who in ("rank0_ms", "rank1_ms"):
                parts = "  ".join(f"{k} {v:.2f}" for k, v in p[who].items())
                print(f"    {who[:5]} ms/step: {parts}")
    finally:
        many.shutdown()
    if args.json:
        report = {
            "benchmark": "tp-profile",
            "model": args.model,
            "device": args.device,
            "tp": args.tp,
            "threads_per_rank": args.num_threads,
            "max_tokens": args.max_tokens,
            "prompts": "random 32-token prompts, greedy, ignore_eos",
            "results": rows,
        }
        write_json(args.json, report)
    return 0
