"""Overlap scheduling (engine/core/overlap.py) forced on for the CPU against the same engine with it
off: identical outputs (token ids, text, logprobs, finish reasons, usage and every streaming
delta) over EOS mid-batch, stop strings and stop ids, staggered max_tokens, max_model_len,
plain and non-plain rows, arrivals mid-decode, aborts during a launched step, the PD decode
role; pages back to baseline after every run.  Admission while slots or pages are scarce:
test_overlap_admission.py; the runs and their comparison: overlap_runs.py."""

from __future__ import annotations

import argparse

import pytest
from overlap_runs import (
    PROMPTS,
    assert_same,
    assert_same_runs,
    check_pages,
    core_of,
    delta_of,
    drive,
    final_of,
    greedy,
)

from pdserve.disagg.fake import FakeKVManager, link
from pdserve.engine.core.request import DisaggRequestInfo
from pdserve.engine.sampling_params import SamplingParams
from pdserve.server.engine_args import add_engine_args, engine_argv, engine_config_from_args


def test_eos_stops_and_staggered_lengths_equal_sync(eos_model):
    folder, full = eos_model
    requests = [
        ("eos", PROMPTS[0], greedy(max_tokens=30, logprobs=0)),  # EOS at token 7
        ("long", PROMPTS[1], greedy(max_tokens=40, ignore_eos=True)),
        ("short", PROMPTS[2], greedy(max_tokens=3, ignore_eos=True)),
        ("mid", PROMPTS[3], greedy(max_tokens=17, ignore_eos=True, logprobs=0)),
        ("stop-id", PROMPTS[0], greedy(max_tokens=30, ignore_eos=True, stop_token_ids=[full[4]])),
        ("one", PROMPTS[4], greedy(max_tokens=1)),
        ("eos-or-len", PROMPTS[5], greedy(max_tokens=25)),
    ]
    _, on = assert_same_runs(folder, requests, min_ahead=10)
    runs = drive(core_of(folder, True), requests)[1]
    assert runs["eos"][4] == "stop" and runs["eos"][0] == full[:7]
    assert runs["stop-id"][4:6] == ("stop", full[4]) and runs["stop-id"][0] == full[:5]
    assert runs["long"][4] == "length" and len(runs["long"][0]) == 40


def test_stop_strings_and_max_model_len_equal_sync(eos_model):
    folder, _ = eos_model
    probe = drive(
        core_of(folder, False), [("p", PROMPTS[1], greedy(max_tokens=20, ignore_eos=True))]
    )[1]
    text = probe["p"][1]
    stop = text[len(text) // 3 : len(text) // 3 + 3]
    assert stop.strip()
    requests = [
        ("stop-str", PROMPTS[1], greedy(max_tokens=20, ignore_eos=True, stop=[stop])),
        ("ctx", PROMPTS[2], greedy(ignore_eos=True, max_tokens=None)),  # runs to max_model_len
        ("other", PROMPTS[3], greedy(max_tokens=20, ignore_eos=True)),
    ]
    _, on = assert_same_runs(folder, requests, max_model_len=40)
    finals = drive(core_of(folder, True, max_model_len=40), requests)[1]
    assert finals["stop-str"][4:6] == ("stop", stop) and stop not in finals["stop-str"][1]
    assert finals["ctx"][4] == "length" and len(PROMPTS[2]) + len(finals["ctx"][0]) == 40


def test_plain_and_non_plain_rows_equal_sync(eos_model):
    """Rows that are not plain greedy (top logprobs, seeded and unseeded sampling, penalties,
    logit bias, min_tokens bans) run their steps in sync; the plain ones overlap once they
    are alone."""
    folder, _ = eos_model
    requests = [
        ("plain", PROMPTS[0], greedy(max_tokens=24, ignore_eos=True, logprobs=0)),
        ("top", PROMPTS[1], greedy(max_tokens=4, logprobs=2)),
        ("seeded", PROMPTS[2], SamplingParams(temperature=0.8, seed=5, max_tokens=6)),
        ("unseeded", PROMPTS[3], SamplingParams(temperature=0.8, max_tokens=5)),
        ("penalty", PROMPTS[4], greedy(max_tokens=7, repetition_penalty=1.3)),
        ("bias", PROMPTS[5], greedy(max_tokens=3, logit_bias={5: 2.0})),
        ("min", PROMPTS[0], greedy(max_tokens=20, min_tokens=10)),  # bans until 10 tokens
    ]
    assert_same_runs(folder, requests, min_ahead=5)


def test_arrivals_mid_decode_equal_sync(eos_model):
    """A request arriving while a step is launched drains the pipeline and is scheduled in a
    mixed step (no TTFT cost); overlap resumes afterwards."""
    folder, _ = eos_model

    def add(rid, prompt, **kw):
        return lambda core: core.add_request(rid, prompt, greedy(ignore_eos=True, **kw))

    requests = [("first", PROMPTS[0], greedy(max_tokens=30, ignore_eos=True))]
    events = {
        4: add("second", PROMPTS[1], max_tokens=12),
        5: add("third", PROMPTS[2], max_tokens=20, logprobs=0),
        13: add("fourth", PROMPTS[3], max_tokens=5),
    }
    assert_same_runs(folder, requests, events, min_ahead=10)
    # no TTFT cost: an arrival's first token comes in the step call it was added before, as
    # in a synchronous run (the launched step is drained, the arrival prefilled at once)
    for overlap in (False, True):
        first: dict[str, int] = {}
        drive(core_of(folder, overlap), requests, events, first_steps=first)
        assert (first["second"], first["third"], first["fourth"]) == (4, 5, 13), overlap


def test_abort_during_a_launched_step(eos_model):
    folder, _ = eos_model
    core = core_of(folder, True)
    params = greedy(max_tokens=30, ignore_eos=True)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1]), ("c", PROMPTS[2])):
        core.add_request(rid, prompt, params)
    seen: dict[str, int] = {}
    while core.stats()["overlap_ahead_steps"] < 3:
        for out in core.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
    assert core.overlap.pending
    b = core._requests["b"]
    held = core.kv.num_held_pages
    pages = list(b.pages)
    core.abort_request("b")  # its row is in the launched step: its pages stay held
    assert b.finish_reason == "abort" and b.pages == []
    assert core.kv.num_held_pages == held and all(core.kv.refcount(p) == 1 for p in pages)
    check_pages(core)
    finals = {}
    while core.has_unfinished_requests():
        outs = core.step()
        check_pages(core)
        for out in outs:
            assert out.request_id != "b", "an aborted request emits nothing"
            if out.finished:
                finals[out.request_id] = final_of(out)
    assert core.num_free_pages == core.kv.num_pages and core.kv.num_held_pages == 0
    ref = drive(core_of(folder, False), [("a", PROMPTS[0], params), ("c", PROMPTS[2], params)])
    assert_same(finals, ref[1])
    # every request aborted while a step is launched: the last abort collects it (no row is
    # live), so nothing is held and nothing waits, as after a synchronous run's aborts
    for rid in ("x", "y"):
        core.add_request(rid, PROMPTS[3], params)
    ahead = core.stats()["overlap_ahead_steps"]
    while core.stats()["overlap_ahead_steps"] < ahead + 2:
        core.step()
    core.abort_request("x")
    assert core.overlap.pending and core.has_unfinished_requests()  # y's row is live
    core.abort_request("y")
    assert not core.overlap.pending and not core.has_unfinished_requests()
    assert core.num_free_pages == core.kv.num_pages and core.kv.num_held_pages == 0
    assert core.step() == []


def _abort_then_share(folder, overlap, abort_after, other, share=None):
    """Request "a" (and "o" when ``other``) decoding; "a" aborted after ``abort_after``
    step calls, then "b" sharing ``share`` (default: "a"'s tokens so far) plus 3 tokens.
    Returns (a's tokens at the abort, a launched step held a's row, pages no request holds
    and cached pages right after the abort, b's final, the prefix cache once idle)."""
    core = core_of(folder, overlap)
    params = greedy(max_tokens=30, ignore_eos=True)
    core.add_request("a", PROMPTS[3], params)
    if other:
        core.add_request("o", PROMPTS[1], params)
    for _ in range(abort_after):
        core.step()
        check_pages(core)
    a = core._requests["a"]
    tokens, held = (
        list(a.all_token_ids),
        core.overlap.pending and core.overlap._launched[0].holds(a),
    )
    core.abort_request("a")
    check_pages(core)
    after_abort = (core.num_free_pages, core.kv.num_cached_pages, len(core.kv.cache))
    core.add_request("b", (share or tokens) + [7, 8, 9], greedy(max_tokens=4, ignore_eos=True))
    finals = drive(core, [])[1]
    idle = (core.kv.num_cached_pages, len(core.kv.cache), core.stats()["prefix_cache_hit_tokens"])
    return tokens, held, after_abort, finals["b"], idle


@pytest.mark.parametrize("other", [False, True])
def test_abort_during_a_launched_step_caches_as_sync(eos_model, other):
    """A request aborted while a launched step holds its row: that step is the one the
    synchronous engine had run by then, so its full pages enter the prefix cache as there
    (a request continuing the conversation hits them), and once no launched row is live
    the pages are back at once, as in sync (none held until another step call)."""
    folder, _ = eos_model
    for abort_after in (3, 4, 5, 6):  # PROMPTS[3] has 14 tokens: 4-token pages fill at 16, 20
        sync = _abort_then_share(folder, False, abort_after, other)
        over = _abort_then_share(folder, True, abort_after, other, share=sync[0])
        assert over[1], "the abort came while a launched step held the row"
        if not other:  # with "o" running, the launched step is collected by the next step
            assert over[2] == sync[2], abort_after
        assert_same(over[3], sync[3])  # b's output and num_cached_tokens
        assert over[4] == sync[4], abort_after


def pd_run(folder, overlap, params):
    """Decode requests (``overlap`` on the decode engine) fed by a prefill engine over the
    loopback fake backend; returns (decode deltas, finals, decode engine)."""
    prefill, decode = core_of(folder, False), core_of(folder, overlap)
    mp = FakeKVManager(prefill.executor.kv_args(), "prefill")
    md = FakeKVManager(decode.executor.kv_args(), "decode")
    prefill.bind_kv_managers({"nixl": mp})
    decode.bind_kv_managers({"nixl": md})
    link(mp, md)
    for i, p in enumerate(params):
        kw = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7000 + i}
        decode.add_request(f"d{i}", PROMPTS[i], p, DisaggRequestInfo(role="decode", **kw))
        prefill.add_request(f"p{i}", PROMPTS[i], p, DisaggRequestInfo(role="prefill", **kw))
    deltas: dict[str, list] = {}
    finals = {}
    for _ in range(500):
        if not (prefill.has_unfinished_requests() or decode.has_unfinished_requests()):
            break
        prefill.step()
        outs = decode.step()
        check_pages(decode)
        for out in outs:
            deltas.setdefault(out.request_id, []).append(delta_of(out))
            if out.finished:
                finals[out.request_id] = final_of(out)
    assert decode.num_free_pages == decode.kv.num_pages == prefill.num_free_pages
    assert decode.kv.num_held_pages == 0
    return deltas, finals, decode


def test_pd_decode_role_overlaps_and_equals_sync(tiny_model_dir):
    """Decode requests join from a KV transfer (first token from the aux record), then
    their decode steps overlap: the same deltas as a synchronous decode worker, the same
    tokens as a mixed one."""
    folder = tiny_model_dir("llama")
    params = [greedy(max_tokens=12 + 5 * i, ignore_eos=True, logprobs=0) for i in range(3)]
    d_off, f_off, off = pd_run(folder, False, params)
    d_on, f_on, on = pd_run(folder, True, params)
    assert_same(d_on, d_off, "deltas")
    assert_same(f_on, f_off)
    assert on.stats()["overlap_ahead_steps"] > 5 and off.stats()["overlap_launched_steps"] == 0
    ref = drive(core_of(folder, False), [(f"d{i}", PROMPTS[i], p) for i, p in enumerate(params)])
    for rid, want in ref[1].items():
        assert f_on[rid][:2] == want[:2] and f_on[rid][4] == want[4]


def test_overlap_switch(tiny_model_dir):
    """Off on CPU by default (a CPU forward is synchronous), forced on by the config;
    ``--overlap-schedule`` / ``--no-overlap-schedule`` set it, unset = auto."""
    folder = tiny_model_dir("llama")
    assert not core_of(folder, None).overlap.enabled
    assert core_of(folder, True).overlap.enabled
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).scheduler.overlap_schedule is None
    args = parser.parse_args(["--no-overlap-schedule"])
    assert engine_config_from_args(args).scheduler.overlap_schedule is False
    assert engine_argv(args) == ["--no-overlap-schedule"]
    args = parser.parse_args(["--overlap-schedule"])
    assert engine_config_from_args(args).scheduler.overlap_schedule is True
