"""When the serving benchmark sends its requests: Poisson arrivals at the asked rates.

Drawn from seeded generators, so a saved spec repeats the exact same arrival times.
"""

from __future__ import annotations

import math
import random


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
            raise ValueError(f"--request-rate: {part!r} is not a number") from None
        if not rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {part!r}")
        rates.append(rate)
    if not rates:
        raise ValueError("--request-rate: no rate given")
    return tuple(rates)
