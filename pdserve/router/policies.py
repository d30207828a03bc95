"""Load-balancing policies: which worker of one role gets the next request."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerState:
    """What the router knows about one worker (mutated only on the router's event loop).

    outstanding: requests dispatched to it and not yet answered.
    server_info: the worker's last ``/get_server_info`` JSON (prefill: bootstrap port).
    """

    url: str
    role: str  # "prefill", "decode" or "mixed"
    healthy: bool = False
    consecutive_failures: int = 0
    outstanding: int = 0
    last_error: str | None = None
    server_info: dict[str, Any] = field(default_factory=dict)


class Policy(ABC):
    """Picks one worker from a non-empty sequence of healthy workers."""

    @abstractmethod
    def pick(self, workers: Sequence[WorkerState]) -> WorkerState:
        """Return one of ``workers`` (never empty)."""


class RandomPolicy(Policy):
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, workers: Sequence[WorkerState]) -> WorkerState:
        return self._rng.choice(list(workers))


class RoundRobinPolicy(Policy):
    """Cycles over the workers in URL order; skips ejected ones."""

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def pick(self, workers: Sequence[WorkerState]) -> WorkerState:
        chosen = workers[self._next % len(workers)]
        self._next += 1
        return chosen


class PowerOfTwoPolicy(Policy):
    """Two random picks, the one with fewer outstanding requests wins (Mitzenmacher's
    power of two choices)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, workers: Sequence[WorkerState]) -> WorkerState:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.outstanding <= b.outstanding else b


_POLICIES: dict[str, type[Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "power_of_two": PowerOfTwoPolicy,
}


def create_policy(name: str, rng: random.Random | None = None) -> Policy:
    """Build the policy called ``name``; ValueError naming ``policy`` if unknown."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(_POLICIES)}, got {name!r}") from None
    return cls(rng or random.Random())
