"""``pdserve bench offline --speculative MODE``: one engine's output tokens/s with and
without speculative decoding, side by side, greedy, EOS ignored.

MODE is ``ngram`` (the prompt-lookup drafter, ``engine/spec/drafter.py``), ``draft`` (the
draft model ``--speculative-model``, ``engine/spec/draft_model.py``) or ``replay:RATE`` — the **acceptance-controlled** mode for random weights, where no drafter
can guess: the plain run's own greedy output is recorded and proposed back with each draft
token independently corrupted with probability ``1 - RATE`` (``ReplayDrafter``), so each
draft is accepted with probability RATE up to the first corrupted one.  Its figures are
labelled with RATE; that drafter costs a host lookup per row (no model), so they bound
what a real drafter of the same acceptance reaches — unless ``--speculative-model`` is given
too: then the draft model runs every step as it would (its cost paid) and its proposals are
replaced by the replayed ones.  ``reference:RATE`` is the same with ``ReferenceDrafter``:
a greedy verify keeps the recorded tokens up to the first corrupted draft whatever the
verify forward's argmax, so the rate holds in bf16 too, where the verify step's rounding
differs from the decode step's and ``replay`` loses its reference at the first near tie;
the positions where the argmax differed are reported (``reference_mismatches``: 0 in
exact arithmetic).

Workloads (``--spec-workload``): ``copy`` (the default with ``ngram``): chat prompts asking
the model to repeat a given passage with one light edit, where prompt lookup finds real
matches; ``gsm8k`` (the default with ``replay``): GSM8K test questions, as ``bench offline``.
Per concurrency, after a warm-up of each side, ``--repeats`` interleaved timed runs, each
from an empty prefix cache; reported: median tok/s of each side, the speed-up, the mean
acceptance length (tokens a verify row kept: accepted drafts + 1), the acceptance rate
(accepted / drafted) and the fraction of outputs identical to the plain run's (greedy:
all of them, the parity speculative decoding promises).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from collections.abc import Callable
from typing import Any

from pdserve.bench.cli import write_json

# Copy-heavy workload: passages written for this benchmark, and the edit asked for.
PASSAGES = (
    "To replace a bicycle chain, shift onto the smallest sprocket, open the quick link "
    "with pliers, and pull the old chain free. Thread the new chain through the "
    "derailleur, join the ends with a fresh link, and turn the pedals to check the shift.",
    "The river town wakes before the sun. Bakers light their ovens, fishermen check "
    "their nets, and the ferry captain counts the crates stacked on the pier. By seven "
    "the market square is full of voices, carts and the smell of fresh bread.",
    "Our meeting notes: the budget review moves to Thursday, the design team shares the "
    "new prototype on Friday, and every project lead sends a one-page status report to "
    "the office manager before the end of the month.",
    "A good cup of tea needs fresh water, a warm pot and patience. Let the leaves steep "
    "for three to five minutes, depending on their type, then pour slowly and enjoy it "
    "while the kitchen is still quiet.",
)
EDITS = (
    ("Thursday", "Wednesday"),
    ("seven", "eight"),
    ("three", "two"),
    ("new", "updated"),
)


def copy_prompts(llm: Any, n: int) -> list[list[int]]:
    """``n`` chat prompts (token ids) asking to repeat a passage with one word changed."""
    out = []
    for i in range(n):
        text = PASSAGES[i % len(PASSAGES)]
        old, new = next(((a, b) for a, b in EDITS if a in text), ("the", "the"))
        ask = f"Repeat the following passage exactly, changing only '{old}' to '{new}'.\n\n{text}"
        out.append(llm.chat_token_ids([{"role": "user", "content": ask}]))
    return out


def first_difference(a: Any, b: Any) -> int:
    """The first position where token lists ``a`` and ``b`` differ (the shorter one's
    length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parse_mode(text: str) -> tuple[str, float | None]:
    """``"ngram"`` -> ("ngram", None); ``"replay:0.8"`` -> ("replay", 0.8);
    ``"reference:0.8"`` -> ("reference", 0.8); ValueError naming ``speculative``
    otherwise."""
    if text in ("ngram", "draft"):
        return text, None
    mode, _, value = text.partition(":")
    if mode in ("replay", "reference") and value:
        try:
            rate = float(value)
        except ValueError:
            rate = -1.0
        if 0.0 <= rate <= 1.0:
            return mode, rate
    raise ValueError(
        "speculative must be ngram, draft, replay:RATE or reference:RATE with RATE in "
        f"[0, 1], got {text!r}"
    )


class _PaidReplay:
    """The replay drafter's proposals at a draft model's cost: ``draft.propose`` runs (its
    forwards, its KV), then its proposals are replaced by ``replay``'s."""

    name = "replay+draft"

    def __init__(self, draft: Any, replay: Any) -> None:
        self.draft, self.replay = draft, replay

    def propose(self, rows: Any) -> Any:
        self.draft.propose(rows)
        return self.replay.propose(rows)

    def on_verified(self, request_id: str, num_accepted: int) -> None:
        self.draft.on_verified(request_id, num_accepted)

    def release(self, request_id: str) -> None:
        self.draft.release(request_id)
        self.replay.release(request_id)


def _draft_model(llm: Any, model: str, k: int) -> Any:
    """A draft-model drafter for ``llm``'s engine (``engine/spec/factory.py``)."""
    from dataclasses import replace

    from pdserve.engine.spec.factory import make_drafter

    engine = llm.engine
    cfg = engine.config
    cfg = replace(
        cfg,
        scheduler=replace(
            cfg.scheduler,
            speculative_algorithm="draft",
            speculative_model=model,
            num_speculative_tokens=k,
        ),
    )
    return make_drafter(
        cfg,
        engine.source,
        engine.dtype,
        engine.attention_backend,
        engine.max_model_len,
        engine.kv.num_pages,
        engine.kv.page_size,
    )


def _verify_step_note(engine: Any) -> str:
    """How the engine runs its verify steps (``CUDAGraphRunner`` verify graphs or eager)."""
    g = engine.executor.rank0.runner.graphs
    if g is None or not g.q:
        return "eager (no CUDA graphs: CPU, --enforce-eager or TP > 1)"
    return (
        f"CUDA graphs of {g.q} tokens a row for up to {g.verify_max_batch} rows "
        "(larger or mixed steps eager; see results[].verify_steps); overlap scheduling off"
    )


def run_speculative(
    args: argparse.Namespace,
    llm: Any,
    counts: list[int],
    gsm8k_prompts: Callable[[Any, int], list[list[int]]],
    timed: Callable[[Any, list[list[int]], int], tuple[float, list[list[int]]]],
) -> int:
    """The comparison (module docstring); prints a table, writes ``args.json``; 2 on a
    bad ``--speculative`` / ``--spec-workload``.  ``gsm8k_prompts(llm, n)``: the ``gsm8k``
    workload's prompts; ``timed(llm, prompts, max_tokens)``: seconds and output ids of one
    greedy run from an empty prefix cache (both ``bench offline``'s)."""
    from pdserve.engine.spec.drafter import NgramDrafter, ReferenceDrafter, ReplayDrafter

    try:
        mode, rate = parse_mode(args.speculative)
        controlled = mode in ("replay", "reference")
        workload = args.spec_workload or ("gsm8k" if controlled else "copy")
        if workload not in ("copy", "gsm8k"):
            raise ValueError(f"spec-workload must be copy or gsm8k, got {workload!r}")
        if mode == "draft" and not args.speculative_model:
            raise ValueError("speculative draft needs --speculative-model")
    except ValueError as exc:
        print(f"pdserve bench offline: {exc}", file=sys.stderr)
        return 2
    engine = llm.engine
    k = args.num_speculative_tokens
    n_max = max(counts)
    all_prompts = copy_prompts(llm, n_max) if workload == "copy" else gsm8k_prompts(llm, n_max)
    draft = _draft_model(llm, args.speculative_model, k) if args.speculative_model else None
    label = {"ngram": "ngram", "draft": f"draft model {args.speculative_model}"}.get(
        mode, f"acceptance-controlled (rate {rate})"
    )
    if mode == "reference":
        label = f"acceptance-controlled, reference kept (rate {rate}; benchmark only)"
    if controlled and draft is not None:
        label += f", draft model {args.speculative_model} run for its cost"
    print(
        f"model {args.model}  dtype {engine.dtype}  device {engine.device}  k {k}  "
        f"speculative {label}  workload {workload}  max_tokens {args.max_tokens}"
    )
    print(
        f"{'prompts':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'speed-up':>8} "
        f"{'accept len':>10} {'accept rate':>11} {'same outputs':>12}"
    )
    results = []
    for n in counts:
        prompts = all_prompts[:n]
        engine.set_drafter(None)
        timed(llm, prompts, args.max_tokens)  # warm-up
        _, plain_ids = timed(llm, prompts, args.max_tokens)
        if mode == "ngram":
            drafter: Any = NgramDrafter(k, args.speculative_ngram_min, args.speculative_ngram_max)
        elif mode == "draft":
            drafter = draft
        else:
            refs = [p + o for p, o in zip(prompts, plain_ids)]
            kind = ReferenceDrafter if mode == "reference" else ReplayDrafter
            drafter = kind(refs, k, rate or 0.0, engine.vocab_size, seed=0)
            if draft is not None:
                drafter = _PaidReplay(draft, drafter)
        engine.set_drafter(drafter, k)
        timed(llm, prompts, args.max_tokens)  # warm-up (verify shapes)
        plain_runs, spec_runs, same = [], [], []
        first_diffs: list[int] = []
        before = engine.stats()
        mismatches0 = engine.scheduler.num_reference_mismatches
        runner = engine.executor.rank0.runner
        vsteps0 = dict(runner.verify_steps)
        for _ in range(args.repeats):
            engine.set_drafter(None)
            dt, ids = timed(llm, prompts, args.max_tokens)
            plain_runs.append(n * args.max_tokens / dt)
            engine.set_drafter(drafter, k)
            dt, spec_ids = timed(llm, prompts, args.max_tokens)
            spec_runs.append(n * args.max_tokens / dt)
            same.append(sum(a == b for a, b in zip(spec_ids, ids)) / n)
            first_diffs += [first_difference(a, b) for a, b in zip(spec_ids, ids) if a != b]
        engine.set_drafter(None)
        after = engine.stats()
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        rows = after["spec_verify_rows"] - before["spec_verify_rows"]
        mismatches = engine.scheduler.num_reference_mismatches - mismatches0
        vsteps = {k: v - vsteps0[k] for k, v in runner.verify_steps.items()}
        row = {
            "num_prompts": n,
            "plain_tok_s": statistics.median(plain_runs),
            "spec_tok_s": statistics.median(spec_runs),
            "plain_runs": plain_runs,
            "spec_runs": spec_runs,
            "acceptance_length": (accepted + rows) / rows if rows else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "identical_outputs": min(same),
            # where each differing output first left the plain run's (0 = its first token;
            # max_tokens - 1 = only the last one, which no draft covers: a row with one
            # token left decodes it plainly, over KV the verify forwards wrote)
            "first_differences": sorted(first_diffs),
            "reference_mismatches": mismatches if mode == "reference" else None,
            "kept_tokens": accepted + rows,
            "verify_steps": vsteps,
            "prompt_lens": [len(p) for p in prompts],
        }
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        results.append(row)
        alen = "-" if row["acceptance_length"] is None else f"{row['acceptance_length']:.2f}"
        arate = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
        print(
            f"{n:>7} {row['plain_tok_s']:>11.1f} {row['spec_tok_s']:>10.1f} "
            f"{row['speedup']:>8.2f} {alen:>10} {arate:>11} {row['identical_outputs']:>12.0%}"
        )
    if args.json:
        import torch

        report = {
            "benchmark": "offline-speculative",
            "model": args.model,
            "dtype": str(engine.dtype),
            "device": str(engine.device),
            "speculative": label,
            "num_speculative_tokens": k,
            "workload": workload,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "verify_step": _verify_step_note(engine),
            "results": results,
        }
        write_json(args.json, report)
    return 0
