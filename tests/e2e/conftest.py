"""The end-to-end tests' shared deployment: ``pd_and_mixed`` on the tiny model (a prefill,
a decode and a router over them, beside a mixed worker), started once for the files whose
module fixture uses it (tests/conftest.py's ``SHARED_PD_FILES``) instead of once per file.
tests/conftest.py runs those files in one xdist worker, one after another (each xdist
worker is its own process); the deployment is stopped after the last of their tests in a
row (``pytest_runtest_teardown`` below), not left idle while the worker runs other files,
and started again should one of them come after other files (a plain ``pytest`` runs the
files in name order)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from pdserve_procs import SHARED_PD_STORE, pd_and_mixed

# Every worker's flags: one torch thread (4 processes on the 2 shared cores of CI) and the
# Responses API store that test_openai_peers_pd.py fills and bounds.
FLAGS = ["--num-threads", "1", "--responses-store-size", str(SHARED_PD_STORE)]

_running: dict[str, Any] = {}  # "procs": the deployment, "stack": what stops it


def _stop_shared() -> None:
    stack = _running.pop("stack", None)
    _running.pop("procs", None)
    if stack is not None:
        stack.close()


@pytest.fixture(scope="module")
def shared_pd(tmp_path_factory) -> dict[str, Any]:
    """The running shared deployment (``pd_and_mixed``'s dict, every worker given
    ``FLAGS``), started if none runs."""
    if "procs" not in _running:
        stack = contextlib.ExitStack()
        try:
            procs = stack.enter_context(
                pd_and_mixed(tmp_path_factory.mktemp("shared-pd-logs"), worker_extra=FLAGS)
            )
        except BaseException:
            stack.close()
            raise
        _running.update(procs=procs, stack=stack)
    return _running["procs"]


def _uses_shared(item: pytest.Item | None) -> bool:
    return item is not None and "shared_pd" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test using ``shared_pd`` whose next test (if any) does not: stop the
    shared deployment."""
    if _uses_shared(item) and not _uses_shared(nextitem):
        _stop_shared()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_shared()  # a run ended early (-x): nothing left running
