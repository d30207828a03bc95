"""Start-up warm-up (engine/core/warmup.py): the eager step shapes run, every page goes
back, the prefix cache stays empty, and what the engine generates afterwards is unchanged
(the triton backend's own warm-up: tests/model/test_triton_warmup.py)."""

from __future__ import annotations

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.core.warmup import warm_up
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 40))


def _core(folder: str) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=folder, device="cpu", dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=96),
        )
    )


def _generate(core: EngineCore) -> list[int]:
    core.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                return list(out.outputs[0].token_ids)
    raise AssertionError("no output")


def test_warm_up_returns_every_page_and_leaves_generation_unchanged(tiny_model_dir):
    folder = tiny_model_dir("llama")
    core = _core(folder)
    free, steps = core.kv.num_free_pages, core.num_steps
    out = warm_up(core)
    assert out["steps"] == 2  # a prefill step and a mixed (decode + extend chunk) step
    assert out["backend_variants"] == 0  # torch_sdpa on CPU compiles nothing
    assert core.kv.num_free_pages == free and core.kv.num_held_pages == 0
    assert core.kv.num_cached_pages == 0  # nothing indexed in the prefix cache
    assert core.num_steps == steps and not core.has_unfinished_requests()
    warmed = _generate(core)
    assert warmed == _generate(_core(folder))  # a fresh engine, no warm-up: same tokens
    # the pages went back after the request too (none leaked by the warm-up's)
    assert core.kv.num_held_pages == 0


def test_warm_up_releases_its_pages_when_a_step_fails(tiny_model_dir, monkeypatch):
    core = _core(tiny_model_dir("llama"))
    free = core.kv.num_free_pages

    def boom(plan):
        raise RuntimeError("step failed")

    monkeypatch.setattr(core.executor, "execute", boom)
    with pytest.raises(RuntimeError, match="step failed"):
        warm_up(core)
    assert core.kv.num_free_pages == free and core.kv.num_held_pages == 0
