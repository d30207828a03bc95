"""``pdserve bench host``: the engine's host (Python) time per decode step, by phase.

An ``EngineCore`` runs ``N`` requests of random ``--prompt-len``-token prompts for
``--max-tokens`` output tokens (EOS ignored) and every full decode step (all ``N`` requests,
one token each) is timed. With ``--executor synthetic`` (the default) the model is not run:
the executor returns a random token per sampling row, so the figures are the host side
alone (scheduling, bookkeeping, token append, detokenization, stop checks, outputs); with
``--executor model`` the real model runs and ``execute`` holds its compute and sampling.

Two passes per repeat, each run's median over its steps, the best run of ``--repeats``
after a warm-up (a shared machine only ever adds time):

- ``host``: the step's wall time minus ``execute``, with only the step's two once-a-step
  calls (``schedule``, ``execute``) timed, so per-row timers add nothing to it;
- the breakdown: ``schedule``, ``update`` (``Scheduler.update_from_output``), ``append``
  (every ``EngineCore._append_token`` of the step), ``output`` (every
  ``EngineCore._make_output``) and ``other`` (the rest of the step: the disaggregation
  poll, the grammar-mask pass, the loops), with per-row timers, whose own cost
  (``timer_us`` a call, measured here) lands in ``other``.

All figures are microseconds per decode step (and ``host`` also per row). The timers wrap
the engine's methods on that one instance only (instance attributes), nothing global.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from pdserve.bench.cli import add_json_flag, write_json
from pdserve.config import ModelConfig, default_of

PHASES = ("schedule", "update", "append", "output", "disagg", "masks", "gc", "other")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``pdserve bench host``."""
    p = subparsers.add_parser(
        "host",
        help="engine host time per decode step by phase (schedule, append, outputs)",
    )
    p.add_argument(
        "--model",
        default="random:tiny",
        help="HF folder, .gguf file, random:<preset> or the embedded id",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--num-prompts", default="1,64", help="comma-separated concurrencies")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of each random prompt")
    p.add_argument(
        "--executor",
        choices=("synthetic", "model"),
        default="synthetic",
        help="synthetic: random tokens, no model (host time alone); model: run the model",
    )
    p.add_argument(
        "--stop", action="append", default=None, help="a stop string (repeatable); unset: none"
    )
    p.add_argument(
        "--logprobs", type=int, default=None, help="top logprobs per token; unset: no logprobs"
    )
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this thread's CPU time (steadier on a busy machine)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per concurrency (best kept)")
    add_json_flag(p)
    p.set_defaults(func=run_host)


CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    # this thread's CPU seconds: steadier on a shared machine (what other processes take
    # is not counted), blind to waits
    "cpu": time.thread_time,
}


def _timed(
    fn: Callable[..., Any], acc: list[float], clock: Callable[[], float] = time.perf_counter
) -> Callable[..., Any]:
    """``fn`` whose seconds per call (by ``clock``) are added to ``acc[0]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += clock() - t0

    return wrapper


def timer_overhead_us(clock: Callable[[], float], calls: int = 20000) -> float:
    """Microseconds one :func:`_timed` wrapper adds to a call (median of 5 batches)."""
    acc = [0.0]
    f = _timed(lambda: None, acc, clock)
    plain = lambda: None  # noqa: E731
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        t1 = time.perf_counter()
        for _ in range(calls):
            plain()
        runs.append((t1 - t0 - (time.perf_counter() - t1)) / calls * 1e6)
    return statistics.median(runs)


def synthetic_executor(vocab: int, eos: frozenset[int], logprobs: int | None, seed: int = 0):
    """An ``execute(plan)`` that returns a random non-EOS token (logprob -1.0, and
    ``logprobs`` made-up alternatives) for each sampling row: no model, no tensors."""
    from pdserve.engine.step import SampledToken, StepResult

    rng = random.Random(seed)
    k = logprobs or 0

    def execute(plan: Any) -> StepResult:
        sampled = {}
        for seq in plan.seqs:
            if seq.sample:
                tok = rng.randrange(vocab)
                while tok in eos:
                    tok = rng.randrange(vocab)
                top = tuple((tok + j, -1.0 - j) for j in range(k))
                sampled[seq.request_id] = SampledToken(tok, -1.0, top)
        return StepResult(sampled=sampled)

    return execute


def _one_run(engine: Any, n: int, args: argparse.Namespace, run: int, detail: bool) -> dict:
    """Run ``n`` requests to the end; microseconds per full decode step of each phase
    (medians over the steps)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        stop=args.stop,
        logprobs=args.logprobs,
    )
    rng = random.Random(run)
    for i in range(n):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
        engine.add_request(f"host-{run}-{i}", prompt, params)
    clock = CLOCKS[args.clock]
    wrapped = [("schedule", engine.scheduler, "schedule"), ("execute", engine.executor, "execute")]
    if detail:
        wrapped += [
            ("update", engine.scheduler, "update_from_output"),
            ("append", engine, "_append_token"),
            ("output", engine, "_make_output"),
            ("masks", engine, "_attach_grammar_masks"),
            ("disagg", engine.pd, "poll"),
            ("disagg", engine.pd, "admit_receivers"),
            ("disagg", engine.pd, "send_chunks"),
        ]
    accs = {name: [0.0] for name, _, _ in wrapped}
    # (object, attribute, what its instance dict held before: None = nothing)
    restore = []
    for name, obj, attr in wrapped:
        restore.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, _timed(getattr(obj, attr), accs[name], clock))
    gc_acc = [0.0, 0.0]  # seconds in collections this step, start of the current one

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_acc[1] = clock()
        else:
            gc_acc[0] += clock() - gc_acc[1]

    gc.callbacks.append(on_gc)
    per_step: list[dict[str, float]] = []
    try:
        while engine.has_unfinished_requests():
            for acc in accs.values():
                acc[0] = 0.0
            gc_acc[0] = 0.0
            decode = engine.scheduler.running and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running
            )
            full = len(engine.scheduler.running) == n
            t0 = clock()
            engine.step()
            total = clock() - t0
            if decode and full:
                row = {name: acc[0] * 1e6 for name, acc in accs.items()}
                row["host"] = total * 1e6 - row["execute"]
                row["gc"] = gc_acc[0] * 1e6  # inside the other phases' figures too
                if detail:
                    row["other"] = row["host"] - sum(row[k] for k in PHASES[:-2])
                per_step.append(row)
    finally:
        gc.callbacks.remove(on_gc)
        for obj, attr, before in restore:
            if before is None:
                delattr(obj, attr)  # the instance attribute shadowed the class's method
            else:
                setattr(obj, attr, before)
    if not per_step:
        raise RuntimeError("no full decode step was timed (max_tokens too small?)")
    out = {k: statistics.median(r[k] for r in per_step) for k in per_step[0]}
    out["gc_mean"] = statistics.fmean(r["gc"] for r in per_step)
    out["steps"] = len(per_step)
    return out


def measure(engine: Any, n: int, args: argparse.Namespace) -> dict:
    """``host`` (light pass) and the phase breakdown (detailed pass) of ``n`` requests:
    the best of ``args.repeats`` runs of each after a warm-up (the breakdown is that of
    the detailed run with the least host time); microseconds per decode step."""
    _one_run(engine, n, args, run=-1, detail=True)  # warm-up
    light, detail = [], []
    for r in range(args.repeats):
        light.append(_one_run(engine, n, args, run=2 * r, detail=False))
        detail.append(_one_run(engine, n, args, run=2 * r + 1, detail=True))
    # best of the runs: on a shared machine, other processes only ever add time
    host = min(x["host"] for x in light)
    res: dict[str, float | int] = {
        "num_prompts": n,
        "host_us": host,
        "host_us_per_row": host / n,
        "execute_us": min(x["execute"] for x in light),
    }
    best = min(detail, key=lambda x: x["host"])
    for ph in PHASES:
        res[f"{ph}_us"] = best[ph]
    res["detailed_host_us"] = best["host"]
    res["gc_mean_us"] = min(x["gc_mean"] for x in light)
    return res


def run_host(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve bench host``; prints one row per concurrency."""
    from pdserve.bench.offline import _parse_counts
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.core.engine import EngineCore

    try:
        counts = _parse_counts(args.num_prompts)
        if args.max_tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
            raise ValueError("--max-tokens must be >= 2, --prompt-len and --repeats >= 1")
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    n_max = max(counts)
    config = EngineConfig(
        model=ModelConfig(
            model=args.model, device=args.device, dtype=default_of(ModelConfig, "dtype")
        ),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max(2048, n_max * args.prompt_len),
            max_running_requests=n_max,
            overlap_schedule=False,  # every step runs synchronously, through the executor
        ),
    )
    engine = EngineCore(config)
    if args.executor == "synthetic":
        # an instance attribute: this engine's executor only
        engine.executor.execute = synthetic_executor(  # type: ignore[method-assign]
            engine.vocab_size, engine.eos_token_ids, args.logprobs
        )
    timer = timer_overhead_us(CLOCKS[args.clock])
    print(
        f"bench host: {args.model} on {args.device}, executor {args.executor}, prompt "
        f"{args.prompt_len} + {args.max_tokens} tokens, stop {args.stop}, logprobs "
        f"{args.logprobs}; {args.clock} us per decode step (timer {timer:.2f} us a call, in 'other')"
    )
    cols = ("host", "schedule", "update", "append", "output", "disagg", "masks", "other")
    print(
        f"{'prompts':>7} {'host/row':>9} "
        + " ".join(f"{c:>9}" for c in cols)
        + f" {'execute':>9} {'gc mean':>9}"
    )
    results = []
    for n in counts:
        res = measure(engine, n, args)
        results.append(res)
        print(
            f"{n:>7} {res['host_us_per_row']:>9.1f} "
            + " ".join(f"{res[c + '_us']:>9.1f}" for c in cols)
            + f" {res['execute_us']:>9.1f} {res['gc_mean_us']:>9.1f}"
        )
    engine.shutdown()
    if args.json:
        workload = {k: v for k, v in vars(args).items() if k != "func"}
        write_json(args.json, {"workload": workload, "timer_us": timer, "results": results})
    return 0
