"""Speculative decoding through real processes and real NIXL (host memory): a prefill and a
decode worker both started with ``--speculative-algorithm ngram`` behind the router give a
mixed worker's greedy output (without speculation) token for token, with the decode side's
verify counters moving; a decode that speculates paired with a prefill that does not is
refused at the bootstrap, the error naming ``speculative``."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve_procs import start_router, start_worker, stop, wait_healthy

pytestmark = pytest.mark.timeout(600)

SPEC = ["--speculative-algorithm", "ngram", "--num-speculative-tokens", "3"]
ONE = ["--num-threads", "1"]
PROMPTS = [[5, 6, 7, 8, 9] * 4, [40, 41, 42] * 5 + [7], [11, 12, 13, 14, 15, 16, 17]]


def _counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return fams[name].samples[0].value


def test_pd_speculating_equals_mixed_and_a_mismatch_is_refused(tmp_path):
    boot = ["--disaggregation-bootstrap-port", "0"]
    prefill = start_worker("prefill", "prefill", tmp_path, extra=[*boot, *SPEC, *ONE])
    decode = start_worker("decode", "decode", tmp_path, extra=[*SPEC, *ONE])
    plain_prefill = start_worker("plain-prefill", "prefill", tmp_path, extra=[*boot, *ONE])
    mixed = start_worker("mixed", "mixed", tmp_path, extra=ONE)
    router = start_router("router", tmp_path, prefill=[prefill], decode=[decode])
    bad = start_router("bad-router", tmp_path, prefill=[plain_prefill], decode=[decode])
    procs = [prefill, decode, plain_prefill, mixed, router, bad]
    try:
        wait_healthy(procs)
        for prompt in PROMPTS:
            body = {
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 1,
            }
            a = httpx.post(router.url + "/v1/completions", json=body, timeout=300)
            b = httpx.post(mixed.url + "/v1/completions", json=body, timeout=300)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            ca, cb = a.json()["choices"][0], b.json()["choices"][0]
            assert ca["text"] == cb["text"]
            assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
            la, lb = ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]
            assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4
        assert _counter(decode.url, "pdserve_engine_spec_accepted_tokens") > 0
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        r = httpx.post(bad.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code >= 500 and "speculative" in r.text, r.text
    finally:
        stop(procs)


def test_up_gives_the_speculative_flags_to_prefill_and_decode(tmp_path):
    """``pdserve up --speculative-algorithm ...``: the decode side speculates, and its
    prefill peers get the same configuration (the bootstrap compares them)."""
    from pdserve.cli import build_parser
    from pdserve.launch.plan import plan_children

    argv = ["up", "--device", "cpu", "--model", "random:tiny", "--speculative-algorithm"]
    argv += ["ngram", "--num-speculative-tokens", "5", "--speculative-ngram-max", "4"]
    workers, _ = plan_children(build_parser().parse_args(argv), tmp_path)
    roles = []
    for w in workers:
        parsed = build_parser().parse_args(w.argv[3:])
        roles.append(parsed.role)
        got = (parsed.speculative_algorithm, parsed.num_speculative_tokens)
        assert got + (parsed.speculative_ngram_max,) == ("ngram", 5, 4)
    assert sorted(roles) == ["decode", "prefill"]
