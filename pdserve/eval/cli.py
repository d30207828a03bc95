"""``pdserve eval gsm8k``: GSM8K accuracy of an OpenAI-compatible URL (and a second one).

The prompt format and the few-shot source are stated in ``pdserve/bench/gsm8k_data.py``, the
answer extraction in ``pdserve/eval/gsm8k.py``; scoring and comparison in
``pdserve/eval/runner.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import shlex
import sys
from typing import Any

from pdserve.bench.serve import NO_PROGRESS, TARGET_FLAGS
from pdserve.cli import Flag, add_flags

URL, COMPARE, MODEL_NAME, TIMEOUT = TARGET_FLAGS
GSM8K_FLAGS: tuple[Flag, ...] = (
    URL,
    COMPARE._replace(
        help="second target, asked the same questions; differing answers are counted; unset: "
        "the --url target alone"
    ),
    MODEL_NAME,
    Flag("--num-questions", "test questions scored (default 200)", int, default=200),
    Flag(
        "--num-shots",
        "few-shot examples: the first K test rows, then excluded from scoring (default 0)",
        int,
        default=0,
    ),
    Flag("--concurrency", "requests in flight per target (default 16)", int, default=16),
    Flag("--max-tokens", "max_tokens of each answer (default 512)", int, default=512),
    TIMEOUT._replace(help="seconds allowed per request (default 1800)", default=1800.0),
    Flag(
        "--json",
        "write every question's prompt, output, answers and the summary here; unset: not written",
        metavar="FILE",
    ),
    NO_PROGRESS,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``eval`` and its ``gsm8k`` sub-command."""
    ev = subparsers.add_parser("eval", help="accuracy evaluations against a serving URL")
    sub = ev.add_subparsers(dest="eval_command", metavar="EVAL")
    p = sub.add_parser(
        "gsm8k", help="GSM8K test accuracy (greedy, chat completions)", description=__doc__
    )
    add_flags(p, GSM8K_FLAGS)
    p.set_defaults(func=run_gsm8k)
    ev.set_defaults(func=lambda args: (ev.print_help(), 2)[1])


def _validate(args: argparse.Namespace) -> None:
    for name in ("concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")


async def _run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    from tqdm import tqdm

    from pdserve.bench.openai_client import fetch_model_name, make_client, normalize_base_url
    from pdserve.eval.gsm8k import split_shots
    from pdserve.eval.runner import Timer, compare_results, evaluate, summarize_eval

    _validate(args)
    shots, questions = split_shots(args.num_questions, args.num_shots)
    urls = [("target", args.url)] + ([("compare", args.compare)] if args.compare else [])
    bases = [(name, normalize_base_url(url)) for name, url in urls]
    targets, per_target = [], []
    async with make_client(args.timeout) as client:
        for name, base in bases:
            model = args.model_name or await fetch_model_name(client, base)
            bar = tqdm(
                total=len(questions),
                unit="q",
                desc=f"gsm8k {name}",
                disable=args.no_progress,
                file=sys.stderr,
                dynamic_ncols=True,
            )
            try:
                with Timer() as timer:
                    results = await evaluate(
                        client,
                        base,
                        model,
                        questions,
                        shots,
                        args.max_tokens,
                        args.concurrency,
                        # mypy cannot infer the type of a lambda with a default argument
                        lambda r, bar=bar: bar.update(1),  # type: ignore[misc]
                    )
            finally:
                bar.close()
            per_target.append(results)
            targets.append(
                {
                    "name": name,
                    "url": base,
                    "model": model,
                    "summary": summarize_eval(results, timer.elapsed).to_dict(),
                    "questions": [r.to_dict() for r in results],
                }
            )
    comparison = compare_results(per_target[0], per_target[1]) if len(per_target) == 2 else None
    return targets, comparison


def _print(targets: list[dict[str, Any]], comparison: dict[str, Any] | None) -> None:
    from rich.table import Table

    from pdserve.bench.report import make_console

    table = Table(title="GSM8K (test split, greedy, chat completions)")
    for col in (
        "target",
        "questions",
        "correct",
        "accuracy",
        "95% CI (Wilson)",
        "invalid",
        "failed",
        "mean output tokens",
        "duration (s)",
    ):
        table.add_column(col, justify="left" if col == "target" else "right")
    for t in targets:
        s = t["summary"]
        table.add_row(
            f"{t['name']}\n{t['url']}",
            str(s["num_questions"]),
            str(s["correct"]),
            f"{100 * s['accuracy']:.1f}%",
            f"[{100 * s['ci_low']:.1f}%, {100 * s['ci_high']:.1f}%]",
            f"{s['invalid']} ({100 * s['invalid_rate']:.1f}%)",
            str(s["failed"]),
            f"{s['mean_completion_tokens']:.1f}",
            f"{s['duration_s']:.1f}",
        )
    console = make_console()
    console.print(table)
    for t in targets:
        errors = list(dict.fromkeys(q["error"] for q in t["questions"] if q["error"]))[:3]
        for err in errors:
            console.print(f"{t['name']} error: {err}", markup=False, highlight=False)
    if comparison is not None:
        console.print(
            f"compare vs target on the {comparison['both_completed']} questions both completed: "
            f"{comparison['extracted_differ']} extracted answers differ, "
            f"{comparison['text_differ']} raw outputs differ",
            markup=False,
            highlight=False,
        )
        for d in comparison["first_differences"]:
            console.print(
                f"  question {d['index']}: answers {d['target_extracted']!r} vs {d['compare_extracted']!r}, "
                f"text parts at char {d['first_difference_at_char']}: "
                f"{d['target_text']!r} vs {d['compare_text']!r}",
                markup=False,
                highlight=False,
            )


def run_gsm8k(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve eval gsm8k``: 0 ok, 1 unreachable target or every request
    failed, 2 bad arguments."""
    from pdserve.bench import gsm8k_data
    from pdserve.bench.report import json_safe
    from pdserve.eval import gsm8k

    try:
        targets, comparison = asyncio.run(_run(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print(targets, comparison)
    if args.json:
        doc = {
            "version": 1,
            "tool": "pdserve eval gsm8k",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command_line": shlex.join(sys.argv),
            "arguments": {k: v for k, v in vars(args).items() if k != "func"},
            "machine": {"host": platform.node(), "platform": platform.platform()},
            "prompt_format": {
                "instruction": gsm8k_data.INSTRUCTION,
                "user_message": gsm8k_data.format_question("<question>"),
                "few_shot_source": "first num_shots rows of the test split, excluded from scoring",
                "extraction": gsm8k.EXTRACTION_RULE,
                "sampling": {"temperature": 0.0, "max_tokens": args.max_tokens},
            },
            "targets": targets,
            "comparison": comparison,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(json_safe(doc), f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(t["summary"]["failed"] < t["summary"]["num_questions"] for t in targets) else 1
