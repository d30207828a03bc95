"""The drafter a scheduler config asks for (``SchedulerConfig.speculative_algorithm``)."""

from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.engine.spec.drafter import Drafter, NgramDrafter


def make_drafter(config: SchedulerConfig) -> Drafter | None:
    """The drafter of ``config``, or ``None`` when speculation is off.  ValueError naming
    ``speculative_algorithm`` for an algorithm this build cannot run."""
    algo = config.speculative_algorithm
    if algo is None:
        return None
    if algo == "ngram":
        return NgramDrafter(
            config.num_speculative_tokens,
            config.speculative_ngram_min,
            config.speculative_ngram_max,
        )
    raise ValueError(f"speculative_algorithm {algo!r} is not available in this build")
