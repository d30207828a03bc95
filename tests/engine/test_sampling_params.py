"""SamplingParams validation (ValueError naming the field) and n-fan-out."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.engine.sampling_params import sample_request_id


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 30}, "prompt_logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ""}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "2"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**70}, "seed"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_values_are_normalised():
    p = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=-1,
        max_tokens=None,
        stop="END",
        stop_token_ids=[5, 7],
        logprobs=20,
        prompt_logprobs=0,
        seed=3,
    )
    assert p.greedy and p.stop == ("END",) and p.stop_token_ids == (5, 7)
    assert SamplingParams().stop == () and SamplingParams().stop_token_ids == ()


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(max_new_tokens=5)  # type: ignore[call-arg]


def test_fan_out_gives_distinct_ids_and_seeds():
    assert SamplingParams().fan_out("r") == [("r", SamplingParams())]
    pairs = SamplingParams(n=3, seed=10, temperature=1.0).fan_out("r")
    assert (
        [i for i, _ in pairs]
        == [sample_request_id("r", i) for i in range(3)]
        == ["r#0", "r#1", "r#2"]
    )
    assert [p.seed for _, p in pairs] == [10, 11, 12]
    assert all(p.n == 1 for _, p in pairs)
    assert [p.seed for _, p in SamplingParams(n=2).fan_out("x")] == [None, None]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: "1"}}, "logit_bias"),
        ({"logit_bias": 5}, "logit_bias"),
    ],
)
def test_bad_penalties_and_bias_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalties_and_bias_are_normalised():
    p = SamplingParams(logit_bias={"7": 5, 2: -100.0}, repetition_penalty=1.2)
    assert p.logit_bias == ((2, -100.0), (7, 5.0)) and p.has_penalties
    assert SamplingParams().logit_bias == () and not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties


def test_seeds_are_int64_and_the_generator_seed_mixes_every_bit():
    from pdserve.engine.sampling_params import SEED_MAX, SEED_MIN, generator_seed

    pairs = SamplingParams(n=2, seed=SEED_MAX, temperature=1.0).fan_out("r")
    assert [p.seed for _, p in pairs] == [SEED_MAX, SEED_MIN]  # seed + i wraps in int64
    seeds = [0, 1, 2**32 + 1, 2**40 + 1, -1, SEED_MIN, SEED_MAX]
    mixed = [generator_seed(s) for s in seeds]
    assert all(0 <= m < 2**64 for m in mixed)
    assert len({m & 0xFFFFFFFF for m in mixed}) == len(seeds)  # the CPU generator's 32 bits
    assert mixed == [generator_seed(s) for s in seeds]  # a function: PD equals mixed
