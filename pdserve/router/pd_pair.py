"""A PD request's two legs on a (prefill, decode) pair.

Both legs get the client's body plus ``bootstrap_host``, ``bootstrap_port`` (the prefill
worker's bootstrap server, ``workers.bootstrap_address``) and ``bootstrap_room``; the
router reserves the request's consecutive rooms from that one (:class:`LiveRooms`;
numbering: :mod:`pdserve.disagg.base`). The prefill leg is never streamed and has no
``stream`` fields: its answer serves only for prompt logprobs, cached-token counts, timing
and errors, merged into decode's (:mod:`pdserve.router.answer_merge`). The first failing
leg cancels the other (:func:`~pdserve.router.legs.wait_legs`).

:func:`whole_on_pair` answers a non-streamed request; :func:`open_on_pair` opens decode's
stream with the prefill leg still running beside it, for the relay to watch.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi.responses import Response

from pdserve import tracing
from pdserve.disagg.base import ROOM_LIMIT
from pdserve.http.wire import json_bytes
from pdserve.router.answer_merge import (
    merge_cached_tokens,
    merge_prompt_logprobs,
    merge_router_timing,
    merge_timing,
)
from pdserve.router.legs import Leg, LegSender, PrefillWatch, wait_legs
from pdserve.router.picking import Route
from pdserve.router.request_facts import num_samples, wants_prompt_logprobs
from pdserve.router.workers import WorkerState, bootstrap_address

# fields of the client's body that the prefill leg of a PD request does not get
_DECODE_ONLY_FIELDS = ("stream", "stream_options")


class LiveRooms:
    """The bootstrap rooms of the PD requests now running (``live``, a set the router's
    metrics read too); ``rng`` draws new ones."""

    def __init__(self, live: set[int], rng: random.Random | None = None) -> None:
        self.live = live
        # rooms only need to differ between routers sharing a prefill: a generator seeded
        # from os.urandom (random.Random's default) is as good as SystemRandom's syscall
        # per draw, which cost ~4 % of the router's CPU a request
        self._rng = rng or random.Random()

    def reserve(self, n: int) -> int:
        """Draw a random room R with R .. R+n-1 all free and below ``ROOM_LIMIT``; mark
        them live."""
        while True:
            room = self._rng.randrange(0, ROOM_LIMIT - n + 1)
            if not any(room + i in self.live for i in range(n)):
                self.live.update(range(room, room + n))
                return room

    def release(self, room: int, n: int) -> None:
        """Rooms ``room`` .. ``room + n - 1`` are free again."""
        self.live.difference_update(range(room, room + n))


@dataclass
class PairLegs:
    """A PD request's two legs (:func:`pair_legs`): the pair, its rooms (``room`` ..
    ``room + n - 1``), decode's body and prefill's; ``handed_off``: the rooms are released
    by whoever took them over (a stream's relay), not by the block."""

    prefill: WorkerState
    decode: WorkerState
    room: int
    n: int
    decode_body: dict
    prefill_body: dict
    handed_off: bool = False


@contextmanager
def pair_legs(rooms: LiveRooms, endpoint: str, body: dict, route: Route) -> Iterator[PairLegs]:
    """The two legs' bodies of a PD request on ``route``'s pair, with its bootstrap
    rooms reserved (and traced) for the block; released at its end unless the block
    set ``handed_off`` (then whoever took them over releases them)."""
    assert route.pair is not None
    prefill, decode = route.pair
    host, port = bootstrap_address(prefill)
    n = num_samples(endpoint, body)
    room = rooms.reserve(n)
    tracing.phase_so_far(
        "route",
        {
            "pdserve.prefill": prefill.url,
            "pdserve.decode": decode.url,
            "pdserve.room": room,
            "pdserve.rooms": n,
            **route.attributes(),
        },
    )
    legs = dict(body, bootstrap_host=host, bootstrap_port=port, bootstrap_room=room)
    # The prefill leg's answer serves only for prompt logprobs, counts and errors.
    prefill_body = {k: v for k, v in legs.items() if k not in _DECODE_ONLY_FIELDS}
    pd = PairLegs(prefill, decode, room, n, legs, prefill_body)
    try:
        yield pd
    finally:
        if not pd.handed_off:
            rooms.release(room, n)


async def whole_on_pair(
    legs: LegSender, rooms: LiveRooms, endpoint: str, body: dict, route: Route
) -> Response:
    """Decode's answer to ``body`` with prefill's merged in (prompt logprobs, timing,
    cached tokens; selective PD's decision in the timing blocks). Both workers are counted
    outstanding by the caller."""
    with pair_legs(rooms, endpoint, body, route) as pd:
        p_task = asyncio.ensure_future(
            legs.post(pd.prefill, endpoint, pd.prefill_body, counted=True)
        )
        d_task = asyncio.ensure_future(legs.post(pd.decode, endpoint, pd.decode_body, counted=True))
        await wait_legs((p_task, d_task))
        answer = d_task.result().json()
        prefill_answer = p_task.result().json()
        merge_prompt_logprobs(endpoint, answer, prefill_answer)
        merge_timing(endpoint, answer, prefill_answer)
        if route.info is not None:
            merge_router_timing(endpoint, answer, route.info)
        return Response(
            json_bytes(merge_cached_tokens(endpoint, answer, prefill_answer)),
            media_type="application/json",
        )


async def open_on_pair(
    legs: LegSender, rooms: LiveRooms, endpoint: str, body: dict, route: Route
) -> Leg:
    """Decode's open stream of ``body`` as a :class:`Leg` whose ``prefill`` watches the
    prefill leg, still running. Prefill is counted outstanding until its POST ends, decode
    and the rooms until the leg closes."""
    with pair_legs(rooms, endpoint, body, route) as pd:
        decode = pd.decode
        prefill_body = {k: v for k, v in pd.prefill_body.items() if k != "return_token_ids"}
        p_task = legs.post_task(pd.prefill, endpoint, prefill_body)
        with legs.counted_if_opened(decode):
            d_task = asyncio.ensure_future(legs.open_stream(decode, endpoint, pd.decode_body))
            # until decode's stream is open; prefill keeps running (the relay watches it)
            await wait_legs((p_task, d_task), until=d_task)

        def close() -> None:
            decode.outstanding -= 1
            rooms.release(pd.room, pd.n)

        pd.handed_off = True
        watch = PrefillWatch(p_task, hold_first=wants_prompt_logprobs(endpoint, body))
        return Leg(
            d_task.result(),
            decode,
            watch,
            close,
            {pd.prefill.url, decode.url},
            route.info,
            route.held,
        )
