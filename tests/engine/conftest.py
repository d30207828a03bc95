"""Shared fixtures of the engine tests: tiny random HF models saved to disk, the tokenizer,
the tiny Llama with an EOS of the overlap tests, the engine pair of the disagg tests."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers
from disagg_pairs import assert_closed_once_after_terminal, pd_pair
from overlap_runs import PROMPTS, core_of, drive

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.loader import embedded_tokenizer
from tiny_models import random_tiny_model

TINY_CONFIGS = {
    # GQA 4/2, tied embeddings
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # q/k/v bias, untied lm_head
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # q/k RMSNorm, explicit head_dim != hidden / heads
    "qwen3": lambda: transformers.Qwen3Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2 tokenizer (byte-level BPE, 49152 tokens, chat template)."""
    return embedded_tokenizer()


def save_tiny_model(arch: str, folder, tokenizer, seed: int = 0) -> None:
    """Save a tiny random ``arch`` model (every parameter random, biases and norms
    included, std 0.1 so greedy choices are clear) with ``tokenizer`` into ``folder``."""
    model = random_tiny_model(TINY_CONFIGS[arch](), seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """``tiny_model_dir(arch)`` -> folder of a saved tiny random model (built once per arch)."""
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            save_tiny_model(arch, folder, tokenizer)
            cache[arch] = str(folder)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """One shared ``LLM`` over the tiny Llama (fp32, CPU, a small pool)."""
    from pdserve import LLM

    return LLM(tiny_model_dir("llama"), device="cpu", num_pages=256)


@pytest.fixture(scope="session")
def eos_model(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with an EOS that greedy decoding of PROMPTS[0] emits as its 7th token
    (the way test_generation builds one), for the overlap tests; returns (folder, that
    prompt's greedy tokens)."""
    folder = tmp_path_factory.mktemp("overlap-eos")
    shutil.copytree(tiny_model_dir("llama"), folder, dirs_exist_ok=True)
    probe = core_of(str(folder), False)
    _, finals = drive(
        probe, [("p", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
    )
    full = finals["p"][0]
    eos = full[6]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    return str(folder), full


@pytest.fixture(scope="module")
def pd_cores(tiny_model_dir):
    """(prefill engine, decode engine, managers) sharing one tiny Llama, pools of 64 pages
    of 4 tokens (``disagg_pairs.pd_pair``); one pair per test module."""
    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64),
    )
    return pd_pair(cfg)


@pytest.fixture
def pd_clean(pd_cores):
    """A test (of a module that uses this fixture for all its tests) must leave both engines
    of ``pd_cores`` idle with all pages and aux slots free, and every room closed once after
    a terminal poll."""
    before = frozenset(id(h) for mgr in pd_cores[2].values() for h in mgr.handles())
    yield
    for core in pd_cores[:2]:
        assert core.num_free_pages == 64 and not core.has_unfinished_requests()
        assert core.page_ids.num_free_aux_slots == core.page_ids.num_aux_slots
    assert_closed_once_after_terminal(pd_cores[2].values(), before)
