"""``pdserve bench host``: the engine's host (Python) time per decode step, by phase.

An ``EngineCore`` runs ``N`` requests of random ``--prompt-len``-token prompts for
``--max-tokens`` output tokens (EOS ignored) and every full decode step (all ``N`` requests,
one token each) is timed. With ``--executor synthetic`` (the default) the model is not run:
the executor returns a random token per sampling row, so the figures are the host side
alone (scheduling, bookkeeping, token append, detokenization, stop checks, outputs); with
``--executor model`` the real model runs and ``execute`` holds its compute and sampling.
With ``--executor stub`` the real model runner runs (the step's staging buffer, the
attention plan, the logits gather, the sampler, and with ``--graphs`` the CUDA-graph
runner's static-buffer filling, replayed eagerly) around a model whose forward and LM head
cost nothing (:class:`StubModel`): ``execute`` is host work too and counts in ``host``.
``--page-size``, ``--budget`` and ``--backend triton`` give the GPU engine's shape
(128-token pages, a 4,096-token step, the Triton backend's plan) on the CPU.

Each run also times the first token: ``intake`` (``add_request`` of every request), then
every step until each request has its first token (``prefill``: their host time summed,
``prefill_steps`` of them), ``first`` = both: the host time of a batch's first token.

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
# the first token's host phases of a run (microseconds; ``prefill_steps`` a count)
FIRST = ("intake", "prefill", "first")


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
        choices=("synthetic", "stub", "model"),
        default="synthetic",
        help="synthetic: random tokens, no model runner (host time alone); stub: the real "
        "model runner around a forward and LM head that cost nothing (the runner's host "
        "work counts as host); model: run the model",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="with --executor stub: decode steps go through the CUDA-graph runner's "
        "buffer filling (replayed eagerly), as on a GPU",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "torch_sdpa", "triton"),
        default="auto",
        help="with --executor stub: whose attention plan the runner builds (triton: the "
        "GPU engine's); auto: the device's",
    )
    p.add_argument(
        "--page-size", type=int, default=None, help="tokens per KV page; unset: the device's"
    )
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="tokens a step (max_num_batched_tokens); unset: every prompt in one step",
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


# The stub's logits columns (the sampler's tensors stay negligible) and the first token it
# picks: ids from 256 on are ordinary text pieces in the usual BPE vocabularies (the low ids
# are special tokens, which skip_special_tokens decodes to nothing: the detokenizer would
# then buffer every id of the output and decode them all again at each token)
STUB_FIRST = 256
STUB_VOCAB = STUB_FIRST + 64


class StubModel:
    """Stands in for a runner's ``LlamaForCausalLM`` at no compute cost: the forward
    returns zeros ``[T, 1]`` (one hidden column), the LM head the rows of one fixed
    ``[max_rows, STUB_VOCAB]`` fp32 table (row ``r`` ranks token ``STUB_FIRST + r % 64``
    first, so greedy picks vary by row, all ordinary text tokens). ``backend``,
    ``shapes`` (with ``vocab = STUB_VOCAB``) and ``dtype`` are what the model runner and the
    CUDA-graph runner read; the KV cache is not touched."""

    def __init__(self, model: Any, backend: Any, max_rows: int) -> None:
        import copy

        import torch

        self.backend = backend
        self.dtype = model.dtype
        self.shapes = copy.copy(model.shapes)
        self.shapes.vocab = STUB_VOCAB
        self._hidden = torch.zeros(max_rows, 1, dtype=model.dtype)
        rows = torch.arange(max_rows)
        logits = torch.zeros(max_rows, STUB_VOCAB, dtype=torch.float32)
        logits[rows, STUB_FIRST + rows % (STUB_VOCAB - STUB_FIRST)] = 1.0
        self._logits = logits

    def __call__(self, input_ids: Any, positions: Any, attn: Any, caches: Any, plan: Any) -> Any:
        return self._hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: Any, out: Any = None) -> Any:
        n = hidden.shape[0]
        if out is None:
            return self._logits[:n]
        return out.copy_(self._logits[:n])


def install_stub(engine: Any, backend: str = "auto", graphs: bool = False) -> StubModel:
    """Put a :class:`StubModel` under ``engine``'s (TP=1) model runner, with the attention
    backend ``backend`` (``auto``: the model's own) for the plan; ``graphs``: also a
    CUDA-graph runner over it that replays eagerly (``CUDAGraphRunner(eager=True)``), so
    decode steps fill its static buffers as a GPU engine's do. ValueError for TP > 1."""
    from pdserve.engine.worker.cuda_graph import CUDAGraphRunner
    from pdserve.model.attention import get_attention_backend

    rank0 = getattr(engine.executor, "rank0", None)
    if rank0 is None or engine.executor.tp_size != 1:
        raise ValueError("--executor stub needs a TP=1 engine")
    runner = rank0.runner
    model = runner.model
    be = model.backend if backend == "auto" else get_attention_backend(backend)
    sc = engine.config.scheduler
    max_rows = max(sc.max_num_batched_tokens, sc.max_running) + 1
    stub = StubModel(model, be, max_rows)
    runner.model = stub
    if graphs:
        storage = runner.storage
        runner.graphs = CUDAGraphRunner(
            stub,  # type: ignore[arg-type]
            storage.layer_caches,
            storage.page_size,
            sc.max_running,
            CUDAGraphRunner.max_pages_for(engine.max_model_len, storage.page_size),
            eager=True,
        )
    return stub


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
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(n)]
    clock = CLOCKS[args.clock]
    # the runner's execute is host work too with the stub model (not subtracted)
    stub = getattr(args, "executor", "synthetic") == "stub"
    t0 = clock()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"host-{run}-{i}", prompt, params)
    intake = clock() - t0
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
    prefill, prefill_steps = 0.0, 0
    sched = engine.scheduler
    try:
        while engine.has_unfinished_requests():
            # a step of the first token: some request has none yet (none has finished:
            # max_tokens >= 2)
            first = any(r.num_output_tokens == 0 for r in sched.waiting) or any(
                r.num_output_tokens == 0 for r in sched.running
            )
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
            if first:
                prefill += total - (0.0 if stub else accs["execute"][0])
                prefill_steps += 1
            if decode and full:
                row = {name: acc[0] * 1e6 for name, acc in accs.items()}
                row["host"] = total * 1e6 - (0.0 if stub else row["execute"])
                row["gc"] = gc_acc[0] * 1e6  # inside the other phases' figures too
                if detail:
                    row["other"] = row["host"] - sum(row[k] for k in PHASES[:-2])
                    if stub:  # the runner's host work: its own column, not "other"
                        row["other"] -= row["execute"]
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
    out["intake"] = intake * 1e6
    out["prefill"] = prefill * 1e6
    out["first"] = out["intake"] + out["prefill"]
    out["prefill_steps"] = prefill_steps
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
    # the first token: each phase's best light run (a shared machine only adds time)
    for ph in FIRST:
        res[f"{ph}_us"] = min(x[ph] for x in light)
    res["prefill_steps"] = light[0]["prefill_steps"]
    res["gc_mean_us"] = min(x["gc_mean"] for x in light)
    return res


def run_host(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve bench host``; prints one row per concurrency."""
    import torch

    from pdserve.bench.offline import _parse_counts
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.core.engine import EngineCore

    try:
        counts = _parse_counts(args.num_prompts)
        if args.max_tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
            raise ValueError("--max-tokens must be >= 2, --prompt-len and --repeats >= 1")
        if args.graphs and args.executor != "stub":
            raise ValueError("--graphs needs --executor stub")
        if (args.budget is not None and args.budget < 1) or (
            args.page_size is not None and args.page_size < 1
        ):
            raise ValueError("--budget and --page-size must be >= 1")
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    n_max = max(counts)
    page_size = args.page_size
    num_pages = None
    if args.executor != "model":  # no weights to size memory for: pages enough for all
        per_req = -(-(args.prompt_len + args.max_tokens) // (page_size or 16)) + 1
        num_pages = n_max * per_req + 64
    config = EngineConfig(
        model=ModelConfig(
            model=args.model, device=args.device, dtype=default_of(ModelConfig, "dtype")
        ),
        cache=CacheConfig(page_size=page_size, num_pages=num_pages),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.budget or max(2048, n_max * args.prompt_len),
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
    elif args.executor == "stub":
        install_stub(engine, args.backend, args.graphs)
        # no CPU compute to share out: torch's intra-op pool would only add wake-ups (on
        # a GPU these small ops are kernel launches)
        torch.set_num_threads(1)
    timer = timer_overhead_us(CLOCKS[args.clock])
    print(
        f"bench host: {args.model} on {args.device}, executor {args.executor}"
        f"{' + graphs' if args.graphs else ''}, prompt {args.prompt_len} + {args.max_tokens} "
        f"tokens, page {engine.page_ids.page_size}, budget "
        f"{config.scheduler.max_num_batched_tokens}, stop {args.stop}, logprobs "
        f"{args.logprobs}; {args.clock} us per decode step (timer {timer:.2f} us a call, in "
        "'other'); the first token's host us (intake, prefill steps, both)"
    )
    cols = ("host", "schedule", "update", "append", "output", "disagg", "masks", "other")
    print(
        f"{'prompts':>7} {'host/row':>9} "
        + " ".join(f"{c:>9}" for c in cols)
        + f" {'execute':>9} {'gc mean':>9} {'intake':>9} {'prefill':>9} {'steps':>5} {'first':>9}"
    )
    results = []
    for n in counts:
        res = measure(engine, n, args)
        results.append(res)
        print(
            f"{n:>7} {res['host_us_per_row']:>9.1f} "
            + " ".join(f"{res[c + '_us']:>9.1f}" for c in cols)
            + f" {res['execute_us']:>9.1f} {res['gc_mean_us']:>9.1f} {res['intake_us']:>9.1f}"
            f" {res['prefill_us']:>9.1f} {res['prefill_steps']:>5} {res['first_us']:>9.1f}"
        )
    engine.shutdown()
    if args.json:
        workload = {k: v for k, v in vars(args).items() if k != "func"}
        write_json(args.json, {"workload": workload, "timer_us": timer, "results": results})
    return 0
