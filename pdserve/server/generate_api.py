"""Native ``POST /generate`` (SGLang's shape): ``text`` or ``input_ids``, a
``sampling_params`` dict, logprob options, streaming of cumulative chunks."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.engine.core.request import RequestOutput
from pdserve.http.disconnect import cancel_on_disconnect
from pdserve.server import formatting as fmt
from pdserve.server.formatting import sse_response
from pdserve.server.openai_api import WorkerContext, encode
from pdserve.server.protocol import GenerateRequest
from pdserve.server.serving import APIError, Job, make_params
from pdserve.server.structured import compile_or_400, structured_params


def build_generate_router(ctx: WorkerContext) -> APIRouter:
    """The ``/generate`` endpoint bound to ``ctx``."""
    api = APIRouter()

    @api.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Response:
        ctx.accept(req, "/generate")
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids", "text")
        if req.input_ids is not None:
            prompt_ids = list(req.input_ids)
        else:
            assert req.text is not None  # exactly one of text / input_ids, checked above
            ctx.check_text(req.text, "text")
            prompt_ids = await encode(ctx.tokenizer, req.text)
        if req.return_logprob and req.logprob_start_len >= max(len(prompt_ids), 1):
            raise APIError(
                400,
                f"logprob_start_len ({req.logprob_start_len}) must be < the prompt length "
                f"({len(prompt_ids)})",
                "logprob_start_len",
            )
        sp = req.sampling_params
        k = req.top_logprobs_num
        spec = structured_params(sp, prefix="sampling_params.")
        await compile_or_400(ctx.serving.engine.core, spec)
        params = make_params(
            **sp.sampling_params(),
            structured_outputs=spec,
            max_tokens=sp.max_new_tokens,
            min_tokens=sp.min_new_tokens,
            logprobs=k if req.return_logprob else None,
            prompt_logprobs=k if req.return_logprob and req.logprob_start_len >= 0 else None,
        )
        job = Job(prompt_ids, params, req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
        if req.rid:
            job.request_id = req.rid

        def item(index: int, out: RequestOutput) -> dict:
            o = out.outputs[0]
            body: dict[str, Any] = {
                "text": o.text,
                "output_ids": list(o.token_ids),
                "meta_info": fmt.generate_meta(
                    out,
                    o,
                    return_logprob=req.return_logprob,
                    top_logprobs_num=k,
                    logprob_start_len=req.logprob_start_len,
                    latency=time.perf_counter() - job.arrival,
                    return_timing=req.return_timing,
                ),
            }
            if sp.n > 1:
                body["index"] = index
            return body

        if req.stream:
            return await sse_response(request, ctx.serving, job, lambda i, out: [item(i, out)])
        outs = await cancel_on_disconnect(request, ctx.serving.collect(job))
        items = [item(i, out) for i, out in enumerate(outs)]
        return JSONResponse(items if sp.n > 1 else items[0])

    return api
