"""Request bodies of the worker's HTTP API, validated with pydantic.

OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (plus vLLM/SGLang-style
extensions: ``top_k``, ``min_p``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``prompt_logprobs``, ``return_token_ids``) and the native ``/generate`` (SGLang's shape).
Every body also accepts the disaggregation fields ``bootstrap_host``, ``bootstrap_port``,
``bootstrap_room`` that the router adds. Unknown fields are rejected (never dropped silently).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
)

ROOM_LIMIT = 2**63  # bootstrap rooms are 63-bit


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Bootstrap(_Body):
    """The disaggregation fields (required on prefill/decode workers, ignored on mixed)."""

    bootstrap_host: str | None = None
    bootstrap_port: StrictInt | None = Field(None, ge=1, le=65535)
    bootstrap_room: StrictInt | None = Field(None, ge=0, lt=ROOM_LIMIT)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _OpenAISampling(Bootstrap):
    """Fields shared by both OpenAI endpoints."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=128)
    temperature: StrictFloat = Field(1.0, ge=0.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    user: str | None = None
    # extensions (vLLM names)
    top_k: StrictInt = Field(0, ge=-1)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    return_token_ids: StrictBool = False

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (must be 0)")
        return value


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``; ``prompt`` is one string or one list of token ids."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(
                    "exactly one prompt per request is supported (send a batch as separate requests)"
                )
            value = value[0]
        if len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_OpenAISampling):
    """``POST /v1/chat/completions``; the chat template of the model builds the prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = True


class GenerateSamplingParams(_Body):
    """``sampling_params`` of ``/generate`` (SGLang's names)."""

    max_new_tokens: StrictInt | None = Field(128, ge=1)
    min_new_tokens: StrictInt = Field(0, ge=0)
    temperature: StrictFloat = Field(1.0, ge=0.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    n: StrictInt = Field(1, ge=1, le=128)
    seed: StrictInt | None = None


class GenerateRequest(Bootstrap):
    """``POST /generate``: ``text`` or ``input_ids``; logprobs as SGLang
    (``logprob_start_len`` -1 = no prompt logprobs, else from that prompt position)."""

    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = Field(0, ge=0, le=20)
    logprob_start_len: StrictInt = Field(-1, ge=-1)
    stream: StrictBool = False
    rid: str | None = None
