"""GSM8K answer extraction and scoring (pure functions); the questions and their prompt format
are ``pdserve/bench/gsm8k_data.py``."""

from __future__ import annotations

import math
import re

from pdserve.bench.gsm8k_data import GSM8KItem, load_gsm8k_test, normalize_number

# A number: thousands groups with commas, or plain digits; optional sign and decimals.
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_AFTER_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_AFTER_ANSWER_IS = re.compile(r"answer is\s*:?\s*\$?\s*(" + _NUMBER + ")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
EXTRACTION_RULE = (
    "the number after the first '####', else after the first 'The answer is', else the last "
    "number; commas and '$' stripped, 18.00 -> 18"
)
_Z95 = 1.959963984540054  # two-sided 95% normal quantile


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
