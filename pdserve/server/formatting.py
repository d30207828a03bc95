"""Engine outputs -> the worker's HTTP answers: the JSON pieces (logprobs, usage, the
``/generate`` meta info), what ``/v1/completions`` and ``/v1/chat/completions`` build alike
(the response head, a choice's extension fields, the usage of whole answers and of
streams), and the SSE response of a running job. Streamed and whole answers of every
endpoint are built here, from the same pieces.

Token strings are the tokenizer's decoding of the single token (as OpenAI reports them).
Stream usage (``stream_options``): ``include_usage`` adds a last chunk with the request's
usage and ``"usage": null`` to every chunk before it, as OpenAI; ``continuous_usage_stats``
the usage so far to every chunk. An SSE response awaits the first engine output before the
200 is sent (so errors before the first token keep their HTTP status); later errors become
a well-formed SSE error event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from pdserve.engine.core.request import CompletionOutput, RequestOutput
from pdserve.engine.step import TokenLogprob
from pdserve.http.disconnect import cancel_on_disconnect
from pdserve.http.http_errors import error_json
from pdserve.http.wire import SSE_DONE, sse_event
from pdserve.server.protocol import _OpenAISampling
from pdserve.server.serving import APIError, Job, Serving


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's convention, used by Llama 3, Qwen, SmolLM2...):
    each byte is written as one printable character, the bytes that print as themselves
    (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) as themselves and the other 68 as the
    characters from U+0100 on, in byte order. Returns character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in kept}
    moved = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(0x100 + n): b for n, b in enumerate(moved)})
    return alphabet


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of a fast tokenizer's decoder and of its parts (``ByteLevel``,
    ``ByteFallback``, ...); empty when the tokenizer does not say."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError, TypeError):
        return set()
    parts = decoder.get("decoders") or [decoder]
    return {d.get("type", "") for d in parts if isinstance(d, dict)}


class TokenText:
    """Decodes single token ids, memoised (the same ids recur in logprob answers): the
    text of a token alone (``"\ufffd"`` for one that holds part of a character) and its
    raw bytes (:meth:`raw`, what OpenAI's ``bytes`` fields carry: a character split over
    tokens is whole again when their bytes are joined)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self._raw: dict[int, bytes] = {}
        kinds = _decoder_kinds(tokenizer)
        self._alphabet = _byte_level_alphabet() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tok.decode([token_id])
            if len(self._cache) > 200_000:
                self._cache.clear()
        return text

    def raw(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for: from its byte-level piece (GPT-2-style
        BPE) or its ``<0xNN>`` piece (SentencePiece byte fallback, ``▁`` a space), else the
        UTF-8 of its text (special tokens, other tokenizers)."""
        data = self._raw.get(token_id)
        if data is not None:
            return data
        data = self(token_id).encode("utf-8")
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._tok.all_special_ids:
            if self._alphabet is not None and all(c in self._alphabet for c in piece):
                data = bytes(self._alphabet[c] for c in piece)
            elif self._byte_fallback and len(piece) == 6 and piece.startswith("<0x"):
                data = bytes([int(piece[3:5], 16)])
            elif self._byte_fallback:
                data = piece.replace("\u2581", " ").encode("utf-8")
        if len(self._raw) > 200_000:
            self._raw.clear()
        self._raw[token_id] = data
        return data


def usage(
    prompt_tokens: int,
    outputs: Sequence[CompletionOutput],
    *,
    scoring: bool = False,
    cached_tokens: int = 0,
) -> dict:
    """OpenAI ``usage``: prompt counted once, completion tokens summed over samples
    (none when ``scoring``: a ``max_tokens`` 0 request, whose one engine token is dropped);
    ``prompt_tokens_details.cached_tokens``: prompt tokens found in the prefix cache
    (:func:`cached_tokens`), never above ``prompt_tokens``."""
    completion = 0 if scoring else sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)},
    }


def cached_tokens(outs: Sequence[RequestOutput]) -> int:
    """Cached prompt tokens of a request whose samples are ``outs``: the fewest any sample
    found (the prompt is counted once, like ``prompt_tokens``)."""
    return min((o.num_cached_tokens for o in outs), default=0)


def completion_top(entry: TokenLogprob, tt: TokenText, k: int | None = None) -> dict[str, float]:
    """One ``top_logprobs`` dict of the legacy completions layout: the ``k`` best tokens
    (all of ``entry.top`` when ``k`` is None) plus the chosen token itself, so up to
    ``k + 1`` entries (OpenAI's API reference: "the API will always return the logprob of
    the sampled token, so there may be up to logprobs+1 elements"; vLLM does the same)."""
    top = {tt(i): lp for i, lp in entry.top[:k]}
    top.setdefault(tt(entry.token_id), entry.logprob)
    return top


def _tokens_at(tt: TokenText, ids: Sequence[int], offset: int) -> tuple[list[str], list[int]]:
    """Each token's text and the character offset in the answer's text where it starts, the
    first at ``offset``: counted over the tokens' bytes decoded in order, so tokens that
    share one character (its bytes split over them) start where that character does."""
    tokens, offsets = [], []
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for t in ids:
        offsets.append(offset)
        tokens.append(tt(t))
        offset += len(decoder.decode(tt.raw(t)))
    return tokens, offsets


def completion_logprobs(entries: Sequence[TokenLogprob], tt: TokenText, offset: int) -> dict:
    """Legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs,
    text_offset), text offsets counted from ``offset``; each top dict holds the sampled
    token too (:func:`completion_top`)."""
    tokens, offsets = _tokens_at(tt, [e.token_id for e in entries], offset)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [completion_top(e, tt) for e in entries],
        "text_offset": offsets,
    }


def echo_logprobs(
    prompt_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None] | None,
    tt: TokenText,
    k: int,
) -> dict:
    """Completions ``logprobs`` object of an echoed prompt (OpenAI's layout): the first
    token's logprob and top are null; each other top dict holds the prompt token too
    (:func:`completion_top`); text offsets from 0. ``entries`` is the engine's
    prompt logprobs, or ``None`` on a decode worker (which never ran the prompt): then
    every logprob and top is null and the router fills them in from the prefill leg's
    answer (``router/relay.py``)."""
    tokens, offsets = _tokens_at(tt, prompt_ids, 0)
    rows = list(entries) if entries is not None else [None] * len(prompt_ids)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in rows],
        "top_logprobs": [None if e is None else completion_top(e, tt, k) for e in rows],
        "text_offset": offsets,
    }


def join_logprobs(first: dict, second: dict) -> dict:
    """Two completions ``logprobs`` objects one after the other (lists concatenated)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(entries: Sequence[TokenLogprob], tt: TokenText) -> dict:
    """Chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def one(token_id: int, logprob: float) -> dict:
        return {"token": tt(token_id), "logprob": logprob, "bytes": list(tt.raw(token_id))}

    return {
        "content": [
            dict(one(e.token_id, e.logprob), top_logprobs=[one(i, lp) for i, lp in e.top])
            for e in entries
        ]
    }


def prompt_logprobs_json(
    entries: Sequence[TokenLogprob | None] | None, tt: TokenText, k: int | None = None
) -> list | None:
    """Extension ``prompt_logprobs``: ``None`` for the first prompt token, then per token
    ``{token_id, token, logprob, top_logprobs: [{token_id, token, logprob}]}`` (the first
    ``k`` alternatives; all when ``k`` is None)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            "token_id": e.token_id,
            "token": tt(e.token_id),
            "logprob": e.logprob,
            "top_logprobs": [{"token_id": i, "token": tt(i), "logprob": lp} for i, lp in e.top[:k]],
        }
        for e in entries
    ]


def generate_meta(
    out: RequestOutput,
    sample: CompletionOutput,
    *,
    return_logprob: bool,
    top_logprobs_num: int,
    logprob_start_len: int,
    latency: float,
    return_timing: bool = False,
) -> dict:
    """``meta_info`` of a native ``/generate`` answer (SGLang's shape: logprob entries are
    ``[logprob, token_id, null]``; the first prompt token's logprob is null); with
    ``return_timing``, ``timing``: the finished sample's timing block (server/phases.py)."""
    if sample.finish_reason is None:
        finish = None
    elif sample.finish_reason == "length":
        finish = {"type": "length", "length": len(sample.token_ids)}
    else:
        finish = {"type": sample.finish_reason, "matched": sample.stop_reason}
    meta: dict[str, Any] = {
        "id": out.request_id,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(sample.token_ids),
        "cached_tokens": out.num_cached_tokens,
        "finish_reason": finish,
        "e2e_latency": latency,
    }
    if return_timing and out.timing is not None:
        meta["timing"] = out.timing
    if not return_logprob:
        return meta
    outs = sample.logprobs or []
    meta["output_token_logprobs"] = [[e.logprob, e.token_id, None] for e in outs]
    if top_logprobs_num:
        meta["output_top_logprobs"] = [[[lp, i, None] for i, lp in e.top] for e in outs]
    if logprob_start_len >= 0:
        prompt = out.prompt_logprobs
        if prompt is None:  # decode role: the router merges the prefill leg's
            meta["input_token_logprobs"] = None
            if top_logprobs_num:
                meta["input_top_logprobs"] = None
        else:
            ids = out.prompt_token_ids
            rows = list(zip(ids, prompt))[logprob_start_len:]
            meta["input_token_logprobs"] = [
                [None if e is None else e.logprob, t, None] for t, e in rows
            ]
            if top_logprobs_num:
                meta["input_top_logprobs"] = [
                    None if e is None else [[lp, i, None] for i, lp in e.top] for _, e in rows
                ]
    return meta


# What the OpenAI endpoints build alike.


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
    token_text: TokenText,
    out: RequestOutput,
    token_ids: list[int],
    first: bool,
) -> dict[str, Any]:
    """Extension fields of one choice: token ids (``return_token_ids``; the prompt's with
    the first chunk), prompt logprobs (first chunk only) and, with ``return_timing``, the
    finished sample's timing block (``server/phases.py``)."""
    extra: dict[str, Any] = {}
    if req.return_timing and out.timing is not None:
        extra["timing"] = out.timing
    if req.return_token_ids:
        extra["token_ids"] = token_ids
        if first:
            extra["prompt_token_ids"] = out.prompt_token_ids
    if req.prompt_logprobs is not None and first:
        extra["prompt_logprobs"] = prompt_logprobs_json(
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
        usage(
            length,
            [out.outputs[0] for out in outs[p * n : (p + 1) * n]],
            scoring=scoring,
            cached_tokens=cached_tokens(outs[p * n : (p + 1) * n]),
        )
        for p, length in enumerate(lengths)
    )


def summed_usage(usages: Iterable[dict]) -> dict:
    """Field-wise sum of :func:`usage` dicts (the usage of a batch of prompts)."""
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
        """``chunk``, under ``include_usage``: with this sample's usage so far when
        ``continuous_usage_stats`` is set too, else ``"usage": null`` (OpenAI's chunks
        before the usage chunk); without ``include_usage`` as is (vLLM's rule:
        ``continuous_usage_stats`` alone adds nothing) (``o`` None: a chunk before any
        output token, e.g. chat's opening role chunk)."""
        opts = self._req.stream_options
        if not (opts and opts.include_usage):  # vLLM: no usage in chunks without it
            return chunk
        if not opts.continuous_usage_stats:
            chunk["usage"] = None
        else:
            chunk["usage"] = usage(
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
            total = summed_usage(
                usage(
                    length,
                    [o for i, o in self._finals.items() if i // n == p],
                    scoring=self._scoring,
                    cached_tokens=min(
                        (c for i, c in self._cached.items() if i // n == p), default=0
                    ),
                )
                for p, length in enumerate(self._lengths)
            )
            yield dict(head, choices=[], usage=total)


# SSE.

ChunkFn = Callable[[int, RequestOutput], Iterable[dict]]


async def sse_response(
    request: Request,
    serving: Serving,
    job: Job | Sequence[Job],
    chunks: ChunkFn,
    tail: Callable[[], Iterable[dict]] = lambda: (),
) -> StreamingResponse:
    """Start ``job`` (or a batch of jobs, numbered as ``Serving.stream_all``) and stream
    ``chunks(index, output)`` for each engine output, then ``tail()`` (e.g. the usage
    chunk), then ``[DONE]``. Raises APIError if the job fails before its first output."""
    jobs = [job] if isinstance(job, Job) else job
    it: AsyncGenerator[Any, None] = serving.stream_all(jobs)  # its own async iterator
    try:
        first = await cancel_on_disconnect(request, it.__anext__())
    except BaseException:
        await it.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            item = first
            stamped = False
            while True:
                for chunk in chunks(*item):
                    if not stamped:  # the timing block's first_chunk_unix (phases.py)
                        stamped = True
                        now = time.perf_counter()
                        for j in jobs:
                            j.first_chunk_at = now
                    yield sse_event(chunk)
                try:
                    item = await it.__anext__()
                except StopAsyncIteration:
                    break
            for chunk in tail():
                yield sse_event(chunk)
        except APIError as exc:
            yield sse_event(error_json(exc.status, exc.message, exc.param, exc.code))
        finally:
            with anyio.CancelScope(shield=True):
                await it.aclose()  # aborts unfinished samples when the client went away
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")
