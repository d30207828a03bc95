"""End-to-end engine behaviour on a tiny random Llama: stop strings / token ids, EOS from the
generation config, min_tokens, ignore_eos, n, seeds, logprobs, prompt logprobs, streaming
deltas, abort, and the ValueErrors of bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from pdserve import LLM, SamplingParams
from pdserve.engine.core.request import PromptError

PROMPT = "The weather today is"


def greedy(llm, max_tokens=30, **kw):
    return llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    )[0]


def test_stop_string_is_cut_from_the_text(tiny_llm):
    full = greedy(tiny_llm).outputs[0]
    pieces = [tiny_llm.get_tokenizer().decode([t]) for t in full.token_ids]
    stop = next(p for p in pieces[4:] if p.strip())  # a real piece of text, not at the start
    out = greedy(tiny_llm, stop=[stop, "never-there"]).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_min_tokens(tiny_llm):
    full = greedy(tiny_llm).outputs[0].token_ids
    stop_id = full[3]
    first = full.index(stop_id)
    out = greedy(tiny_llm, stop_token_ids=[stop_id]).outputs[0]
    assert out.token_ids == full[: first + 1]  # the stop token is kept in token_ids, not in text
    assert out.text == tiny_llm.get_tokenizer().decode(full[:first])
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = greedy(tiny_llm, stop_token_ids=[stop_id], min_tokens=first + 3).outputs[0]
    assert stop_id not in out.token_ids[: first + 3]  # masked until min_tokens
    assert len(out.token_ids) > first + 3 or out.finish_reason == "length"


def test_eos_from_generation_config_and_ignore_eos(tiny_model_dir, tmp_path):
    folder = tmp_path / "eos-model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    probe = LLM(str(folder), device="cpu", num_pages=64)
    full = greedy(probe).outputs[0].token_ids
    eos = full[5]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    llm = LLM(str(folder), device="cpu", num_pages=64)
    assert eos in llm.engine.eos_token_ids
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert out.token_ids == full[: full.index(eos) + 1]
    assert out.text == llm.get_tokenizer().decode(full[: full.index(eos)])
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[
        0
    ].outputs[0]
    assert out.token_ids == full and out.finish_reason == "length"
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, min_tokens=8))[
        0
    ].outputs[0]
    assert eos not in out.token_ids[:8]


def test_seeds_n_and_batch_independence(tiny_llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=123, ignore_eos=True)
    alone = tiny_llm.generate([PROMPT], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)
    batch = tiny_llm.generate(["Some other prompt here", PROMPT, "x"], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = (
        tiny_llm.generate(
            [PROMPT], SamplingParams(temperature=1.0, max_tokens=12, seed=124, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone

    multi = tiny_llm.generate(
        [PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=123, ignore_eos=True)
    )[0]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert multi.outputs[0].token_ids == alone  # sample i uses seed + i
    assert len({tuple(c.token_ids) for c in multi.outputs}) == 3
    for seed in (-1, -(2**63), 2**63 - 1):  # any int64 is a valid seed
        assert tiny_llm.generate(
            [PROMPT], SamplingParams(temperature=1.0, max_tokens=2, seed=seed)
        )[0].finished
    # seeds differing only above bit 31 (which a CPU generator's manual_seed drops) differ
    high = [
        tuple(
            tiny_llm.generate(
                [PROMPT], SamplingParams(temperature=1.5, max_tokens=12, seed=s, ignore_eos=True)
            )[0]
            .outputs[0]
            .token_ids
        )
        for s in (1, 2**32 + 1, 2**40 + 1)
    ]
    assert len(set(high)) == 3, high
    twice = tiny_llm.generate([PROMPT], SamplingParams(n=2, temperature=0, max_tokens=8))[0]
    assert twice.outputs[0].token_ids == twice.outputs[1].token_ids


def test_logprobs_and_prompt_logprobs_match_transformers(tiny_llm, tiny_model_dir, tokenizer):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32
    )
    ids = tokenizer(PROMPT)["input_ids"]
    out = tiny_llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=3, logprobs=5, prompt_logprobs=2)
    )[0]
    with torch.no_grad():
        ref = torch.log_softmax(
            hf(torch.tensor([ids + out.outputs[0].token_ids])).logits[0].float(), -1
        )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
        assert lp.token_id == ids[i]
        assert abs(lp.logprob - ref[i - 1, ids[i]].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref[i - 1].topk(2).indices.tolist()
    c = out.outputs[0]
    for j, lp in enumerate(c.logprobs):
        pos = len(ids) - 1 + j
        assert abs(lp.logprob - ref[pos, lp.token_id].item()) < 1e-4
        assert [t for t, _ in lp.top] == ref[pos].topk(5).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the best
    assert abs(c.cumulative_logprob - sum(lp.logprob for lp in c.logprobs)) < 1e-5


def test_streaming_deltas_add_up_and_abort_frees_pages(tiny_llm):
    core = tiny_llm.engine
    baseline = core.num_free_pages
    core.add_request(
        "s",
        tiny_llm.get_tokenizer()(PROMPT)["input_ids"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
    )
    core.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    text, ids, lps, final = "", [], [], None
    steps = 0
    while core.has_unfinished_requests():
        for o in core.step():
            if o.request_id == "s":
                c = o.outputs[0]
                text += c.delta_text
                ids += c.delta_token_ids
                lps += c.delta_logprobs
                final = o
        steps += 1
        if steps == 5:
            core.abort_request("a")
            with pytest.raises(ValueError, match="request_id"):
                core.add_request("s", [1], SamplingParams())
    c = final.outputs[0]
    assert final.finished and c.finish_reason == "length"
    assert text == c.text and ids == c.token_ids and lps == c.logprobs and len(ids) == 20
    assert core.num_free_pages == baseline
    assert not core.has_unfinished_requests()


def test_bad_input_raises_value_error_naming_the_field(tiny_llm, tiny_model_dir):
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        tiny_llm.generate(["ok", "word " * 600])
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        tiny_llm.generate([[]])
    with pytest.raises(ValueError, match="sampling_params"):
        tiny_llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_llm.generate(["a"], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="model"):
        LLM("random:no-such-preset", device="cpu")
    with pytest.raises(ValueError, match="model"):
        LLM("/no/such/model/path", device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_model_dir("llama"), device="cpu", dtype="float64")
    with pytest.raises(TypeError):
        LLM(tiny_model_dir("llama"), device="cpu", pipeline_parallel_size=2)  # type: ignore[call-arg]
    with pytest.raises(PromptError, match="prompt token ids must be integers") as bad:
        tiny_llm.engine.add_request("bad", [10**9], SamplingParams())
    assert bad.value.field == "prompt"
    too_long = list(range(1, tiny_llm.engine.max_model_len + 1))
    with pytest.raises(PromptError, match="context limit") as bad:  # the server's check too
        tiny_llm.engine.add_request("long", too_long, SamplingParams())
    assert bad.value.field == "prompt" and bad.value.code == "context_length_exceeded"
    with pytest.raises(ValueError, match="n must be 1"):
        tiny_llm.engine.add_request("bad", [1], SamplingParams(n=2))
    assert tiny_llm.generate(["still alive"], SamplingParams(max_tokens=2))[0].finished


def test_chat_applies_the_template(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Hi!"}]
    out = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4))[0]
    expected = tok(
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert out.prompt_token_ids == expected
    assert len(tiny_llm.chat([msgs, msgs], SamplingParams(max_tokens=2))) == 2


def test_abort_storm_leaves_pages_and_outputs_as_before(tiny_model_dir):
    import random

    llm = LLM(
        tiny_model_dir("llama"), device="cpu", num_pages=40, page_size=4, max_num_batched_tokens=24
    )
    core = llm.engine
    canary = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    before = llm.generate([PROMPT], canary)[0].outputs[0]
    rng = random.Random(0)
    live: set[str] = set()
    for i in range(40):
        if i < 25:
            rid = f"s{i}"
            params = SamplingParams(
                temperature=rng.choice([0, 0.8]),
                max_tokens=rng.randint(1, 20),
                ignore_eos=True,
                prompt_logprobs=rng.choice([None, 1]),
            )
            core.add_request(
                rid, [rng.randrange(100, 5000) for _ in range(rng.randint(1, 60))], params
            )
            live.add(rid)
        for _ in range(rng.randint(0, 3)):
            for out in core.step():
                if out.finished:
                    live.discard(out.request_id)
        if live and rng.random() < 0.5:
            victim = rng.choice(sorted(live))
            core.abort_request(victim)
            live.discard(victim)
    while core.has_unfinished_requests():
        core.step()
    assert core.stats()["num_preemptions"] > 0  # the storm really squeezed the pool
    assert core.num_free_pages == 40
    after = llm.generate([PROMPT], canary)[0].outputs[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


def test_repetition_penalty_matches_transformers_generate(tiny_llm, tiny_model_dir, tokenizer):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir("llama"), dtype=torch.float32
    )
    ids = tokenizer(PROMPT)["input_ids"]
    p = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.8, ignore_eos=True)
    got = tiny_llm.generate([ids], p)[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            repetition_penalty=1.8,
        )[0, len(ids) :].tolist()
    assert got == ref
    plain = tiny_llm.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert plain[0].outputs[0].token_ids != got  # the penalty changed something


def test_outputs_carry_their_prompt_text(tiny_llm):
    """As vLLM's: ``RequestOutput.prompt`` is the text given, ``None`` for token ids."""
    p = SamplingParams(max_tokens=2)
    texts = tiny_llm.generate(["first prompt", "x"], p)
    assert [o.prompt for o in texts] == ["first prompt", "x"]
    assert tiny_llm.generate("alone", p)[0].prompt == "alone"
    assert tiny_llm.generate([[1, 2, 3]], p)[0].prompt is None
