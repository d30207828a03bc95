"""``pdserve bench quality`` on the tiny random preset (CPU): every pair of variants gets an
agreement and a mean |dlogprob| over the same positions, a variant against itself agrees
everywhere, and bad variants are a usage error naming the flag."""

from __future__ import annotations

import math

from pdserve.bench import quality as q


def test_quality_report_pairs_and_perplexity():
    r = q.quality("random:tiny", "cpu", ["fp32", "fp32", "fp8"], continuation=4, gsm8k=1)
    assert len(r["pairs"]) == 3 and r["texts"] == len(q.PARITY_PROMPTS) + 1
    same = r["pairs"][0]
    assert (same["a"], same["b"]) == ("fp32", "fp32")
    assert same["top1_agreement"] == 1.0 and same["mean_abs_dlogprob"] < 1e-5
    positions = {p["positions"] for p in r["pairs"]}
    assert len(positions) == 1 and positions.pop() > 50
    for p in r["pairs"][1:]:
        assert 0.0 <= p["top1_agreement"] <= 1.0 and p["mean_abs_dlogprob"] > 0
    assert all(math.isfinite(v) and v > 1 for v in r["perplexity"].values())
    assert r["perplexity_ratio"]["fp32"] == 1.0  # the second variant is the base


def test_bad_variants_are_usage_errors(capsys):
    import argparse

    args = argparse.Namespace(
        model="random:tiny", device="cpu", variants="fp32,int4", continuation=2, gsm8k=0, json=None
    )
    assert q.run_quality(args) == 2
    assert "variants" in capsys.readouterr().err
