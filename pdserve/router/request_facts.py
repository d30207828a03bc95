"""What the router reads from a client's body before it sends it on: how many bootstrap
rooms a PD request needs (:func:`num_samples`), whether the client asked for prompt
logprobs (:func:`wants_prompt_logprobs`, which only a PD request's prefill leg has) and
the prompt's length in tokens, estimated without a tokenizer
(:func:`prompt_tokens_estimate`, selective PD's input).

Pure functions of ``(endpoint, body)``, each reading a field as the workers will (``n``
and ``logprob_start_len`` as ``http.json_fields.as_int`` does); a body the workers will
reject gets a harmless answer here (1 room, no estimate), and the workers' 400 later.
"""

from __future__ import annotations

from pdserve.disagg.base import MAX_ROOMS_PER_REQUEST, rooms_needed
from pdserve.http.json_fields import as_int
from pdserve.router.workers import routing_key

# bytes of prompt text per token, for selective PD's estimate (English text under a
# byte-level BPE of about 50k entries averages about 4; an underestimate of the tokens for
# other text, so such a prompt is more likely to be disaggregated than not)
BYTES_PER_TOKEN = 4


def _int(value: object, default: int) -> int | None:
    """A body's integer field as the workers read it (``http.json_fields.as_int``); ``default``
    for null or absent; None for anything else (which the workers reject with a 400)."""
    return default if value is None else as_int(value)


def wants_prompt_logprobs(endpoint: str, body: dict) -> bool:
    """Whether the client asked for prompt logprobs (which only the prefill leg has),
    also as the logprobs of an echoed prompt."""
    if endpoint == "/generate":
        start = _int(body.get("logprob_start_len"), -1)
        return body.get("return_logprob") is True and start is not None and start >= 0
    if (
        endpoint == "/v1/completions"
        and body.get("echo") is True
        and body.get("logprobs") is not None
    ):
        return True  # the echoed prompt's tokens carry their logprobs
    return body.get("prompt_logprobs") is not None


def _num_prompts(endpoint: str, body: dict) -> int:
    """Prompts of the request: the length of a ``/v1/completions`` batch, else 1."""
    prompt = body.get("prompt") if endpoint == "/v1/completions" else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def num_samples(endpoint: str, body: dict) -> int:
    """Rooms the request needs: ``n`` per prompt (null: 1; 1 for an invalid ``n``, which
    the workers reject with a 400)."""
    params = body.get("sampling_params") if endpoint == "/generate" else body
    n = _int(params.get("n") if isinstance(params, dict) else None, 1)
    if n is None or not 1 <= n <= MAX_ROOMS_PER_REQUEST:
        n = 1
    return rooms_needed(_num_prompts(endpoint, body), n)


def prompt_tokens_estimate(endpoint: str, body: dict) -> int | None:
    """The prompt's length in tokens, estimated without a tokenizer: exact for token ids
    (``/generate``'s ``input_ids``, a ``/v1/completions`` prompt of ids), else the UTF-8
    bytes of the text (a chat's message contents) over ``BYTES_PER_TOKEN``; None for a
    batch of prompts or a shape the workers will reject."""
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        text = routing_key(endpoint, body) or ""
        return len(text.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN
    prompt = (
        body.get("input_ids", body.get("text")) if endpoint == "/generate" else body.get("prompt")
    )
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8", "surrogatepass")) // BYTES_PER_TOKEN
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return None
