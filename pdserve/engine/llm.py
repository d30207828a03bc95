"""The offline API, in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tqdm import tqdm

from pdserve import gc_watch
from pdserve.config import EMBEDDED_MODEL_ID, EngineConfig
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.core.request import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LLM:
    """An engine in this process, for batch generation.

    model: HF folder, ``.gguf`` file, ``random:<preset>`` or the embedded id (default).
    fields: any field of ``ModelConfig``, ``CacheConfig`` or ``SchedulerConfig`` by name
    (``pdserve/config.py`` gives their meanings and defaults; e.g. ``dtype``, ``device``,
    ``page_size``, ``max_running_requests``, ``enforce_eager``, ``quantization``,
    ``speculative_algorithm``), sorted out by :meth:`EngineConfig.from_fields`;
    ``gpu_ids`` may be any sequence. With ``tensor_parallel_size`` > 1, ranks ``1..N-1``
    are processes started with the ``spawn`` method: a script must guard its entry point
    with ``if __name__ == "__main__":``. Call :meth:`shutdown` (or use ``with LLM(...) as
    llm:``) to stop the rank processes.
    Unknown keyword arguments raise TypeError; bad values ValueError naming the field.

    freeze_heap: once the engine is up, collect once and move every object left to the
    garbage collector's permanent generation (``gc.freeze``, as the server's worker does
    after start-up), so that a generation-2 collection walks only what requests made since
    instead of the model, tokenizer and caches; ``None`` (default): on CUDA only. A step
    of many rows allocates enough to set off full collections: on the H200 one took
    230-260 ms in the middle of a 22 ms decode step of 1,024 rows (FP8 + e4m3 KV), 1.86 s
    of a 6.7 s ``bench offline`` run of 1,024 prompts; frozen, 19,482 -> 26,073 output
    tok/s, the same tokens (docs/benchmarks.md row S9-FP8BIG).
    """

    def __init__(
        self, model: str = EMBEDDED_MODEL_ID, *, freeze_heap: bool | None = None, **fields: Any
    ) -> None:
        if fields.get("gpu_ids") is not None:
            fields["gpu_ids"] = tuple(fields["gpu_ids"])
        self.engine = EngineCore(EngineConfig.from_fields(model=model, **fields))
        self._ids = itertools.count()
        if freeze_heap or (freeze_heap is None and self.engine.device.type == "cuda"):
            gc_watch.freeze_heap()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV page no request holds (they go back to the pool), so the
        next prompts are computed in full; returns how many pages were dropped."""
        return self.engine.kv.reset_cache()

    def shutdown(self) -> None:
        """Stop the engine's rank processes (tensor parallelism); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished ``RequestOutput`` per prompt,
        in input order, with ``n`` samples in ``outputs`` (ordered by index).

        prompts: a string, a list of strings (tokenized with special tokens) or a list of
        token-id lists.  sampling_params: one for all prompts or one per prompt
        (default ``SamplingParams()``).  Raises ValueError naming the prompt when one is
        empty or too long for the context, and before anything is queued.
        """
        token_lists = self._tokenize(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(token_lists)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(token_lists):
            raise ValueError(
                f"sampling_params has {len(params_list)} entries for {len(token_lists)} prompts"
            )
        for i, p in enumerate(params_list):
            if not isinstance(p, SamplingParams):
                raise ValueError(
                    f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}"
                )
        outputs = self._run(token_lists, params_list, use_tqdm)
        texts = [prompts] if isinstance(prompts, str) else prompts
        for out, text in zip(outputs, texts):
            if isinstance(text, str):
                out.prompt = text
        return outputs

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of
        ``{"role", "content"}`` messages) or a list of them, then :meth:`generate`."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations: list[Sequence[dict[str, Any]]]
        if isinstance(messages[0], dict):
            conversations = [cast(Sequence[dict[str, Any]], messages)]
        else:
            conversations = list(cast(Sequence[Sequence[dict[str, Any]]], messages))
        token_lists = [
            self.chat_token_ids(
                c,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs,
            )
            for c in conversations
        ]
        return self.generate(token_lists, sampling_params, use_tqdm=use_tqdm)

    def chat_token_ids(
        self,
        conversation: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt token ids of one conversation under the tokenizer's chat template (the
        template writes any BOS itself, so no special tokens are added again)."""
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(
            list(conversation),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
        ids: list[int] = tok(text, add_special_tokens=False)["input_ids"]
        return ids

    # --- internals ---------------------------------------------------------------------
    def _tokenize(self, prompts: object) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"prompts must be a string, a list of strings or a list of token-id "
                f"lists, got {type(prompts).__name__}"
            )
        out: list[list[int]] = []
        for i, p in enumerate(prompts):
            ids: list[int]
            if isinstance(p, str):
                ids = self.engine.tokenizer(p)["input_ids"]
            elif isinstance(p, (list, tuple)) and all(map(isinstance, p, itertools.repeat(int))):
                ids = list(p)
            else:
                raise ValueError(f"prompts[{i}] must be a string or a list of token ids")
            if not ids:
                raise ValueError(f"prompts[{i}] is empty")
            if len(ids) >= self.engine.max_model_len:
                raise ValueError(
                    f"prompts[{i}] has {len(ids)} tokens; the context limit "
                    f"max_model_len is {self.engine.max_model_len}"
                )
            out.append(ids)
        return out

    def _run(
        self, token_lists: list[list[int]], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        children: list[tuple[str, list[str]]] = []  # (request id, its engine request ids)
        live: set[str] = set()
        try:
            for ids, params in zip(token_lists, params_list):
                base = str(next(self._ids))
                pairs = params.fan_out(base)
                for child_id, child_params in pairs:
                    self.engine.add_request(child_id, ids, child_params)
                    live.add(child_id)
                children.append((base, [c for c, _ in pairs]))
            done: dict[str, RequestOutput] = {}
            bar = tqdm(total=len(live), disable=not use_tqdm, desc="generate")
            while live:
                steps = self.engine.num_steps  # cheap: stats() builds a dict of gauges
                outs = self.engine.step()
                if not outs and self.engine.num_steps == steps:
                    raise RuntimeError(
                        "engine made no progress (a scheduler bug): "
                        f"{len(live)} requests left, stats {self.engine.stats()}"
                    )
                for out in outs:
                    if out.finished:
                        done[out.request_id] = out
                        live.discard(out.request_id)
                        bar.update(1)
            bar.close()
        finally:
            for child_id in live:
                self.engine.abort_request(child_id)
        return [
            self._merge(base, ids, [done[c] for c in kids])
            for ids, (base, kids) in zip(token_lists, children)
        ]

    @staticmethod
    def _merge(request_id: str, prompt: list[int], outs: list[RequestOutput]) -> RequestOutput:
        completions = []
        for index, out in enumerate(outs):
            c = out.outputs[0]
            c.index = index
            completions.append(c)
        error = next((o.error for o in outs if o.error), None)
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=prompt,
            outputs=completions,
            finished=True,
            prompt_logprobs=outs[0].prompt_logprobs,
            error=error,
            num_cached_tokens=min(o.num_cached_tokens for o in outs),  # prompt counted once
        )
