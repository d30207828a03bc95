"""``pdserve bench sampler``: what one sampler call costs per step, by kind of row.

For each batch size it times ``sampler.sample`` on random ``logits[B, V]`` (fp32) for:
``greedy`` rows; ``unseeded`` random rows (temperature 0.8, top_p 0.95: one batched
exponential draw from the shared generator); ``seeded`` random rows (the same, each row
drawing from its own generator: one draw per row, the way every random row was sampled
before issue 10); and ``penalties`` (greedy rows with presence, frequency and repetition
penalties over ``--prompt-len`` + ``--output-len`` tokens, in steady state: the request's
device copy of its tokens grows by one token a step). Ratios are measured in the same run:
``unseeded / seeded`` (the gain of the batched draw) and ``penalties / greedy`` (what
penalties add).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from pdserve.bench.cli import add_json_flag, write_json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``pdserve bench sampler``."""
    p = subparsers.add_parser(
        "sampler", help="sampler cost per step: greedy, batched vs per-row draws, penalties"
    )
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size V (SmolLM2's)")
    p.add_argument("--batch-sizes", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=1000, help="prompt tokens of a penalised row")
    p.add_argument("--output-len", type=int, default=200, help="output tokens of a penalised row")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per case (median kept)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    add_json_flag(p)
    p.set_defaults(func=run_sampler)


def _median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(
    vocab: int, batch: int, prompt_len: int, output_len: int, repeats: int, device: str
) -> dict:
    """Median milliseconds of one ``sample`` call per case, and the two ratios."""
    import torch

    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.worker.penalties import PenaltyTokens
    from pdserve.engine.worker.sampler import SampleRequest, sample

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen, device=dev)
    random_p = SamplingParams(temperature=0.8, top_p=0.95)
    seeded_p = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
    pen_p = SamplingParams(
        temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    )
    own = [torch.Generator(device=dev).manual_seed(i) for i in range(batch)]
    histories = [
        list(torch.randint(0, vocab, (prompt_len + output_len,)).tolist()) for _ in range(batch)
    ]
    tokens = [PenaltyTokens(h, prompt_len) for h in histories]

    def penalised() -> None:
        for h in histories:
            h.append(h[-1])  # one new token a step, as a decoding request
        sample(logits, [SampleRequest(pen_p, None, penalty_tokens=t) for t in tokens])

    cases: dict[str, Callable[[], object]] = {
        "greedy": lambda: sample(
            logits, [SampleRequest(SamplingParams(temperature=0), None)] * batch
        ),
        "unseeded": lambda: sample(logits, [SampleRequest(random_p, None)] * batch, gen),
        "seeded": lambda: sample(logits, [SampleRequest(seeded_p, g) for g in own], gen),
        "penalties": penalised,
    }
    ms = {name: _median_ms(fn, repeats, sync) for name, fn in cases.items()}
    return {
        "batch": batch,
        "ms": ms,
        "unseeded_over_seeded": ms["unseeded"] / ms["seeded"],
        "penalties_over_greedy": ms["penalties"] / ms["greedy"],
    }


def run_sampler(args: argparse.Namespace) -> int:
    """Print one line per batch size (and write ``--json``)."""
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    results = []
    for b in sizes:
        r = measure(args.vocab, b, args.prompt_len, args.output_len, args.repeats, args.device)
        results.append(r)
        ms = r["ms"]
        print(
            f"B={b:<4} V={args.vocab}: greedy {ms['greedy']:.2f} ms | unseeded {ms['unseeded']:.2f}"
            f" ms | seeded {ms['seeded']:.2f} ms | penalties {ms['penalties']:.2f} ms | "
            f"unseeded/seeded {r['unseeded_over_seeded']:.2f} | penalties/greedy "
            f"{r['penalties_over_greedy']:.2f}",
            flush=True,
        )
    if args.json:
        write_json(args.json, {"args": vars(args) | {"func": None}, "results": results})
    return 0
