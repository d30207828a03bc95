"""Incremental detokenizer: deltas add up to the decoded text, never half a character;
stop strings cut the text (OpenAI semantics) and never leak into a streamed delta."""

from __future__ import annotations

from pdserve.engine.core.stop import IncrementalDetokenizer

TEXT = "Hello wörld! 你好, 🙂 naïve café — done."


def stream(tok, ids, stop=(), prompt=(1, 2)):
    d = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=True, stop=stop)
    deltas, hit = [], None
    for i, t in enumerate(ids):
        hit = d.add_token(t, check_stop=True)
        last = hit is not None or i == len(ids) - 1
        deltas.append(d.take_delta(finished=last))
        if hit:
            break
    return d, deltas, hit


def test_deltas_concatenate_to_the_decoded_text(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    d, deltas, hit = stream(tokenizer, ids)
    assert hit is None
    assert "".join(deltas) == d.text == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    for delta in deltas:
        assert "\ufffd" not in delta  # no broken UTF-8 in any delta
        delta.encode("utf-8")


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer("Hi there", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    d, deltas, _ = stream(tokenizer, ids)
    assert d.text == "Hi there" and "".join(deltas) == "Hi there"


def test_stop_string_cuts_the_text_and_is_not_streamed(tokenizer):
    ids = tokenizer("The answer is 42. STOP here please", add_special_tokens=False)["input_ids"]
    d, deltas, hit = stream(tokenizer, ids, stop=("STOP", "zzz"))
    assert hit == "STOP"
    assert d.text == "The answer is 42. " and "".join(deltas) == d.text
    # a stop string spanning several tokens, matched at the earliest position
    d, deltas, hit = stream(tokenizer, ids, stop=("here please", "42."))
    assert hit == "42." and d.text == "The answer is "


def test_text_is_held_back_only_as_long_as_a_stop_string_could_start(tokenizer):
    ids = tokenizer("abc defgh", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True, stop=("xyz!",))
    shown = ""
    for t in ids:
        d.add_token(t, check_stop=True)
        shown += d.take_delta(finished=False)
        assert len(d.text) - len(shown) <= 3
    assert shown + d.take_delta(finished=True) == "abc defgh"
