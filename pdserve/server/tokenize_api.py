"""``POST /tokenize``, ``POST /detokenize`` (vLLM's request and response shapes) and
``GET /version`` of a worker."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse

import pdserve
from pdserve.server.openai_api import (
    WorkerContext,
    apply_chat_template,
    chat_messages,
    check_model,
    encode,
    template_flags,
)
from pdserve.server.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.server.serving import APIError


def build_tokenize_router(ctx: WorkerContext) -> APIRouter:
    """The tokenizer endpoints and ``/version`` bound to ``ctx``."""
    api = APIRouter()

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        """``{count, max_model_len, tokens, token_strs}`` of ``prompt`` or ``messages``
        (``token_strs`` only with ``return_token_strs``, else null)."""
        ctx.accept(req, "/tokenize")
        check_model(ctx, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ctx.check_text(req.prompt, "prompt")
            text = req.prompt
            special = True if req.add_special_tokens is None else req.add_special_tokens
        else:
            messages = chat_messages(ctx, req.messages or [])
            text = await apply_chat_template(ctx.tokenizer, messages, **template_flags(req))
            special = bool(req.add_special_tokens)
        ids = await encode(ctx.tokenizer, text, add_special_tokens=special)
        strs = None
        if req.return_token_strs:
            strs = await asyncio.to_thread(ctx.tokenizer.convert_ids_to_tokens, ids)
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": ctx.serving.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        """``{prompt}``: the text of ``tokens`` (400 for ids outside the vocabulary)."""
        ctx.accept(req, "/detokenize")
        check_model(ctx, req.model)
        vocab = ctx.serving.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be ids in [0, {vocab}), got {bad[0]}", "tokens")
        text = await asyncio.to_thread(ctx.tokenizer.decode, req.tokens)
        return JSONResponse({"prompt": text})

    @api.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pdserve.__version__})

    return api
