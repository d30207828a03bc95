"""One engine request: its tokens, how many have KV in the cache, its pages and outputs.

Tokens are scheduled, not phases (vLLM v1): ``num_tokens`` is prompt + output tokens,
``num_computed_tokens`` how many of them have KV in the pool.  A step computes tokens
``[num_computed_tokens, num_computed_tokens + n)``; when that reaches ``num_tokens`` the
last position's logits are sampled and one token is appended.  Prefill, chunked prefill,
decode and recompute after preemption are all the same rule.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass

import torch

from pdserve.disagg.base import KVReceiver, KVSender, Role, check_room, pd_role
from pdserve.engine.core.detokenizer import IncrementalDetokenizer
from pdserve.engine.core.stop import TokenStop
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step import TokenLogprob
from pdserve.engine.structured.manager import GrammarState
from pdserve.engine.worker.penalties import PenaltyTokens
from pdserve.ports import check_port


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
    # prefill: leading pages already handed to sender.send (chunked sending); while > 0
    # the transfer layer may read them, so they are never freed or preempted
    kv_pages_sent: int = 0
    pending_finish: tuple[str, str | int | None] = ("length", None)  # prefill: after Success

    @property
    def handle(self) -> KVSender | KVReceiver | None:
        """The room's sender or receiver, whichever the request holds (or ``None``)."""
        return self.sender or self.receiver


class Status(enum.Enum):
    WAITING_FOR_PEER = "waiting_for_peer"  # disagg: transfer not yet bootstrapped; no pages
    WAITING = "waiting"  # in the FCFS queue
    RUNNING = "running"  # in the running batch
    TRANSFERRING = "transferring"  # disagg: pages handed to the transfer layer
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
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)  # the prompt never changes
        self.params = params
        self.arrival = arrival
        self.detokenizer = detokenizer
        self.generator = generator  # seeded random requests only (others: the shared one)
        self.pd = PDState(disagg) if disagg is not None else None  # disaggregation
        # Append-only, as is ``logprobs``: outputs are views of them (outputs.py).
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
        self.all_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.logprobs is not None:
            self.logprobs.append(TokenLogprob(token_id, logprob, top))

    def finish(
        self, reason: str, stop_reason: str | int | None = None, error: str | None = None
    ) -> None:
        self.status = Status.FINISHED
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
