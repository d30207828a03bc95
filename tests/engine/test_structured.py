"""Structured outputs in the engine: every output matches its constraint (JSON schema checked
with ``jsonschema``, regex, choice, EBNF), greedy and seeded-sampled; ``max_tokens`` cutting
an object short says ``length``; PD output (first token sampled under the grammar on
prefill, decode's matcher resuming from it) equals mixed output; bad constraints are a
ValueError naming the field; the bitmask unpacking is exact."""

from __future__ import annotations

import itertools
import json
import re

import disagg_pairs
import jsonschema
import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.disagg.base import KVPoll
from pdserve.disagg.fake import FakeKVManager, link
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.core.request import DisaggRequestInfo
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.bitmask import allocate_bitmask, bitmask_to_bool
from pdserve.engine.structured.params import StructuredOutputsParams as SO
from pdserve.model.loader import embedded_tokenizer

# Real text: random ids can end mid-UTF-8 character, and that partial character's text
# then shows at the start of the output.
PROMPT = embedded_tokenizer().encode("Describe a user as JSON. Answer:")
rooms = itertools.count(5000)

# Bounded (maxLength, maximum, maxItems) so a random model's output ends inside the budget.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "role", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,8}@[a-z]{2,5}\.com"
CHOICES = ("red", "green", "blue")
GRAMMAR = 'root ::= "(" [0-9] [0-9]? ("+" [0-9] [0-9]?){0,3} ")"'


def check(spec: SO, text: str) -> None:
    """Assert ``text`` satisfies ``spec``."""
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.regex, text), text
    elif spec.kind == "choice":
        assert text in spec.choice
    else:
        assert re.fullmatch(r"\(\d\d?(\+\d\d?){0,3}\)", text), text


SPECS = {
    "json": SO(json=SCHEMA, strict=True),
    "json_object": SO(json_object=True),
    "regex": SO(regex=REGEX),
    "choice": SO(choice=CHOICES),
    "grammar": SO(grammar=GRAMMAR),
}


@pytest.fixture(scope="module")
def cores(tiny_model_dir):
    """(prefill engine, decode engine, their managers) over one tiny Llama, loopback KV
    managers (pdserve/disagg/fake.py: the KV really moves between the two pools)."""
    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=128),
    )
    prefill, decode = EngineCore(cfg), EngineCore(cfg)
    p = FakeKVManager(prefill.executor.kv_args(), "prefill")
    d = FakeKVManager(decode.executor.kv_args(), "decode")
    link(p, d)
    prefill.bind_kv_managers({"nixl": p})
    decode.bind_kv_managers({"nixl": d})
    return prefill, decode, p, d


def drive(*cores):
    return disagg_pairs.drive(*cores, max_steps=400)


def info(role, room):
    return DisaggRequestInfo(role, "127.0.0.1", 1, room)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_output_matches_constraint_and_pd_equals_mixed(cores, kind, temperature):
    prefill, decode, p_mgr, d_mgr = cores
    spec = SPECS[kind]
    params = SamplingParams(
        temperature=temperature, seed=11, max_tokens=80, logprobs=2, structured_outputs=spec
    )
    decode.add_request("mixed", PROMPT, params)
    want = drive(decode)["mixed"].outputs[0]
    if kind == "json_object":  # unbounded: a random model may write one string forever
        assert want.text.startswith("{")
        assert want.finish_reason == "length" or isinstance(json.loads(want.text), dict)
    else:
        assert want.finish_reason == "stop", want.text
        check(spec, want.text)
    room = next(rooms)
    decode.add_request("d", PROMPT, params, info("decode", room))
    prefill.add_request("p", PROMPT, params, info("prefill", room))
    got = drive(prefill, decode)
    assert got["p"].outputs[0].token_ids == want.token_ids[:1]
    rest = got["d"].outputs[0]
    assert rest.token_ids == want.token_ids and rest.text == want.text
    assert rest.logprobs == want.logprobs and rest.finish_reason == want.finish_reason
    for mgr in (p_mgr, d_mgr):  # each side's room closed once, after its Success
        assert mgr.handle(room).closes == [KVPoll.Success]


def test_unconstrained_output_differs(cores):
    """The constraint is what makes the output valid (the tiny model alone writes no JSON)."""
    decode = cores[1]
    decode.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=30))
    text = drive(decode)["free"].outputs[0].text
    with pytest.raises(ValueError):
        json.loads(text)


def test_max_tokens_cut_reports_length(cores):
    decode = cores[1]
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=SPECS["json"])
    decode.add_request("cut", PROMPT, params)
    out = drive(decode)["cut"].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_a_complete_grammar_ends_the_output_before_min_tokens(cores):
    decode = cores[1]
    spec = SO(choice=["red", "green"])
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs=spec)
    decode.add_request("min", PROMPT, params)
    out = drive(decode)["min"].outputs[0]
    assert out.text in ("red", "green") and out.finish_reason == "stop"


def test_several_rows_in_one_batch(cores):
    """Rows with different grammars (and one without) batched in one step stay correct."""
    decode = cores[1]
    kinds = [k for k in SPECS if k != "json_object"]
    for i, kind in enumerate(kinds):
        decode.add_request(
            f"r{i}",
            PROMPT,
            SamplingParams(temperature=0.8, seed=i, max_tokens=80, structured_outputs=SPECS[kind]),
        )
    decode.add_request("plain", PROMPT, SamplingParams(temperature=0, max_tokens=10))
    final = drive(decode)
    for i, kind in enumerate(kinds):
        check(SPECS[kind], final[f"r{i}"].outputs[0].text)
    assert len(final["plain"].outputs[0].token_ids) == 10


@pytest.mark.parametrize(
    "spec, words",
    [
        (SO(json={"type": "objectx"}, field="response_format.json_schema.schema"), "objectx"),
        (SO(json={"type": "object", "required": "a"}, field="guided_json"), "array"),
        (SO(regex="(a", field="guided_regex"), "parenthesis"),
        (SO(grammar="root ::= foo", field="sampling_params.ebnf"), "foo"),
    ],
)
def test_invalid_constraint_is_a_value_error_naming_the_field(cores, spec, words):
    decode = cores[1]
    with pytest.raises(ValueError) as exc:
        decode.add_request("bad", PROMPT, SamplingParams(structured_outputs=spec))
    assert str(exc.value).startswith(spec.field + " ") and words in str(exc.value)
    assert not decode.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"json": "{not json"}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json": []}],
)
def test_params_need_exactly_one_valid_constraint(kwargs):
    with pytest.raises(ValueError, match="^rf "):
        SO(field="rf", **kwargs)


def test_bitmask_to_bool_is_exact():
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    bitmask = allocate_bitmask(3, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=gen))
    want = torch.tensor(
        [[(int(bitmask[r, j // 32]) >> (j % 32)) & 1 == 1 for j in range(vocab)] for r in range(3)]
    )
    assert torch.equal(bitmask_to_bool(bitmask, vocab), want)
    wider = bitmask_to_bool(bitmask, 200)  # a model vocabulary wider than the tokenizer's
    assert torch.equal(wider[:, :vocab], want[:, :vocab]) and not wider[:, 128:].any()
