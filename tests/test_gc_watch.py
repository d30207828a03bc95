"""GcWatch: every collection timed into the histogram, slow ones logged, the heap frozen."""

from __future__ import annotations

import gc
import logging

import pytest

from pdserve import gc_watch
from pdserve.gc_watch import PAUSE_BUCKETS, GcWatch


@pytest.fixture
def watch():
    # the process's own watch, when an in-process test before this one started it (bench
    # offline, the offline LLM) and froze the heap, would log these collections as
    # warnings too: it is set aside while this one is looked at
    other = gc_watch._PROCESS
    if other is not None:
        other.uninstall()
    w = GcWatch(slow_s=1e-9).install()  # every pause is "slow": each one is logged
    yield w
    w.uninstall()
    gc.unfreeze()
    if other is not None:
        other.install()


def test_collections_are_timed_by_generation_and_logged(watch, caplog):
    with caplog.at_level(logging.DEBUG, logger="pdserve.gc_watch"):
        gc.collect(0)
        gc.collect(2)
    # before the freeze (start-up, a short command) a slow pause is debug, not a warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("generation-2 collection paused" in r.message for r in caplog.records)
    caplog.clear()
    watch.freeze()  # serving from here: a slow pause is a warning
    with caplog.at_level(logging.WARNING, logger="pdserve.gc_watch"):
        gc.collect(0)
        gc.collect(2)
    s = watch.stats()
    assert s["collections"]["0"] >= 1 and s["collections"]["2"] >= 1
    hist = s["pause_seconds"]
    assert hist["count"] == sum(s["collections"].values()) >= 2
    assert list(hist["buckets"]) == [*map(str, PAUSE_BUCKETS), "+Inf"]
    assert hist["buckets"]["+Inf"] == hist["count"]  # cumulative
    counts = list(hist["buckets"].values())
    assert counts == sorted(counts)
    assert 0 < s["max_pause_seconds"] <= hist["sum"]
    assert any("generation-2 collection paused" in r.message for r in caplog.records)


def test_freeze_moves_the_heap_to_the_permanent_generation(watch):
    kept = [[i] for i in range(1000)]  # tracked containers alive now
    gc.collect()
    assert watch.stats()["collections"]["2"] >= 1
    n = watch.freeze()
    assert n >= gc.get_freeze_count() >= len(kept)  # frozen objects freed by refcount leave it
    s = watch.stats()
    assert s["frozen_objects"] == n and s["startup_full_collection_seconds"] > 0
    # start-up's collections (and the freeze's own) are not counted: serving starts at 0
    assert s["collections"] == {"0": 0, "1": 0, "2": 0} and s["max_pause_seconds"] == 0
    assert s["pause_seconds"]["count"] == 0
    gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_thaw_returns_the_heap_and_quiets_the_warning(watch, caplog):
    kept = [[i] for i in range(1000)]
    watch.freeze()
    assert gc.get_freeze_count() >= len(kept)
    watch.thaw()  # a bench dropping its engine: its collection is expected
    assert gc.get_freeze_count() == 0 and watch.stats()["frozen_objects"] == 0
    with caplog.at_level(logging.DEBUG, logger="pdserve.gc_watch"):
        gc.collect(2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("generation-2 collection paused" in r.message for r in caplog.records)
    assert watch.stats()["collections"]["2"] >= 1  # still counted


def test_uninstalled_watch_counts_nothing_and_bad_threshold_is_refused():
    w = GcWatch().install()
    w.uninstall()
    gc.collect()
    assert w.stats()["pause_seconds"]["count"] == 0
    with pytest.raises(ValueError, match="slow_s"):
        GcWatch(slow_s=0)
