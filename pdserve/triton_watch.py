"""Triton compilations in a serving process: counted, and after start-up logged by kernel.

Triton compiles a ``@triton.jit`` kernel once per set of compile-time constants and per
specialization of its plain arguments (an int equal to 1 or divisible by 16, a pointer
16-byte aligned or not). A compile costs about 0.3-1.5 s on an H200 and runs in the
engine thread, inside the step of whichever request first needs that variant: a stall of
the whole batch. Start-up compiles what serving needs (graph capture, the worker's
warm-up: ``engine/core/warmup.py``); :class:`CompileWatch` counts every compilation
through Triton's JIT hook and, once :meth:`CompileWatch.mark_started` is called, logs each
later one as a warning naming the kernel and counts it by kernel (``/metrics``:
``pdserve_triton_compilations_after_startup_total``; ``/get_server_info``: ``triton``).

The hook is ``triton.knobs.runtime.jit_post_compile_hook`` (Triton >= 3.4), else the class
attribute ``JITFunction.compiled_hook`` of older releases; a hook already set is called
too. Triton calls it on every miss of a kernel's in-memory cache, also when the variant
then loads from Triton's disk cache (cheaper than a compile, but still a pause, and the
variant a warm-up missed). Under ``TRITON_INTERPRET=1`` kernels are interpreted, not
compiled: nothing is counted.

A leaf: imports nothing of pdserve.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


class CompileWatch:
    """Counts Triton JIT compilations; those after :meth:`mark_started` are logged and
    counted per kernel. :meth:`install` sets the hook (once per process:
    :func:`process_watch`); :meth:`stats` may be read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._at_startup = 0
        self._after: dict[str, int] = {}
        self._previous: Any = None
        self._target: tuple[Any, str] | None = None

    def install(self) -> CompileWatch:
        """Set Triton's post-compile hook to :meth:`on_compile` (chaining a hook already
        set); returns self. Without Triton installed nothing is set."""
        try:
            import triton
        except ImportError:  # a CPU install without Triton: nothing compiles
            return self
        knobs = getattr(triton, "knobs", None)
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            target: tuple[Any, str] = (runtime, "jit_post_compile_hook")
        else:
            from triton.runtime.jit import JITFunction

            target = (JITFunction, "compiled_hook")
        previous = getattr(*target, None)
        if previous is self.on_compile:
            return self
        self._previous, self._target = previous, target
        setattr(*target, self.on_compile)
        return self

    def uninstall(self) -> None:
        """Put back the hook that was set before :meth:`install`."""
        if self._target is not None and getattr(*self._target, None) == self.on_compile:
            setattr(*self._target, self._previous)
        self._target = None

    def mark_started(self) -> None:
        """Start-up is over: from now on each compilation is a stall, logged and counted."""
        with self._lock:
            self._started = True

    def on_compile(self, *args: Any, **kwargs: Any) -> Any:
        """Triton's hook: called with keywords ``key``, ``repr``, ``fn`` (``.name``: the
        kernel's qualified name), ``compile``, ``is_manual_warmup``, ``already_compiled``.
        Returns what a chained hook returns (else ``None``: Triton goes on)."""
        fn = kwargs.get("fn")
        name = str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or "?")
        with self._lock:
            started = self._started
            if started:
                self._after[name] = self._after.get(name, 0) + 1
            else:
                self._at_startup += 1
        if started:
            logger.warning(
                "triton: kernel %s compiled after start-up (a stall of the step that needed "
                "it; a variant the warm-up did not run): %s",
                name,
                kwargs.get("repr") or "",
            )
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return None

    def stats(self) -> dict:
        """``{"compilations_at_startup", "compilations_after_startup",
        "compilations_after_startup_by_kernel": {kernel: count}}``."""
        with self._lock:
            return {
                "compilations_at_startup": self._at_startup,
                "compilations_after_startup": sum(self._after.values()),
                "compilations_after_startup_by_kernel": dict(self._after),
            }


_PROCESS: CompileWatch | None = None


def process_watch() -> CompileWatch:
    """The process's one installed :class:`CompileWatch` (created on the first call)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = CompileWatch().install()
    return _PROCESS
