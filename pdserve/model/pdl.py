"""Programmatic dependent launch (PDL) of our Triton kernels, CUDA sm_90+ only.

A kernel launched with PDL may start while the kernel before it on the stream is still
finishing; it must then wait for that kernel's completion in-kernel before it touches
memory (PTX ``griddepcontrol.wait``: Triton's ``gdc_wait``), and it lets the kernel after
it launch early (``griddepcontrol.launch_dependents``). Every kernel of ours that takes a
``PDL`` constexpr does both first thing when ``PDL`` is set, before any load or store of
data another kernel may write, so the only overlap is launch latency, CTA scheduling and
weight reads; results are the same bits. A kernel
launched without PDL (cuBLAS, torch) runs as before: it starts after its predecessor ends.

Kernels that read weights may read them before the wait (weights are never written
during a step): the FP8 one-row gemv its first weight tile, the w8a8 kernel asks for its
first tiles in L2 (:func:`prefetch_l2`), so those reads overlap the previous kernel's tail.

On by default on sm_90+ (``PDSERVE_TRITON_PDL=0`` turns it off): in the engine's one-row
decode step on the H200 it saved 0.20 ms of 2.94 (FP8) and 0.11 of 4.34 (bf16), and a
little at 64 / 256 rows (docs/benchmarks.md, session 7).
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


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a PDL-capable kernel: with ``PDL``, wait until the previous kernel on
    the stream has finished and its writes are visible, then let the next one launch."""
    if PDL:
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
    return {"PDL": True, "launch_pdl": True}


def launch_options(t: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments for launching a PDL-capable kernel whose tensors live where ``t``
    does: ``{"PDL": True, "launch_pdl": True}`` when ``PDSERVE_TRITON_PDL`` is on (the default; read
    once a process and device) and ``t`` is on a CUDA device of compute capability >= 9,
    else ``{"PDL": False}``."""
    if t.device.type != "cuda":
        return _OFF
    return _options(t.device.index if t.device.index is not None else 0)
