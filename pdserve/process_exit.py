"""How a child process ended, in words, for the errors that name it (``pdserve up``'s
children, tensor-parallel ranks)."""

from __future__ import annotations

import signal


def death_cause(code: int | None) -> str:
    """From ``Popen.returncode`` / ``Process.exitcode``: ``-N`` means killed by signal N,
    ``None`` that no exit status is known (the process is gone or was never reaped)."""
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
