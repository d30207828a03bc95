"""Runs GSM8K questions against a chat-completions URL and scores the answers.

Greedy (temperature 0), non-streaming requests, at most ``concurrency`` in flight.
A request that fails counts as incorrect and is reported apart from invalid answers
(completions with no number in them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from pdserve.bench.gsm8k_data import GSM8KItem, build_messages
from pdserve.bench.openai_client import chat_completion
from pdserve.eval.gsm8k import extract_answer, wilson_interval


@dataclass(frozen=True)
class QuestionResult:
    """One question on one target: the prompt sent, the raw output (``None`` if the
    request failed, then ``error`` says why), the extracted and gold answers."""

    index: int
    question: str
    messages: list[dict[str, str]]
    output: str | None
    error: str | None
    extracted: str | None
    gold: str
    correct: bool
    completion_tokens: int | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return asdict(self)


@dataclass(frozen=True)
class EvalSummary:
    """Scores of one target over ``num_questions``.

    accuracy = correct / num_questions, with its 95% Wilson interval [ci_low, ci_high];
    invalid = completed requests whose output has no number; failed = request errors
    (both count as incorrect).
    """

    num_questions: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float
    invalid: int
    invalid_rate: float
    failed: int
    duration_s: float
    mean_completion_tokens: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return asdict(self)


async def evaluate(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    questions: Sequence[GSM8KItem],
    shots: Sequence[GSM8KItem],
    max_tokens: int,
    concurrency: int,
    on_done: Callable[[QuestionResult], None] = lambda r: None,
) -> list[QuestionResult]:
    """Ask every question (after ``shots``) and score it; results in question order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(item: GSM8KItem) -> QuestionResult:
        messages = build_messages(item.question, list(shots))
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        async with sem:
            text, error, usage = await chat_completion(client, base_url, body)
        extracted = extract_answer(text) if text is not None else None
        result = QuestionResult(
            index=item.index,
            question=item.question,
            messages=messages,
            output=text,
            error=error,
            extracted=extracted,
            gold=item.gold,
            correct=extracted == item.gold,
            completion_tokens=usage.get("completion_tokens"),
        )
        on_done(result)
        return result

    return list(await asyncio.gather(*(one(q) for q in questions)))


def summarize_eval(results: Sequence[QuestionResult], duration_s: float) -> EvalSummary:
    """Accuracy (Wilson 95% interval), invalid and failed counts of ``results``."""
    n = len(results)
    correct = sum(r.correct for r in results)
    invalid = sum(1 for r in results if r.error is None and r.extracted is None)
    failed = sum(1 for r in results if r.error is not None)
    low, high = wilson_interval(correct, n)
    tokens = [r.completion_tokens for r in results if r.completion_tokens is not None]
    return EvalSummary(
        num_questions=n,
        correct=correct,
        accuracy=correct / n if n else 0.0,
        ci_low=low,
        ci_high=high,
        invalid=invalid,
        invalid_rate=invalid / n if n else 0.0,
        failed=failed,
        duration_s=duration_s,
        mean_completion_tokens=sum(tokens) / len(tokens) if tokens else float("nan"),
    )


def compare_results(
    a: Sequence[QuestionResult], b: Sequence[QuestionResult], max_listed: int = 5
) -> dict[str, Any]:
    """How the answers of two targets on the same questions differ.

    Only questions both completed are compared. Returns counts of differing extracted
    answers and differing raw outputs, and the first ``max_listed`` differences (index,
    both extracted answers, and the character offset where the outputs part).
    """
    if [r.index for r in a] != [r.index for r in b]:
        raise ValueError("compare_results needs results for the same questions in the same order")
    both = [(x, y) for x, y in zip(a, b) if x.error is None and y.error is None]
    differ = [(x, y) for x, y in both if x.output != y.output]
    listed = []
    for x, y in differ[:max_listed]:
        ox, oy = x.output or "", y.output or ""
        offset = next((i for i, (c, d) in enumerate(zip(ox, oy)) if c != d), min(len(ox), len(oy)))
        listed.append(
            {
                "index": x.index,
                "target_extracted": x.extracted,
                "compare_extracted": y.extracted,
                "first_difference_at_char": offset,
                "target_text": ox[max(0, offset - 20) : offset + 60],
                "compare_text": oy[max(0, offset - 20) : offset + 60],
            }
        )
    return {
        "both_completed": len(both),
        "extracted_differ": sum(1 for x, y in both if x.extracted != y.extracted),
        "text_differ": len(differ),
        "first_differences": listed,
    }


class Timer:
    """Context manager measuring wall seconds in ``elapsed``."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.start
