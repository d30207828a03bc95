"""CUDA-graph decode and backend selection.

The tests marked ``gpu`` need a CUDA device and run on the GPU machine (``make test-gpu``);
``make test`` deselects them. The others check on CPU what a graph relies on.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.worker.cuda_graph import capture_reserve_bytes, graph_batch_sizes
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.presets import preset_config
from pdserve.server.engine_args import add_engine_args, engine_argv, engine_config_from_args


def test_graph_batch_sizes_cover_every_batch():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    with pytest.raises(ValueError, match="max_batch"):
        graph_batch_sizes(0)


def test_capture_reserve_does_not_grow_with_the_number_of_graphs():
    """Every graph writes its logits into one shared ``[max_batch, V]`` fp32 buffer, so the
    reserve holds that buffer and the largest bucket's intermediates, whatever the number
    of graphs (before: every graph's own logits, 67 GB for Llama-3.1-8B up to 1,024 rows)."""
    model = LlamaForCausalLM(preset_config("llama-3.1-8b"), torch.bfloat16, "meta")
    tri = LlamaForCausalLM(preset_config("llama-3.1-8b"), torch.bfloat16, "meta", "triton")
    assert capture_reserve_bytes(tri, 64) == capture_reserve_bytes(model, 64)
    for max_batch in (64, 256, 1024):
        shared = max_batch * 128256 * 4
        assert 3 * shared < capture_reserve_bytes(tri, max_batch) < 5 * shared + (2 << 30)
    assert capture_reserve_bytes(tri, 1024) < 5 << 30


def test_attention_backend_and_enforce_eager_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--attention-backend", "triton", "--enforce-eager"])
    mc = engine_config_from_args(args).model
    assert mc.attention_backend == "triton" and mc.enforce_eager is True
    assert engine_argv(args) == ["--attention-backend", "triton", "--enforce-eager"]
    assert engine_argv(parser.parse_args([])) == []
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="flashinfer")


def test_cpu_engine_defaults_to_torch_sdpa_without_graphs():
    llm = LLM("random:tiny", device="cpu", num_pages=16)
    assert llm.engine.attention_backend == "torch_sdpa"
    assert llm.engine.executor.rank0.runner.graphs is None


def test_plain_greedy_rows_are_argmax_only():
    from pdserve.engine.step import ScheduledSeq
    from pdserve.engine.worker.sampler import plain_greedy

    def row(banned=(), **kw):
        return ScheduledSeq("r", [1], 0, [0], True, 0, [], SamplingParams(**kw), None, banned)

    assert plain_greedy(row(temperature=0))
    assert plain_greedy(row(temperature=0, logprobs=0))  # the chosen token's logprob only
    assert not plain_greedy(row(temperature=0, logprobs=2))
    assert not plain_greedy(row(temperature=0.7))
    assert not plain_greedy(row(temperature=0, logit_bias={3: 1.0}))
    assert not plain_greedy(row(temperature=0, repetition_penalty=1.1))
    assert not plain_greedy(row(banned=(2,), temperature=0))


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("logprobs", [1, None])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager(dtype, logprobs):
    """Greedy decode through captured graphs gives the eager run's tokens, at batch sizes
    that hit a bucket exactly and ones that pad (3, 5 rows); without top logprobs the rows
    take the graph's own argmax (``greedy_tokens``), with them the sampler's."""
    _needs_cuda()
    prompts = [[1 + (7 * i + j) % 300 for j in range(5 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=logprobs)
    runs = {}
    for eager in (False, True):
        llm = LLM(
            "random:tiny",
            device="cuda",
            dtype=dtype,
            max_running_requests=8,
            kv_cache_memory=0.25,
            enforce_eager=eager,
        )
        graphs = llm.engine.executor.rank0.runner.graphs
        assert (graphs is None) == eager
        assert llm.engine.attention_backend == "triton"
        if graphs is not None:  # every graph's logits: a view of the one shared buffer
            shared = graphs._logits_out.data_ptr()
            assert len(graphs._logits) > 3
            assert all(t.data_ptr() == shared for t in graphs._logits.values())
        runs[eager] = [[o.outputs[0] for o in llm.generate(prompts[:n], params)] for n in (1, 3, 5)]
        del llm
        torch.cuda.empty_cache()
    for graph_outs, eager_outs in zip(runs[False], runs[True]):
        for g, e in zip(graph_outs, eager_outs):
            assert g.token_ids == e.token_ids
            tol = 1e-4 if dtype == "float32" else 0.05
            if logprobs is None:  # the summed logprob of 24 tokens
                assert abs(g.cumulative_logprob - e.cumulative_logprob) < 24 * tol
                continue
            lg = [t.logprob for t in g.logprobs]
            le = [t.logprob for t in e.logprobs]
            assert max(abs(a - b) for a, b in zip(lg, le)) < tol


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_short_context_graphs_and_unbounded_ones_match_eager(monkeypatch):
    """At rows x KV heads >= 256 (128 rows of the 2-KV-head tiny model) a step whose contexts
    all fit ONE_SPLIT_MAX_CONTEXT replays the bucket's short-context graph (one split), and
    once one row's context passes it the unbounded graph (split); greedy fp32 tokens equal
    the eager run's either way."""
    _needs_cuda()
    from pdserve.engine.worker import cuda_graph
    from pdserve.model.triton_backend import ONE_SPLIT_MAX_CONTEXT

    picked: list = []
    real_pick = cuda_graph.pick_graph

    def recording_pick(bs, bounds, max_context):
        key = real_pick(bs, bounds, max_context)
        picked.append((key, max_context))
        return key

    monkeypatch.setattr(cuda_graph, "pick_graph", recording_pick)
    n = 128
    prompts = [[1 + (3 * i + j) % 300 for j in range(8 + i % 7)] for i in range(n - 1)]
    prompts.append([1 + j % 250 for j in range(ONE_SPLIT_MAX_CONTEXT - 12)])  # crosses the bound
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(
            "random:tiny",
            device="cuda",
            dtype="float32",
            max_running_requests=n,
            kv_cache_memory=1.0,
            enforce_eager=eager,
        )
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]
    keys = {key for key, _ in picked if key[0] == n}
    assert keys == {(n, ONE_SPLIT_MAX_CONTEXT), (n, None)}, picked
    for (bs, bound), longest in picked:
        if bs == n:  # the bounded graph exactly while every context fits its bound
            assert (bound is not None) == (longest <= ONE_SPLIT_MAX_CONTEXT)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_programmatic_dependent_launch_gives_the_same_bits(monkeypatch):
    """PDSERVE_TRITON_PDL=1 (model/pdl.py): graphs and eager steps with every Triton kernel
    launched under PDL give the tokens and logprobs of the run without it, bit for bit (each
    kernel waits for its predecessor before touching memory). Before sm_90 the flag must
    change nothing (pdl.launch_options: no PDL there), so the same equality holds. CPU twin:
    tests/model/test_pdl.py (when PDL is asked for; every kernel built for sm_90)."""
    _needs_cuda()
    from pdserve.model import pdl

    prompts = [[1 + (7 * i + j) % 300 for j in range(5 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("PDSERVE_TRITON_PDL", on)
        pdl._options.cache_clear()
        for eager in (False, True):
            llm = LLM(
                "random:tiny",
                device="cuda",
                dtype="float32",
                max_running_requests=8,
                kv_cache_memory=0.25,
                enforce_eager=eager,
            )
            outs = llm.generate(prompts, params)
            runs[on, eager] = [
                (o.outputs[0].token_ids, [t.logprob for t in o.outputs[0].logprobs]) for o in outs
            ]
            del llm
            torch.cuda.empty_cache()
    pdl._options.cache_clear()
    assert runs["1", False] == runs["0", False]
    assert runs["1", True] == runs["0", True]


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_chunked_prefill_on_cuda_equals_one_chunk():
    """A prompt prefilled in many chunks that sample nothing (so no step ends with a device
    read) gives the tokens of the same prompt prefilled in one step. Guards the pinned staging
    buffer: rewriting it while the previous step's copy is still queued corrupted the slots
    (an illegal memory access on an 8,192-token prompt on the H200)."""
    _needs_cuda()
    prompt = [1 + (13 * j) % 300 for j in range(1500)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = []
    for budget in (64, 2048):
        llm = LLM(
            "random:tiny",
            device="cuda",
            dtype="float32",
            kv_cache_memory=0.25,
            max_num_batched_tokens=budget,
        )
        outs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
        del llm
        torch.cuda.empty_cache()
    assert outs[0] == outs[1]


def _overlap_run(overlap, enforce_eager, requests, late):
    """Greedy outputs of ``requests`` ((id, prompt, params)) on a CUDA engine, ``late`` added
    after 5 steps; returns ({id: (token ids, logprobs, finish_reason)}, stats)."""
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.core.engine import EngineCore

    core = EngineCore(
        EngineConfig(
            model=ModelConfig(
                model="random:tiny", device="cuda", dtype="float32", enforce_eager=enforce_eager
            ),
            cache=CacheConfig(kv_cache_memory=0.25),
            scheduler=SchedulerConfig(max_running_requests=8, overlap_schedule=overlap),
        )
    )
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    finals = {}
    for k in range(2000):
        if k == 5 and late:
            core.add_request(*late)
        if k > 5 and not core.has_unfinished_requests():
            break
        for out in core.step():
            if out.finished:
                c = out.outputs[0]
                lps = [t.logprob for t in c.logprobs] if c.logprobs is not None else None
                finals[out.request_id] = (c.token_ids, lps, c.finish_reason)
    assert core.num_free_pages == core.kv.num_pages
    stats = core.stats()
    del core
    torch.cuda.empty_cache()
    return finals, stats


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_overlap_schedule_matches_sync_and_eager():
    """Overlap scheduling (on by default on CUDA) gives the synchronous graph run's and the
    eager run's greedy tokens, with rows that end mid-batch (a stop token id, staggered
    max_tokens, max_tokens=1) and a request arriving mid-decode; eager CUDA steps do not
    overlap (only graph steps do)."""
    _needs_cuda()
    prompts = [[1 + (7 * i + j) % 300 for j in range(5 + 3 * i)] for i in range(6)]
    probe, _ = _overlap_run(
        False,
        False,
        [("p", prompts[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))],
        None,
    )
    stop = probe["p"][0][6]

    def params(max_tokens, **kw):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)

    requests = [
        ("stop", prompts[0], params(30, stop_token_ids=[stop], logprobs=0)),
        ("long", prompts[1], params(40, logprobs=0)),
        ("short", prompts[2], params(3)),
        ("one", prompts[3], params(1)),
        ("mid", prompts[4], params(17, logprobs=0)),
    ]
    late = ("late", prompts[5], params(12, logprobs=0))
    on, on_stats = _overlap_run(None, False, requests, late)
    off, off_stats = _overlap_run(False, False, requests, late)
    eager, eager_stats = _overlap_run(None, True, requests, late)
    assert on_stats["overlap_ahead_steps"] > 10 and off_stats["overlap_launched_steps"] == 0
    assert eager_stats["overlap_launched_steps"] == 0
    assert on["stop"][2] == "stop" and on["long"][2] == "length"
    for other in (off, eager):
        assert on.keys() == other.keys()
        for rid, (ids, lps, reason) in on.items():
            assert ids == other[rid][0] and reason == other[rid][2], rid
            if lps is not None:
                assert max(abs(a - b) for a, b in zip(lps, other[rid][1])) < 1e-4


def test_page_table_rows_are_written_by_difference():
    """A replay rewrites only the rows whose page list changed (a new list object: the
    scheduler grows pages into a new list), and every row when the width changes."""
    import numpy as np

    from pdserve.engine.worker.cuda_graph import TableRows, fill_page_table

    buf = np.zeros(64, dtype=np.int32)
    written = TableRows()
    a, b, c = [3, 4], [7], [9, 10]
    table = buf[:6].reshape(3, 2)
    assert fill_page_table(table, [a, b, c], written) == 3
    assert table.tolist() == [[3, 4], [7, 0], [9, 10]]
    table[0, 0] = -5  # a row that is not rewritten keeps what the buffer holds
    b = b + [8]  # row 1's request grew a page: a new list
    assert fill_page_table(table, [a, b, c], written) == 1
    assert table.tolist() == [[-5, 4], [7, 8], [9, 10]]
    assert fill_page_table(table, [c, b], written) == 1  # row 0 now another request's list
    assert table[0].tolist() == [9, 10]
    wide = buf[:6].reshape(2, 3)  # a new width lays the buffer out anew: every row
    assert fill_page_table(wide, [c, b + [11]], written) == 2
    assert wide.tolist() == [[9, 10, wide[0, 2]], [7, 8, 11]]
