"""Programmatic dependent launch (PDL) of our Triton kernels, CUDA sm_90+ only, opt-in.

A kernel launched with PDL may start while the kernel before it on the stream is still
finishing; it must then wait for that kernel's completion in-kernel before it touches
memory (PTX ``griddepcontrol.wait``: Triton's ``gdc_wait``), and it lets the kernel after
it launch early (``griddepcontrol.launch_dependents``). Every kernel of ours that takes a
``PDL`` constexpr does both first thing when ``PDL`` is set, before any load or store, so
the only overlap is launch latency and CTA scheduling; results are the same bits. A kernel
launched without PDL (cuBLAS, torch) runs as before: it starts after its predecessor ends.

Off unless ``PDSERVE_TRITON_PDL=1``: not measured in the engine (a probe's figures:
docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdserve import envs

_OFF: dict[str, Any] = {"PDL": False}


# With PDL on: whether each kernel lets the next one launch before it waits for its own
# predecessor (``PDL`` = 2) rather than after (``PDL`` = True). Then the kernels that read
# weights before the wait (triton_w8a8's prefetch) may start a few launches ahead; the
# order of the results is the same (each still waits for the kernel before it, which
# itself waited). Off until measured in the engine's step (scripts/gpu_s7_fp8row.sh).
TRIGGER_FIRST = False


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a PDL-capable kernel: with ``PDL``, wait until the previous kernel on
    the stream has finished and its writes are visible, then let the next one launch;
    ``PDL == 2``: let the next one launch first, then wait (:data:`TRIGGER_FIRST`)."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ``ptrs`` (a tensor of global addresses, valid ones: no
    mask) in L2 (PTX ``prefetch.global.L2``), no wait, no value. For data no earlier kernel
    of a step writes (weights), issued before :func:`pdl_enter`'s wait so that the read
    overlaps the previous kernel's tail. CUDA only (inline PTX: not under the interpreter)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@functools.cache
def _options(device_index: int) -> dict[str, Any]:
    if not envs.TRITON_PDL.get() or os.environ.get("TRITON_INTERPRET") == "1":
        return _OFF  # (the interpreter has no grid dependency control)
    if torch.cuda.get_device_capability(device_index)[0] < 9:
        return _OFF
    return {"PDL": 2 if TRIGGER_FIRST else True, "launch_pdl": True}


def launch_options(t: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for launching a PDL-capable kernel whose tensors live where ``t``
    does: ``{"PDL": True, "launch_pdl": True}`` when ``PDSERVE_TRITON_PDL`` is on (read
    once a process and device; ``"PDL": 2`` with :data:`TRIGGER_FIRST`) and ``t`` is on a CUDA device of compute capability >= 9,
    else ``{"PDL": False}``."""
    if t.device.type != "cuda":
        return _OFF
    return _options(t.device.index if t.device.index is not None else 0)
