"""The tensor-parallel flags: ``serve --tensor-parallel-size/--tp``, ``--gpu-ids`` into
``ModelConfig``; ``up --prefill-tp/--decode-tp`` into each worker's argv, the CPU threads
shared over every rank; bad values rejected naming the flag or field."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from pdserve.cli import build_parser, main
from pdserve.launch.plan import plan_children as _plan
from pdserve.launch.up import _banner
from pdserve.server.engine_args import engine_argv, engine_config_from_args


def _value(argv: list[str], flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last one wins


def test_serve_flags_reach_the_model_config():
    args = build_parser().parse_args(["serve", "--tp", "2", "--gpu-ids", "3,1"])
    mc = engine_config_from_args(args).model
    assert (mc.tensor_parallel_size, mc.gpu_ids) == (2, (3, 1))
    assert mc.rank_gpu_id(1) == 1
    long = build_parser().parse_args(["serve", "--tensor-parallel-size", "4"])
    assert engine_config_from_args(long).model.tensor_parallel_size == 4
    assert engine_argv(args) == ["--tensor-parallel-size", "2", "--gpu-ids", "3,1"]
    assert engine_argv(build_parser().parse_args(["serve"])) == []


def test_bad_tp_flags_fail_naming_them(capsys):
    with pytest.raises(ValueError, match="gpu_ids"):
        engine_config_from_args(build_parser().parse_args(["serve", "--tp", "2", "--gpu-ids", "0"]))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_config_from_args(build_parser().parse_args(["serve", "--tp", "0"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--gpu-ids", "a,b"])
    assert "--gpu-ids" in capsys.readouterr().err
    assert main(["up", "--prefill-tp", "0", "--port", "0"]) == 2
    assert "--prefill-tp must be >= 1" in capsys.readouterr().err


def test_up_refuses_a_tp_size_the_model_cannot_split_before_starting_workers(capsys):
    """The embedded SmolLM2 (9 query heads, 3 KV heads, intermediate 1536) splits over 1 or
    3 ranks: read from its config, before any worker starts (no "started" line)."""
    assert main(["up", "--prefill-tp", "2", "--port", "0"]) == 2
    out = capsys.readouterr()
    assert "--prefill-tp 2: model smollm2-135m-instruct cannot be split" in out.err
    assert "valid sizes: 1, 3" in out.err and "started" not in out.out
    tiny = ["up", "--model", "random:tiny", "--port", "0"]
    assert main([*tiny, "--tp", "3"]) == 2  # 4 query heads: 1, 2, 4
    assert "--tensor-parallel-size 3:" in capsys.readouterr().err
    assert main([*tiny, "--decode-tp", "8"]) == 2
    err = capsys.readouterr().err
    assert "--decode-tp 8:" in err and "valid sizes: 1, 2, 4" in err


def test_up_banner_shows_each_workers_tp(tmp_path):
    args = build_parser().parse_args(["up", "--device", "cpu", "--prefill-tp", "2"])
    workers, router = _plan(args, tmp_path)
    for pid, child in enumerate(workers + [router], start=100):
        child.proc = SimpleNamespace(pid=pid)  # type: ignore[assignment]
    lines = _banner(args, workers, router).splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["prefill-0", "decode-0", "router"]
    assert lines[1].endswith("tp 2") and lines[2].endswith("tp 1") and " tp " not in lines[3]


def test_up_gives_each_role_its_tp_and_shares_the_cores_over_ranks(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    args = build_parser().parse_args(
        ["up", "--device", "cpu", "--prefill-tp", "2", "--decode-tp", "1", "--num-decode", "2"]
    )
    workers, _ = _plan(args, tmp_path)
    tp = {w.name: _value(w.argv, "--tensor-parallel-size") for w in workers}
    assert tp == {"prefill-0": "2", "decode-0": "1", "decode-1": "1"}
    # 4 rank processes (2 + 1 + 1) on 8 cores: 2 threads each.
    assert {_value(w.argv, "--num-threads") for w in workers} == {"2"}
    plain = build_parser().parse_args(["up", "--device", "cpu", "--tp", "2"])
    assert {_value(w.argv, "--tensor-parallel-size") for w in _plan(plain, tmp_path)[0]} == {"2"}
