"""Migration of a request whose worker failed: what the router resends, and how the
continued stream is made to read as one stream to the client.

A stream that breaks after tokens reached the client continues on another worker (pair)
as a *continued request*: the same endpoint and sampling fields, the prompt as token ids
(the original prompt's ids, which the first leg's first chunk carries under
``return_token_ids``, then every token id the client received), ``max_tokens`` (chat:
``max_completion_tokens`` too) and ``min_tokens`` reduced by those tokens, no prompt
logprobs and no echo (the client has them). A chat request keeps its endpoint: the
worker takes the templated prompt as ``prompt_token_ids`` (a pdserve extension of
``/v1/chat/completions``) and templates nothing, so no text is tokenized twice.

The continued stream's chunks are rewritten (:meth:`StreamState.rewrite`): the first
leg's ``id`` and ``created``; a chat's second opening chunk (``delta.role``) dropped;
``token_ids`` / ``prompt_token_ids`` removed unless the client asked for them (the
router always asks, to know the ids); ``text_offset`` of completions logprobs shifted by
the text already sent; ``usage`` counted against the original prompt (``prompt_tokens``
= the original prompt, ``completion_tokens`` = every token the client received).

Mid-stream migration is exact for greedy requests; it is not offered (the stream ends
with the error, as without migration) where the continued request would not produce
what the uninterrupted one would: ``/generate`` (cumulative chunks), ``n`` > 1 or a
batch of prompts, stop strings (text held back by the worker was never sent), structured
outputs and tools (the grammar / parser state is the worker's), presence and frequency
penalties (they count output tokens, which become prompt tokens), ``truncate_prompt_tokens``
(the longer prompt would be cut elsewhere). Before any chunk
reached the client every request is resent whole, as is every non-streamed request.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.router.legs import Leg

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# fields whose non-null value makes the output depend on state only the worker holds
_STATEFUL = (
    "tools",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "json_schema",
    "regex",
    "ebnf",
    "choice",
)


def mid_stream_refusal(endpoint: str, body: dict) -> str | None:
    """Why a stream of ``body`` cannot continue on another worker once tokens were sent
    (a short reason for the client's error and the log), None when it can."""
    if endpoint not in (CHAT, COMPLETIONS):
        return f"{endpoint} streams are not continued on another worker"
    if body.get("n") not in (None, 1):
        return "a stream of n > 1 samples is not continued on another worker"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return "a stream of a batch of prompts is not continued on another worker"
    if body.get("stop"):
        return "a stream with stop strings is not continued on another worker"
    if body.get("truncate_prompt_tokens") is not None:  # the longer prompt would be cut
        return "a stream with truncate_prompt_tokens is not continued on another worker"
    for name in _STATEFUL:
        value = body.get(name)
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "tools" and body.get("tool_choice") == "none":
            continue
        if value:
            return f"a stream with {name} is not continued on another worker"
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            return f"a stream with {name} is not continued on another worker"
    return None


@dataclass
class StreamState:
    """What the client of one streamed request has received so far, across legs.

    ``legs``: legs started (1 for the first); ``appended``: token ids the current leg's
    prompt holds beyond the original prompt (what its usage must move back to the
    completion)."""

    endpoint: str
    body: dict
    client_ids: bool = False  # the client asked for return_token_ids itself
    prompt_ids: list[int] | None = None
    sent_ids: list[int] = field(default_factory=list)
    started: bool = False  # a chunk of a choice reached the client
    finished: bool = False  # a finish_reason reached the client
    head: dict[str, Any] = field(default_factory=dict)  # the first leg's id and created
    next_offset: int = 0  # completions: text_offset after the last token sent
    legs: int = 0
    appended: int = 0
    base_offset: int = 0  # completions: the client's text_offset where this leg starts
    pending: int = 0  # last tokens sent whose text has not come yet (a character's part)
    starts: list[int] = field(default_factory=list)  # completions: each sent token's offset
    skip: int = 0  # tokens the current leg regenerates that the client already has

    def __post_init__(self) -> None:
        self.client_ids = self.body.get("return_token_ids") is True

    def first_body(self) -> dict:
        """The first leg's body: the client's, asking for the token ids (OpenAI
        endpoints)."""
        self.legs = 1
        if self.endpoint in (CHAT, COMPLETIONS):
            return dict(self.body, return_token_ids=True)
        return self.body

    def can_continue(self) -> bool:
        """Whether :meth:`continued_body` would give a body now (no side effect)."""
        if not self.started:
            return True
        if mid_stream_refusal(self.endpoint, self.body) or self.prompt_ids is None:
            return False
        return not self.pending or self.body.get("temperature") in (0, 0.0)

    def continued_body(self) -> dict | None:
        """The next leg's body; None when the tokens sent cannot be continued from (the
        request refuses mid-stream migration, or the prompt ids are unknown)."""
        if not self.started:  # nothing reached the client: the request again, whole
            body = self.first_body()
            self.legs += 1
            self.appended = 0
            return body
        if mid_stream_refusal(self.endpoint, self.body) or self.prompt_ids is None:
            return None
        body = copy.deepcopy(self.body)
        # A seam inside a character (its first bytes' tokens sent, no text for them yet)
        # would be decoded wrongly by a worker primed with half a character: such tokens
        # are generated again (greedy: the same ones) and left out of what the client gets.
        back = self.pending
        if back and body.get("temperature") not in (0, 0.0):
            return None  # a sampled stream would not draw the same tokens again
        k = len(self.sent_ids) - back
        ids = self.prompt_ids + self.sent_ids[:k]
        if self.endpoint == CHAT:
            body["prompt_token_ids"] = ids
            keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
        else:
            body["prompt"] = ids
            body["echo"] = False
            body.setdefault("max_tokens", 16)  # the worker's default, counted down
            keys = ("max_tokens",)
        for key in keys:
            if isinstance(body.get(key), int):
                body[key] -= k
                if body[key] < 1:
                    return None  # nothing left to generate: the stream had ended
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - k)
        body.pop("prompt_logprobs", None)
        body["return_token_ids"] = True
        self.legs += 1
        self.appended = k
        self.skip = back
        # the new leg's text_offset starts at the first token it generates
        self.base_offset = self.starts[k] if back and len(self.starts) > k else self.next_offset
        return body

    def rewrite(self, chunk: Any) -> Any | None:
        """The chunk to send the client in place of ``chunk`` (a parsed SSE data object
        of the current leg), recording what it carries; None to send nothing."""
        if not isinstance(chunk, dict) or "error" in chunk:
            return chunk
        if self.endpoint not in (CHAT, COMPLETIONS):
            self.started = True  # /generate: passed as is, never continued mid-stream
            return chunk
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created") if k in chunk}
        else:
            chunk.update(self.head)
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if (
                self.started
                and self.legs > 1
                and isinstance(delta, dict)
                and "role" in delta
                and not choice.get("token_ids")
                and choice.get("finish_reason") is None
            ):
                return None  # the continued chat's own opening chunk
            prompt_ids = choice.pop("prompt_token_ids", None)
            if self.prompt_ids is None and isinstance(prompt_ids, list):
                self.prompt_ids = prompt_ids
            if self.client_ids and not self.started and prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
            ids = choice.pop("token_ids", None)
            if isinstance(ids, list) and self.skip:
                dropped = min(self.skip, len(ids))
                self.skip -= dropped
                ids = ids[dropped:]
                _drop_logprobs(choice.get("logprobs"), dropped)
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                if not ids and not text and choice.get("finish_reason") is None:
                    return None  # only tokens the client has (no text of theirs yet)
            if self.client_ids and ids is not None:
                choice["token_ids"] = ids
            if isinstance(ids, list) and ids:
                self.sent_ids.extend(ids)
                text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
                self.pending = 0 if text else self.pending + len(ids)
            self._shift_offsets(choice.get("logprobs"))
            if choice.get("finish_reason") is not None:
                self.finished = True
            self.started = True
        if (
            isinstance(choices, list)
            and choices
            and not chunk.get("usage")
            and all(isinstance(c, dict) and _empty_chat_choice(c) for c in choices)
        ):
            return None  # its token ids were all it carried (held-back text of a tool call)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and self.appended:
            usage["prompt_tokens"] = usage.get("prompt_tokens", 0) - self.appended
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.appended
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])
        return chunk

    def _shift_offsets(self, logprobs: Any) -> None:
        """Completions logprobs: a continued leg counts ``text_offset`` from its own start;
        the client's count goes on from the text already sent."""
        if not isinstance(logprobs, dict):
            return
        offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
        if not isinstance(offsets, list) or not offsets or not isinstance(tokens, list):
            return
        if self.appended:
            logprobs["text_offset"] = offsets = [o + self.base_offset for o in offsets]
        self.starts.extend(offsets)
        last = tokens[-1] if tokens else ""
        self.next_offset = offsets[-1] + len(last if isinstance(last, str) else "")


def _drop_logprobs(logprobs: Any, n: int) -> None:
    """Remove the first ``n`` tokens' entries of a chunk's logprobs (chat's ``content``,
    completions' parallel lists), in place."""
    if not isinstance(logprobs, dict):
        return
    for key in ("content", "tokens", "token_logprobs", "top_logprobs", "text_offset"):
        if isinstance(logprobs.get(key), list):
            logprobs[key] = logprobs[key][n:]


@dataclass
class Migration:
    """How a relay continues a stream elsewhere: ``state`` of what the client got,
    ``budget`` migrations allowed (``--max-migrations``), ``reopen(body)``: open the next
    leg for ``body`` (raises ``legs.LegError``, or ``NoHealthyWorker`` when no
    healthy worker came within ``wait_s`` seconds, ``--migration-wait``);
    ``eject(urls)``: take workers whose connection failed out of picking at once;
    ``count(reason)``: one migration done, for the metrics. ``done``: migrations tried;
    ``note``: why the last one could not be made, for the client's error; ``avoid``: the
    URLs of the workers of failed legs (shared with ``reopen``, which picks them only when
    there is no other)."""

    state: StreamState
    budget: int
    reopen: Callable[[dict], Awaitable[Leg]]
    eject: Callable[[set[str]], None]
    count: Callable[[str], None]
    wait_s: float = 0.0
    done: int = 0
    note: str = ""
    avoid: set[str] = field(default_factory=set)


def _empty_chat_choice(choice: dict) -> bool:
    """A chat chunk's choice with nothing for the client once its token ids are taken
    out: an empty ``delta``, no logprobs, no finish reason, no other field."""
    return (
        choice.get("delta") == {}
        and choice.get("logprobs") is None
        and choice.get("finish_reason") is None
        and set(choice) <= {"index", "delta", "logprobs", "finish_reason"}
    )
