"""``SamplingParams``: how one request is sampled and when it stops (vLLM's field names)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.disagg.base import MAX_TOP_LOGPROBS
from pdserve.engine.structured.params import StructuredOutputsParams


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a request's seed: a signed 64-bit integer
_MASK64 = 2**64 - 1


def _wrap64(value: int) -> int:
    """``value`` wrapped into the signed 64-bit range (``seed + i`` of sample ``i``)."""
    return (value - SEED_MIN) % 2**64 + SEED_MIN


def generator_seed(seed: int) -> int:
    """The torch generator seed of a request's ``seed``: splitmix64 of its 64 bits, so that
    seeds differing in any bit (also only in the high 32, which a CPU generator's
    ``manual_seed`` ignores) start different streams. Every role uses it: a seeded request
    samples the same through PD as on a mixed worker."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping options of one request (OpenAI / vLLM semantics).

    n: samples per prompt; each becomes its own engine request (see :meth:`fan_out`).
    temperature: 0 means greedy (exact argmax); > 0 divides the logits.
    top_p: nucleus mass in (0, 1]; 1 disables.  top_k: keep the k best tokens; 0 or -1 disables.
    min_p: drop tokens whose probability is below ``min_p`` times the best one's; 0 disables.
    max_tokens: most tokens to generate; ``None`` means up to the context limit.
    min_tokens: tokens to generate before EOS, ``stop_token_ids`` or ``stop`` may end the request.
    stop: strings that end the request; the matched string is not part of the output text.
    stop_token_ids: token ids that end the request (the id stays in ``token_ids``).
    ignore_eos: keep generating past EOS tokens.
    seed: per-request seed; the same seed gives the same tokens whatever the batch.
    logprobs: top alternatives per output token (0 = only the sampled token's logprob;
        ``None`` = none), at most ``MAX_TOP_LOGPROBS``.
    prompt_logprobs: the same for every prompt token (the first one has none).
    skip_special_tokens: leave special tokens out of the output text.
    presence_penalty / frequency_penalty: in [-2, 2]; subtracted from the logit of every
        token already generated, once (presence) and per occurrence (frequency) — OpenAI's
        definition, over the output tokens only.
    repetition_penalty: > 0, 1 disables; a logit of a token seen in the prompt or the output
        is divided by it when positive, multiplied when negative (transformers'
        ``RepetitionPenaltyLogitsProcessor``, from the CTRL paper, Keskar et al. 2019).
    logit_bias: token id -> bias in [-100, 100] added to that token's logit (OpenAI); a
        mapping (JSON object keys may be strings of digits) or ``(id, bias)`` pairs, stored
        as sorted pairs.  Ids are checked against the vocabulary by the engine.

    All four change which token is chosen, never the reported logprobs (those stay the raw
    model's, as OpenAI and vLLM report them).
    structured_outputs: a constraint the output must match (JSON schema, JSON object,
        regex, choice, EBNF grammar; ``engine/structured/``), or ``None``.

    Raises ``ValueError`` naming the field for any out-of-range or wrongly typed value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an integer >= 0 (0 or -1 disable it), got {self.top_k!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        object.__setattr__(self, "stop", self._check_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._check_stop_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64), got {self.seed!r}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}"
                )
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be a boolean, got {self.skip_special_tokens!r}"
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or None, got {so!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if not _is_number(rep) or not 0 < rep < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rep!r}")
        object.__setattr__(self, "logit_bias", self._check_logit_bias(self.logit_bias))

    @staticmethod
    def _check_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
        if bias is None:
            return ()
        if isinstance(bias, Mapping):
            items = list(bias.items())
        elif isinstance(bias, (list, tuple)):
            items = list(bias)
        else:
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        out: dict[int, float] = {}
        for item in items:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
            key, value = item
            if isinstance(key, str) and key.isdigit():
                key = int(key)
            if not _is_int(key) or key < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            if not _is_number(value) or not -100 <= value <= 100:
                raise ValueError(
                    f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key}"
                )
            out[key] = float(value)
        return tuple(sorted(out.items()))

    @staticmethod
    def _check_stop(stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in items):
            raise ValueError("stop must not contain an empty string")
        return tuple(items)

    @staticmethod
    def _check_stop_token_ids(ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {ids!r}")
        return tuple(ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as validated: sorted ``(token id, bias)`` pairs."""
        return self.logit_bias  # type: ignore[return-value]  # normalised in __post_init__

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the token history (a penalty is not neutral)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def fan_out(self, request_id: str) -> list[tuple[str, SamplingParams]]:
        """Split an ``n``-sample request into ``n`` single-sample engine requests.

        Sample ``i`` gets the id ``sample_request_id(request_id, i)`` and, when ``seed`` is
        set, the seed ``seed + i`` (wrapped into int64; so the samples differ yet each is reproducible).  With
        ``n == 1`` the id and params are returned unchanged.
        """
        if self.n == 1:
            return [(request_id, self)]
        return [
            (
                sample_request_id(request_id, i),
                replace(self, n=1, seed=None if self.seed is None else _wrap64(self.seed + i)),
            )
            for i in range(self.n)
        ]


def sample_request_id(request_id: str, index: int) -> str:
    """Engine request id of sample ``index`` of a fanned-out request: ``"{request_id}#{index}"``."""
    return f"{request_id}#{index}"
