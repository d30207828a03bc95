"""``pdserve up`` shares the CPU between its CPU workers: ``--num-threads`` per worker and
``OMP_WAIT_POLICY=PASSIVE`` for every child, unless the user set the OpenMP variables."""

from __future__ import annotations

import os

import pytest

from pdserve.cli import build_parser
from pdserve.config import ServerConfig
from pdserve.launch.plan import cpu_threads_plan
from pdserve.launch.plan import plan_children as _plan


def _threads_flag(argv: list[str]) -> int | None:
    return int(argv[argv.index("--num-threads") + 1]) if "--num-threads" in argv else None


def test_cpu_workers_split_the_cores_and_children_get_a_passive_wait_policy(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    args = build_parser().parse_args(
        ["up", "--device", "cpu", "--num-prefill", "1", "--num-decode", "3"]
    )
    workers, router = _plan(args, tmp_path)
    assert [_threads_flag(w.argv) for w in workers] == [2, 2, 2, 2]  # 8 cores // 4 CPU workers
    assert all(c.env["OMP_WAIT_POLICY"] == "PASSIVE" for c in workers + [router])
    assert all(
        c.env["PATH"] == os.environ["PATH"] for c in workers + [router]
    )  # the rest is inherited
    assert "--num-threads" not in router.argv


def test_user_openmp_settings_win(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert cpu_threads_plan(3, {})[0] == 1  # never 0 threads
    threads, env = cpu_threads_plan(2, {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "ACTIVE"})
    assert threads is None and env["OMP_WAIT_POLICY"] == "ACTIVE" and env["OMP_NUM_THREADS"] == "4"
    threads, env = cpu_threads_plan(0, {})  # no CPU worker (all on CUDA): torch's default
    assert threads is None and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_num_threads_must_not_be_negative():
    with pytest.raises(ValueError, match="num_threads"):
        ServerConfig(num_threads=-1)
