"""A speculative draft model's KV pool lives inside the one ``--kv-cache-memory`` budget
(``engine/worker/rank_worker.py``: ``draft_kv_bytes_per_token``;
``kv_storage.compute_num_pages``): the target and the draft get as many pages each, the
budget split by their KV bytes per token, both pools' bytes within it; greedy output
still equals the plain run's, and both pools' pages are back at the end."""

from __future__ import annotations

import pytest
import torch
import transformers
from overlap_runs import PROMPTS, assert_same, drive, greedy

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.worker.kv_storage import GiB, compute_num_pages, kv_bytes_per_token
from pdserve.engine.worker.rank_worker import draft_kv_bytes_per_token
from tiny_models import random_tiny_model

BUDGET_GIB = 0.0005
PS = 4


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def shallow_draft(folder, tmp_path_factory):
    """The target's tokenizer and widths, one layer instead of two: half the KV a token."""
    cfg = transformers.AutoConfig.from_pretrained(folder)
    cfg.num_hidden_layers = 1
    out = tmp_path_factory.mktemp("draft1")
    random_tiny_model(cfg, seed=3).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    return str(out)


def _core(folder, **sched):
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=folder, device="cpu", dtype="float32"),
            cache=CacheConfig(page_size=PS, kv_cache_memory=BUDGET_GIB),
            scheduler=SchedulerConfig(max_running_requests=4, **sched),
        )
    )


def test_compute_num_pages_splits_the_budget():
    shape = dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_running_requests=4,
        max_model_len=100,
    )
    own = kv_bytes_per_token(2, 2, 8, torch.float32)
    cfg = CacheConfig(page_size=16, kv_cache_memory=1.0)
    assert compute_num_pages(cfg, **shape, extra_bytes_per_token=own) == GiB // (16 * 2 * own)
    assert compute_num_pages(cfg, **shape) == GiB // (16 * own)
    assert compute_num_pages(CacheConfig(num_pages=5), **shape, extra_bytes_per_token=own) == 5
    with pytest.raises(ValueError, match="kv_cache_memory"):
        compute_num_pages(
            CacheConfig(page_size=16, kv_cache_memory=1e-9), **shape, extra_bytes_per_token=own
        )


def test_draft_pool_inside_the_kv_budget(folder, shallow_draft):
    spec = {
        "speculative_algorithm": "draft",
        "speculative_model": shallow_draft,
        "num_speculative_tokens": 3,
    }
    plain = _core(folder)
    core = _core(folder, **spec)
    target = core.executor.rank0.storage
    draft = core.drafter.executor.rank0.storage
    shapes = core.executor.rank0.model.shapes  # the draft: the same widths, one layer
    t_tok = kv_bytes_per_token(2, shapes.n_kv_heads, shapes.head_dim, torch.float32)
    d_tok = kv_bytes_per_token(1, shapes.n_kv_heads, shapes.head_dim, torch.float32)
    assert draft_kv_bytes_per_token(core.config, torch.float32) == d_tok == t_tok // 2
    budget = int(BUDGET_GIB * GiB)
    assert core.kv.num_pages == target.num_pages == budget // (PS * (t_tok + d_tok))
    assert draft.num_pages == target.num_pages
    assert target.kv.nbytes + draft.kv.nbytes <= budget
    assert plain.kv.num_pages == budget // (PS * t_tok) > core.kv.num_pages
    assert draft_kv_bytes_per_token(plain.config, torch.float32) == 0
    reqs = [(f"r{i}", p, greedy(max_tokens=12, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    _, f0 = drive(plain, reqs)
    _, f1 = drive(core, reqs)
    assert_same(f1, f0)
    assert core.stats()["spec_verify_rows"] > 0
    core.drafter.check_integrity()
    assert core.drafter.num_held_pages == 0
