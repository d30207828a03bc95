"""Workloads of the serving benchmark: what is sent (prompts, lengths) and when (arrivals).

Everything is drawn from seeded generators, so a workload spec saved in the JSON output
repeats the exact same requests and arrival times.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

DATASETS = ("random", "gsm8k", "shared-prefix", "multi-turn")
ENDPOINTS = ("completions", "chat")

# Common English words; each is one token (with its leading space) in the GPT-2 style
# BPE vocabularies of Llama-family tokenizers, so a prompt of N words is about N tokens.
# The server's own count (usage.prompt_tokens) is what the report shows.
_WORDS = tuple(
    [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "are",
        "with",
        "as",
        "his",
        "they",
        "be",
        "at",
        "one",
        "have",
        "this",
        "from",
        "or",
        "had",
        "by",
        "word",
        "but",
        "what",
        "some",
        "we",
        "can",
        "out",
        "other",
        "were",
        "all",
        "there",
        "when",
        "up",
        "use",
        "your",
        "how",
        "said",
        "an",
        "each",
        "she",
        "which",
        "do",
        "their",
        "time",
        "if",
        "will",
        "way",
        "about",
        "many",
        "then",
        "them",
        "write",
        "would",
        "like",
        "so",
        "these",
        "her",
        "long",
        "make",
        "thing",
        "see",
        "him",
        "two",
        "has",
        "look",
        "more",
        "day",
        "could",
        "go",
        "come",
        "did",
        "number",
        "sound",
        "no",
        "most",
        "people",
        "my",
        "over",
        "know",
        "water",
        "than",
        "call",
        "first",
        "who",
        "may",
        "down",
        "side",
        "been",
        "now",
        "find",
        "any",
        "new",
        "work",
        "part",
        "take",
        "get",
        "place",
        "made",
        "live",
        "where",
        "after",
        "back",
        "little",
        "only",
        "round",
        "man",
        "year",
        "came",
        "show",
        "every",
        "good",
        "me",
        "give",
        "our",
        "under",
        "name",
        "very",
        "through",
        "just",
        "form",
        "sentence",
        "great",
        "think",
        "say",
        "help",
        "low",
        "line",
        "differ",
        "turn",
        "cause",
        "much",
        "mean",
        "before",
        "move",
        "right",
        "boy",
        "old",
        "too",
        "same",
        "tell",
        "does",
        "set",
        "three",
        "want",
        "air",
        "well",
        "also",
        "play",
        "small",
        "end",
        "put",
        "home",
        "read",
        "hand",
        "port",
        "large",
        "spell",
        "add",
        "even",
        "land",
        "here",
        "must",
        "big",
        "high",
        "such",
        "follow",
        "act",
        "why",
        "ask",
        "men",
        "change",
        "went",
        "light",
        "kind",
        "off",
        "need",
        "house",
        "picture",
        "try",
        "us",
        "again",
        "animal",
        "point",
        "mother",
        "world",
        "near",
        "build",
        "self",
        "earth",
        "father",
        "head",
        "stand",
        "own",
        "page",
        "should",
        "country",
        "found",
        "answer",
        "school",
        "grow",
        "study",
        "still",
        "learn",
        "plant",
        "cover",
        "food",
        "sun",
        "four",
        "between",
        "state",
        "keep",
        "eye",
        "never",
        "last",
        "let",
        "thought",
        "city",
        "tree",
        "cross",
        "farm",
        "hard",
        "start",
        "might",
        "story",
        "saw",
        "far",
        "sea",
        "draw",
        "left",
        "late",
        "run",
        "while",
        "press",
        "close",
        "night",
        "real",
        "life",
        "few",
        "north",
        "open",
        "seem",
        "together",
        "next",
        "white",
        "children",
        "begin",
        "got",
        "walk",
        "example",
        "ease",
        "paper",
        "group",
        "always",
        "music",
        "those",
        "both",
        "mark",
        "often",
        "letter",
        "until",
        "mile",
        "river",
        "car",
        "feet",
        "care",
        "second",
        "book",
        "carry",
        "took",
        "science",
        "eat",
        "room",
        "friend",
        "began",
        "idea",
        "fish",
        "mountain",
        "stop",
        "once",
        "base",
        "hear",
        "horse",
        "cut",
        "sure",
        "watch",
        "color",
        "face",
        "wood",
        "main",
    ]
)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    prompt: text (completions) or the user message (chat).
    max_tokens: output tokens asked for (exact with ``ignore_eos``).
    expected_input_len: words in a random prompt (≈ tokens), or ``None`` for GSM8K.
    system: the shared system prompt of its group (``shared-prefix``): sent as a system
        message (chat) or before the prompt (completions).
    conversation/turn: ``multi-turn`` only: which conversation, and the turn in it (the
        prompt is that turn's user message; earlier turns and answers come before it).
    """

    index: int
    prompt: str
    max_tokens: int
    expected_input_len: int | None = None
    system: str | None = None
    conversation: int | None = None
    turn: int | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    """What requests to send (the full, repeatable description).

    dataset: ``random`` (word prompts of random length), ``gsm8k`` (test questions),
        ``shared-prefix`` (``num_groups`` groups, each sharing a system prompt of
        ``system_prompt_len`` words, requests of the groups in a seeded random order) or
        ``multi-turn`` (``num_requests / num_turns`` conversations of ``num_turns`` turns;
        each turn sends the whole history, earlier answers included, plus a new message).
    input_len / output_len: mean prompt (per turn, per question) words and output tokens.
    range_ratio: lengths are uniform integers in [len·(1−r), len·(1+r)] (vLLM's
        convention), r in [0, 1).
    endpoint: ``completions`` (raw prompt) or ``chat`` (prompt as one user message);
        ``None`` means ``completions`` for random and ``chat`` for gsm8k.
    ignore_eos: ask the server to generate exactly ``max_tokens`` (pdserve/vLLM/SGLang
        extension field; other servers ignore it).
    seed: seeds the prompt words, the lengths and the Poisson arrivals.
    """

    dataset: str = "random"
    num_requests: int = 64
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    endpoint: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    num_groups: int = 4
    system_prompt_len: int = 1024
    num_turns: int = 4

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.input_len < 1:
            raise ValueError(f"input_len must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.endpoint is not None and self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("num_groups", "system_prompt_len", "num_turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dataset == "multi-turn" and self.endpoint == "completions":
            raise ValueError("endpoint must be chat for the multi-turn dataset")

    @property
    def resolved_endpoint(self) -> str:
        """The endpoint actually used (``completions`` or ``chat``)."""
        if self.endpoint is not None:
            return self.endpoint
        return "chat" if self.dataset in ("gsm8k", "multi-turn") else "completions"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy, with the resolved endpoint."""
        d = asdict(self)
        d["endpoint"] = self.resolved_endpoint
        return d


@dataclass(frozen=True)
class InterferenceSpec:
    """The interference scenario's long-prompt stream: prompt words (≈ tokens) and Poisson rate (req/s)."""

    long_input_len: int = 1024
    long_request_rate: float = 1.0

    def __post_init__(self) -> None:
        if self.long_input_len < 1:
            raise ValueError(f"long_input_len must be >= 1, got {self.long_input_len}")
        if not self.long_request_rate > 0:
            raise ValueError(f"long_request_rate must be > 0, got {self.long_request_rate}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return asdict(self)


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """``n`` integers uniform in [mean·(1−r), mean·(1+r)], each at least 1."""
    lo = max(1, int(math.floor(mean * (1.0 - range_ratio))))
    hi = max(lo, int(math.ceil(mean * (1.0 + range_ratio))))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_prompt(rng: random.Random, num_words: int) -> str:
    """A prompt of ``num_words`` common words drawn with ``rng`` (distinct across requests,
    so prefix caches do not flatter the figures)."""
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def build_requests(spec: WorkloadSpec) -> list[RequestSpec]:
    """The ``spec.num_requests`` requests of a workload, deterministic in ``spec.seed``.

    GSM8K prompts are the test questions in order (cycled when more requests than
    questions are asked for), formatted as ``pdserve eval gsm8k`` does with zero shots.
    """
    rng = random.Random(spec.seed)
    n = spec.num_requests
    out_lens = sample_lengths(rng, spec.output_len, spec.range_ratio, n)
    if spec.dataset == "random":
        in_lens = sample_lengths(rng, spec.input_len, spec.range_ratio, n)
        return [
            RequestSpec(i, random_prompt(rng, in_lens[i]), out_lens[i], in_lens[i])
            for i in range(n)
        ]
    if spec.dataset == "shared-prefix":
        in_lens = sample_lengths(rng, spec.input_len, spec.range_ratio, n)
        systems = [random_prompt(rng, spec.system_prompt_len) for _ in range(spec.num_groups)]
        groups = [i % spec.num_groups for i in range(n)]
        rng.shuffle(groups)  # not round-robin: a round-robin router must not look cache-aware
        return [
            RequestSpec(
                i,
                random_prompt(rng, in_lens[i]),
                out_lens[i],
                in_lens[i] + spec.system_prompt_len,
                system=systems[groups[i]],
            )
            for i in range(n)
        ]
    if spec.dataset == "multi-turn":
        in_lens = sample_lengths(rng, spec.input_len, spec.range_ratio, n)
        return [
            RequestSpec(
                i,
                random_prompt(rng, in_lens[i]),
                out_lens[i],
                in_lens[i],
                conversation=i // spec.num_turns,
                turn=i % spec.num_turns,
            )
            for i in range(n)
        ]
    from pdserve.eval.gsm8k import format_question, load_gsm8k_test

    items = load_gsm8k_test()
    return [
        RequestSpec(i, format_question(items[i % len(items)].question), out_lens[i])
        for i in range(n)
    ]


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival times in seconds from the start for a Poisson process of ``rate`` req/s.

    Inter-arrival gaps are exponential with mean 1/rate, drawn from
    ``random.Random(seed)``; the first request arrives at 0. ``rate = inf`` sends
    everything at once. Raises ``ValueError`` for a rate <= 0.
    """
    if not rate > 0:
        raise ValueError(f"request_rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def parse_rates(text: str) -> tuple[float, ...]:
    """Parse ``--request-rate`` (``"1,2.5,inf"``) into positive floats; ``ValueError`` otherwise."""
    rates = []
    for part in text.split(","):
        part = part.strip()
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"request_rate: {part!r} is not a number") from None
        if not rate > 0:
            raise ValueError(f"request_rate must be > 0, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("request_rate: no rate given")
    return tuple(rates)
