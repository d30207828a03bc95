"""One engine request: its tokens, how many have KV in the cache, its pages and outputs.

Tokens are scheduled, not phases (vLLM v1): ``num_tokens`` is prompt + output tokens,
``num_computed_tokens`` how many of them have KV in the pool.  A step computes tokens
``[num_computed_tokens, num_computed_tokens + n)``; when that reaches ``num_tokens`` the
last position's logits are sampled and one token is appended.  Prefill, chunked prefill,
decode and recompute after preemption are all the same rule.

Here too: ``RequestOutput`` / ``CompletionOutput``, what ``EngineCore.step`` returns per
request that advanced (``Request.make_output``): cumulative state plus this step's deltas,
as views of the request's append-only lists, hence their place beside it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import torch

from pdserve.disagg.base import AuxRecord, KVReceiver, KVSender, Role, check_room, pd_role
from pdserve.engine.core.stop import IncrementalDetokenizer, TokenStop
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step import TokenLogprob
from pdserve.engine.structured.manager import GrammarState
from pdserve.engine.worker.penalties import PenaltyTokens
from pdserve.ports import check_port

_LAZY: Any = object()  # a field not materialized yet (``None`` is a value of logprobs)


class CompletionOutput:
    """One sample of a request.

    index: the sample's index among the request's ``n``.
    text: output text so far; a stop string, or the text of a stopping EOS / stop token
        id, is not part of it.  token_ids: output tokens so far (a stopping EOS or stop
        token id included, as vLLM does).
    logprobs: one ``TokenLogprob`` per output token when ``logprobs`` was asked, else None.
    cumulative_logprob: sum of the output tokens' logprobs.
    finish_reason: ``None`` while running, then ``"stop"``, ``"length"``, ``"abort"`` or
        ``"error"`` (see ``RequestOutput.error``).
    stop_reason: the stop string or stop token id that ended it, if any.
    delta_*: what this step added (for streaming; the deltas concatenate to the totals).

    Every field reads and assigns like a plain attribute (the constructor takes them as a
    dataclass would).  The engine builds its outputs with :meth:`snapshot`, which copies
    nothing: the four token lists are slices of the request's append-only lists, cut on
    first read (then kept), so a step costs O(1) per request whatever its length, and a
    stream that reads only the deltas never copies the totals.
    """

    __slots__ = (
        "index",
        "text",
        "cumulative_logprob",
        "finish_reason",
        "stop_reason",
        "delta_text",
        "_token_ids",
        "_logprobs",
        "_delta_token_ids",
        "_delta_logprobs",
        "_ids",
        "_lps",
        "_start",
        "_reported",
        "_end",
        "_lp_end",
    )
    index: int
    text: str
    cumulative_logprob: float
    finish_reason: str | None
    stop_reason: str | int | None
    delta_text: str
    # a field's value, or _LAZY until first read (snapshots only)
    _token_ids: Any
    _logprobs: Any
    _delta_token_ids: Any
    _delta_logprobs: Any
    # a snapshot's sources: the request's lists and where this output's slices lie
    _ids: list[int]
    _lps: list[TokenLogprob]
    _start: int
    _reported: int
    _end: int
    _lp_end: int

    def __init__(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        cumulative_logprob: float,
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        delta_text: str = "",
        delta_token_ids: list[int] | None = None,
        delta_logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        self.index = index
        self.text = text
        self.cumulative_logprob = cumulative_logprob
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.delta_text = delta_text
        self._token_ids = token_ids
        self._logprobs = logprobs
        self._delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self._delta_logprobs = delta_logprobs

    @classmethod
    def snapshot(
        cls,
        all_token_ids: list[int],
        num_prompt: int,
        num_reported: int,
        logprobs: list[TokenLogprob] | None,
        *,
        text: str,
        delta_text: str,
        cumulative_logprob: float,
        finish_reason: str | None,
        stop_reason: str | int | None,
    ) -> CompletionOutput:
        """Sample 0 of a request as it stands now, copying nothing.

        all_token_ids: the request's prompt + output ids (append-only: what is there now
        never changes); num_prompt: how many are the prompt; num_reported: output tokens
        already reported (the delta is the rest); logprobs: its per-output-token list
        (append-only) or None.  ``token_ids = all_token_ids[num_prompt:]``, ``delta_*``
        from ``num_reported`` on, all as of this call.
        """
        self = cls.__new__(cls)
        self.index = 0
        self.text = text
        self.cumulative_logprob = cumulative_logprob
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.delta_text = delta_text
        self._token_ids = self._delta_token_ids = _LAZY
        self._logprobs = self._delta_logprobs = _LAZY if logprobs is not None else None
        self._ids = all_token_ids
        self._lps = logprobs if logprobs is not None else []
        self._start = num_prompt
        self._reported = num_reported
        self._end = len(all_token_ids)
        self._lp_end = 0 if logprobs is None else len(logprobs)
        return self

    @property
    def token_ids(self) -> list[int]:
        if self._token_ids is _LAZY:
            self._token_ids = self._ids[self._start : self._end]
        return self._token_ids  # type: ignore[no-any-return]

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids = value

    @property
    def delta_token_ids(self) -> list[int]:
        if self._delta_token_ids is _LAZY:
            self._delta_token_ids = self._ids[self._start + self._reported : self._end]
        return self._delta_token_ids  # type: ignore[no-any-return]

    @delta_token_ids.setter
    def delta_token_ids(self, value: list[int]) -> None:
        self._delta_token_ids = value

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        if self._logprobs is _LAZY:
            self._logprobs = self._lps[: self._lp_end]
        return self._logprobs  # type: ignore[no-any-return]

    @logprobs.setter
    def logprobs(self, value: list[TokenLogprob] | None) -> None:
        self._logprobs = value

    @property
    def delta_logprobs(self) -> list[TokenLogprob] | None:
        if self._delta_logprobs is _LAZY:
            self._delta_logprobs = self._lps[self._reported : self._lp_end]
        return self._delta_logprobs  # type: ignore[no-any-return]

    @delta_logprobs.setter
    def delta_logprobs(self, value: list[TokenLogprob] | None) -> None:
        self._delta_logprobs = value

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in _COMPLETION_FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable, like a dataclass with eq

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in _COMPLETION_FIELDS)
        return f"CompletionOutput({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (CompletionOutput, self._fields())


# The public fields, in constructor order (equality, repr, pickling).
_COMPLETION_FIELDS = (
    "index",
    "text",
    "token_ids",
    "cumulative_logprob",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "delta_text",
    "delta_token_ids",
    "delta_logprobs",
)


class PhaseTimes:
    """When one engine request crossed each phase boundary, on the engine thread: plain
    ``time.perf_counter()`` floats in seconds (this process's clock), 0.0 for a boundary
    not reached (or not on this role's path).  Recording is a float store per boundary;
    the serving layer turns them into histograms, spans and the response's timing block.

    queued: the engine took the request (``EngineCore.add_request``).
    peer_ready: PD: the room's peer is known (prefill: decode's destination arrived, which
        may come before or after ``scheduled`` and ``computed``; decode: the bootstrap
        with prefill is done).
    scheduled: first admitted into a batch (its first prompt chunk or, decode, its first
        step after the KV arrived).
    computed: PD prefill: the prompt's last chunk ran and the first token was sampled
        (``transfer_posted`` too, when decode's destination was there already).
    transfer_posted: PD: prefill posted its last pages and the aux record (the first
        token was sampled then); decode handed its pages to the receiver (``init``).
    transfer_finished: PD: the transfer layer's own record of the room's ``Success``
        (``RoomHandle.finished_at``; decode: the notification with the first token
        arrived; prefill: its WRITEs completed and the notification went out).
    transfer_done: PD: the engine saw the room's ``Success`` (its next poll after
        ``transfer_finished``).
    first_token: the first output token was appended (not on prefill, which only samples
        it: ``transfer_posted``).
    finished: the request ended (any reason).
    kv_pages: PD: pages the transfer moves (decode: the fresh ones it asked for; prefill:
        the prompt's pages), else 0.
    """

    __slots__ = (
        "queued",
        "peer_ready",
        "scheduled",
        "computed",
        "transfer_posted",
        "transfer_finished",
        "transfer_done",
        "first_token",
        "finished",
        "kv_pages",
    )

    def __init__(self, queued: float = 0.0) -> None:
        self.queued = queued
        self.peer_ready = 0.0
        self.scheduled = 0.0
        self.computed = 0.0
        self.transfer_posted = 0.0
        self.transfer_finished = 0.0
        self.transfer_done = 0.0
        self.first_token = 0.0
        self.finished = 0.0
        self.kv_pages = 0

    def as_dict(self) -> dict[str, float]:
        """The boundaries reached (non-zero), by name; ``kv_pages`` as a float count."""
        return {name: float(getattr(self, name)) for name in self.__slots__ if getattr(self, name)}


@dataclass
class RequestOutput:
    """State of one request after a step.

    prompt_logprobs: ``None`` for the first prompt token, then one ``TokenLogprob`` per
        prompt token, once the prompt has been computed (if asked).
    finished: every sample has a ``finish_reason``.
    error: why the request failed (``finish_reason == "error"``), e.g. a KV transfer
        failure; ``None`` otherwise.
    num_cached_tokens: prompt tokens whose KV was not computed for this request: found in
        the prefix cache at admission (full pages; a disaggregated decode worker counts the
        leading pages it already held and did not receive).  Never above the prompt length.
    prompt: the prompt's text when it was given as text (the offline ``LLM.generate``, as
        vLLM's ``RequestOutput.prompt``); ``None`` for token ids and inside the engine.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt: str | None = field(default=None, compare=False)
    times: PhaseTimes | None = field(default=None, compare=False, repr=False)
    timing: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DisaggRequestInfo:
    """How a request takes part in prefill/decode disaggregation.

    role: ``Role.PREFILL`` (compute the prompt, sample the first token, send the KV) or
        ``Role.DECODE`` (receive the KV and the first token, generate the rest); the strings
        ``"prefill"`` / ``"decode"`` are parsed into the enum.
    bootstrap_host/bootstrap_port/bootstrap_room: the prefill worker's bootstrap server
        and the transfer's room id, as the router drew them.
    fake: use the ``fake`` transfer backend's manager (health probes) instead of the real one.
    """

    role: Role
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    fake: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", pd_role(self.role, "disagg.role"))  # frozen: parse once
        check_port(self.bootstrap_port, "disagg.bootstrap_port", allow_zero=False)  # a peer's
        check_room(self.bootstrap_room, "disagg.bootstrap_room")


@dataclass
class PDState:
    """A request's part in prefill/decode disaggregation: its address and its room's
    progress, in one place (``Request.pd``; ``None`` on a mixed worker).  Only the PD flow
    (``engine/core/pd_flow.py``) changes it.

    info: role, bootstrap address and room, as the router drew them.
    sender/receiver: the room's KV sender (prefill) or receiver (decode) while the request
        holds the room; both ``None`` before it is created and once it is released.
    aux_slot: the aux slot the room uses, while it holds one.
    """

    info: DisaggRequestInfo
    sender: KVSender | None = None
    receiver: KVReceiver | None = None
    aux_slot: int | None = None
    peer_ready: bool = False  # decode: receiver bootstrapped, waiting for pages
    # prefill: decode's destination arrived and the sender was given init(); before that the
    # prompt is computed as usual but nothing is sent (the sends wait for this)
    dest_ready: bool = False
    # prefill: the aux record of a prompt computed before decode's destination arrived
    # (status TRANSFERRING, pages held, nothing sent; or, pages given back, see ``expired``,
    # until the prompt is computed again): the last send, posted on arrival
    pending_aux: AuxRecord | None = None
    # prefill: pages of the whole prompt counted against the compute-ahead cap while it is
    # computed before decode's destination arrived (0: not computed ahead, or it arrived)
    ahead_pages: int = 0
    # prefill: a prompt computed ahead waited --pd-compute-ahead-timeout for the destination
    # (PDFlow._give_back): its pages went back (full ones stay in the prefix cache) and it
    # waits for the destination without them; the first token stays sampled (pending_aux)
    # and only the prompt's KV is computed again once the destination comes
    expired: bool = False
    # prefill: leading pages already handed to sender.send (chunked sending); while > 0
    # the transfer layer may read them, so they are never freed or preempted
    kv_pages_sent: int = 0
    pending_finish: tuple[str, str | int | None] = ("length", None)  # prefill: after Success

    @property
    def handle(self) -> KVSender | KVReceiver | None:
        """The room's sender or receiver, whichever the request holds (or ``None``)."""
        return self.sender or self.receiver


class Status(enum.Enum):
    WAITING_FOR_PEER = "waiting_for_peer"  # decode: transfer not yet bootstrapped; no pages
    WAITING = "waiting"  # in the FCFS queue
    RUNNING = "running"  # in the running batch
    # disagg: pages handed to the transfer layer (prefill: also a computed prompt whose
    # pages wait for decode's destination, PDState.pending_aux)
    TRANSFERRING = "transferring"
    FINISHED = "finished"


class Request:
    """Mutable state of one single-sample engine request (owned by the engine thread)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival: int,
        detokenizer: IncrementalDetokenizer,
        generator: torch.Generator | None,
        disagg: DisaggRequestInfo | None = None,
    ) -> None:
        self.request_id = request_id
        self.times = PhaseTimes(time.perf_counter())  # phase boundaries (engine thread)
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)  # the prompt never changes
        self.params = params
        self.arrival = arrival
        self.detokenizer = detokenizer
        self.generator = generator  # seeded random requests only (others: the shared one)
        self.pd = PDState(disagg) if disagg is not None else None  # disaggregation
        # Append-only, as is ``logprobs``: outputs are views of them (below).
        self.all_token_ids = list(prompt_token_ids)
        # the sampler's penalty state: these tokens on the device, grown as they are appended
        self.penalty_tokens = (
            PenaltyTokens(self.all_token_ids, len(prompt_token_ids))
            if params.has_penalties
            else None
        )
        self.num_computed_tokens = 0
        # prompt tokens not computed here: found in the prefix cache (or, disagg decode,
        # already held when the rest of the prompt's KV arrived)
        self.num_cached_tokens = 0
        self.pages: list[int] = []
        self.page_keys: list[bytes] = []  # prefix-cache keys of pages[: len(page_keys)]
        # keys of the first full pages of all_token_ids hashed at admission (a pure function
        # of those tokens, which never change): cache_full_pages takes them, not hashing again
        self.known_keys: list[bytes] = []
        self.status = Status.WAITING
        self.cumulative_logprob = 0.0
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.grammar: GrammarState | None = None  # structured outputs: the output's matcher
        self.token_stop: TokenStop | None = None  # its stop conditions, built on first token
        # streaming: how much was already reported
        self.num_reported_tokens = 0

    def pages_pinned(self) -> bool:
        """Whether the transfer layer may read this request's pages now (prefill: pages
        handed to its sender), so they are never freed or preempted."""
        return self.pd is not None and self.pd.kv_pages_sent > 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def compute_end(self) -> int:
        """How many leading tokens of ``all_token_ids`` this engine computes the KV of (the
        scheduler's target; it samples only when that is every token): all of them, but a
        PD prefill request's prompt only (decode computes the first output token's KV).  A
        prefill request whose first token is already sampled is only scheduled to compute
        its prompt's KV again after giving its pages back (``PDState.expired``): it reaches
        this end without sampling again."""
        pd = self.pd
        if pd is not None and pd.info.role is Role.PREFILL:
            return self.num_prompt_tokens
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def prompt_logprobs_done(self) -> int:
        """Prompt positions whose logprobs are known (position 0 has none by definition)."""
        return 0 if self.prompt_logprobs is None else len(self.prompt_logprobs)

    def needs_prompt_logprobs(self) -> bool:
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def append_token(
        self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...]
    ) -> None:
        if len(self.all_token_ids) == self.num_prompt_tokens:
            self.times.first_token = time.perf_counter()
        self.all_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            self.logprobs.append(TokenLogprob(token_id, logprob, top))

    def finish(
        self, reason: str, stop_reason: str | int | None = None, error: str | None = None
    ) -> None:
        self.status = Status.FINISHED
        self.times.finished = time.perf_counter()
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error

    def make_output(self) -> RequestOutput:
        """This request as it stands after this step, with the delta since its last
        output (advances ``num_reported_tokens``).  O(1): the totals are views cut on first
        read (``CompletionOutput.snapshot``)."""
        finished = self.status is Status.FINISHED
        completion = CompletionOutput.snapshot(
            self.all_token_ids,
            self.num_prompt_tokens,
            self.num_reported_tokens,
            self.logprobs,
            text=self.detokenizer.text,
            delta_text=self.detokenizer.take_delta(finished),
            cumulative_logprob=self.cumulative_logprob,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.num_reported_tokens = len(self.all_token_ids) - self.num_prompt_tokens
        prompt_lps = self.prompt_logprobs
        if prompt_lps is not None and len(prompt_lps) < self.num_prompt_tokens:
            prompt_lps = None  # not all computed yet
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            prompt_logprobs=prompt_lps,
            error=self.error,
            num_cached_tokens=self.num_cached_tokens,
            times=self.times,
        )


class PromptError(ValueError):
    """A prompt :func:`check_prompt` rejects.  field: ``"prompt"``, ``"logit_bias"`` or
    ``"max_tokens"`` (the server names its own prompt field); code: OpenAI's, or None."""

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


def check_prompt(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    *,
    output_tokens: int = 1,
) -> None:
    """The one check of a prompt against the model: not empty, integer ids in
    ``[0, vocab_size)``, ``logit_bias`` and ``stop_token_ids`` ids in the vocabulary, and ``len(prompt) +
    output_tokens <= max_model_len`` (the engine asks room for 1 output token; the server
    for ``max_tokens``).  Raises :class:`PromptError` (a ValueError) naming the field."""
    n = len(prompt_token_ids)
    if n == 0:
        raise PromptError("prompt must not be empty", "prompt")
    # the same test as "any(not isinstance(t, int) or not 0 <= t < vocab_size)", with its
    # per-token work in C (map, min, max): intake does no Python per prompt token
    if not (
        all(map(isinstance, prompt_token_ids, repeat(int)))
        and min(prompt_token_ids) >= 0
        and max(prompt_token_ids) < vocab_size
    ):
        raise PromptError(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    bad_bias = [t for t, _ in params.logit_bias_items if t >= vocab_size]
    if bad_bias:
        raise PromptError(
            f"logit_bias token ids must be in [0, {vocab_size}), got {bad_bias[0]}", "logit_bias"
        )
    bad_stop = [t for t in params.stop_token_ids or () if t >= vocab_size]
    if bad_stop:  # one the model can never sample: the stop would silently never match
        raise PromptError(
            f"stop_token_ids must be in [0, {vocab_size}), got {bad_stop[0]}", "stop_token_ids"
        )
    if n + output_tokens > max_model_len:
        raise PromptError(
            f"this model's context limit is {max_model_len} tokens, but the request needs "
            f"{n + output_tokens} ({n} in the prompt, {output_tokens} of max_tokens)",
            "max_tokens" if n < max_model_len else "prompt",
            code="context_length_exceeded",
        )


def check_stops(
    req: Request, token_id: int, eos_token_ids: Collection[int], max_model_len: int
) -> tuple[str, str | int | None] | None:
    """Whether ``req`` ends with ``token_id``, its output token just appended: ``(reason,
    stop_reason)`` (``"stop"`` or ``"length"``, as :meth:`TokenStop.check`, or ``("stop",
    the stop string)``), else None.  A complete grammar ends it at an EOS even before
    ``min_tokens`` (unless ``ignore_eos``).  Unless an EOS or stop token ends it, the token
    goes to ``req.detokenizer`` (its text; a stop string, checked once past ``min_tokens``,
    ends it): an EOS or stop token adds no text (vLLM).  Builds ``req.token_stop`` on the
    first call."""
    params = req.params
    stop = req.token_stop
    if stop is None:
        stop = req.token_stop = TokenStop(
            params, eos_token_ids, max_model_len, req.num_prompt_tokens
        )
    num_output = len(req.all_token_ids) - req.num_prompt_tokens
    verdict: tuple[str, str | int | None] | None = stop.check(token_id, num_output)
    if (
        req.grammar is not None
        and token_id in eos_token_ids
        and not params.ignore_eos
        and req.grammar.is_terminated
    ):
        verdict = ("stop", None)  # the grammar is complete: it ends the output (min_tokens too)
    if verdict is None or verdict[0] == "length":
        stop_str = req.detokenizer.add_token(token_id, check_stop=num_output > stop.min_tokens)
        if stop_str is not None:
            verdict = ("stop", stop_str)
    return verdict
