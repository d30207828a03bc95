"""The verify step's CUDA-graph path (``engine/worker/cuda_graph.py``: verify graphs), on
CPU up to the capture call: the right-aligned window layout; and a whole speculative run
whose verify steps go through ``CUDAGraphRunner.replay_verify`` with the runner's eager
test hook (the static buffers, the capture plan of ``q`` query tokens a row and the
output slicing, run without capturing) under the ``triton`` backend (Triton's CPU
interpreter), in fp32: its output equals the plain eager run's token for token, logprobs
included, with rows of fewer drafts padded in the same steps; every page is back after
each run.  ``tests/engine/test_gpu_verify_graph.py`` checks the captured graphs on CUDA."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():  # before the backend's kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")
    __import__("triton_interp").install()  # the interpreter without its redundant re-patching

import numpy as np
import pytest
from overlap_runs import PROMPTS, assert_same, drive, greedy

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.spec.drafter import ReferenceDrafter, ReplayDrafter
from pdserve.engine.worker.cuda_graph import (
    VERIFY_GRAPH_MAX_TOKENS,
    CUDAGraphRunner,
    verify_batch_sizes,
    verify_window,
)

K = 3
PS = 4


def test_verify_window_right_aligns_each_row():
    table = np.array([[7, 8, 9], [3, 4, 0]], dtype=np.int32)
    # row 0: last token at position 5 + 3 drafts (full); row 1: last token at 2, 1 draft
    w = verify_window([[11, 12, 13, 14], [21, 22]], np.array([5, 2]), table, PS, K + 1, 4)
    assert w.ids.tolist() == [11, 12, 13, 14, 0, 0, 21, 22] + [0] * 8
    assert w.positions.tolist()[:8] == [5, 6, 7, 8, 2, 2, 2, 3]
    # slot = page * PS + pos % PS: row 0 positions 5..8 -> pages 8, 8, 8, 9
    assert w.slots.tolist() == [33, 34, 35, 36, -1, -1, 14, 15] + [-1] * 8
    assert w.seq_lens.tolist() == [9, 4, 0, 0]
    assert w.rows.tolist() == [0, 1, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="1 .. 4 tokens"):
        verify_window([[1] * 5], np.array([0]), table[:1], PS, K + 1, 1)
    with pytest.raises(ValueError, match="bs"):
        verify_window([[1], [2]], np.array([0, 0]), table, PS, K + 1, 1)


def test_verify_batch_sizes():
    assert verify_batch_sizes(64, 5) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert verify_batch_sizes(256, 5)[-1] == VERIFY_GRAPH_MAX_TOKENS // 5
    assert verify_batch_sizes(3, 5) == [1, 2, 3]
    with pytest.raises(ValueError, match="query_len"):
        verify_batch_sizes(8, 1)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


def _core(folder, **sched):
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=folder, device="cpu", attention_backend="triton"),
            cache=CacheConfig(page_size=PS, num_pages=96),
            scheduler=SchedulerConfig(max_running_requests=4, **sched),
        )
    )


def _with_eager_graphs(core):
    """Give ``core``'s runner an eager CUDAGraphRunner; returns the list every graph
    verify step appends its rows' token counts to."""
    ctx = core.executor.rank0
    ctx.runner.graphs = CUDAGraphRunner(
        ctx.model,
        ctx.storage.layer_caches,
        PS,
        max_batch=4,
        max_pages=CUDAGraphRunner.max_pages_for(ctx.max_model_len, PS),
        eager=True,
    )
    steps: list[list[int]] = []
    inner = ctx.runner._graph_verify

    def counted(plan):
        out = inner(plan)
        if out is not None:
            steps.append([len(s.token_ids) for s in plan.seqs])
        return out

    ctx.runner._graph_verify = counted
    return steps


def _requests(**kw):
    params = [greedy(max_tokens=m, ignore_eos=True, **kw) for m in (14, 9, 17)]
    return [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS[1:4], params))]


@pytest.mark.timeout(600)
def test_graph_verify_equals_plain_eager_decode(folder):
    """Plain greedy rows take the graph's own greedy pick (``verify_greedy_packed``: the
    cumulative logprob checks its logprobs); rows asking top logprobs go through the
    acceptance rule on the graph's logits."""
    base = _core(folder)
    reqs = _requests()
    _, f0 = drive(base, reqs)
    refs = [list(p) + list(f0[rid][0]) for rid, p, _ in reqs]
    spec = _core(folder, speculative_algorithm="ngram", num_speculative_tokens=K)
    steps = _with_eager_graphs(spec)
    # the benchmark mode: every kept token the graph's argmax too (no override)
    spec.set_drafter(ReferenceDrafter(refs, K, 0.7, spec.vocab_size, seed=2), K)
    assert spec.executor.rank0.runner.graphs.q == K + 1
    _, f1 = drive(spec, reqs)
    assert_same(f1, f0)
    assert spec.scheduler.num_reference_mismatches == 0
    assert len(steps) >= 5 and spec.executor.rank0.runner.verify_steps["graph"] == len(steps)
    assert any(max(s) == K + 1 and min(s) < K + 1 for s in steps), steps  # padded rows
    # the normal greedy rule on the graph's logits (replayed drafts, corrupted at 0.5)
    reqs = _requests(logprobs=2)
    _, f0 = drive(base, reqs)
    n = len(steps)
    spec.set_drafter(ReplayDrafter(refs, K, 0.5, spec.vocab_size, seed=4), K)
    _, f2 = drive(spec, reqs)
    assert_same(f2, f0)
    assert len(steps) >= n + 5
    assert spec.stats()["spec_accepted_tokens"] > 10
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec.set_drafter(ReplayDrafter(refs, K + 1, 0.5, spec.vocab_size), K + 1)


def _step_core(folder, device, dtype):
    """An idle engine with verify graphs of k = K made at start (``rank_worker``), or on
    CPU the eager test hook (prepared at ``set_drafter``)."""
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(model=folder, device=device, dtype=dtype, attention_backend="triton"),
            cache=CacheConfig(page_size=PS, num_pages=96),
            scheduler=SchedulerConfig(
                max_running_requests=4, speculative_algorithm="ngram", num_speculative_tokens=K
            ),
        )
    )
    if device == "cpu":
        _with_eager_graphs(core)
        core.executor.rank0.runner.graphs.prepare_verify(K)
    return core


def _graph_vs_eager_step(core):
    """:func:`_verify_step_both_ways` under inference mode, as the engine runs its steps
    (the graphs' buffers and the KV cache are inference tensors: CUDA refuses in-place
    updates of them outside it)."""
    import torch

    with torch.inference_mode():
        return _verify_step_both_ways(core)


def _verify_step_both_ways(core):
    """One verify step of rows with 3, 1 and 0 drafts over prompts prefilled into pages of
    their own, through the verify graph and eagerly: (graph logits, eager logits, tokens
    kept by ``execute`` through the graph, tokens ``verify`` keeps from the eager logits)."""
    import torch

    from pdserve.engine.spec.verify import VerifySpan, verify, verify_rows
    from pdserve.engine.step import BatchPlan, ScheduledSeq, StepResult

    runner = core.executor.rank0.runner
    params = greedy(max_tokens=8)
    prompts = [PROMPTS[2], PROMPTS[4], PROMPTS[0]]
    pages = [list(range(b * 8, b * 8 + 8)) for b in range(len(prompts))]
    pre = BatchPlan(
        tuple(
            ScheduledSeq(f"p{b}", list(p), 0, pages[b], True, 0, [], params, None)
            for b, p in enumerate(prompts)
        )
    )
    first = runner.execute(pre).sampled
    drafts = [(7, 8, 9), (11,), ()]
    seqs = tuple(
        ScheduledSeq(
            f"p{b}",
            [first[f"p{b}"].token_id, *drafts[b]],
            len(p),
            pages[b],
            True,
            0,
            [],
            params,
            None,
            draft_token_ids=drafts[b],
        )
        for b, p in enumerate(prompts)
    )
    plan = BatchPlan(seqs)
    got = runner._graph_verify(plan)
    assert got is not None
    logits_g = got[0].clone()
    kept_g = runner.execute(plan).verified  # the graph path again, through execute
    logits_e = runner._eager_step(plan, StepResult())
    rows, spans = [], []
    for s in seqs:
        spans.append(VerifySpan(len(rows), s.draft_token_ids))
        rows.extend(verify_rows(s))
    kept_e = verify(logits_e, rows, spans)
    assert logits_g.shape == logits_e.shape == (7, core.vocab_size)
    assert logits_g.dtype == torch.float32
    ids = lambda kept: [[t.token_id for t in k] for k in kept]  # noqa: E731
    return logits_g, logits_e, ids(kept_g[f"p{b}"] for b in range(2)), ids(kept_e[:2])


@pytest.mark.timeout(600)
def test_graph_verify_step_equals_eager_step_cpu(folder):
    """The eager hook on CPU: the same logits as the eager verify step (fp32)."""
    core = _step_core(folder, "cpu", "float32")
    lg, le, kg, ke = _graph_vs_eager_step(core)
    assert (lg - le).abs().max().item() < 1e-4
    assert kg == ke


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_captured_verify_graph_equals_eager_step(folder, dtype):
    """On CUDA the captured verify graph (made at start) against the eager verify step:
    fp32 within 1e-3 and the same kept tokens; bf16 within 0.5 (the rows' GEMMs have
    another M: rounding differs) with the argmax of at least 6 of the 7 positions equal."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    core = _step_core(folder, "cuda", dtype)
    g = core.executor.rank0.runner.graphs
    assert g is not None and g.q == K + 1 and g._vgraphs, "no verify graphs were captured"
    lg, le, kg, ke = _graph_vs_eager_step(core)
    if dtype == "float32":
        assert (lg - le).abs().max().item() < 1e-3
        assert kg == ke
    else:
        assert (lg - le).abs().max().item() < 0.5
        assert (lg.argmax(-1) == le.argmax(-1)).sum().item() >= 6


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_gpu_speculative_run_through_verify_graphs_equals_plain(folder):
    """fp32 on CUDA, graphs on both sides: the reference mode's output equals the plain
    run's token for token with nothing overridden, and verify graphs ran the steps."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")

    def core(**sched):
        return EngineCore(
            EngineConfig(
                model=ModelConfig(model=folder, device="cuda", dtype="float32"),
                cache=CacheConfig(page_size=PS, num_pages=96),
                scheduler=SchedulerConfig(max_running_requests=4, **sched),
            )
        )

    reqs = _requests()
    _, f0 = drive(core(), reqs)
    refs = [list(p) + list(f0[rid][0]) for rid, p, _ in reqs]
    spec = core(speculative_algorithm="ngram", num_speculative_tokens=K)
    runner = spec.executor.rank0.runner
    spec.set_drafter(ReferenceDrafter(refs, K, 0.7, spec.vocab_size, seed=2), K)
    _, f1 = drive(spec, reqs)
    assert_same(f1, f0)
    assert spec.scheduler.num_reference_mismatches == 0
    assert runner.graphs._vgraphs and runner.verify_steps["graph"] >= 5, runner.verify_steps
