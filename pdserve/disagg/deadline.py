"""Run a blocking call on a helper thread and give up on it at a deadline."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn()`` on a fresh daemon helper thread and wait at most ``timeout_s`` seconds.

    Returns ``fn``'s result unchanged. An exception raised by ``fn`` is re-raised in the
    caller as the very same object (its traceback extended). At the deadline raises
    ``TimeoutError`` naming ``what``; the helper thread is then abandoned (it is a daemon
    thread, so it cannot keep the process alive), because a hung native call (e.g. NIXL
    ``create_backend``) cannot be interrupted from Python.

    Thread-local state (such as the current CUDA device) is *not* inherited by the helper:
    ``fn`` must set up whatever it needs itself.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    box: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller unchanged
            box["error"] = exc
        finally:
            done.set()

    helper = threading.Thread(target=target, name=f"deadline:{what}", daemon=True)
    helper.start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{what} did not finish within {timeout_s:g} s")
    helper.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
