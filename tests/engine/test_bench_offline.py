"""``pdserve bench offline`` runs end to end and compares like with like."""

from __future__ import annotations

import gc
import json

import pytest

from pdserve.cli import main


@pytest.mark.timeout(300)
def test_bench_offline_writes_json_with_identical_outputs(tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = main(
        [
            "bench",
            "offline",
            "--model",
            "random:tiny",
            "--device",
            "cpu",
            "--num-prompts",
            "1,2",
            "--max-tokens",
            "4",
            "--repeats",
            "1",
            "--kv-order",
            "layer_major",  # not the CPU default: the flag reaches the pool
            "--max-num-batched-tokens",
            "512",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["num_prompts"] for r in report["results"]] == [1, 2]
    assert report["kv_order"] == "layer_major"
    assert report["max_num_batched_tokens"] == 512
    assert report["complete"] is True  # written after each row too, False until the end
    # the start-up heap frozen before the rows (and thawed after), the rows' collections
    gc_stats = report["gc"]
    assert gc_stats["frozen_objects"] > 10_000 and set(gc_stats["collections"]) == {"0", "1", "2"}
    assert gc.get_freeze_count() == 0
    for row in report["results"]:
        assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["hf_tok_s"])
        assert (
            row["identical_outputs"] == row["identical_first_tokens"] == 1.0
        )  # same weights, greedy
    assert "ratio" in capsys.readouterr().out


def test_bench_offline_rejects_bad_arguments(capsys):
    assert main(["bench", "offline", "--model", "random:tiny", "--num-prompts", "0"]) == 2
    assert "num-prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # refused while parsing (engine_args.config_value)
        main(["bench", "offline", "--model", "random:tiny", "--kv-order", "diagonal"])
    assert exc.value.code == 2
    assert "--kv-order" in capsys.readouterr().err


def test_prefill_row_times_new_prompts_every_run(monkeypatch):
    """Repeated prompts would hit the prefix cache and time nothing: each timed run of the
    prefill row gets prompts no earlier run had."""
    from types import SimpleNamespace

    from pdserve.bench import offline

    seen: list[tuple[int, ...]] = []

    def fake_ours(llm, prompts, max_tokens):
        seen.append(tuple(prompts[0]))
        return 1.0, None

    monkeypatch.setattr(offline, "_time_ours", fake_ours)
    monkeypatch.setattr(offline, "_time_hf", lambda *a: (2.0, None))
    llm = SimpleNamespace(engine=SimpleNamespace(vocab_size=1000, device="cpu"))
    row = offline._time_prefill(llm, object(), (2, 16), 0, 3)
    assert len(seen) == 4 and len(set(seen)) == 4  # the warm-up and 3 runs, all different
    assert row["ours_tok_s"] == 32.0 and row["ratio"] == 2.0


@pytest.mark.timeout(300)
def test_one_token_runs_are_warmed_up_before_they_are_timed(monkeypatch, capsys):
    """The one-token run (the decode rate's reference) has step shapes of its own; its first
    run must be a warm-up, never a timed one."""
    from pdserve.bench import offline

    calls: list[int] = []
    real = offline._time_ours

    def recording(llm, prompts, max_tokens):
        calls.append(max_tokens)
        return real(llm, prompts, max_tokens)

    monkeypatch.setattr(offline, "_time_ours", recording)
    args = ["bench", "offline", "--model", "random:tiny", "--device", "cpu"]
    assert main(args + ["--num-prompts", "2", "--max-tokens", "3", "--repeats", "2"]) == 0
    assert calls == [3, 1, 3, 1, 3, 1]  # warm-up of both lengths, then 2 timed pairs
    calls.clear()
    assert main(args + ["--num-prompts", "2", "--max-tokens", "1", "--repeats", "1"]) == 0
    assert calls == [1, 1]
    capsys.readouterr()


@pytest.mark.timeout(300)
def test_input_len_long_context_and_ours_only(tmp_path, capsys):
    """--input-len makes every prompt exactly that long, --long-context adds a row of its
    own length, --ours-only leaves the transformers columns empty, and the roofline is the
    larger of the byte and the FLOP time, both from rates measured in the run."""
    from pdserve.bench.roofline import forward_flops
    from pdserve.model.presets import preset_config
    from pdserve.model.shapes import ModelShapes

    out = tmp_path / "offline.json"
    args = ["bench", "offline", "--model", "random:tiny", "--device", "cpu", "--ours-only"]
    args += ["--num-prompts", "1,3", "--input-len", "24", "--long-context", "2x40"]
    assert main(args + ["--max-tokens", "3", "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["num_prompts"] for r in rows] == [1, 3, 2]
    assert [r["prompt_lens"] for r in rows] == [[24], [24] * 3, [40] * 2]
    assert [r["prompt_source"] for r in rows][:2] == ["random", "random"]
    assert report["copy_bandwidth_bytes_per_s"] > 0 and report["matmul_flop_per_s"] > 0
    assert report["matmul_flop_per_s_burst"] > 0  # beside the roofline's rate (held, on a GPU)
    # the best batch is that of the fastest decode row, the long-context row left out
    top = max(rows[:2], key=lambda r: r["ours_tok_s"])
    assert report["best_batch"] == {
        "num_prompts": top["num_prompts"],
        "ours_tok_s": top["ours_tok_s"],
    }
    # every prompt of the largest row can run at once, with the budget batched_tokens_for gives
    assert report["max_running_requests"] == 3 and report["max_num_batched_tokens"] == 2048
    assert report["kv_cache_dtype"] == "torch.float32" and report["quantization"] is None
    shapes = ModelShapes(preset_config("tiny"))
    for r in rows:
        assert r["hf_tok_s"] is None and r["ratio"] is None and r["identical_outputs"] is None
        assert r["mean_context"] == r["mean_prompt_len"] + 2  # + (max_tokens + 1) / 2
        assert r["step_flops"] == forward_flops(shapes, r["num_prompts"], r["mean_context"])
        mem = 1e3 * r["step_bytes"] / report["copy_bandwidth_bytes_per_s"]
        comp = 1e3 * r["step_flops"] / report["matmul_flop_per_s"]
        assert r["memory_ms_per_step"] == pytest.approx(mem)
        assert r["roofline_ms_per_step"] == pytest.approx(max(mem, comp))
        assert r["roofline_bound"] == ("memory" if mem >= comp else "compute")
        # the step every prompt decodes in, against the roofline at that span's context;
        # or, when it came out faster than the roofline measured beside it (random:tiny's
        # weights sit in the CPU's cache, which a loaded machine's copy rate does not show),
        # rejected with that reason and the run's fraction kept
        if r["steady_error"] is None:
            assert r["ours_step_ms_all_decoding"] > 0 and r["steady_roofline_ms"] > 0
            assert r["roofline_fraction"] == pytest.approx(
                r["steady_roofline_ms"] / r["ours_step_ms_all_decoding"]
            )
        else:
            assert "is faster than its roofline" in r["steady_error"], r["steady_error"]
            assert r["ours_step_ms_all_decoding"] is None
            assert r["roofline_fraction"] == r["run_roofline_fraction"]
        assert r["run_roofline_fraction"] == pytest.approx(
            r["roofline_ms_per_step"] / (r["ours_decode_ms_per_step"] or r["ours_ms_per_step"])
        )
    assert "step ms" in capsys.readouterr().out


def test_steady_decode_step_times_every_row_decoding_and_leaves_nothing_behind():
    """The step the roofline describes: all rows decoding. Too many prompts for the batch
    or a span longer than the context is refused naming why; afterwards no request is left and every page is back (once the
    prefix cache lets go of the prompts' full pages)."""
    from pdserve.bench.roofline import SteadyStepError, steady_decode_step
    from pdserve.engine.llm import LLM

    llm = LLM("random:tiny", device="cpu", max_running_requests=3)
    core = llm.engine
    free = core.kv.num_free_pages
    prompts = [[5 + i] * 20 for i in range(3)]
    got = steady_decode_step(llm, prompts, steps=4)
    assert got is not None and got["step_s"] > 0
    # 20-token prompts, 1 token from prefill + 2 warm steps, then the middle of 4 steps
    assert got["mean_context"] == 20 + 3 + 2
    assert not core.has_unfinished_requests()
    llm.reset_prefix_cache()  # the prompts' full pages stay cached until then
    assert core.kv.num_free_pages == free
    with pytest.raises(SteadyStepError, match="max_running_requests 3"):
        steady_decode_step(llm, prompts + [[9] * 20], steps=4)
    with pytest.raises(SteadyStepError, match="fewer --steady-steps"):
        steady_decode_step(llm, prompts, steps=core.max_model_len)
    assert not core.has_unfinished_requests()


def test_steady_decode_step_names_a_preemption():
    """A pool too small for every row's context: the span saw a preemption and says so."""
    from pdserve.bench.roofline import SteadyStepError, steady_decode_step
    from pdserve.engine.llm import LLM

    llm = LLM("random:tiny", device="cpu", max_running_requests=4, num_pages=12, page_size=4)
    with pytest.raises(SteadyStepError, match="preemption"):
        steady_decode_step(llm, [[5 + i] * 8 for i in range(4)], steps=8)
    assert not llm.engine.has_unfinished_requests()


def test_gsm8k_prompts_cut_or_padded_to_input_len():
    from pdserve.bench.offline import fit_length

    assert fit_length([1, 2, 3, 4], 2) == [1, 2]
    assert fit_length([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(ValueError):
        fit_length([], 3)


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--num-prompts", "1025"], "num-prompts"),
        (["--input-len", "0"], "input-len"),
        (["--steady-steps", "-1"], "steady-steps"),
        (["--input-source", "gsm8k"], "input-source"),
        (["--long-context", "32"], "long-context"),
        (["--long-context", "2000x16"], "long-context"),
        (["--input-len", "5000", "--ours-only"], "input-len"),  # random:tiny's limit: 4,096
        (["--long-context", "1x4095", "--ours-only", "--num-prompts", "1"], "long-context"),
    ],
)
def test_new_options_reject_bad_values(extra, field, capsys):
    assert main(["bench", "offline", "--model", "random:tiny", "--device", "cpu"] + extra) == 2
    assert field in capsys.readouterr().err


def test_step_budget_follows_the_largest_row():
    """Unset, bench offline's step budget is 16 tokens a prompt of its largest row within
    2,048..16,384: rows of 1,024 prompts get their prompts admitted in a few steps."""
    from pdserve.bench.offline import batched_tokens_for

    assert [batched_tokens_for(n) for n in (1, 64, 128, 256, 512, 1024)] == [
        2048,
        2048,
        2048,
        4096,
        8192,
        16384,
    ]
    with pytest.raises(ValueError, match="max_prompts"):
        batched_tokens_for(0)


def test_best_batch_leaves_the_long_context_row_out():
    from pdserve.bench.offline import best_batch

    rows = [
        {"num_prompts": 256, "ours_tok_s": 9.0, "prompt_source": "gsm8k"},
        {"num_prompts": 512, "ours_tok_s": 12.0, "prompt_source": "gsm8k"},
        {"num_prompts": 32, "ours_tok_s": 99.0, "prompt_source": "random (long context)"},
    ]
    assert best_batch(rows) == {"num_prompts": 512, "ours_tok_s": 12.0}
    assert best_batch(rows[2:]) is None
