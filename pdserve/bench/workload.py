"""What the serving benchmark sends: the workload spec (dataset, lengths, endpoint) and the
requests it stands for (prompts from :mod:`pdserve.bench.prompts`; arrival times are
:mod:`pdserve.bench.arrivals`).

Everything is drawn from seeded generators, so a workload spec saved in the JSON output
repeats the exact same requests.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.bench.prompts import random_prompt, sample_lengths
from pdserve.bounds import check_min

DATASETS = ("random", "gsm8k", "shared-prefix", "multi-turn")
ENDPOINTS = ("completions", "chat")


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
    phase_timing: ask for each request's per-phase timings (pdserve's ``return_timing``
        field; sent only when true) so the report breaks TTFT down by phase.
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
    phase_timing: bool = False

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        check_min(self, 1, "num_requests", "input_len", "output_len")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.endpoint is not None and self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        check_min(self, 0, "temperature")
        check_min(self, 1, "num_groups", "system_prompt_len", "num_turns")
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
        check_min(self, 1, "long_input_len")
        check_min(self, 0, "long_request_rate", above=True)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return asdict(self)


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
    from pdserve.bench.gsm8k_data import format_question, load_gsm8k_test

    items = load_gsm8k_test()
    return [
        RequestSpec(i, format_question(items[i % len(items)].question), out_lens[i])
        for i in range(n)
    ]
