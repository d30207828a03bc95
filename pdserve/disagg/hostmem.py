"""Host (CPU) memory for KV pools that NIXL moves well: transparent huge pages.

Between two processes on one host, UCX copies with CMA (``process_vm_writev``), which pins
the pages of every descriptor; on 2 MiB pages that costs far less than on 4 KiB pages.
numpy asks the kernel for huge pages on large arrays (``madvise(MADV_HUGEPAGE)``), torch
does not; so the pools ask for them here (the gain: docs/benchmarks.md, "Notes moved from
disagg docstrings").
"""

from __future__ import annotations

import ctypes
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MADV_HUGEPAGE = 14
_HUGE = 2 << 20


def advise_hugepages(address: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned interior of ``[address, address+nbytes)``.
    Effective for pages not touched yet. Returns False where unsupported (not Linux, or
    the kernel refused)."""
    if not sys.platform.startswith("linux"):
        return False
    start = (address + _HUGE - 1) & ~(_HUGE - 1)
    end = (address + nbytes) & ~(_HUGE - 1)
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on CPU, advised to use huge pages before first touch."""
    import torch

    t = torch.empty(shape, dtype=dtype)
    advise_hugepages(t.data_ptr(), t.numel() * t.element_size())
    return t
