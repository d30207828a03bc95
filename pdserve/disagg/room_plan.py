"""Room numbering of a PD request, the one rule the router and the workers share.

The router draws one ``bootstrap_room`` R per client request and sends it to both legs.
A request of ``P`` prompts with ``n`` samples each reserves the ``P * n`` rooms
``R .. R + P * n - 1``: sample ``i`` of prompt ``p`` uses room ``R + p * n + i`` on both
workers, so every sample has its own live room. Every room is an int in
``[0, ROOM_LIMIT)``, and a request uses at most ``MAX_ROOMS_PER_REQUEST`` of them.

A leaf next to :data:`pdserve.disagg.base.ROOM_LIMIT`: the router and the server both
import it, and it imports neither.
"""

from __future__ import annotations

from pdserve.disagg.base import ROOM_LIMIT

# Cap on the rooms one request reserves through a PD router (workers reject
# n > protocol.MAX_N); documented in docs/reference.md's `n` row (launch/api_docs.py).
MAX_ROOMS_PER_REQUEST = 1024


def sample_room(room: int, prompt_index: int, n: int, sample_index: int) -> int:
    """The room of sample ``sample_index`` of prompt ``prompt_index`` of a request whose
    ``bootstrap_room`` is ``room`` and which has ``n`` samples per prompt."""
    return room + prompt_index * n + sample_index


def rooms_needed(num_prompts: int, n: int) -> int:
    """How many consecutive rooms a request of ``num_prompts`` prompts with ``n`` samples
    each reserves."""
    return num_prompts * n


def check_room(value: object, field: str = "bootstrap_room") -> int:
    """``value`` if it is an int (not a bool) in ``[0, ROOM_LIMIT)``; else ValueError
    naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < ROOM_LIMIT:
        bound = f"2**{ROOM_LIMIT.bit_length() - 1}"
        raise ValueError(f"{field} must be an integer in [0, {bound}), got {value!r}")
    return value
