"""Load-balancing policies: which worker of one role gets the next request.

``cache_aware`` follows SGLang's gateway: the router keeps, per worker, an approximate
index of the prompts it routed there, and sends a request to the worker whose index holds
the longest prefix of its prompt, unless the load is out of balance (then the least
loaded worker).  The index is built from routing decisions alone (no event channel from
the workers, no tokenizer in the router), so a burst of requests sharing a prompt sticks
to one worker from its first request on, and it works for mixed workers as for prefill
ones.  It is approximate: the worker may have evicted what the index still lists.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
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
    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        """Return one of ``workers`` (never empty).  ``key``: the request's prompt as text
        (:func:`routing_key`), used by ``cache_aware`` only; ``None`` when unknown."""

    def forget(self, url: str) -> None:
        """The worker at ``url`` left the pool: drop what the policy keeps about it (a
        worker added again at that URL starts afresh, its cache empty)."""
        return None  # only cache_aware keeps anything per worker


class RandomPolicy(Policy):
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        return self._rng.choice(list(workers))


class RoundRobinPolicy(Policy):
    """Cycles over the workers in URL order; skips ejected ones."""

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        chosen = workers[self._next % len(workers)]
        self._next += 1
        return chosen


class PowerOfTwoPolicy(Policy):
    """Two random picks, the one with fewer outstanding requests wins (Mitzenmacher's
    power of two choices)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.outstanding <= b.outstanding else b


def _block_keys(text: str, block_chars: int) -> list[bytes]:
    """Chained blake2b keys of ``text`` in blocks of ``block_chars`` characters (the last
    block may be shorter): key ``i`` names the whole prefix up to the end of block ``i``."""
    keys, parent = [], b""
    data = text.encode("utf-8", "surrogatepass")
    step = block_chars  # bytes, approximately characters for ASCII-heavy prompts
    for start in range(0, len(data), step):
        parent = hashlib.blake2b(parent + data[start : start + step], digest_size=16).digest()
        keys.append(parent)
    return keys


class CacheAwarePolicy(Policy):
    """SGLang-gateway-style cache-aware routing over an approximate per-worker prefix index.

    Per pick: when ``max_load - min_load > balance_abs_threshold`` and ``max_load >
    balance_rel_threshold * min_load`` (load = outstanding requests), the least loaded
    worker; otherwise, when the best worker's index holds more than ``cache_threshold`` of
    the prompt's blocks, that worker (ties: least loaded), else the worker with the
    smallest index (the most room for a new prefix; ties: least loaded).  The chosen
    worker's index then records the prompt's blocks (LRU, at most ``max_blocks`` per
    worker).  Defaults are SGLang router's (cache_threshold 0.5, balance_abs_threshold 32,
    balance_rel_threshold 1.0001).
    """

    def __init__(
        self,
        rng: random.Random,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        block_chars: int = 64,
        max_blocks: int = 1 << 16,
    ) -> None:
        self._rng = rng
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._index: dict[str, OrderedDict[bytes, None]] = {}

    def forget(self, url: str) -> None:
        self._index.pop(url, None)

    def indexed_urls(self) -> set[str]:
        """URLs of the workers the index holds prompts of."""
        return set(self._index)

    def matched_blocks(self, worker: WorkerState, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` the index of ``worker`` holds."""
        index = self._index.get(worker.url)
        n = 0
        while index is not None and n < len(keys) and keys[n] in index:
            n += 1
        return n

    def pick(self, workers: Sequence[WorkerState], key: str | None = None) -> WorkerState:
        workers = list(workers)
        least = min(workers, key=lambda w: w.outstanding)
        if len(workers) == 1 or key is None:
            chosen = least
            keys: list[bytes] = [] if key is None else _block_keys(key, self.block_chars)
        else:
            keys = _block_keys(key, self.block_chars)
            loads = [w.outstanding for w in workers]
            hi, lo = max(loads), min(loads)
            if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
                chosen = least
            else:
                matched = {w.url: self.matched_blocks(w, keys) for w in workers}
                best = max(matched.values())
                if keys and best / len(keys) > self.cache_threshold:
                    chosen = min(
                        (w for w in workers if matched[w.url] == best),
                        key=lambda w: w.outstanding,
                    )
                else:
                    chosen = min(
                        workers,
                        key=lambda w: (len(self._index.get(w.url, ())), w.outstanding),
                    )
        self._record(chosen, keys)
        return chosen

    def _record(self, worker: WorkerState, keys: Sequence[bytes]) -> None:
        index = self._index.setdefault(worker.url, OrderedDict())
        for k in keys:
            index[k] = None
            index.move_to_end(k)
        while len(index) > self.max_blocks:
            index.popitem(last=False)


def routing_key(endpoint: str, body: dict) -> str | None:
    """The prompt of a client request as text, for ``cache_aware``: ``/generate``'s
    ``text`` or ``input_ids``, ``/v1/completions``' ``prompt`` (the first one of a list),
    ``/v1/chat/completions``' ``messages`` (role and content of each, in order, so a
    growing conversation keeps its prefix).  ``None`` when absent or of another shape
    (the worker answers that with a 400)."""
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role')}>{_text_of(m.get('content'))}")
        return "\n".join(parts)
    prompt = (
        body.get("text", body.get("input_ids")) if endpoint == "/generate" else body.get("prompt")
    )
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    return _text_of(prompt) or None


def _text_of(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # token ids, or OpenAI content parts
        return " ".join(str(v.get("text", "")) if isinstance(v, dict) else str(v) for v in value)
    return ""


_POLICIES: dict[str, Callable[[random.Random], Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "cache_aware": CacheAwarePolicy,
}


def create_policy(name: str, rng: random.Random | None = None) -> Policy:
    """Build the policy called ``name``; ValueError naming ``policy`` if unknown."""
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(_POLICIES)}, got {name!r}") from None
    return cls(rng or random.Random())
