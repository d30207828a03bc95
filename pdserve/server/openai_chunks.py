"""What ``/v1/completions`` and ``/v1/chat/completions`` build alike: the response head,
the extension fields of a choice, and the ``usage`` of whole answers and of streams
(``stream_options``: ``include_usage`` adds a last chunk with the request's usage and
``"usage": null`` to every chunk before it, as OpenAI; ``continuous_usage_stats`` the usage
so far to every chunk)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pdserve.engine.core.request import CompletionOutput, RequestOutput
from pdserve.server import formatting as fmt
from pdserve.server.protocol import _OpenAISampling


def response_head(id_prefix: str, obj: str, request_id: str, model: str) -> dict[str, Any]:
    """``{"id": f"{id_prefix}-{request_id}", "object", "created" (Unix s), "model"}``."""
    return {
        "id": f"{id_prefix}-{request_id}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
    }


def choice_extras(
    req: _OpenAISampling,
    token_text: fmt.TokenText,
    out: RequestOutput,
    token_ids: list[int],
    first: bool,
) -> dict[str, Any]:
    """Extension fields of one choice: token ids (``return_token_ids``; the prompt's with
    the first chunk) and prompt logprobs (first chunk only)."""
    extra: dict[str, Any] = {}
    if req.return_token_ids:
        extra["token_ids"] = token_ids
        if first:
            extra["prompt_token_ids"] = out.prompt_token_ids
    if req.prompt_logprobs is not None and first:
        extra["prompt_logprobs"] = fmt.prompt_logprobs_json(
            out.prompt_logprobs, token_text, req.prompt_logprobs
        )
    return extra


def final_usage(
    prompt_tokens: int | Sequence[int], outs: Sequence[RequestOutput], scoring: bool = False
) -> dict:
    """``usage`` of a whole answer whose samples are ``outs``; for a batch,
    ``prompt_tokens`` lists each prompt's length, ``outs`` holds ``n`` samples per prompt in
    order, and the counts are the prompts' usages summed (as vLLM)."""
    lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    n = len(outs) // max(len(lengths), 1)
    return summed_usage(
        fmt.usage(
            length,
            [out.outputs[0] for out in outs[p * n : (p + 1) * n]],
            scoring=scoring,
            cached_tokens=fmt.cached_tokens(outs[p * n : (p + 1) * n]),
        )
        for p, length in enumerate(lengths)
    )


def summed_usage(usages: Iterable[dict]) -> dict:
    """Field-wise sum of ``fmt.usage`` dicts (the usage of a batch of prompts)."""
    total: dict[str, Any] = {}
    for u in usages:
        if not total:
            total = dict(u, prompt_tokens_details=dict(u["prompt_tokens_details"]))
            continue
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            total[key] += u[key]
        total["prompt_tokens_details"]["cached_tokens"] += u["prompt_tokens_details"][
            "cached_tokens"
        ]
    return total


class StreamSamples:
    """Per-sample state of one streamed answer: which samples sent their first chunk, and
    the final output and cached prompt tokens of each finished one (for the usage).
    ``prompt_tokens``: the prompt's length, or each prompt's of a batch (sample ``index``
    belongs to prompt ``index // n``)."""

    def __init__(
        self, req: _OpenAISampling, prompt_tokens: int | Sequence[int], scoring: bool = False
    ) -> None:
        self._req = req
        self._lengths = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
        self._scoring = scoring
        self._started: set[int] = set()
        self._finals: dict[int, CompletionOutput] = {}
        self._cached: dict[int, int] = {}

    def see(self, index: int, out: RequestOutput) -> tuple[CompletionOutput, bool, bool]:
        """Record sample ``index``'s new output: ``(its output, first chunk?, worth a
        chunk?)`` (a chunk with no token, no text, no end is sent only as the first)."""
        o = out.outputs[0]
        first = index not in self._started
        self._started.add(index)
        if o.finished:
            self._finals[index] = o
            self._cached[index] = out.num_cached_tokens
        return o, first, bool(o.delta_token_ids or o.delta_text or o.finished or first)

    def with_usage(self, chunk: dict, o: CompletionOutput | None, out: RequestOutput) -> dict:
        """``chunk``, with this sample's usage so far under ``continuous_usage_stats``, else
        ``"usage": null`` under ``include_usage`` (OpenAI's chunks before the usage chunk)
        (``o`` None: a chunk before any output token, e.g. chat's opening role chunk)."""
        opts = self._req.stream_options
        if opts and opts.include_usage and not opts.continuous_usage_stats:
            chunk["usage"] = None
        elif opts and opts.continuous_usage_stats:
            chunk["usage"] = fmt.usage(
                self._lengths[self._prompt_of(chunk)],
                [] if o is None else [o],
                scoring=self._scoring,
                cached_tokens=out.num_cached_tokens,
            )
        return chunk

    def _prompt_of(self, chunk: dict) -> int:
        return int(chunk["choices"][0]["index"]) // self._req.n if chunk.get("choices") else 0

    def tail(self, head: dict) -> Iterator[dict]:
        """The last chunk (no choices, the request's usage, summed over a batch's prompts)
        under ``include_usage``."""
        opts = self._req.stream_options
        if opts and opts.include_usage:
            n = self._req.n
            usage = summed_usage(
                fmt.usage(
                    length,
                    [o for i, o in self._finals.items() if i // n == p],
                    scoring=self._scoring,
                    cached_tokens=min(
                        (c for i, c in self._cached.items() if i // n == p), default=0
                    ),
                )
                for p, length in enumerate(self._lengths)
            )
            yield dict(head, choices=[], usage=usage)
