"""Markdown tables of every request field of the HTTP API, generated from the pydantic
models of ``server/protocol.py`` (names, types, defaults) and the meanings below (one
sentence per field). docs/reference.md includes them
(``python -m pdserve.launch.flag_docs --update docs/reference.md``); ``tests/e2e/test_readme.py``
fails when a field has no meaning here or docs/reference.md is stale."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pdserve.disagg.base import MAX_ROOMS_PER_REQUEST
from pdserve.server import protocol as p
from pdserve.server import responses_input as r
from pdserve.server.structured import JSONSchemaFormat, ResponseFormat, StructuredOutputsObject
from pdserve.server.tools import FunctionDef

# field -> meaning; "Model.field" overrides where one name means something else.
MEANINGS: dict[str, str] = {
    "model": "must be the served model name when given (404 otherwise)",
    "n": f"samples per prompt, 1 to {p.MAX_N}; each is its own engine request (and bootstrap "
    f"room); through a PD router a request has at most {MAX_ROOMS_PER_REQUEST} samples "
    "(prompts x n; 400 otherwise)",
    "temperature": "a finite number >= 0 (NaN, infinities and negatives are a 400): 0 = greedy "
    "(exact argmax); > 0 divides the logits; no upper bound (above OpenAI's 2 is accepted, as "
    "SGLang does)",
    "top_p": "nucleus mass in (0, 1]; 1 disables",
    "top_k": "keep the k most likely tokens; 0 or -1 disables",
    "min_p": "drop tokens below min_p x the best token's probability; 0 disables",
    "stop": "strings that end the output (not included in the text)",
    "stop_token_ids": "token ids that end the output (included in token_ids)",
    "seed": "per-request seed: the same seed gives the same tokens whatever the batch, PD or mixed",
    "stream": "answer as server-sent events",
    "stream_options": "see the stream_options table",
    "presence_penalty": "[-2, 2], subtracted once from the logit of every token already generated",
    "frequency_penalty": "[-2, 2], subtracted from a token's logit per time it was generated",
    "repetition_penalty": "> 0, 1 disables; divides a positive (multiplies a negative) logit of "
    "every token in the prompt or output (transformers' definition)",
    "logit_bias": 'object token id -> bias in [-100, 100] added to that logit, e.g. {"50256": -100}',
    "min_tokens": "tokens to generate before EOS, stop ids or stop strings may end the output",
    "ignore_eos": "keep generating past EOS",
    "skip_special_tokens": "leave special tokens out of the text",
    "prompt_logprobs": "top-k logprobs of every prompt token, as choices[i].prompt_logprobs "
    "(chat: as the answer's top-level prompt_logprobs, where vLLM puts them; in a stream, "
    "in the first chunk); the first is null",
    "truncate_prompt_tokens": "vLLM: keep only the last N prompt tokens (-1: the context "
    "limit); usage counts the kept ones",
    "continue_final_message": "vLLM: the output continues the final message (no end of turn, "
    "no new turn); needs add_generation_prompt false (true with it is a 400; unset follows). "
    "Unset: a final assistant message with text continues (SGLang's assistant prefill); "
    "false: it gets a new turn",
    "return_token_ids": "add choices[i].token_ids (and prompt_token_ids in the first chunk)",
    "return_timing": "pdserve: add choices[i].timing to each finished choice (streams: its "
    "last chunk): seconds per phase on each worker, {role: {phases: {name: s}, start_unix, "
    "first_token_out, kv_pages, kv_bytes, transfer_gbps}}; through the router in PD mode "
    "both prefill and decode",
    "GenerateRequest.return_timing": "pdserve: add meta_info.timing to the finished answer: "
    "seconds per phase on each worker, as choices[i].timing of the OpenAI endpoints",
    "user": "accepted, no effect (as metadata, store, service_tier, "
    "reasoning_effort, prompt_cache_key, safety_identifier, verbosity, modalities; "
    "parallel_tool_calls: false limits tool_choice required to one call)",
    "CompletionRequest.prompt": "one string or list of token ids, or a batch of them: n choices "
    "per prompt, index p * n + i, usage summed",
    "CompletionRequest.max_tokens": "most tokens to generate (null: 16, OpenAI's default); 0 only "
    "with echo (scores the prompt)",
    "CompletionRequest.logprobs": "top-k alternatives per token (<= 20), OpenAI's legacy layout "
    "(tokens, token_logprobs, top_logprobs, text_offset)",
    "echo": "prepend the prompt to the text and, with logprobs, its tokens' logprobs (the first "
    "null) to the logprobs",
    "suffix": "not supported: a non-empty suffix is a 400",
    "best_of": "only as n (another value is a 400)",
    "messages": "the conversation, rendered by the model's chat template",
    "ChatCompletionRequest.max_tokens": "most tokens to generate, up to the context limit when "
    "omitted or null (max_completion_tokens wins)",
    "max_completion_tokens": "most tokens to generate",
    "ChatCompletionRequest.logprobs": "return the sampled tokens' logprobs (choices[i].logprobs)",
    "top_logprobs": "alternatives per token (<= 20); needs logprobs true",
    "add_generation_prompt": "end the rendered prompt with the assistant turn's opening",
    "prompt_token_ids": "pdserve: the prompt as token ids, already through the chat template "
    "(messages are checked, not rendered); the router's migration sends it",
    "role": "system, developer (= system), user, assistant or tool",
    "content": 'text, or a list of {"type": "text", "text"} parts (concatenated)',
    "name": "the speaker's name (passed to the template)",
    "include_usage": "add a last chunk with the usage of the whole request (no choices); "
    'every chunk before it has `"usage": null`, as OpenAI\'s',
    "continuous_usage_stats": "with include_usage: put the usage so far in every chunk "
    "instead of null (vLLM's extension; alone it adds nothing, as vLLM's)",
    "max_new_tokens": "most tokens to generate (null: 128)",
    "min_new_tokens": "as min_tokens",
    "text": "the prompt text (or give input_ids)",
    "input_ids": "the prompt as token ids (or give text)",
    "sampling_params": "see the sampling_params table",
    "return_logprob": "add output (and, with logprob_start_len >= 0, input) logprobs to meta_info",
    "top_logprobs_num": "alternatives per token in meta_info.*_top_logprobs (<= 20)",
    "logprob_start_len": "first prompt position with input logprobs; -1: none",
    "rid": "the request id (meta_info.id)",
    "TokenizeRequest.prompt": "text to tokenize (or give messages)",
    "TokenizeRequest.messages": "chat messages, rendered by the chat template, to tokenize",
    "add_special_tokens": "add the tokenizer's special tokens (default: true for a prompt, "
    "false for messages)",
    "return_token_strs": "add token_strs, the vocabulary strings of the tokens",
    "tokens": "token ids to turn into text",
    # structured outputs (server/structured.py) and tools (server/tools.py)
    "response_format": 'see the response_format table: {"type": "text" | "json_object" | '
    '"json_schema"}',
    "guided_json": "vLLM: the output is JSON valid under this JSON Schema (object or JSON text)",
    "guided_regex": "vLLM: the output matches this regular expression in full",
    "guided_choice": "vLLM: the output is exactly one of these strings",
    "guided_grammar": 'vLLM: the output matches this EBNF (GBNF) grammar, rule "root" first',
    "structured_outputs": "vLLM: an object with one of json, regex, choice, grammar, json_object",
    "json_schema": "SGLang: as guided_json",
    "regex": "SGLang: as guided_regex",
    "ebnf": "SGLang: as guided_grammar",
    "choice": "as guided_choice",
    "ResponseFormat.type": "text: no constraint; json_object: one JSON object; json_schema: "
    "JSON valid under json_schema.schema",
    "ResponseFormat.json_schema": "see the response_format.json_schema table",
    "JSONSchemaFormat.name": "the schema's name (not used)",
    "JSONSchemaFormat.description": "the schema's description (not used)",
    "schema_": "the JSON Schema the output must be valid under (checked against its "
    "meta-schema: 400 naming this field)",
    "JSONSchemaFormat.strict": "true: properties and items the schema does not name are not "
    "allowed; otherwise the schema's own meaning holds",
    "json_": "a JSON Schema (as guided_json)",
    "StructuredOutputsObject.regex": "as guided_regex",
    "StructuredOutputsObject.choice": "as guided_choice",
    "grammar": "as guided_grammar",
    "json_object": "true: one JSON object",
    "tools": 'functions the model may call: [{"type": "function", "function": {name, '
    "description, parameters}}], rendered by the chat template (or pdserve's default format, "
    "see Tools)",
    "tool_choice": "none | auto (default with tools: tool-call text parsed) | required | "
    '{"type": "function", "function": {"name"}} (both forced by a grammar: always valid JSON)',
    "tool_calls": "an assistant turn's calls: [{id, type, function: {name, arguments}}]",
    "tool_call_id": "the id of the call a tool message answers; required for role tool (400 "
    "naming messages[i].tool_call_id, as OpenAI's)",
    "FunctionDef.name": "the function's name",
    "FunctionDef.description": "what it does (shown to the model)",
    "parameters": "its arguments' JSON Schema (forced calls are valid under it)",
    "FunctionDef.strict": "accepted; forced calls are always strict",
    # /v1/responses (server/responses.py)
    "input": "a string (one user message) or a list of input items: messages (role user, "
    "system, developer or assistant; content a string or input_text/output_text parts), "
    "function_call and function_call_output items; another item type, or an image/file/"
    "audio part, is a 400 naming it; so is a function_call_output whose call_id no earlier "
    "function_call (in input or the previous response) has",
    "instructions": "a system message before the input (not carried over by "
    "previous_response_id, as OpenAI's)",
    "max_output_tokens": "most tokens to generate (status incomplete when it cut the output)",
    "ResponsesRequest.tools": 'function tools: [{"type": "function", name, description, '
    "parameters}] (chat's tools path); a built-in tool (web_search_preview, file_search, "
    "...) is a 400 naming tools[i].type",
    "ResponsesRequest.tool_choice": 'none | auto | required | {"type": "function", "name"} '
    "(as chat's)",
    "ResponsesRequest.parallel_tool_calls": "false: tool_choice required makes one call at most",
    "ResponsesRequest.text": 'the output format: {"format": {"type": "text" | "json_object" '
    '| "json_schema", name, schema, strict}} (structured outputs)',
    "ResponsesRequest.stream": "answer as OpenAI's typed server-sent events, response.created "
    "to response.completed (also for an incomplete response, as vLLM's)",
    "ResponsesRequest.store": "keep the response in this worker's bounded store (serve "
    "--responses-store-size) for GET /v1/responses/{id} and previous_response_id",
    "previous_response_id": "continue a stored response: its conversation (input and "
    "output items) comes before input; unknown or dropped: 400 naming it",
    "previous_items": "pdserve: the conversation before input as input items (the router "
    "sends it for previous_response_id, so any worker or PD pair can serve the follow-up)",
    "background": "not supported: true is a 400",
    "ResponsesRequest.metadata": "echoed in the response",
    "ResponsesRequest.user": "echoed in the response",
    "truncation": "accepted, echoed (disabled when unset); no effect",
    "include": '"message.output_text.logprobs": each output text part carries its tokens\' '
    "logprobs (chat's shape; with top_logprobs alternatives; a 400 with tools); other "
    "values accepted, no effect",
    "ResponsesRequest.top_logprobs": "alternatives per output token (<= 20); implies the "
    "output text's logprobs",
    "reasoning": "accepted, no effect (no reasoning models)",
    "ResponsesRequest.service_tier": "accepted, no effect",
    "ResponsesRequest.prompt_cache_key": "accepted, no effect",
    "ResponsesRequest.safety_identifier": "accepted, no effect",
    "ResponseTextFormat.type": "text: no constraint; json_object: one JSON object; "
    "json_schema: JSON valid under schema",
    "ResponseTextFormat.name": "the schema's name (echoed)",
    "ResponseTextFormat.description": "the schema's description (echoed)",
    "ResponseTextFormat.strict": "as response_format.json_schema.strict",
    "bootstrap_host": "PD: the prefill worker's bootstrap address (the router adds it)",
    "bootstrap_port": "PD: the prefill worker's bootstrap port (the router adds it)",
    "bootstrap_room": "PD: the transfer's 63-bit room id (the router draws it)",
}

_NOOP = set(p._NoOpFields.model_fields) - {"user"}
_BOOTSTRAP = set(p.Bootstrap.model_fields)

# (title, model, fields left out because another table has them)
SECTIONS: tuple[tuple[str, type[BaseModel], set[str]], ...] = (
    ("`/v1/completions` and `/v1/chat/completions`", p._OpenAISampling, _BOOTSTRAP | _NOOP),
    ("`/v1/completions` only", p.CompletionRequest, set(p._OpenAISampling.model_fields)),
    ("`/v1/chat/completions` only", p.ChatCompletionRequest, set(p._OpenAISampling.model_fields)),
    ("`messages[i]`", p.ChatMessage, set()),
    ("`stream_options`", p.StreamOptions, set()),
    ("`response_format`", ResponseFormat, set()),
    ("`response_format.json_schema`", JSONSchemaFormat, set()),
    ("`structured_outputs`", StructuredOutputsObject, set()),
    ("`tools[i].function`", FunctionDef, set()),
    ("`/v1/responses`", r.ResponsesRequest, _BOOTSTRAP),
    ("`/v1/responses` `text.format`", r.ResponseTextFormat, set()),
    ("`/generate`", p.GenerateRequest, _BOOTSTRAP),
    ("`/generate` `sampling_params`", p.GenerateSamplingParams, set()),
    ("`/tokenize`", p.TokenizeRequest, set()),
    ("`/detokenize`", p.DetokenizeRequest, set()),
    ("every body (PD)", p.Bootstrap, set()),
)


def _type(ann: Any) -> str:
    """A short JSON-ish name of a field's annotation (``int``, ``string | null``, ...)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' for a in args)
    if origin is list:
        return f"list[{_type(args[0])}]" if args else "list"
    if origin is dict or ann is dict:
        return "object"
    if ann is type(None):
        return "null"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "object"
    names = {int: "int", float: "number", bool: "bool", str: "string"}
    return names.get(ann, getattr(ann, "__name__", str(ann)))


def _default(info: Any) -> str:
    if info.default is PydanticUndefined:
        return "{}" if info.default_factory is not None else "required"
    if info.default is None:
        return ""
    value = str(info.default).lower() if isinstance(info.default, bool) else info.default
    return f"`{value}`"


def meaning(model: type[BaseModel], field: str) -> str | None:
    return MEANINGS.get(f"{model.__name__}.{field}", MEANINGS.get(field))


def missing_meanings() -> list[str]:
    """``Model.field`` of every documented field without a meaning in MEANINGS."""
    return [
        f"{model.__name__}.{name}"
        for _, model, skip in SECTIONS
        for name in model.model_fields
        if name not in skip and meaning(model, name) is None
    ]


def _field_type(info: Any) -> str:
    """The type column: the annotation's, with ``null`` for every optional field (a JSON
    null there means its default: ``protocol._Body``)."""
    text = _type(info.annotation)
    if info.is_required() or text.endswith("null"):
        return text
    return f"{text} \\| null"


NULL_NOTE = (
    "An optional field may be given as JSON `null`: it then means the field's default, "
    "as when it is left out (OpenAI's spec marks these fields nullable; the official "
    "`openai` client sends `null` for an argument given as `None`). An integer field takes "
    "an integral number too (`2.0`, as Python's `json` writes it); `2.5` is a 400.\n\n"
)


def api_tables() -> str:
    """Every section's table: field, type, default, meaning (after :data:`NULL_NOTE`)."""
    out = [NULL_NOTE.rstrip("\n") + "\n"]
    for title, model, skip in SECTIONS:
        rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
        for name, info in model.model_fields.items():
            if name in skip:
                continue
            text = (meaning(model, name) or "").replace("|", "\\|")
            rows.append(
                f"| `{info.alias or name}` | {_field_type(info)} | {_default(info)} | {text} |"
            )
        out.append(f"##### {title}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(out)
