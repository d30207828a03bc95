"""FP8 KV cache in the engine (``kv_cache_dtype="fp8_e4m3"``, tiny random Llama, CPU): the
pool holds e4m3 pages of a quarter of the fp32 bytes, its layout fingerprint says so, and
prefix caching and chunked prefill give the same greedy tokens as without them (every token
is read back from the FP8 cache whatever the chunking); FP8 weights and FP8 KV together
run too."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams

SYSTEM = list(range(200, 237))
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + [8, 9, 10, 11, 12, 13], list(range(400, 430))]


def greedy(llm, prompts):
    out = []
    for p in prompts:  # one by one: later prompts can hit the earlier ones' pages
        o = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, logprobs=1))[0]
        out.append((o.outputs[0].token_ids, [x.logprob for x in o.outputs[0].logprobs]))
    return out


def _llm(folder, **kw):
    return LLM(folder, device="cpu", num_pages=128, page_size=4, kv_cache_dtype="fp8_e4m3", **kw)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return _llm(tiny_model_dir("llama"), enable_prefix_caching=False)


def test_fp8_pool_and_fingerprint(plain, tiny_model_dir):
    storage = plain.engine.executor.rank0.storage
    assert storage.kv.dtype == torch.float8_e4m3fn
    ref = LLM(tiny_model_dir("llama"), device="cpu", num_pages=8, page_size=4)
    assert storage.page_bytes * 4 == ref.engine.executor.rank0.storage.page_bytes
    assert storage.layout.dtype == "float8_e4m3fn"


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}])
def test_prefix_cache_and_chunked_prefill_unchanged(plain, tiny_model_dir, kw):
    want = greedy(plain, PROMPTS)
    got = greedy(_llm(tiny_model_dir("llama"), **kw), PROMPTS)
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(gl, wl)) < 1e-4


def test_fp8_weights_and_kv_together(tiny_model_dir):
    llm = _llm(tiny_model_dir("llama"), quantization="fp8")
    rank = llm.engine.executor.rank0
    assert next(rank.model.decoder_layers()).fp8  # the linears are e4m3
    assert len(greedy(llm, PROMPTS[:1])[0][0]) == 10


def test_fp8_on_a_mixture_of_experts_model():
    """A sparse layer has no dense MLP: its attention linears are e4m3, its experts stay in
    the model dtype; FP8 KV as anywhere."""
    llm = LLM(
        "random:tiny-qwen3-moe",
        device="cpu",
        num_pages=64,
        page_size=4,
        quantization="fp8",
        kv_cache_dtype="fp8_e4m3",
    )
    layers = list(llm.engine.executor.rank0.model.decoder_layers())
    assert all({"qkv_proj", "o_proj"} <= set(layer.fp8) for layer in layers)
    assert any(layer.moe is not None and "gate_up_proj" not in layer.fp8 for layer in layers)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
