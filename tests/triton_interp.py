"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) without its redundant re-patching.

Under the interpreter a launch (``GridExecutor``) patches ``triton.language`` once for the
grid (``_patch_lang``: every builtin of ``tl``, ``tl.tensor``, ``tl.math`` wrapped for the
interpreter, restored when the grid ends); but every call of a ``@triton.jit`` helper inside
the kernel (``InterpretedFunction.__call__``: ``_dot``, ``pdl_enter``, the tile loops), in
every program of the grid, patches the same modules again (``inspect.getmembers`` over
them all: ~2 ms a call, a third of a grouped-MoE launch's CPU time). Those re-patches set
attributes that the grid's patch already set to the same wrappers.

:func:`install` skips a helper's re-patch when the running grid's own patch already covered
every language module the helper's globals name (``tl``, ``tl.core``); a helper naming one
the grid's did not still patches it, as before. Nothing else changes: the same interpreted
code, the same wrappers. Idempotent; a Triton without these internals is left as it is.
"""

from __future__ import annotations

import inspect
from typing import Any

_installed = False


def install() -> None:
    """Wrap ``triton.runtime.interpreter``'s ``_patch_lang`` and ``GridExecutor.__call__``
    (see the module docstring); once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    real_patch = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if real_patch is None or scope_cls is None or executor is None:
        return
    langs_of_triton = (tl, tl.core)
    # per running grid (a stack: one at a time in practice): the language modules its own
    # patch covered, None until that patch (its first _patch_lang call) is made
    grids: list[frozenset[int] | None] = []

    found: dict[tuple[Any, int], frozenset[int]] = {}  # per (function, size of its globals)

    def langs(fn: Any) -> frozenset[int]:
        key = (fn, len(fn.__globals__))
        if key not in found:
            found[key] = frozenset(
                id(v)
                for v in fn.__globals__.values()
                if inspect.ismodule(v) and v in langs_of_triton
            )
        return found[key]

    def patch_lang(fn: Any) -> Any:
        if grids and grids[-1] is not None and langs(fn) <= grids[-1]:
            return scope_cls()  # already patched for this grid: nothing to set or restore
        scope = real_patch(fn)
        if grids:  # the grid's own patch (restored when it ends), or a helper's (never is)
            grids[-1] = langs(fn) | (grids[-1] or frozenset())
        return scope

    real_call = executor.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        grids.append(None)
        try:
            return real_call(self, *args, **kwargs)
        finally:
            grids.pop()

    interpreter._patch_lang = patch_lang
    executor.__call__ = call
