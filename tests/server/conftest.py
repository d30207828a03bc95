"""Shared fixtures of the server tests: one real mixed worker per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdserve_procs import Proc, start_worker, stop, wait_healthy


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Iterator[Proc]:
    """A mixed ``pdserve serve`` worker (tiny random model, one torch thread), healthy and
    its ``/get_server_info`` read into ``info``; stopped after the module's tests."""
    proc = start_worker(
        "mixed", "mixed", tmp_path_factory.mktemp("worker-logs"), extra=["--num-threads", "1"]
    )
    try:
        wait_healthy([proc])
        proc.get_info()
        yield proc
    finally:
        stop([proc])
