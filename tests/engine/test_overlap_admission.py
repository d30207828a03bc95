"""Overlap scheduling (engine/core/overlap.py) forced on for the CPU against the same engine with it
off while request slots or pages are scarce: a step is launched ahead with requests waiting
only when the synchronous scheduler could admit none of them, so every request is admitted
in the same engine step and the outputs are identical (preemption, more requests than
slots, rows that may end on a token not yet seen, a pool too small for all, arrivals while
saturated); pages back to baseline after every run (the runs: overlap_runs.py)."""

from __future__ import annotations

from overlap_runs import PROMPTS, assert_same_runs, core_of, drive, greedy


def test_preemption_when_pages_run_out_equals_sync(eos_model):
    """24 pages of 4 tokens cannot hold the batch: the overlapped steps stop when the free
    list is short, the synchronous scheduler preempts, the outputs still equal sync's."""
    folder, _ = eos_model
    requests = [(f"r{i}", p, greedy(max_tokens=24, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    off, on = assert_same_runs(folder, requests, num_pages=24, min_ahead=5)
    assert off.stats()["num_preemptions"] > 0
    assert on.stats()["num_preemptions"] == off.stats()["num_preemptions"]


def test_more_requests_than_slots_equal_sync(eos_model):
    """Two request slots, six requests of staggered lengths: while the slots are full and
    no row can end unseen (EOS ignored, no stops) overlap engages with requests waiting; a
    row that ``max_tokens`` ends at N frees its slot for N+1, so that step drains and admits
    the next request exactly when a synchronous run does."""
    folder, _ = eos_model
    requests = [
        (f"r{i}", p, greedy(max_tokens=6 + 4 * i, ignore_eos=True, logprobs=0))
        for i, p in enumerate(PROMPTS)
    ]
    _, on = assert_same_runs(folder, requests, max_running_requests=2, min_saturated=15)
    assert on.stats()["num_preemptions"] == 0


def test_rows_that_may_end_unseen_drain_while_saturated(eos_model):
    """Rows whose end may come from a token the host has not seen yet (EOS, stop ids, stop
    strings) may free a slot at any step: with requests waiting, their steps run in sync
    (outputs still equal sync's); past ``min_tokens`` only (before it no token ends them)."""
    folder, full = eos_model
    requests = [
        ("eos", PROMPTS[0], greedy(max_tokens=30)),  # EOS at its 7th token
        ("len", PROMPTS[1], greedy(max_tokens=12, ignore_eos=True)),
        ("stop-id", PROMPTS[0], greedy(max_tokens=30, ignore_eos=True, stop_token_ids=[full[4]])),
        ("wait", PROMPTS[2], greedy(max_tokens=9, ignore_eos=True)),
    ]
    _, on = assert_same_runs(folder, requests, max_running_requests=2)
    assert on.stats()["overlap_ahead_steps"] > 0  # once "wait" runs, nothing waits
    saturated = [0]
    drive(core_of(folder, True, max_running_requests=2), requests, saturated=saturated)
    assert saturated[0] == 0
    # a stop string counts only past min_tokens: before that both rows overlap while
    # "wait" waits (stop strings keep a row plain greedy; EOS is ignored)
    probe = drive(
        core_of(folder, False), [("p", PROMPTS[1], greedy(max_tokens=24, ignore_eos=True))]
    )[1]
    text = probe["p"][1]
    stop = text[-len(text) // 4 :][:3]
    requests = [
        ("min", PROMPTS[1], greedy(max_tokens=24, min_tokens=12, ignore_eos=True, stop=[stop])),
        ("len", PROMPTS[3], greedy(max_tokens=16, ignore_eos=True)),
        ("wait", PROMPTS[2], greedy(max_tokens=9, ignore_eos=True)),
    ]
    assert_same_runs(folder, requests, max_running_requests=2, min_saturated=8)


def test_pool_too_small_for_all_equal_sync(eos_model):
    """A pool of 16 pages of 4 tokens: a 52-token prompt (13 pages) waits until both running
    rows ended (``max_tokens`` frees their pages), so meanwhile they overlap; it is admitted
    in the step a synchronous run admits it, and a request sharing its prefix (matched
    pages, held) joins it as in sync.  No preemption in either run."""
    folder, _ = eos_model
    long = [1 + (11 * j) % 300 for j in range(52)]
    requests = [
        ("r0", PROMPTS[0], greedy(max_tokens=20, ignore_eos=True)),
        ("r1", PROMPTS[2], greedy(max_tokens=14, ignore_eos=True, logprobs=0)),
        ("long", long, greedy(max_tokens=4, ignore_eos=True)),
        ("shared", long[:40] + [5, 6, 7], greedy(max_tokens=4, ignore_eos=True)),
        ("tail", PROMPTS[1], greedy(max_tokens=9, ignore_eos=True)),
    ]
    off, on = assert_same_runs(folder, requests, num_pages=16, min_saturated=10)
    assert on.stats()["prefix_cache_hit_tokens"] >= 40
    assert on.stats()["num_preemptions"] == 0


def test_staggered_arrivals_while_saturated_equal_sync(eos_model):
    """Requests arriving while every slot is taken join the queue without draining the
    pipeline (they could not be admitted anyway) and are admitted when a slot frees."""
    folder, _ = eos_model

    def add(rid, prompt, **kw):
        return lambda core: core.add_request(rid, prompt, greedy(ignore_eos=True, **kw))

    requests = [
        ("a", PROMPTS[0], greedy(max_tokens=20, ignore_eos=True)),
        ("b", PROMPTS[1], greedy(max_tokens=11, ignore_eos=True)),
    ]
    events = {
        3: add("c", PROMPTS[2], max_tokens=8),
        5: add("d", PROMPTS[3], max_tokens=14, logprobs=0),
        9: add("e", PROMPTS[4], max_tokens=6),
        10: add("f", PROMPTS[5], max_tokens=5),
    }
    assert_same_runs(folder, requests, events, max_running_requests=2, min_saturated=8)
