"""OpenAI-compatible endpoints of a worker: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/v1/models/{id}``; and prompt text -> token ids for every endpoint of the
worker (``/generate`` and ``/tokenize`` too): a cheap length bound checked before
tokenizing, and tokenization / chat templates run off the event loop (a long prompt would
otherwise stall every request and ``/health`` of the worker).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.engine.core.request import RequestOutput
from pdserve.engine.structured.params import StructuredOutputsParams
from pdserve.http.disconnect import cancel_on_disconnect
from pdserve.server import formatting as fmt
from pdserve.server import tools as tl
from pdserve.server.field_policy import FieldPolicy
from pdserve.server.formatting import (
    StreamSamples,
    choice_extras,
    final_usage,
    response_head,
    sse_response,
)
from pdserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _OpenAISampling,
)
from pdserve.server.serving import APIError, Job, Serving, make_params
from pdserve.server.structured import compile_or_400, structured_params

MIN_CHARS_PER_TOKEN = 16  # the bound's floor; see max_prompt_chars


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Longest prompt text (in characters) that could still fit ``max_model_len`` tokens.

    One token stands for at most as many characters as its longest vocabulary entry (the
    vocabulary's strings spell out a token's bytes, e.g. byte-level BPE's one character per
    byte, and a character is at least one byte), so ``max_model_len * longest entry`` is an
    upper bound on the characters of any prompt that fits; the factor is at least
    ``MIN_CHARS_PER_TOKEN`` in case a normalizer drops characters. Text longer than this
    cannot fit and is rejected without tokenizing it.
    """
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 a tokenizer without get_vocab: a generous fixed factor
        longest = 0
    return max_model_len * max(MIN_CHARS_PER_TOKEN, longest)


def check_text(text: str, field: str, *, limit: int, max_model_len: int) -> None:
    """400 naming ``field`` for text that is not valid Unicode (lone surrogates) or longer
    than ``limit`` characters (which cannot fit the context limit)."""
    if limit and len(text) > limit:
        raise APIError(
            400,
            f"{field} is {len(text)} characters long, more than can fit this model's context "
            f"limit of {max_model_len} tokens (at most {limit} characters)",
            field,
            code="context_length_exceeded",
        )
    try:
        text.encode("utf-8")
    except (
        UnicodeEncodeError
    ) as exc:  # a \ud800 escape without its pair: the tokenizer raises TypeError
        raise APIError(
            400,
            f"{field} is not valid Unicode: a lone surrogate at character {exc.start} "
            f"(\\ud800-\\udfff escapes must come in pairs)",
            field,
        ) from None


async def encode(tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
    """``tokenizer.encode(text, **kwargs)`` in a worker thread."""
    return await asyncio.to_thread(tokenizer.encode, text, **kwargs)


async def apply_chat_template(tokenizer: Any, messages: list[dict], **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`` in a worker
    thread; 400 naming ``messages`` when the model has no template or it rejects them."""
    try:
        return await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, tokenize=False, **kwargs
        )
    except Exception as exc:  # no template, or the template rejects the roles
        raise APIError(400, f"cannot apply the model's chat template: {exc}", "messages") from exc


@dataclass
class WorkerContext:
    """What the endpoints of one worker share."""

    serving: Serving
    tokenizer: Any
    model_name: str
    token_text: fmt.TokenText
    max_prompt_chars: int = 0  # max_prompt_chars(); 0 = no bound
    fields: FieldPolicy | None = None  # unknown request fields; None: ignored silently
    responses_store_size: int = 1000  # most responses /v1/responses keeps (0: none)
    model_root: str | None = None  # the --model value (model objects' ``root``)
    # /v1/models' ``created``: Unix time (s) the model was loaded and this worker set up
    created: int = field(default_factory=lambda: int(time.time()))

    def accept(self, body: Any, endpoint: str) -> None:
        """Apply the field policy to a parsed body (400 for unknown fields when strict)."""
        if self.fields is not None:
            self.fields.apply(body, endpoint)

    def check_text(self, text: str, field: str) -> None:
        """400 naming ``field`` for prompt text that cannot be tokenized or cannot fit."""
        check_text(
            text, field, limit=self.max_prompt_chars, max_model_len=self.serving.max_model_len
        )


def check_model(ctx: WorkerContext, model: str | None) -> None:
    """404 ``model_not_found`` unless ``model`` is unset or the one this worker serves."""
    if model is not None and model != ctx.model_name:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this worker serves '{ctx.model_name}'",
            "model",
            code="model_not_found",
        )


def _job(
    ctx: WorkerContext,
    req: _OpenAISampling,
    prompt_ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutputsParams | None = None,
) -> Job:
    params = make_params(
        **req.sampling_params(),
        structured_outputs=structured,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    job = Job(prompt_ids, params, req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
    if isinstance(req, ChatCompletionRequest):  # a chat's prompt is its messages
        job.prompt_field = "prompt_token_ids" if req.prompt_token_ids is not None else "messages"
    return job


def chat_messages(ctx: WorkerContext, messages: list[ChatMessage]) -> list[dict]:
    """The chat template's input for ``messages`` (``developer`` is ``system``); 400 naming
    ``messages[i].content`` for text that cannot be tokenized."""
    out = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    for i, m in enumerate(out):
        ctx.check_text(m["content"], f"messages[{i}].content")
    return out


def _lift_prompt_logprobs(body: dict) -> dict:
    """A chat answer (or chunk) with its choices' ``prompt_logprobs`` moved to the top
    level, where vLLM's chat puts them (the prompt is the same for every choice)."""
    lifted = [c.pop("prompt_logprobs") for c in body["choices"] if "prompt_logprobs" in c]
    if lifted:
        body["prompt_logprobs"] = lifted[0]
    return body


def template_flags(req: Any) -> dict[str, bool]:
    """``add_generation_prompt`` and ``continue_final_message`` for the chat template of a
    parsed chat (or ``/tokenize`` messages) request.

    ``continue_final_message`` (vLLM): the prompt ends inside the final message, which
    the output continues (no end-of-turn after it, no new turn); it needs
    ``add_generation_prompt`` false (an explicit true with it is a 400, as vLLM's; left
    unset it follows). A conversation whose final message is the assistant's, with text and
    no tool calls, is continued when neither field is given (SGLang's assistant prefill);
    ``continue_final_message: false`` makes it a new turn, as before."""
    given = req.model_fields_set
    last = req.messages[-1] if req.messages else None
    if "continue_final_message" in given:
        cont = req.continue_final_message
    else:
        cont = (
            "add_generation_prompt" not in given
            and last is not None
            and last.role == "assistant"
            and bool(last.text())
            and not last.tool_calls
        )
    if cont and req.add_generation_prompt and "add_generation_prompt" in given:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true (the "
            "prompt ends inside the final message, or opens a new turn)",
            "continue_final_message",
        )
    if cont and (last is None or not last.text()):
        raise APIError(
            400,
            "continue_final_message needs a final message with text to continue",
            "continue_final_message",
        )
    if cont:
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": req.add_generation_prompt}


async def chat_job(
    ctx: WorkerContext, req: ChatCompletionRequest
) -> tuple[Job, tl.ToolPlan, list[int], int | None]:
    """A parsed chat request made ready to run: ``(job, tool plan, prompt token ids, top
    logprobs per token or None)``; the prompt is the model's chat template over
    ``req.messages`` (with the tools' rendering), or ``req.prompt_token_ids`` as given
    (already templated: the router's migration). Raises APIError (400 naming the field,
    404 for another model)."""
    check_model(ctx, req.model)
    plan = tl.plan_tools(req, getattr(ctx.tokenizer, "chat_template", None))
    chat_messages(ctx, req.messages)  # checks every message's text
    if req.prompt_token_ids is not None:  # already templated (the router's migration)
        prompt_ids = list(req.prompt_token_ids)
    else:
        messages, template_kwargs = tl.template_messages(req.messages, plan)
        text = await apply_chat_template(
            ctx.tokenizer, messages, **template_flags(req), **template_kwargs
        )
        ctx.check_text(text, "messages")
        prompt_ids = await encode(ctx.tokenizer, text, add_special_tokens=False)
    prompt_ids = req.truncate(prompt_ids, ctx.serving.max_model_len)
    top = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    spec = structured_params(req)
    forced = plan.forced_spec()
    if forced is not None and spec is not None:
        raise APIError(
            400,
            f"tool_choice {plan.mode!r} forces the output; {spec.field} cannot be combined with it",
            spec.field,
        )
    spec = forced or spec
    await compile_or_400(ctx.serving.engine.core, spec)
    job = _job(
        ctx,
        req,
        prompt_ids,
        req.max_completion_tokens or req.max_tokens,
        top,
        req.prompt_logprobs,
        spec,
    )
    return job, plan, prompt_ids, top


def build_openai_router(ctx: WorkerContext) -> APIRouter:
    """The OpenAI endpoints bound to ``ctx``."""
    api = APIRouter()
    tt = ctx.token_text

    def model_card() -> dict[str, Any]:
        """OpenAI's model object of the served model, plus vLLM's ``max_model_len``,
        ``root`` (the model it was loaded from: the ``--model`` value) and ``parent``
        (null: no adapters)."""
        return {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "pdserve",
            "root": ctx.model_root or ctx.model_name,
            "parent": None,
            "max_model_len": ctx.serving.max_model_len,
        }

    @api.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        """``client.models.retrieve(name)``: the served model's object; 404
        ``model_not_found`` for another id (``:path``: an id may hold ``/``)."""
        check_model(ctx, model_id)
        return JSONResponse(model_card())

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        ctx.accept(req, "/v1/completions")
        check_model(ctx, req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(
                400, "best_of is not supported (leave it unset or equal to n)", "best_of"
            )
        batch = req.prompts()
        many = len(batch) > 1
        ids_of: list[list[int]] = []  # each prompt's token ids
        echo_of: list[str] = []  # each prompt's echoed text
        for p, prompt in enumerate(batch):
            if isinstance(prompt, list):
                ids = list(prompt)
            else:
                ctx.check_text(prompt, f"prompt[{p}]" if many else "prompt")
                ids = await encode(ctx.tokenizer, prompt)
            ids_of.append(req.truncate(ids, ctx.serving.max_model_len))
            if len(ids_of[-1]) < len(ids):  # echo what was kept
                batch[p] = ids_of[-1]
        scoring = req.max_tokens == 0  # no output: the engine's one token is dropped
        if scoring and not req.echo:
            raise APIError(
                400,
                "max_tokens is 0 without echo: give max_tokens >= 1, or echo: true to score"
                " the prompt",
                "max_tokens",
            )
        if req.echo:
            for prompt, ids in zip(batch, ids_of):
                echo_of.append(
                    prompt
                    if isinstance(prompt, str)
                    else await asyncio.to_thread(ctx.tokenizer.decode, ids)
                )
        echo_lp = req.echo and req.logprobs is not None
        prompt_k = req.prompt_logprobs
        if echo_lp:
            prompt_k = max(req.logprobs or 0, prompt_k or 0)
        spec = structured_params(req)
        await compile_or_400(ctx.serving.engine.core, spec)
        jobs = [
            _job(ctx, req, ids, 1 if scoring else req.max_tokens, req.logprobs, prompt_k, spec)
            for ids in ids_of
        ]
        head = response_head("cmpl", "text_completion", jobs[0].request_id, ctx.model_name)
        for p, job in enumerate(jobs[1:], 1):  # prompt p: its own engine requests and rooms
            job.request_id = f"{jobs[0].request_id}-{p}"
            job.prompt_index = p

        def choice(index: int, out: RequestOutput, o: Any, first: bool, delta: bool) -> dict:
            """One choice (``index``: ``p * n + i`` for sample ``i`` of prompt ``p``): the
            whole sample, or (``delta``) this chunk's part of it; the echoed prompt (and its
            logprobs) goes in front of the first."""
            p = index // req.n
            echo_text = echo_of[p] if req.echo else ""
            text = "" if scoring else (o.delta_text if delta else o.text)
            ids = [] if scoring else list(o.delta_token_ids if delta else o.token_ids)
            entries = [] if scoring else ((o.delta_logprobs if delta else o.logprobs) or [])
            offset = len(echo_text) + (offsets.get(index, 0) if delta else 0)
            lp = None
            if req.logprobs is not None:
                lp = fmt.completion_logprobs(entries, tt, offset)
                if req.echo and first:
                    head_lp = fmt.echo_logprobs(ids_of[p], out.prompt_logprobs, tt, req.logprobs)
                    lp = fmt.join_logprobs(head_lp, lp)
            if req.echo and first:
                text = echo_text + text
            finish = o.finish_reason
            return {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": "length"
                if scoring and finish
                else tl.openai_finish_reason(finish),
                **choice_extras(req, tt, out, ids, first),
            }

        lengths = [len(ids) for ids in ids_of]
        offsets: dict[int, int] = {}  # streams: text_offset reached so far, per sample
        if req.stream:
            samples = StreamSamples(req, lengths, scoring)

            def chunks(index: int, out: RequestOutput):
                o, first, worth = samples.see(index, out)
                body = choice(index, out, o, first, delta=True)
                # text_offset counts token strings, as within a chunk (completion_logprobs),
                # so a stream's offsets are the whole answer's whatever its chunking
                sent = 0 if scoring else sum(len(tt(e.token_id)) for e in o.delta_logprobs or [])
                offsets[index] = offsets.get(index, 0) + sent
                if worth:
                    yield samples.with_usage(dict(head, choices=[body]), o, out)

            return await sse_response(
                request, ctx.serving, jobs, chunks, lambda: samples.tail(head)
            )

        outs = await cancel_on_disconnect(request, ctx.serving.collect(jobs))
        choices = [
            choice(index, out, out.outputs[0], True, delta=False) for index, out in enumerate(outs)
        ]
        usage = final_usage(lengths, outs, scoring)
        return JSONResponse(dict(head, choices=choices, usage=usage))

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        ctx.accept(req, "/v1/chat/completions")
        job, plan, prompt_ids, top = await chat_job(ctx, req)
        head = response_head("chatcmpl", "chat.completion", job.request_id, ctx.model_name)

        if req.stream:
            samples = StreamSamples(req, len(prompt_ids))
            chunk_head = dict(head, object="chat.completion.chunk")
            tool_streams: dict[int, tl.ToolStream] = {}

            def chunks(index: int, out: RequestOutput):
                o, first, _ = samples.see(index, out)
                if first:  # OpenAI's opening chunk: the role, no content (nor refusal) yet
                    opening = {
                        "index": index,
                        "delta": {"role": "assistant", "content": "", "refusal": None},
                        "logprobs": None,
                        "finish_reason": None,
                        **choice_extras(req, tt, out, [], True),
                    }
                    yield samples.with_usage(
                        _lift_prompt_logprobs(dict(chunk_head, choices=[opening])), None, out
                    )
                if not (o.delta_token_ids or o.delta_text or o.finished):
                    return
                reason = tl.openai_finish_reason(o.finish_reason)
                if plan.mode == "none":
                    deltas = [{"content": o.delta_text}]
                else:
                    ts = tool_streams.setdefault(index, tl.ToolStream(plan))
                    deltas = ts.feed(o.delta_text, o.finished) or [{}]
                    if o.finished:
                        reason = tl.finish_reason(o.finish_reason, ts.calls)
                lp = fmt.chat_logprobs(o.delta_logprobs or [], tt) if top is not None else None
                extras = choice_extras(req, tt, out, list(o.delta_token_ids), False)
                if deltas == [{}] and reason is None and lp is None and not extras:
                    return  # text held back (a tool call not whole yet): nothing to send
                for delta in deltas[:-1]:  # tool-call deltas before the one that finishes
                    between = {
                        "index": index,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield samples.with_usage(dict(chunk_head, choices=[between]), o, out)
                delta = deltas[-1]
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": reason,
                    **extras,
                }
                yield samples.with_usage(dict(chunk_head, choices=[choice]), o, out)

            return await sse_response(
                request, ctx.serving, job, chunks, lambda: samples.tail(chunk_head)
            )

        outs = await cancel_on_disconnect(request, ctx.serving.collect(job))
        choices = []
        for index, out in enumerate(outs):
            o = out.outputs[0]
            lp = fmt.chat_logprobs(o.logprobs or [], tt) if top is not None else None
            content, calls = tl.parse_output(o.text, plan)
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": tl.finish_reason(o.finish_reason, calls),
                    **choice_extras(req, tt, out, list(o.token_ids), True),
                }
            )
        body = dict(head, choices=choices, usage=final_usage(len(prompt_ids), outs))
        return JSONResponse(_lift_prompt_logprobs(body))

    return api
