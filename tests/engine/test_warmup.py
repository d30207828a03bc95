"""Start-up warm-up (engine/core/warmup.py): the eager step shapes run, every page goes
back, the prefix cache stays empty, and what the engine generates afterwards is unchanged
on the CPU's torch_sdpa and on the triton backend (interpreted on CPU); the backend's own
warm-up alone: tests/model/test_triton_warmup.py."""

from __future__ import annotations

import os

if not __import__("torch").cuda.is_available():  # before the backend's kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")
    __import__("triton_interp").install()  # the interpreter without its redundant re-patching

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.core.warmup import warm_up
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 40))


def _core(folder: str, num_pages: int = 96) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=ModelConfig(model=folder, device="cpu", dtype="float32"),
            cache=CacheConfig(page_size=4, num_pages=num_pages),
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


def test_a_pool_too_small_for_the_warm_up_is_refused_naming_the_flag(tiny_model_dir):
    # page size 4: the warm-up's two requests take 3 + 4 pages (11 tokens + 1; 4 + 9)
    core = _core(tiny_model_dir("llama"), num_pages=5)
    with pytest.raises(ValueError, match=r"--num-pages.*needs 7 \(give --num-pages 7 or more"):
        warm_up(core)
    assert core.kv.num_held_pages == 0
    assert warm_up(_core(tiny_model_dir("llama"), num_pages=7))["steps"] == 2


@pytest.mark.timeout(300)
def test_engine_warm_up_through_the_triton_backend(tiny_model_dir):
    """The worker's warm-up on the triton backend (interpreted on CPU): the prefill step,
    the mixed step (a decode row through the split-KV kernel, then an extend chunk whose
    rows start at row0 = 1) and every eager decode configuration run; every page goes
    back; the engine then generates what an engine without a warm-up generates."""
    from pdserve.config import CacheConfig, EngineConfig, ModelConfig
    from pdserve.engine.core.engine import EngineCore
    from pdserve.engine.core.warmup import warm_up
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.model import triton_backend

    def core() -> EngineCore:
        return EngineCore(
            EngineConfig(
                model=ModelConfig(
                    model=tiny_model_dir("llama"), device="cpu", attention_backend="triton"
                ),
                cache=CacheConfig(page_size=4, num_pages=64),
            )
        )

    def generate(c: EngineCore) -> list[int]:
        c.add_request("r", list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=6))
        while True:
            for out in c.step():
                if out.finished:
                    return list(out.outputs[0].token_ids)

    warmed = core()
    free = warmed.kv.num_free_pages
    out = warm_up(warmed)
    assert out["steps"] == 2
    assert out["backend_variants"] == len(triton_backend.eager_decode_configs())
    assert warmed.kv.num_free_pages == free and warmed.kv.num_cached_pages == 0
    assert generate(warmed) == generate(core())
