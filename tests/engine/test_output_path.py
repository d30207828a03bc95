"""The per-token output path: outputs are O(1) snapshots of their step (read late, they
still say what the step said), the streamed deltas add up to the totals over a long
generation with multi-byte characters and stop strings, and the token stop rules.

The engine runs for real (scheduler, bookkeeping, detokenizer, stop checks, outputs) with
its executor scripted: each sampled token is the next one of a known text, so the text is
known and the model's random weights do not matter."""

from __future__ import annotations

import pickle

import pytest

from pdserve.engine.core.request import CompletionOutput
from pdserve.engine.core.stop import TokenStop
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step import SampledToken, StepResult, TokenLogprob

# multi-byte UTF-8 (2, 3 and 4 bytes), split across tokens by the byte-level BPE
TEXT = "Hello wörld! 你好, 🙂 naïve café — done. Ünïcödé 🚀🚀 ok; " * 6


@pytest.fixture(scope="module")
def engine():
    llm = LLM("random:tiny", device="cpu", num_pages=128)
    yield llm.engine
    llm.shutdown()


def scripted(engine, script: list[int], k: int) -> None:
    """Make ``engine`` sample ``script[i]`` as every request's i-th output token, with
    logprob ``-0.5 - i / 1000`` and ``k`` made-up alternatives."""

    def execute(plan):
        out = {}
        for seq in plan.seqs:
            if seq.sample:
                i = engine._requests[seq.request_id].num_output_tokens
                tok = script[i]
                top = tuple((tok + j, -1.0 - j) for j in range(k))
                out[seq.request_id] = SampledToken(tok, -0.5 - i / 1000, top)
        return StepResult(sampled=out)

    engine.executor.execute = execute


def run(engine, rid, script, params):
    """Every output of request ``rid``, and eager copies of what each said when made."""
    scripted(engine, script, params.logprobs or 0)
    engine.add_request(rid, [5, 6, 7], params)
    req = engine._requests[rid]
    outs, eager = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.append(out)
            lps = None if req.logprobs is None else list(req.logprobs)
            eager.append((list(req.output_token_ids), req.detokenizer.text, lps))
    return outs, eager


def test_outputs_read_late_say_what_their_step_said(engine, tokenizer):
    script = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=len(script), logprobs=2, ignore_eos=True)
    outs, eager = run(engine, "late", script, params)
    assert len(outs) == len(script) > 100
    reported = 0
    for out, (ids, text, lps) in zip(outs, eager):  # read after the whole run
        o = out.outputs[0]
        assert o.token_ids == ids and o.text == text and o.logprobs == lps
        assert o.delta_token_ids == ids[reported:] and o.delta_logprobs == lps[reported:]
        reported = len(ids)
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and final.text == TEXT
    assert final.cumulative_logprob == pytest.approx(
        sum(-0.5 - i / 1000 for i in range(len(script)))
    )
    assert [lp.top for lp in final.logprobs] == [((t, -1.0), (t + 1, -2.0)) for t in script]


@pytest.mark.parametrize(
    "stop, cut",
    [
        (("🚀🚀 ok",), "🚀🚀 ok"),
        (("naïve café — done. Ünï",), "naïve café — done. Ünï"),
        (("nowhere",), None),
    ],
)
def test_streamed_deltas_add_up_with_stop_strings(engine, tokenizer, stop, cut):
    script = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=len(script), stop=list(stop), logprobs=0)
    outs, _ = run(engine, f"stop-{cut}", script, params)
    final = outs[-1].outputs[0]
    expected = TEXT if cut is None else TEXT[: TEXT.index(cut)]
    assert final.text == expected
    assert final.stop_reason == cut
    assert final.finish_reason == ("length" if cut is None else "stop")
    assert "".join(o.outputs[0].delta_text for o in outs) == expected
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == final.token_ids
    assert sum((o.outputs[0].delta_logprobs for o in outs), []) == final.logprobs
    assert final.token_ids == script[: len(final.token_ids)]
    for o in outs[:-1]:
        delta = o.outputs[0].delta_text
        assert "\ufffd" not in delta and not any(s in delta for s in stop)


def test_eos_ends_with_its_id_but_no_text(engine, tokenizer):
    eos = min(engine.eos_token_ids)
    script = tokenizer("abc déf", add_special_tokens=False)["input_ids"] + [eos, 100, 101]
    outs, _ = run(engine, "eos", script, SamplingParams(temperature=0, max_tokens=20))
    final = outs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", None)
    assert final.token_ids == script[: script.index(eos) + 1] and final.text == "abc déf"


def test_snapshot_equals_an_eager_output_and_pickles():
    ids, lps = [1, 2, 3, 4], [TokenLogprob(3, -0.1), TokenLogprob(4, -0.2)]
    snap = CompletionOutput.snapshot(
        ids, 2, 1, lps, text="ab", delta_text="b", cumulative_logprob=-0.3,
        finish_reason=None, stop_reason=None,
    )  # fmt: skip
    ids.append(5)
    lps.append(TokenLogprob(5, -0.3))  # the request goes on: the snapshot does not move
    eager = CompletionOutput(
        0, "ab", [3, 4], -0.3, [lps[0], lps[1]], None, None, "b", [4], [lps[1]]
    )
    assert snap == eager and repr(snap) == repr(eager) and not snap.finished
    assert pickle.loads(pickle.dumps(snap)) == eager
    snap.index, snap.token_ids = 3, [9]
    assert (snap.index, snap.token_ids, snap.delta_token_ids) == (3, [9], [4])
    none = CompletionOutput.snapshot(
        [7, 8], 1, 0, None, text="x", delta_text="x", cumulative_logprob=0.0,
        finish_reason="length", stop_reason=None,
    )  # fmt: skip
    assert none.logprobs is None and none.delta_logprobs is None and none.finished
    assert none == CompletionOutput(0, "x", [8], 0.0, None, "length", None, "x", [8], None)


def _stop(**kw):
    params = SamplingParams(temperature=0, **kw)
    return TokenStop(params, eos_token_ids={2, 3}, max_model_len=10, num_prompt=4)


def test_token_stop_rules():
    s = _stop(max_tokens=5)
    assert s.check(2, 1) == ("stop", None) and s.check(3, 5) == ("stop", None)  # EOS before length
    assert s.check(7, 4) is None and s.check(7, 5) == ("length", None)
    # the context limit: 4 prompt + 6 output tokens
    assert _stop().check(7, 5) is None and _stop().check(7, 6) == ("length", None)
    assert _stop(max_tokens=100).check(7, 6) == ("length", None)
    # a stop token id names itself, even when it is an EOS id too
    s = _stop(stop_token_ids=[9, 2])
    assert (
        s.check(9, 1) == ("stop", 9)
        and s.check(2, 1) == ("stop", 2)
        and s.check(3, 1) == ("stop", None)
    )
    # min_tokens: EOS / stop ids count only past it; length still ends it
    s = _stop(min_tokens=2, stop_token_ids=[9], max_tokens=2)
    assert s.check(9, 2) == ("length", None) and s.check(2, 1) is None
    assert _stop(min_tokens=2, stop_token_ids=[9]).check(9, 3) == ("stop", 9)
    s = _stop(ignore_eos=True, stop_token_ids=[9])
    assert s.check(2, 1) is None and s.check(9, 1) == ("stop", 9)


def test_llm_freezes_the_heap_when_asked_and_on_cuda_only_by_default():
    """LLM(freeze_heap=True) moves the start-up heap to the permanent generation (a full
    collection then skips the model, tokenizer and caches); the default does so on CUDA
    only, so a CPU engine leaves the collector as it was."""
    import gc

    gc.unfreeze()
    try:
        llm = LLM("random:tiny", device="cpu", num_pages=16)
        assert gc.get_freeze_count() == 0
        llm.shutdown()
        llm = LLM("random:tiny", device="cpu", num_pages=16, freeze_heap=True)
        assert gc.get_freeze_count() > 0
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        llm.shutdown()
    finally:
        gc.unfreeze()
