"""``pdserve bench grammar``: what a grammar mask costs per token, next to a decode step.

For each grammar library installed (``xgrammar``, ``llguidance``) and each batch size, it
replays a fixed valid JSON answer token by token through ``B`` matchers and times one
token's mask work for the whole batch: fill the ``[B, ceil(V/32)]`` int32 bitmask (the
library), unpack it and apply it to ``logits[B, V]`` (``-inf`` where disallowed; pdserve's
code, the same for both libraries), accept the token (the library).  The same run
times a decode step of the engine (``B`` running requests, one token each) on the same
machine, and reports the ratio ``mask / decode step``: the share of a decode step that
structured outputs add when the mask is computed serially (nothing overlapped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from pdserve.bench.cli import add_json_flag, write_json
from pdserve.bench.roofline import steady_decode_step
from pdserve.embedded import EMBEDDED_MODEL_ID

# A library's part of one mask step: (new matchers, one per row; the bitmask
# ``[B, ceil(V/32)]`` int32 it fills; fill(matchers, bitmask); accept(matchers, token), which
# raises RuntimeError when the library rejects the token).
_Library = tuple[Callable[[], list], Any, Callable[[list, Any], None], Callable[[list, int], None]]

# A typical response_format schema: strings, an integer, an enum, an array, a nested object.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
BENCH_ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["mathematics", "analytical engine", "poetry"],
    "address": {"city": "London", "zip": "W1"},
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``pdserve bench grammar``."""
    p = subparsers.add_parser(
        "grammar",
        help="per-token grammar-mask cost (xgrammar, llguidance) as a fraction of a decode step",
    )
    p.add_argument("--model", default=EMBEDDED_MODEL_ID, help="model whose decode step is timed")
    p.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    p.add_argument(
        "--libraries",
        default="xgrammar,llguidance",
        help="grammar libraries to time (each skipped with a note when not installed)",
    )
    p.add_argument("--decode-steps", type=int, default=20, help="decode steps timed per batch")
    p.add_argument("--repeats", type=int, default=5, help="replays of the answer per library")
    add_json_flag(p)
    p.set_defaults(func=run_grammar)


def _xgrammar(tokenizer, vocab: int, batch: int) -> _Library:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(BENCH_SCHEMA))
    batcher = xgr.BatchGrammarMatcher()

    def fill(ms: list, bitmask: Any) -> None:
        if batch == 1:
            ms[0].fill_next_token_bitmask(bitmask, 0)
        else:
            batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(ms: list, token: int) -> None:
        for m in ms:
            if not m.accept_token(token):
                raise RuntimeError(f"xgrammar rejected token {token}")

    matchers = lambda: [xgr.GrammarMatcher(compiled) for _ in range(batch)]  # noqa: E731
    return matchers, xgr.allocate_token_bitmask(batch, vocab), fill, accept


def _llguidance(tokenizer, vocab: int, batch: int) -> _Library:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(BENCH_SCHEMA))
    executor = llguidance.LLExecutor()

    def fill(ms: list, bitmask: Any) -> None:
        if batch == 1:
            lltorch.fill_next_token_bitmask(ms[0], bitmask, 0)
        else:
            lltorch.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(ms)], bitmask
            )

    def accept(ms: list, token: int) -> None:
        for m in ms:
            if not m.consume_token(token):
                raise RuntimeError(f"llguidance rejected token {token}: {m.get_error()}")

    matchers = lambda: [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]  # noqa: E731
    return matchers, lltorch.allocate_token_bitmask(batch, vocab), fill, accept


_LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance}


def _mask_seconds(
    make, tokenizer, vocab: int, batch: int, tokens: list[int], repeats: int
) -> dict[str, float]:
    """Seconds per token of mask work (``total``) and of its parts (``fill``: the library's
    bitmask, ``apply``: pdserve's unpack + mask of the logits, ``accept``: the library
    advancing the matchers): the median replay of ``repeats`` (by total)."""
    import torch

    from pdserve.engine.structured.bitmask import apply_bitmask_inplace

    matchers, bitmask, fill, accept = make(tokenizer, vocab, batch)
    logits = torch.randn(batch, vocab)
    replays = []
    for _ in range(repeats + 1):  # the first replay warms caches and is dropped
        ms = matchers()
        parts = [0.0, 0.0, 0.0]
        for tok in tokens:
            t0 = time.perf_counter()
            fill(ms, bitmask)
            t1 = time.perf_counter()
            apply_bitmask_inplace(logits, bitmask)
            t2 = time.perf_counter()
            accept(ms, tok)
            for i, dt in enumerate((t1 - t0, t2 - t1, time.perf_counter() - t2)):
                parts[i] += dt
        fill_s, apply_s, accept_s = (x / len(tokens) for x in parts)
        replays.append(
            {
                "total": fill_s + apply_s + accept_s,
                "fill": fill_s,
                "apply": apply_s,
                "accept": accept_s,
            }
        )
    replays = sorted(replays[1:], key=lambda r: r["total"])
    return replays[len(replays) // 2]


def run_grammar(args: argparse.Namespace) -> int:
    """Time decode steps and grammar masks; print a table; 2 on bad arguments."""
    import importlib.util

    import torch

    from pdserve.engine.llm import LLM

    try:
        batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        libs = [x.strip() for x in args.libraries.split(",") if x.strip()]
        unknown = [x for x in libs if x not in _LIBRARIES]
        if unknown or not batches or min(batches) < 1:
            raise ValueError(f"libraries must be among {sorted(_LIBRARIES)}, batch sizes >= 1")
        llm = LLM(args.model, max_running_requests=max(batches))
    except ValueError as exc:
        print(f"pdserve bench grammar: {exc}", file=sys.stderr)
        return 2
    core = llm.engine
    tokenizer, vocab = core.tokenizer, core.vocab_size
    answer = tokenizer.encode(json.dumps(BENCH_ANSWER), add_special_tokens=False)
    tokens = [*answer, *sorted(core.eos_token_ids)[:1]]
    print(
        f"model {args.model}  vocab {vocab}  device {core.device}  threads "
        f"{torch.get_num_threads()}  answer {len(tokens)} tokens"
    )
    results = []
    prompt = core.tokenizer.encode("Write a long story about a robot who learns to paint.")
    for batch in batches:
        steady_decode_step(llm, [prompt] * batch, 3)  # warm-up
        step_s = steady_decode_step(llm, [prompt] * batch, args.decode_steps)["step_s"]
        row = {"batch": batch, "decode_step_ms": step_s * 1e3}
        for lib in libs:
            if importlib.util.find_spec(lib) is None:
                print(f"  {lib}: not installed, skipped")
                continue
            parts = _mask_seconds(_LIBRARIES[lib], tokenizer, vocab, batch, tokens, args.repeats)
            row[f"{lib}_mask_ms"] = parts["total"] * 1e3
            row[f"{lib}_fraction"] = parts["total"] / step_s
            for part in ("fill", "apply", "accept"):
                row[f"{lib}_{part}_ms"] = parts[part] * 1e3
        results.append(row)
        cells = "  ".join(
            f"{lib} {row[f'{lib}_mask_ms']:.3f} ms ({row[f'{lib}_fraction']:.2%}; fill "
            f"{row[f'{lib}_fill_ms']:.3f} apply {row[f'{lib}_apply_ms']:.3f} accept "
            f"{row[f'{lib}_accept_ms']:.3f})"
            for lib in libs
            if f"{lib}_mask_ms" in row
        )
        print(f"batch {batch:>3}: decode step {step_s * 1e3:.2f} ms  mask/token: {cells}")
    if args.json:
        report = {
            "benchmark": "grammar",
            "model": args.model,
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
            "results": results,
        }
        write_json(args.json, report, indent=1)
    return 0
