"""Tensor parallelism through the engine (CPU, gloo, rank 1 a spawned process): TP=2 greedy
output equal to TP=1 for tiny Llama, Qwen2 (one KV head: replicated) and Qwen3; calls run
in a rank's own process; a rank killed mid-request ends it with an error naming the rank,
the engine refuses more, and shutdown leaves no process behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.worker.executor import RankFailedError, check_tp_split
from pdserve.engine.worker.rank_worker import RankContext
from pdserve_procs import TINY, pid_alive

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a king who had three daughters and",
    "1, 2, 3, 4,",
]
LP_TOL = 1e-4  # fp32; the sharded sums add in another order


def assert_same_outputs(ours, ref) -> None:
    """Same tokens, same top-logprob ids, logprobs (sampled, top, prompt) within LP_TOL."""
    for a, b in zip(ours, ref):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        assert ca.finish_reason == cb.finish_reason
        for la, lb in zip(ca.logprobs, cb.logprobs):
            assert abs(la.logprob - lb.logprob) < LP_TOL
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.token_id == pb.token_id and abs(pa.logprob - pb.logprob) < LP_TOL


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_equals_tp1(arch, tiny_model_dir, tokenizer):
    folder = tiny_model_dir(arch)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    # A small token budget: the long prompt is prefilled in chunks beside decodes.
    kw = dict(device="cpu", dtype="float32", num_pages=128, max_num_batched_tokens=16)
    ref = LLM(folder, **kw).generate(prompts, params)
    with LLM(folder, tensor_parallel_size=2, **kw) as llm:
        core = llm.engine
        assert core.executor.tp_size == 2 and len(set(core.executor.rank_pids())) == 2
        shapes = core.executor.rank0.model.shapes
        assert shapes.n_heads == shapes.total_heads // 2  # rank 0 holds its share only
        assert core.executor.rank0.storage.kv_layout.num_kv_heads == shapes.n_kv_heads
        outs = llm.generate(prompts, params)
    assert_same_outputs(outs, ref)


def _rank_facts(ctx: RankContext, tag: str) -> dict:
    return {
        "pid": os.getpid(),
        "rank": ctx.tp.rank,
        "size": ctx.tp.size,
        "num_pages": ctx.storage.num_pages,
        "kv_head_range": ctx.model.shapes.kv_head_range,
        "tag": tag,
    }


def _raise_in_rank(ctx: RankContext) -> None:
    raise ValueError(f"bad thing in rank {ctx.tp.rank}")


@pytest.fixture(scope="module")
def tp2_core():
    core = EngineCore(
        EngineConfig(
            model=ModelConfig(model=TINY, tensor_parallel_size=2, device="cpu"),
            cache=CacheConfig(num_pages=64),
        )
    )
    yield core
    core.shutdown()


@pytest.mark.timeout(300)
def test_call_rank_runs_in_the_rank_process_and_reraises(tp2_core):
    ex = tp2_core.executor
    zero, one = ex.call_rank(0, _rank_facts, "a"), ex.call_rank(1, _rank_facts, "b")
    assert zero["pid"] == os.getpid() and one["pid"] == ex.rank_pids()[1] != os.getpid()
    assert (zero["rank"], one["rank"], one["size"], one["tag"]) == (0, 1, 2, "b")
    assert zero["num_pages"] == one["num_pages"] == 64
    assert zero["kv_head_range"] == (0, 1) and one["kv_head_range"] == (1, 2)
    with pytest.raises(ValueError, match="bad thing in rank 1") as info:
        ex.call_rank(1, _raise_in_rank)
    assert "tensor-parallel rank 1" in str(info.value.__cause__)
    assert "_raise_in_rank" in str(info.value.__cause__)  # the rank's own traceback
    with pytest.raises(ValueError, match="rank must be in"):
        ex.call_rank(2, _rank_facts, "c")
    # The rank still serves steps after a failed call.
    tp2_core.add_request("after-call", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    done = []
    while tp2_core.has_unfinished_requests():
        done += [o for o in tp2_core.step() if o.finished]
    assert len(done[0].outputs[0].token_ids) == 3 and done[0].outputs[0].finish_reason == "length"


def _rank_errors(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and "tensor-parallel rank" in r.getMessage()
    ]


@pytest.mark.timeout(300)
def test_killed_rank_ends_requests_with_error_and_nothing_hangs(tp2_core, caplog):
    core = tp2_core
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    core.add_request("doomed", list(range(1, 40)), params)
    for _ in range(3):
        core.step()
    rank1 = core.executor.rank_pids()[1]
    caplog.set_level(logging.INFO, logger="pdserve.engine.worker.multiproc_executor")
    os.kill(rank1, signal.SIGKILL)
    finished = []
    for _ in range(1000):  # the next step fails: the collective's peer is gone
        finished += [o for o in core.step() if o.finished]
        if not core.has_unfinished_requests():
            break
    # the watcher and the failed step both notice; the death is logged once
    assert len(_rank_errors(caplog)) == 1, _rank_errors(caplog)
    assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL" in _rank_errors(caplog)[0]
    assert [o.request_id for o in finished] == ["doomed"]
    out = finished[0]
    assert out.outputs[0].finish_reason == "error"
    assert "tensor-parallel rank 1" in out.error and "SIGKILL" in out.error
    assert core.failure is not None and "rank 1" in core.failure
    assert len(out.outputs[0].token_ids) < 400
    with pytest.raises(RankFailedError, match="rank 1"):
        core.add_request("later", [1, 2, 3], params)
    core.shutdown()
    core.shutdown()  # idempotent
    assert not pid_alive(rank1)


@pytest.mark.timeout(300)
def test_hung_rank_is_named_after_the_timeout_and_a_normal_stop_logs_no_error(monkeypatch, caplog):
    """A rank stopped (SIGSTOP) mid-request: after PDSERVE_TP_TIMEOUT the request ends with
    an error naming that rank and its pid (not rank 0, not gloo's source path), logged
    once.  The healthy engine before it stops without an ERROR."""
    monkeypatch.setenv("PDSERVE_TP_TIMEOUT", "10")
    caplog.set_level(logging.INFO, logger="pdserve.engine.worker.multiproc_executor")
    cfg = EngineConfig(
        model=ModelConfig(model=TINY, tensor_parallel_size=2, device="cpu"),
        cache=CacheConfig(num_pages=64),
    )
    healthy = EngineCore(cfg)
    healthy.shutdown()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    core = EngineCore(cfg)
    rank1 = core.executor.rank_pids()[1]
    try:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        core.add_request("stuck", list(range(1, 40)), params)
        core.step()
        os.kill(rank1, signal.SIGSTOP)
        finished = []
        while core.has_unfinished_requests():
            finished += [o for o in core.step() if o.finished]
        (out,) = finished
        assert out.outputs[0].finish_reason == "error"
        want = f"tensor-parallel rank 1 (pid {rank1}) did not answer for 10 s (PDSERVE_TP_TIMEOUT)"
        assert want in out.error and "stopped (SIGSTOP)" in out.error, out.error
        assert "gloo" not in out.error and "rank 0" not in out.error, out.error
        assert core.failure == out.error and _rank_errors(caplog) == [
            f"{out.error}; the engine stops serving"
        ]
    finally:
        core.shutdown()  # SIGKILL reaches a stopped process
    assert not pid_alive(rank1)


def _rank_pid(ctx):
    return os.getpid()


@pytest.mark.timeout(300)
def test_call_rank_to_a_hung_rank_fails_naming_it_after_the_timeout():
    """``call_rank`` between steps to a stopped rank raises RankFailedError naming that rank
    and its pid after PDSERVE_TP_TIMEOUT instead of blocking the engine thread; the engine
    is failed for good and its ranks are stopped."""
    cfg = EngineConfig(
        model=ModelConfig(model=TINY, tensor_parallel_size=2, device="cpu"),
        cache=CacheConfig(num_pages=64),
    )
    core = EngineCore(cfg)
    rank1 = core.executor.rank_pids()[1]
    try:
        # start-up and a first answer under the default bound (on a loaded machine a
        # rank can take more than 5 s to answer its first call), then the short one (only
        # the stopped rank is called under it: the test waits it out, so 1 s)
        assert core.executor.call_rank(1, _rank_pid) == rank1
        core.executor._timeout = 1.0  # what ModelConfig(tp_timeout=1) would have set
        os.kill(rank1, signal.SIGSTOP)
        with pytest.raises(RankFailedError) as info:
            core.executor.call_rank(1, _rank_pid)
        want = f"tensor-parallel rank 1 (pid {rank1}) did not answer for 1 s (PDSERVE_TP_TIMEOUT)"
        assert want in str(info.value), info.value
        assert core.failure == str(info.value)
        with pytest.raises(RankFailedError):
            core.executor.call_rank(1, _rank_pid)
    finally:
        core.shutdown()
    assert not pid_alive(rank1)


def test_tp_config_errors_name_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="gpu_ids"):
        ModelConfig(tensor_parallel_size=2, gpu_ids=(0,))
    with pytest.raises(ValueError, match="gpu_ids"):
        ModelConfig(tensor_parallel_size=2, gpu_ids=(1, 1))
    assert ModelConfig(tensor_parallel_size=2, gpu_id=3).rank_gpu_id(1) == 4
    assert ModelConfig(tensor_parallel_size=2, gpu_ids=(5, 2)).rank_gpu_id(1) == 2
    # A model that does not split fails before any rank starts, naming the field.
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(tiny_model_dir("llama"), device="cpu", num_pages=8, tensor_parallel_size=3)
    import transformers

    cfg = transformers.LlamaConfig(
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=130, hidden_size=64
    )
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tp_split(cfg, 4)


def test_a_tp1_engine_never_imports_the_multiproc_executor():
    """TP=1 runs on ``LocalExecutor`` alone: ``engine/worker/multiproc_executor.py`` (spawned
    ranks, pipes, failure bookkeeping) is imported only by ``create_executor`` for N > 1."""
    code = (
        "import sys\n"
        "from pdserve.config import CacheConfig, EngineConfig, ModelConfig\n"
        "from pdserve.engine.core.engine import EngineCore\n"
        f"core = EngineCore(EngineConfig(model=ModelConfig(model={TINY!r}, device='cpu'),"
        " cache=CacheConfig(num_pages=16)))\n"
        "assert type(core.executor).__name__ == 'LocalExecutor'\n"
        "core.shutdown()\n"
        "print('multiproc' if 'pdserve.engine.worker.multiproc_executor' in sys.modules else 'local')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "local"
    from pdserve.engine.worker.multiproc_executor import MultiprocExecutor

    assert MultiprocExecutor.__module__ == "pdserve.engine.worker.multiproc_executor"
