"""The engine's side of prefill/decode disaggregation (rules in docs/architecture.md).

Prefill role: the request queues like any request at once and its prompt is computed
while decode's destination is still on its way ("computed ahead"), as long as the prompts
computed ahead hold at most ``ahead_pages`` pages between them (their whole prompts
counted from arrival until the destination comes); beyond that cap a request waits for its
destination without pages (``WAITING_FOR_PEER``) and queues when it comes, or when the cap
has room again, first come first served (a prompt larger than the whole cap waits for its
destination without holding the others back).  Nothing is sent before
``sender.poll() >= WaitingForInput`` (the destination arrived), when it gets an aux slot and
``sender.init(num_pages, aux_slot)`` and every page computed so far is posted at once.
After that, after each prefill chunk the pages it filled are posted
(``sender.send(pages, last=False)``: the transfer of a long prompt overlaps its own
compute); after the last chunk the first token is sampled and ``sender.send(rest,
last=True, aux=record)`` posts the remaining pages (the partial one included) and the aux
record, which only the transfer layer writes — or, the destination not there yet, the
request leaves the batch holding its pages (``TRANSFERRING``, ``PDState.pending_aux``) and
that last send goes out when the destination arrives; ``ahead_timeout_s`` after it was
computed it gives its pages back instead (full pages stay in the prefix cache; nothing of
it was sent) and waits for its destination without pages, as one the cap kept, but holding
no later one back; its room stays alive, and when the destination comes its prompt's KV is
computed again (mostly prefix-cache hits; the first token stays the one sampled, nothing is
sampled again: ``Request.compute_end``) and sent with that aux record.  The backend's
bootstrap timeout bounds the whole wait, from arrival.  An abort frees a computed room's
pages at the next poll (nothing of it was sent).  At ``Success`` it finishes with that
one token.  A request with pages sent is never preempted and its
pages are freed only after a terminal poll.
Decode role: once ``receiver.poll() >= WaitingForInput`` (and no request waits in the
queue) it gets pages for the prompt and an aux slot: the leading full pages it already
holds in its prefix cache are shared, fresh pages cover the rest, and
``receiver.init(fresh_pages, slot, skip_pages=len(held))`` asks prefill for the rest only;
at ``Success`` it joins the batch with the prompt "computed elsewhere" and the first
token from the aux record.  Pages handed to the transfer layer are released only after
a terminal poll (also after an abort); then ``close()`` is called once.  Pages are
allocated and released through the one page owner (``KVCacheManager``); aux slots come
from ``PageIds``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from pdserve.disagg.base import (
    AuxRecord,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransferError,
    Role,
)
from pdserve.engine.core.request import DisaggRequestInfo, PDState, Request, Status
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.kv.cache import KVCacheManager, PageIds
from pdserve.engine.step import BatchPlan, SampledToken
from pdserve.engine.worker.sampler import skip_draw

logger = logging.getLogger(__name__)


def _poll(handle: KVSender | KVReceiver) -> tuple[KVPoll, str | None]:
    """Poll a sender/receiver.  A poll that raises counts as terminal ``Failed`` with that
    message (after a best-effort ``abort()``): a broken backend must not kill the engine."""
    try:
        state = handle.poll()
    except Exception as exc:  # noqa: BLE001
        try:
            handle.abort()
        except Exception:  # noqa: BLE001
            pass
        return KVPoll.Failed, f"KV transfer poll raised {type(exc).__name__}: {exc}"
    if state == KVPoll.Failed:
        failure = handle.failure_exception()
        return state, str(failure) if failure else "KV transfer failed"
    return state, None


def _holds(handle: KVSender | KVReceiver | None) -> bool:
    """``handle.holds_pages()``; a backend that raises there keeps the pages (safe side)."""
    try:
        return bool(getattr(handle, "holds_pages", lambda: False)())
    except Exception:  # noqa: BLE001
        return True


def _pd(req: Request) -> PDState:
    """``req.pd``: every request the flow tracks is a disaggregated one."""
    assert req.pd is not None, req.request_id
    return req.pd


class PDFlow:
    """Tracks every request that holds a KV sender or receiver (``EngineCore.pd``): the
    room's life, and ``Request.pd`` (:class:`PDState`), which only this class changes.
    The engine owns the tokens: it appends a token the flow hands it (decode's first token
    from the aux record) and the flow sends what prefill sampled.

    managers: ``{"nixl": ..., "fake": ...}``; a request uses ``"fake"`` when
    ``DisaggRequestInfo.fake`` else ``transfer_backend``.  vocab_size: bound of a valid
    first token id.  ahead_pages: the pages prefill prompts computed before decode's
    destination arrived may take between them (each counted as its whole prompt's pages;
    0: none is computed ahead).  ahead_timeout_s: seconds a prompt computed ahead holds its
    pages waiting for its destination before it gives them back (:meth:`_give_back`);
    ValueError if <= 0 or ``ahead_pages`` < 0.
    """

    def __init__(
        self,
        page_ids: PageIds,
        kv: KVCacheManager,
        scheduler: Scheduler,
        managers: Mapping[str, KVManager],
        transfer_backend: str,
        vocab_size: int,
        *,
        ahead_pages: int = 0,
        ahead_timeout_s: float = 30.0,
    ) -> None:
        if ahead_pages < 0:
            raise ValueError(f"ahead_pages must be >= 0, got {ahead_pages}")
        if ahead_timeout_s <= 0:
            raise ValueError(f"ahead_timeout_s must be > 0, got {ahead_timeout_s}")
        self._ahead_cap = ahead_pages
        self._ahead_timeout_s = ahead_timeout_s
        self._ahead_held = 0  # pages counted against the cap (PDState.ahead_pages summed)
        self.num_ahead_capped = 0  # requests that waited for their destination: cap full
        self.num_ahead_expired = 0  # computed-ahead prompts that gave their pages back
        self._page_ids = page_ids
        self._kv = kv
        self._vocab_size = vocab_size
        self._scheduler = scheduler
        self._managers = dict(managers)
        self._backend = transfer_backend
        self._live: list[Request] = []  # arrival order
        # (handle, pages, aux slot)
        self._draining: list[tuple[KVSender | KVReceiver, list[int], int | None]] = []

    def set_managers(self, managers: Mapping[str, KVManager]) -> None:
        """Replace the managers (``EngineCore.bind_kv_managers``: before any request)."""
        self._managers = dict(managers)

    def set_wakeup(self, wakeup: Callable[[], None] | None) -> None:
        """``KVManager.set_wakeup`` on every manager (``EngineCore.set_kv_wakeup``)."""
        for manager in self._managers.values():
            manager.set_wakeup(wakeup)

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    def count(self, status: Status) -> int:
        return sum(1 for r in self._live if r.status is status)

    @property
    def num_waiting_for_peer(self) -> int:
        """Requests whose peer is not ready yet: decode ones bootstrapping
        (``WAITING_FOR_PEER``), prefill ones whose destination has not arrived (computing,
        computed meanwhile, or waiting without pages)."""
        return sum(
            1
            for r in self._live
            if r.status is Status.WAITING_FOR_PEER
            or (_pd(r).sender is not None and not _pd(r).dest_ready)
        )

    @property
    def num_ahead_pages(self) -> int:
        """Pages counted against the compute-ahead cap now: the whole prompts of the prefill
        requests computed (or queued to be) before decode's destination arrived."""
        return self._ahead_held

    @staticmethod
    def holds_room(req: Request) -> bool:
        """Whether ``req`` holds a KV sender or receiver (its end goes through the flow)."""
        return req.pd is not None and req.pd.handle is not None

    @staticmethod
    def sends_first_token(req: Request) -> bool:
        """Whether ``req``'s sampled token goes to decode with its KV (prefill role) instead
        of being appended and checked here."""
        return req.pd is not None and req.pd.info.role is Role.PREFILL

    def manager_for(self, info: DisaggRequestInfo) -> KVManager:
        """The manager serving ``info``; ValueError naming ``disagg`` when absent or of
        the other role."""
        key = "fake" if info.fake else self._backend
        manager = self._managers.get(key)
        if manager is None:
            raise ValueError(f"disagg: this engine has no {key!r} KV transfer manager")
        if manager.role != info.role:
            raise ValueError(
                f"disagg.role {info.role!r} does not match this worker's role {manager.role!r}"
            )
        return manager

    def add(self, req: Request, manager: KVManager) -> None:
        """Create the room's sender/receiver (DuplicateRoomError passes through)."""
        pd = _pd(req)
        info = pd.info
        if info.role is Role.PREFILL:
            pd.sender = manager.create_sender(info.bootstrap_room)
            earlier = any(  # first come first served: none overtakes one the cap kept
                r.status is Status.WAITING_FOR_PEER
                and _pd(r).sender is not None
                and not self._waits_for_dest(r)
                for r in self._live
            )
            self._live.append(req)
            if earlier or not self._compute_ahead(req):
                self.num_ahead_capped += 1
                req.status = Status.WAITING_FOR_PEER  # queued when its destination comes
            return
        else:
            pd.receiver = manager.create_receiver(
                info.bootstrap_host, info.bootstrap_port, info.bootstrap_room
            )
            req.prompt_logprobs = (
                None  # the prompt is computed (and its logprobs reported) on prefill
            )
        req.status = Status.WAITING_FOR_PEER
        self._live.append(req)

    # --- per step -----------------------------------------------------------------------
    def poll(self) -> list[tuple[Request, SampledToken | None]]:
        """Advance every room by its poll state; returns the requests that finished, failed
        or joined, in that order.  A joined decode request comes with prefill's first
        token (from the aux record): the engine appends it as any token, then calls
        :meth:`join`; the others come with ``None``."""
        changed: list[tuple[Request, SampledToken | None]] = []
        blocked = False  # a prefill request over the compute-ahead cap: the later ones wait
        now = time.perf_counter()
        for req in list(self._live):
            pd = _pd(req)
            if (
                pd.pending_aux is not None
                and not pd.expired
                and not pd.dest_ready
                and now - req.times.computed > self._ahead_timeout_s
            ):
                self._give_back(req)  # waits for its destination without pages (below)
            handle = pd.handle
            assert handle is not None  # every live request holds a sender or a receiver
            state, error = _poll(handle)
            if state == KVPoll.Failed:
                if req.status in (Status.WAITING, Status.RUNNING):
                    self._scheduler.remove(req)  # not yet handed over: the pages are ours
                self._end(req, "error", error=error)
                changed.append((req, None))
            elif pd.sender is not None and not pd.dest_ready:
                if state >= KVPoll.WaitingForInput:
                    self._start_sending(req)
                    if req.finished:
                        changed.append((req, None))
                    elif pd.dest_ready and req.status is Status.WAITING_FOR_PEER:
                        # the cap kept it, or it gave its pages back: computed now
                        self._scheduler.add_waiting(req)
                elif (
                    req.status is Status.WAITING_FOR_PEER
                    and not blocked
                    and not self._waits_for_dest(req)
                ):
                    blocked = not self._compute_ahead(req)
            elif req.status is Status.WAITING_FOR_PEER and state >= KVPoll.WaitingForInput:
                pd.peer_ready = True
                req.times.peer_ready = time.perf_counter()
            elif req.status is Status.TRANSFERRING and state == KVPoll.Success:
                req.times.transfer_done = time.perf_counter()
                req.times.transfer_finished = getattr(handle, "finished_at", None) or 0.0
                if pd.sender is not None:
                    self._end(req, *pd.pending_finish)
                    changed.append((req, None))
                else:
                    changed.append((req, self._join_decode(req)))
        for item in list(self._draining):
            handle, pages, slot = item
            if _poll(handle)[0] in (KVPoll.Success, KVPoll.Failed) and not _holds(handle):
                self._draining.remove(item)
                self._release(handle, pages, slot)
        return changed

    @property
    def num_quarantined_pages(self) -> int:
        """Pages kept out of use because a prefill that may still WRITE them was not ruled
        out (``KVReceiver.holds_pages``)."""
        return sum(len(pages) for handle, pages, _ in self._draining if _holds(handle))

    def _compute_ahead(self, req: Request) -> bool:
        """Queue prefill request ``req`` before its destination arrived if its prompt's
        pages fit under the cap (counted against it until the destination comes or the
        request ends); False (nothing changed) if they do not."""
        pd = _pd(req)
        need = self._scheduler.pages_needed(req.num_prompt_tokens)
        if self._ahead_held + need > self._ahead_cap:
            return False
        pd.ahead_pages, self._ahead_held = need, self._ahead_held + need
        self._scheduler.add_waiting(req)  # computed now; the sends wait (_start_sending)
        return True

    def _waits_for_dest(self, req: Request) -> bool:
        """Whether prefill request ``req`` is never computed before its destination arrives,
        and so keeps no later request from the cap (it waits for its destination): its
        prompt alone takes more pages than the cap, or it gave its computed pages back
        after ``ahead_timeout_s`` (:meth:`_give_back`)."""
        if _pd(req).expired:
            return True
        return self._scheduler.pages_needed(req.num_prompt_tokens) > self._ahead_cap

    def _uncount_ahead(self, pd: PDState) -> None:
        self._ahead_held -= pd.ahead_pages
        pd.ahead_pages = 0

    def _give_back(self, req: Request) -> None:
        """``req``'s prompt was computed ``ahead_timeout_s`` ago and decode's destination
        has not come (a decode short of pages sends it only once it has them): the
        fallback to the order before compute-ahead, not a failure.  Its pages go back
        (full ones stay in the prefix cache, evictable) and leave the cap; it waits for its
        destination without pages (``WAITING_FOR_PEER``, holding no later one back), its
        room alive (the backend's bootstrap timeout still bounds the whole wait); when the
        destination comes it is queued and its prompt's KV computed again, then sent with
        the first token sampled the first time (``pending_aux``, :meth:`send_chunks`)."""
        pd = _pd(req)
        assert pd.sender is not None and pd.kv_pages_sent == 0  # nothing sent before dest
        assert req.status is Status.TRANSFERRING and pd.pending_aux is not None
        pd.expired = True
        self.num_ahead_expired += 1
        self._uncount_ahead(pd)
        held = len(req.pages)
        self._scheduler.free_pages(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING_FOR_PEER
        logger.info(
            "room %d: decode's destination did not arrive within %g s of the prompt being "
            "computed (--pd-compute-ahead-timeout): its %d KV pages are given back; it is "
            "computed again when the destination comes",
            pd.info.bootstrap_room,
            self._ahead_timeout_s,
            held,
        )

    def _start_sending(self, req: Request) -> None:
        """Decode's destination arrived for a prefill request (queued, computing, computed
        and waiting, or waiting without pages): an aux slot, ``init``, then what is computed
        goes out at once: the whole prompt and the aux record if it is done, else its full
        pages (none for one waiting without pages: :meth:`poll` queues it)."""
        pd = _pd(req)
        slot = self._page_ids.allocate_aux_slot()
        if slot is None:
            return  # all aux slots in use: try again next step
        pd.aux_slot = slot
        req.times.peer_ready = time.perf_counter()
        assert pd.sender is not None  # only called for a request with a sender
        try:
            pd.sender.init(self._scheduler.pages_needed(req.num_prompt_tokens), slot)
        except Exception as exc:  # noqa: BLE001 - fail this request, not the engine
            self.abort(req, reason="error", error=f"KV sender init failed: {exc}")
            return
        pd.dest_ready = True
        self._uncount_ahead(pd)
        if req.status is Status.TRANSFERRING:  # computed before the destination came
            aux, pd.pending_aux = pd.pending_aux, None
            assert aux is not None  # kept by send_prefill
            self._send_last(req, aux)
        elif req.status is Status.RUNNING:  # chunks computed so far (none in flight:
            self._send_full_pages(req)  # prefill rows never run in a launched step)

    def admit_receivers(self) -> list[Request]:
        """Give ready decode requests their prompt's pages and an aux slot, FCFS, while
        no request waits in the queue (joined or preempted work runs first: KV is not
        received faster than it can be used).  Returns the requests that failed on the way."""
        failed: list[Request] = []
        if self._scheduler.has_waiting():
            return failed
        for req in list(self._live):
            pd = _pd(req)
            if req.status is not Status.WAITING_FOR_PEER or not pd.peer_ready:
                continue
            # Leading prompt pages this worker holds already (a conversation's earlier
            # turns): prefill sends only the rest.  At most (n - 1) // page_size, as on
            # admission, so at least the last page moves.
            # the prompt's page keys hashed once (kept on the request), matched at each try
            held, keys = self._kv.match_prefix_keys(
                req.prompt_token_ids, req.num_prompt_tokens - 1, req.known_keys
            )
            if len(keys) > len(req.known_keys):
                req.known_keys = keys
            fresh = self._scheduler.need_pages(req, req.num_prompt_tokens, len(held))
            if (
                fresh > self._kv.num_available_pages - self._kv.num_evictable_among(held)
                or self._page_ids.num_free_aux_slots == 0
            ):
                break
            slot = self._page_ids.allocate_aux_slot()
            assert slot is not None  # a free slot was checked just above
            assert pd.receiver is not None  # a decode request waiting for its peer has one
            pd.aux_slot = slot
            self._kv.share(held)
            req.pages = held + self._kv.allocate(fresh)
            req.page_keys = keys[: len(held)]
            req.num_cached_tokens = len(held) * self._kv.page_size
            self._kv.cache.record_lookup(req.num_prompt_tokens, req.num_cached_tokens)
            req.status = Status.TRANSFERRING
            req.times.transfer_posted, req.times.kv_pages = time.perf_counter(), fresh
            try:
                pd.receiver.init(req.pages[len(held) :], slot, skip_pages=len(held))
            except Exception as exc:  # noqa: BLE001 - fail this request, not the engine
                self.abort(req, reason="error", error=f"KV receiver init failed: {exc}")
                failed.append(req)
        return failed

    def _senders_by_id(self) -> dict[str, Request]:
        return {r.request_id: r for r in self._live if _pd(r).sender is not None}

    def expect_sends(self, plan: BatchPlan) -> None:
        """Before a step: each prefill-role request whose last prompt chunk is in ``plan``
        and that has sent no page yet tells its sender the pages its one last send will
        list (``KVSender.expect_pages``: NIXL makes that WRITE once decode's destination is
        known too, so the send after the forward only posts it)."""
        if not self._live:
            return
        by_id = self._senders_by_id()
        for seq in plan.seqs:
            req = by_id.get(seq.request_id)
            if req is None or seq.start_pos + len(seq.token_ids) < req.num_prompt_tokens:
                continue  # not the prompt's last chunk
            pd = _pd(req)
            if pd.sender is None or pd.kv_pages_sent:
                continue
            try:
                pd.sender.expect_pages(list(req.pages))
            except Exception as exc:  # noqa: BLE001 - a hint; the send goes the usual way
                logger.warning("request %s: KV send hint failed: %s", req.request_id, exc)

    def send_chunks(self, plan: BatchPlan) -> None:
        """After a step: every prefill-role request whose prompt is not finished sends the
        pages its computed tokens fill completely (chunked sending); one that computed its
        prompt's KV again after giving its pages back (:meth:`_give_back`, nothing sampled)
        and reached the prompt's end leaves the batch and sends the rest with the aux
        record of its first computation."""
        by_id = self._senders_by_id()
        for seq in plan.seqs:
            req = by_id.get(seq.request_id)
            if req is None or seq.sample or req.status is not Status.RUNNING:
                continue
            pd = _pd(req)
            if pd.sender is None or not pd.dest_ready:
                continue  # before the destination: sent all at once when it arrives
            if pd.pending_aux is not None and req.num_computed_tokens >= req.num_prompt_tokens:
                aux, pd.pending_aux = pd.pending_aux, None
                self._scheduler.take_running(req)
                req.status = Status.TRANSFERRING
                self._send_last(req, aux)
            else:
                self._send_full_pages(req)

    def _send_full_pages(self, req: Request) -> None:
        """Send the pages ``req``'s computed tokens fill completely and not sent yet."""
        pd = _pd(req)
        assert pd.sender is not None
        full = min(req.num_computed_tokens // self._page_ids.page_size, len(req.pages))
        if full <= pd.kv_pages_sent:
            return
        pages, pd.kv_pages_sent = req.pages[pd.kv_pages_sent : full], full
        try:
            pd.sender.send(list(pages), last=False)
        except Exception as exc:  # noqa: BLE001 - fail this request, not the engine
            self.abort(req, reason="error", error=f"KV send failed: {exc}")

    def send_prefill(
        self, req: Request, first: SampledToken, finish: tuple[str, str | int | None]
    ) -> None:
        """After the last prefill chunk: post the remaining pages and the aux record, or,
        decode's destination not there yet, keep them (the request holds its pages,
        ``TRANSFERRING``) until it arrives (:meth:`_start_sending`)."""
        pd = _pd(req)
        pd.pending_finish = finish
        self._scheduler.take_running(req)
        req.status = Status.TRANSFERRING
        req.times.computed = time.perf_counter()
        assert pd.sender is not None  # a prefill request in the batch holds its sender
        aux = AuxRecord(
            pd.info.bootstrap_room,
            first.token_id,
            first.logprob,
            tuple(t for t, _ in first.top),
            tuple(lp for _, lp in first.top),
        )
        if not pd.dest_ready:
            pd.pending_aux = aux
            return
        self._send_last(req, aux)

    def _send_last(self, req: Request, aux: AuxRecord) -> None:
        pd = _pd(req)
        assert pd.sender is not None and pd.aux_slot is not None  # the destination is known
        rest, pd.kv_pages_sent = req.pages[pd.kv_pages_sent :], len(req.pages)
        req.times.transfer_posted, req.times.kv_pages = time.perf_counter(), len(req.pages)
        try:
            pd.sender.send(list(rest), last=True, aux=aux)
        except Exception as exc:  # noqa: BLE001
            self.abort(req, reason="error", error=f"KV send failed: {exc}")

    def _join_decode(self, req: Request) -> SampledToken | None:
        """A decode request's KV arrived: release its room (keeping the pages) and return
        prefill's first token, or end it with an error (``None``) for a bad aux record."""
        pd = _pd(req)
        assert pd.receiver is not None  # a transferring decode request holds its receiver
        try:
            aux = pd.receiver.aux_record()
            if not 0 <= aux.first_token_id < self._vocab_size:
                raise KVTransferError(f"aux record token id {aux.first_token_id} is out of range")
        except KVTransferError as exc:
            self._end(req, "error", error=str(exc))
            return None
        self._release(pd.receiver, [], pd.aux_slot)  # keep the pages: they hold the prompt now
        pd.receiver, pd.aux_slot = None, None
        self._live.remove(req)
        req.num_computed_tokens = req.num_prompt_tokens
        self._kv.cache_full_pages(
            req.all_token_ids, req.pages, req.page_keys, req.num_computed_tokens, req.known_keys
        )
        if req.generator is not None:  # the first draw happened on prefill
            skip_draw(req.generator, self._vocab_size, req.generator.device)
        k = req.params.logprobs or 0
        top = tuple(zip(aux.top_ids, aux.top_logprobs))[:k]
        return SampledToken(aux.first_token_id, aux.logprob, top)

    def join(self, req: Request) -> None:
        """After the engine appended a joined decode request's first token: it queues for
        its next token, or (it ended on that token) gives its pages back."""
        if req.finished:
            self._scheduler.free_pages(req)
        else:
            self._scheduler.add_waiting(req)

    # --- endings ------------------------------------------------------------------------
    def abort(self, req: Request, reason: str = "abort", error: str | None = None) -> None:
        """End ``req`` now; its room is aborted and drained (pages the transfer layer may
        hold are freed after a terminal poll, then ``close()``)."""
        pd = _pd(req)
        self._uncount_ahead(pd)
        if req.status in (Status.WAITING, Status.RUNNING):
            if pd.kv_pages_sent:  # the transfer layer may read them: drained below
                self._scheduler.take_running(req)
            else:
                self._scheduler.remove(req)
        handle = pd.handle
        assert handle is not None  # every live request holds a sender or a receiver
        try:
            handle.abort()
        except Exception:  # noqa: BLE001 - still drained below, bounded by the backend's timeouts
            pass
        self._draining.append((handle, req.pages, pd.aux_slot))
        req.pages, pd.aux_slot, pd.sender, pd.receiver = [], None, None, None
        self._live.remove(req)
        req.finish(reason, error=error)

    def _end(
        self,
        req: Request,
        reason: str,
        stop_reason: str | int | None = None,
        error: str | None = None,
    ) -> None:
        """The room reached a terminal state: free everything, close, finish ``req``
        (pages a late WRITE may still reach are drained once released instead)."""
        pd = _pd(req)
        self._uncount_ahead(pd)
        self._live.remove(req)
        handle = pd.handle
        assert handle is not None  # every live request holds a sender or a receiver
        if _holds(handle):
            self._draining.append((handle, req.pages, pd.aux_slot))
        else:
            self._release(handle, req.pages, pd.aux_slot)
        req.pages, pd.aux_slot, pd.sender, pd.receiver = [], None, None, None
        req.finish(reason, stop_reason, error)

    def _release(self, handle: KVSender | KVReceiver, pages: list[int], slot: int | None) -> None:
        if pages:
            self._kv.release(pages)
        if slot is not None:
            self._page_ids.free_aux_slot(slot)
        handle.close()
