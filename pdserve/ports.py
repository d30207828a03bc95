"""The one check of a TCP port number (a leaf: imports nothing of pdserve).

``allow_zero``: 0 asks the kernel for a free port, right for a port this process listens
on, wrong for a peer's port it connects to."""

from __future__ import annotations

PORT_MAX = 65535


def check_port(value: object, field: str, *, allow_zero: bool) -> int:
    """Return ``value`` if it is an int port in ``[0 or 1, 65535]``; ValueError naming
    ``field`` and the range otherwise (a bool is not a port)."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= PORT_MAX:
        raise ValueError(f"{field} must be in [{low}, {PORT_MAX}], got {value!r}")
    return value
