"""CompileWatch: Triton's post-compile hook counts start-up compiles, then logs and counts
each later one by kernel; a hook set before is chained and put back."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pdserve.server.metrics import ServerMetrics
from pdserve.triton_watch import CompileWatch


def _hook_target():
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
        return runtime, "jit_post_compile_hook"
    from triton.runtime.jit import JITFunction

    return JITFunction, "compiled_hook"


def _event(name: str) -> dict:
    """The keywords Triton's JITFunction._call_hook passes (fn: a JitFunctionInfo)."""
    return dict(
        key="k",
        repr=f"{name}[num_warps=4]",
        fn=SimpleNamespace(name=name, module="m", jit_function=None),
        compile={},
        is_manual_warmup=False,
        already_compiled=False,
    )


def test_compiles_counted_then_logged_by_kernel_and_exported(caplog):
    pytest.importorskip("triton")
    target = _hook_target()
    seen: list[str] = []
    before = getattr(*target)
    setattr(*target, lambda **kw: seen.append(kw["fn"].name))  # a hook someone set before
    try:
        chained = getattr(*target)
        w = CompileWatch().install()
        hook = getattr(*target)
        assert hook == w.on_compile  # Triton calls the watch now
        hook(**_event("store_kv_kernel"))
        hook(**_event("extend_kernel"))
        assert w.stats() == {
            "compilations_at_startup": 2,
            "compilations_after_startup": 0,
            "compilations_after_startup_by_kernel": {},
        }
        w.mark_started()
        with caplog.at_level(logging.WARNING, logger="pdserve.triton_watch"):
            hook(**_event("decode_split_kernel"))
            hook(**_event("decode_split_kernel"))
            hook(**_event("decode_merge_kernel"))
        stats = w.stats()
        assert stats["compilations_at_startup"] == 2
        assert stats["compilations_after_startup"] == 3
        assert stats["compilations_after_startup_by_kernel"] == {
            "decode_split_kernel": 2,
            "decode_merge_kernel": 1,
        }
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 3 and "decode_merge_kernel" in warned[2]
        assert seen == ["store_kv_kernel", "extend_kernel", *["decode_split_kernel"] * 2,
                        "decode_merge_kernel"]  # fmt: skip
        # /metrics: a counter, and a counter labelled by kernel
        text = ServerMetrics({"pdserve_triton": w.stats}).render().decode()
        assert "pdserve_triton_compilations_after_startup_total 3.0" in text
        assert (
            'pdserve_triton_compilations_after_startup_by_kernel_total{kernel="decode_split_kernel"} 2.0'
            in text
        )
        w.uninstall()
        assert getattr(*target) is chained
    finally:
        setattr(*target, before)


@pytest.mark.gpu
def test_a_real_compile_reaches_the_hook():
    """The hook is the one Triton calls: a kernel compiled for the CPU interpreter is not
    compiled (nothing to count), so this is gpu-marked (``make test-gpu``)."""
    import os

    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device and no TRITON_INTERPRET")
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    w = CompileWatch().install()
    try:
        w.mark_started()
        x = torch.zeros(8, device="cuda")
        _add_one[(1,)](x, 8, BLOCK=8)
        torch.cuda.synchronize()
        assert w.stats()["compilations_after_startup_by_kernel"]
    finally:
        w.uninstall()
