"""Python's garbage collector in a serving process: frozen after start-up, every pause timed.

CPython's cyclic collector runs in whichever thread allocates past a threshold and holds
the GIL while it walks the generation it collects, so the engine thread (scheduling, the
step's host work) and the event loop (streaming, the router's relay) both stand still for
its duration. A full collection walks every tracked container object of the process; a
worker holds hundreds of thousands of them from start-up (the model's modules and
parameters, the tokenizer's vocabulary, Triton's and torch's caches) that live as long as
the process. :meth:`GcWatch.freeze` (``gc.freeze()``, after a ``gc.collect()``) moves them
to the permanent generation, which later collections skip, so a collection costs what the
requests allocate. vLLM and SGLang freeze the heap after start-up too.

:class:`GcWatch` also times every collection (``gc.callbacks``): a pause of at least
``slow_s`` is logged naming its generation (a warning once the heap is frozen, that is
while serving; at debug level during start-up and in short commands that never freeze,
where loading a model pauses the process by design), and the pauses are a histogram in
``/metrics`` (``pdserve_gc_pause_seconds``) and in ``/get_server_info`` (``gc``), so a
latency stall can be matched against them.

A leaf: imports nothing of pdserve.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time

logger = logging.getLogger(__name__)

# Upper bounds (seconds) of the pause histogram's buckets.
PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def freeze_heap() -> tuple[int, float]:
    """Collect once, then move every object left to the garbage collector's permanent
    generation (``gc.freeze``): later generation-2 collections walk only what was made
    since, not a loaded model's, tokenizer's and caches' objects. Returns the objects
    frozen and the seconds the collection took (what each full collection would have
    stopped the process for without the freeze)."""
    t0 = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - t0
    gc.freeze()
    return gc.get_freeze_count(), seconds


class GcWatch:
    """Times the process's garbage collections and freezes its start-up heap.

    slow_s: a pause at least this long (seconds) is logged: a warning after :meth:`freeze`
    (serving), debug before it (start-up). One per process
    (:meth:`install` adds the callback, :meth:`uninstall` removes it); :meth:`stats` may be
    read from any thread.
    """

    def __init__(self, slow_s: float = 0.05) -> None:
        if not slow_s > 0:
            raise ValueError(f"slow_s must be > 0, got {slow_s!r}")
        self.slow_s = slow_s
        self._start: float | None = None
        self._frozen = 0
        self._full_s = 0.0
        self._reset()

    def _reset(self) -> None:
        """Counts and pauses from now on."""
        self._collections = [0, 0, 0]
        self._counts = [0] * (len(PAUSE_BUCKETS) + 1)  # per bucket, the last is +Inf
        self._sum = self._max = 0.0

    def install(self) -> GcWatch:
        """Start timing collections; returns self."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        """Stop timing collections."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def freeze(self) -> int:
        """Collect once, then move every object left to the permanent generation (later
        collections skip them), and start the counts and pauses afresh (they describe
        serving, not start-up). Call when start-up is over (model loaded, graphs captured,
        before the first request). Returns how many objects are frozen."""
        self._frozen, self._full_s = freeze_heap()
        # what is measured from here on is serving: start-up's collections (this one's
        # walk of the whole heap too) are not counted
        self._reset()
        logger.info(
            "gc: %d start-up objects frozen (a full collection of them took %.0f ms: what "
            "each generation-2 collection would stop the process for without the freeze)",
            self._frozen,
            self._full_s * 1e3,
        )
        return self._frozen

    def thaw(self) -> None:
        """Serving is over (a bench tearing its engine down): the frozen objects go back to
        the collector's generations (``gc.unfreeze``), so a dropped engine's can be freed,
        and a slow pause is logged at debug again, as during start-up (the full collection
        that frees a dropped engine is expected, not a stall). Counts and pauses are
        kept."""
        gc.unfreeze()
        self._frozen = 0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        if self._start is None:  # installed during a collection
            return
        pause = time.perf_counter() - self._start
        self._start = None
        generation = int(info.get("generation", 2))
        self._collections[generation] += 1
        self._counts[bisect.bisect_left(PAUSE_BUCKETS, pause)] += 1
        self._sum += pause
        self._max = max(self._max, pause)
        if pause >= self.slow_s:
            logger.log(
                logging.WARNING if self._frozen else logging.DEBUG,
                "gc: a generation-%d collection paused the process for %.1f ms "
                "(%d objects collected, %d uncollectable)",
                generation,
                pause * 1e3,
                info.get("collected", 0),
                info.get("uncollectable", 0),
            )

    def stats(self) -> dict:
        """``{"frozen_objects", "startup_full_collection_seconds" (the freeze's own full
        collection: what one costs without it), "collections": {"0", "1", "2"},
        "pause_seconds": {"sum",
        "count", "buckets": {upper bound or "+Inf": cumulative count}},
        "max_pause_seconds"}``
        (the histogram form ``server/metrics.py`` exports)."""
        cumulative, buckets = 0, {}
        for bound, n in zip([*map(str, PAUSE_BUCKETS), "+Inf"], self._counts):
            cumulative += n
            buckets[bound] = cumulative
        return {
            "frozen_objects": self._frozen,
            "startup_full_collection_seconds": self._full_s,
            "collections": {str(g): n for g, n in enumerate(self._collections)},
            "pause_seconds": {"sum": self._sum, "count": cumulative, "buckets": buckets},
            "max_pause_seconds": self._max,
        }


_PROCESS: GcWatch | None = None


def process_watch() -> GcWatch:
    """The process's one installed :class:`GcWatch` (created on the first call), so that
    several servers built in one process (tests) share one callback."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = GcWatch().install()
    return _PROCESS


def process_stats() -> dict | None:
    """:meth:`GcWatch.stats` of the process's watch, ``None`` when it has none (an app
    built inside another program, such as a test, that did not start one)."""
    return None if _PROCESS is None else _PROCESS.stats()
