"""Runs of an engine with overlap scheduling forced on against the same engine with it off
(tests/engine/test_overlap*.py): the engines, each request's streaming deltas and final
output, the page checks made after every step, and the comparison of two runs (floats to
1e-4, everything else exact)."""

from __future__ import annotations

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.sampling_params import SamplingParams

PROMPTS = [[1 + (7 * i + j) % 300 for j in range(5 + 3 * i)] for i in range(6)]


def core_of(folder, overlap, num_pages=128, page_size=4, max_model_len=None, **sched):
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=folder, device="cpu", max_model_len=max_model_len),
            cache=CacheConfig(page_size=page_size, num_pages=num_pages),
            scheduler=SchedulerConfig(overlap_schedule=overlap, **sched),
        )
    )


def delta_of(out):
    c = out.outputs[0]
    lps = None if c.delta_logprobs is None else [(t.token_id, t.logprob) for t in c.delta_logprobs]
    return (tuple(c.delta_token_ids), c.delta_text, lps, out.finished, c.finish_reason)


def final_of(out):
    c = out.outputs[0]
    lps = None if c.logprobs is None else [(t.token_id, t.logprob, t.top) for t in c.logprobs]
    return (
        c.token_ids,
        c.text,
        lps,
        c.cumulative_logprob,
        c.finish_reason,
        c.stop_reason,
        out.num_cached_tokens,
        out.error,
    )


def check_pages(core):
    """Page accounting adds up (live requests + pages deferred to launched steps), and every
    page a launched step writes is still held (none freed under a queued step)."""
    launched = core.overlap._launched
    holders = [r.pages for r in core._requests.values()]
    holders += [pages for step in launched for pages in step.deferred]
    core.kv.check_integrity(holders)
    for step in launched:
        for seq in step.plan.seqs:
            assert all(core.kv.refcount(p) > 0 for p in seq.pages), seq.request_id


def drive(
    core, requests, events=None, max_steps=2000, first_steps=None, saturated=None, admitted=None
):
    """Add ``requests`` ((id, prompt, params) triples), step ``core`` until idle, calling
    ``events[k](core)`` before step k; returns (deltas by id, final by id). Checks the pages
    are back to baseline.  ``first_steps`` (a dict) gets the step of each request's first
    output; ``saturated[0]`` (a list) counts the steps launched ahead while a request
    waited; ``admitted`` (a dict) gets the engine step (``stats()["steps"]``, which counts
    launched steps too) that admitted each request (first seen running or with an output):
    with overlap, outputs of launched steps come one ``step`` call later, steps do not."""
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    events = dict(events or {})
    deltas: dict[str, list] = {}
    finals = {}
    for k in range(max_steps):
        if k in events:
            events.pop(k)(core)
        if not core.has_unfinished_requests() and not events:
            assert core.num_free_pages == core.kv.num_pages
            assert core.kv.num_held_pages == 0
            return deltas, finals
        waited, ahead = bool(core.scheduler.waiting), core.overlap.num_ahead
        outs = core.step()
        if saturated is not None and waited:
            saturated[0] += core.overlap.num_ahead - ahead
        if admitted is not None:
            seen = [r.request_id for r in core.scheduler.running] + [o.request_id for o in outs]
            for rid in seen:
                admitted.setdefault(rid, core.stats()["steps"])
        check_pages(core)
        for out in outs:
            if first_steps is not None:
                first_steps.setdefault(out.request_id, k)
            assert out.request_id not in finals, "an output after the final one"
            deltas.setdefault(out.request_id, []).append(delta_of(out))
            if out.finished:
                finals[out.request_id] = final_of(out)
    raise AssertionError("the engine did not become idle")


def assert_same(a, b, path="out"):
    """``a == b`` where every float may differ by 1e-4 (a logprob; a cumulative one 1e-3):
    a step's batch differs with overlap (a row computed in vain, a request joining one step
    later), which moves fp32 results in the last bits; tokens, text and reasons are exact."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) < (1e-3 if abs(a) > 1 else 1e-4), (path, a, b)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert a == b, (path, a, b)


def assert_same_runs(folder, requests, events=None, min_ahead=1, min_saturated=0, **kw):
    """The run with overlap forced on equals the run with it off (and every request is
    admitted in the same engine step); at least ``min_saturated`` steps were launched ahead
    while a request waited; returns both cores."""
    cores = {}
    runs = {}
    admitted: dict[bool, dict[str, int]] = {False: {}, True: {}}
    saturated = {False: [0], True: [0]}
    for overlap in (False, True):
        cores[overlap] = core_of(folder, overlap, **kw)
        runs[overlap] = drive(
            cores[overlap],
            requests,
            events,
            saturated=saturated[overlap],
            admitted=admitted[overlap],
        )
    (d_off, f_off), (d_on, f_on) = runs[False], runs[True]
    assert_same(f_on, f_off)
    assert_same(d_on, d_off, "deltas")
    assert admitted[True] == admitted[False], "a request admitted in another step than in sync"
    assert saturated[True][0] >= min_saturated, saturated[True][0]
    for key in ("num_preemptions", "prompt_tokens_computed", "prefix_cache_hit_tokens"):
        assert cores[True].stats()[key] == cores[False].stats()[key], key
    assert cores[False].stats()["overlap_launched_steps"] == 0
    assert cores[True].stats()["overlap_ahead_steps"] >= min_ahead
    assert cores[True].stats()["generation_tokens"] == cores[False].stats()["generation_tokens"]
    return cores[False], cores[True]


def greedy(**kw):
    return SamplingParams(temperature=0, **kw)
