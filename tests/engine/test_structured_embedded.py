"""Structured outputs on the real embedded model (SmolLM2-135M-Instruct), where the point is
real output: free-length strings and objects (not bounded as for random models) still end
with EOS inside the budget, parse, and validate (``jsonschema``), greedy and sampled."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.params import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "occupation": {"type": "string"},
    },
    "required": ["name", "age", "occupation"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    from pdserve import LLM

    return LLM(device="cpu", num_pages=256)


def chat_prompt(llm, text: str) -> list[int]:
    tok = llm.engine.tokenizer
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize(
    "spec, temperature",
    [
        (SO(json=PERSON, strict=True), 0.0),
        (SO(json=PERSON, strict=True), 0.7),
        (SO(json_object=True), 0.0),
    ],
    ids=["schema-greedy", "schema-sampled", "object-greedy"],
)
def test_embedded_model_writes_valid_json(llm, spec, temperature):
    prompt = chat_prompt(llm, "Describe Alice, a 30 year old painter, as JSON.")
    params = SamplingParams(
        temperature=temperature, seed=4, max_tokens=100, structured_outputs=spec
    )
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    if spec.kind == "json":
        jsonschema.validate(value, PERSON)
    else:
        assert isinstance(value, dict)
