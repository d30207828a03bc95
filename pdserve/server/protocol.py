"""Request bodies of the worker's HTTP API, validated with pydantic.

OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (plus vLLM/SGLang-style
extensions: ``top_k``, ``min_p``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``prompt_logprobs``, ``return_token_ids``, ``repetition_penalty``) and the native
``/generate`` (SGLang's shape), plus ``/tokenize`` and ``/detokenize`` (vLLM's shapes).
Every body also accepts the disaggregation fields ``bootstrap_host``, ``bootstrap_port``,
``bootstrap_room`` that the router adds.

Field policy: a known field is validated strictly (a bad value is a 400 naming it); an
unknown field is kept in ``model_extra`` and handled by ``server/field_policy.py``
(ignored with a warning and a counter, or a 400 under ``--strict-request-fields``).
OpenAI fields that change nothing here (``user``, ``metadata``, ``store``, ...) are declared
in :class:`_NoOpFields`, so they are accepted without a warning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from pdserve.disagg.base import MAX_TOP_LOGPROBS, ROOM_LIMIT
from pdserve.engine.sampling_params import SEED_MAX, SEED_MIN
from pdserve.ports import PORT_MAX
from pdserve.server.body_base import Int, RequestModel
from pdserve.server.structured import GuidedFields, ResponseFormatField
from pdserve.server.tools import ToolFields, ToolMessageFields

MAX_N = 128  # most samples per prompt (`n`), OpenAI's own limit on n


class _Body(RequestModel):
    """The base of the request bodies: unknown fields are kept (see the module's
    docstring); a JSON ``null`` for an optional field means its default
    (``body_base.RequestModel``)."""

    model_config = ConfigDict(extra="allow")  # unknown fields: see server/field_policy.py


class Bootstrap(_Body):
    """The disaggregation fields (``disagg.base.BOOTSTRAP_FIELDS``): required on a prefill
    worker; a decode worker runs a request with none of them whole; ignored on mixed. The
    router sets them and refuses them from a client."""

    bootstrap_host: str | None = None
    bootstrap_port: StrictInt | None = Field(None, ge=1, le=PORT_MAX)
    bootstrap_room: StrictInt | None = Field(None, ge=0, lt=ROOM_LIMIT)


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage;
    ``continuous_usage_stats`` (vLLM) puts the usage so far in every chunk."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _NoOpFields(_Body):
    """OpenAI request fields accepted and ignored: they change nothing on this server
    (no accounts, no stored completions, no service tiers, no reasoning models)."""

    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None


def _logit_bias(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """``logit_bias`` keys are token ids written as JSON strings; values numbers in
    [-100, 100] (the range is checked by SamplingParams, the ids against the vocabulary
    by the worker)."""
    if value is None:
        return None
    for key, bias in value.items():
        if not key.strip().isdigit():
            raise ValueError(f"keys must be token ids (strings of digits), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ValueError(f"values must be numbers, got {bias!r} for {key!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"values must be in [-100, 100], got {bias!r} for {key!r}")
    return value


class _Penalties(_Body):
    """Penalties and bias (OpenAI's ``presence_penalty``, ``frequency_penalty``,
    ``logit_bias``; vLLM's ``repetition_penalty``); meanings in ``SamplingParams``."""

    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0)
    logit_bias: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _logit_bias(value)

    def penalty_params(self) -> dict[str, Any]:
        """The four as ``SamplingParams`` keyword arguments."""
        bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        return {
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
            "logit_bias": bias or None,
        }


class _Sampling(_Penalties, GuidedFields):
    """The sampling fields the OpenAI endpoints and ``/generate`` name alike (``top_k``,
    ``min_p``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``: vLLM's and
    SGLang's extensions); meanings in ``SamplingParams``."""

    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: StrictFloat = Field(1.0, ge=0.0, allow_inf_nan=False)  # finite; no upper bound
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(0, ge=-1)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)

    def sampling_params(self) -> dict[str, Any]:
        """These fields and the penalties as ``SamplingParams`` keyword arguments."""
        return {
            "n": self.n,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": self.top_k,
            "min_p": float(self.min_p),
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "seed": self.seed,
            **self.penalty_params(),
        }


class _OpenAISampling(Bootstrap, _NoOpFields, _Sampling, ResponseFormatField):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # extensions (vLLM names)
    min_tokens: Int = Field(0, ge=0)
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    return_token_ids: StrictBool = False
    # pdserve: each finished choice's per-phase timings (server/phases.py)
    return_timing: StrictBool = False
    truncate_prompt_tokens: Int | None = Field(None, ge=-1)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError(
                "truncate_prompt_tokens must be >= 1 (tokens kept) or -1 (the context limit)"
            )
        return value

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """``ids`` cut to their last ``truncate_prompt_tokens`` (-1: ``max_model_len``)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        keep = max_model_len if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    @field_validator("stream_options")
    @classmethod
    def _only_with_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> Any:
        # OpenAI and vLLM answer 400 too; ``stream`` is declared (so validated) before it
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


# the prompt shapes of a list, picked by its first element: (union member, what the list is,
# what each element must be)
_PROMPT_LISTS = {
    str: ("list[str]", "a list of strings", "a string"),
    int: ("list[int]", "a list of token ids", "a token id (an integer)"),
    list: ("list[list[int]]", "a list of token-id lists", "a list of token ids"),
}


def _prompt_error(value: Any, exc: ValidationError) -> str:
    """The message of a ``prompt`` that fits none of its shapes, from pydantic's errors of
    the member the value's shape picks: e.g. ``prompt[1]: must be a string like the others
    (prompt is a list of strings)``, ``prompt[1][0]: must be a token id (an integer)``."""
    shape = type(value[0]) if isinstance(value, list) and value else None
    if isinstance(value, list) and value and shape in _PROMPT_LISTS:
        member, kind, each = _PROMPT_LISTS[shape]
        for err in exc.errors():
            loc = err["loc"]
            if loc[:1] != (member,) or len(loc) < 2:
                continue
            where = "prompt" + "".join(f"[{i}]" for i in loc[1:])
            if len(loc) == 2:
                return f"{where}: must be {each} like the others (prompt is {kind})"
            return f"{where}: must be a token id (an integer)"
    return (
        "prompt must be a string, a list of token ids, a list of strings or a list of "
        "token-id lists"
    )


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``; ``prompt`` is one string, one list of token ids, or a
    batch (a list of strings or of token-id lists): each prompt gets ``n`` choices,
    numbered ``p * n + i`` across the batch (vLLM's and SGLang's order), the usage sums
    the prompts'.

    ``echo`` prepends the prompt to the text (and, with ``logprobs``, the prompt tokens'
    logprobs to the logprobs, the first one null); ``max_tokens`` 0 generates nothing
    (with ``echo``: pure scoring of the prompt). ``suffix`` is not supported (400);
    ``best_of`` only as ``n``.
    """

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: Int = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: Int | None = Field(None, ge=1)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_clear_error(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # pydantic checks the union; a failure is told as the one error of the shape the
        # first element picks (pydantic's own dump lists every member's errors)
        try:
            return handler(value)
        except ValidationError as exc:
            raise ValueError(_prompt_error(value, exc)) from None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], (str, list)):  # a batch
            for p, prompt in enumerate(value):
                if len(prompt) == 0:
                    raise ValueError(f"prompt[{p}] must not be empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or each of a batch (text or token ids)."""
        value = self.prompt
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return list(value)
        return [value]  # type: ignore[list-item]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported (insertion needs a fill-in-the-middle model)")
        return value


def _unsupported_part(messages: Any) -> str | None:
    """The error for the first content part whose type is not ``text``, else ``None``."""
    if not isinstance(messages, list):
        return None
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                return (
                    f"messages[{i}].content[{j}]: content part type {kind!r} is not supported "
                    "by this model; only 'text' parts are"
                )
    return None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body, ToolMessageFields):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAISampling, ToolFields):
    """``POST /v1/chat/completions``; the chat template of the model builds the prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # pdserve extension: the prompt as token ids, already through the chat template (the
    # router's migration resends a request with the tokens streamed so far appended, so
    # nothing is re-tokenized); ``messages`` are still checked but not templated
    prompt_token_ids: list[StrictInt] | None = Field(None, min_length=1)

    @field_validator("messages", mode="wrap")
    @classmethod
    def _clear_content_errors(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # pydantic checks each content union; a part other than text is told as one error
        # naming it (pydantic's own dump lists the str and list members' errors)
        try:
            messages = handler(value)
        except ValidationError:
            unsupported = _unsupported_part(value)
            if unsupported:
                raise ValueError(unsupported) from None
            raise
        for i, m in enumerate(messages):
            if m.content is None and m.role != "assistant":  # OpenAI: assistant only
                raise ValueError(
                    f"messages[{i}].content must not be null for a {m.role} message "
                    "(only an assistant message, e.g. one with tool_calls, may omit it)"
                )
            if m.role == "tool" and m.tool_call_id is None:  # OpenAI requires it too
                raise ValueError(
                    f"messages[{i}].tool_call_id is required for a tool message (the id "
                    "of the assistant's tool call it answers)"
                )
        return messages


class GenerateSamplingParams(_Sampling):
    """``sampling_params`` of ``/generate`` (SGLang's names)."""

    max_new_tokens: Int = Field(128, ge=1)
    min_new_tokens: Int = Field(0, ge=0)


class GenerateRequest(Bootstrap):
    """``POST /generate``: ``text`` or ``input_ids``; logprobs as SGLang
    (``logprob_start_len`` -1 = no prompt logprobs, else from that prompt position)."""

    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: GenerateSamplingParams = Field(
        default_factory=lambda: GenerateSamplingParams.model_validate({})
    )
    return_logprob: StrictBool = False
    top_logprobs_num: Int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: Int = Field(-1, ge=-1)
    stream: StrictBool = False
    rid: str | None = None
    return_timing: StrictBool = False  # pdserve: meta_info.timing (server/phases.py)


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` text, or chat ``messages`` rendered by
    the chat template (``add_generation_prompt``); ``add_special_tokens`` defaults to true
    for a prompt and false for messages (the template has them), as vLLM does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape): ``tokens`` -> ``{"prompt": text}``."""

    model: str | None = None
    tokens: list[StrictInt]
