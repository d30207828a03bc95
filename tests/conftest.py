"""Collection of the whole suite.

``make test-gpu`` (``pytest -m gpu tests``) runs on the GPU machine, whose image lacks
packages that only CPU tests import (the structured-output tests' ``jsonschema`` and
``xgrammar``, the ``openai`` client of the end-to-end tests, ``kubernetes_validate`` of the
deploy checks). pytest imports every module before it deselects by marker, so one such
module failed the whole GPU run at collection. Under ``-m gpu`` a test module whose source
never names the ``gpu`` marker holds no GPU test and is not imported at all (nothing is
skipped, nothing counted); every other marker expression (CI's ``-m "not gpu"``) collects
every module as usual.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

GPU_MARK = "mark.gpu"  # pytest.mark.gpu, as a decorator or in pytestmark


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """True (do not import) for a ``test_*.py`` file without a gpu-marked test when the
    marker expression is exactly ``gpu``; None (pytest decides) otherwise."""
    if (config.option.markexpr or "").strip() != "gpu":
        return None
    name = collection_path.name
    if collection_path.suffix != ".py" or not name.startswith("test_"):
        return None
    try:
        return GPU_MARK not in collection_path.read_text(encoding="utf-8")
    except OSError:
        return None


# The test files whose module fixture is tests/e2e/conftest.py's ``shared_pd`` (one
# ``pd_and_mixed`` on the tiny model for them all, per test process): their tests only send
# requests and read answers, counters, free pages and stored responses (only
# test_openai_peers_pd.py stores any), so each file's checks hold whichever ran before it.
SHARED_PD_FILES = (
    "tests/e2e/test_openai_surface.py",
    "tests/e2e/test_structured_pd.py",
    "tests/e2e/test_completion_batches.py",
    "tests/e2e/test_openai_peers_pd.py",
)
SHARED_PD_GROUP = "tests/e2e/shared_pd"

# --- Parallel runs (``make test``: pytest-xdist, ``-n 3 --dist loadfile``) -----------------
# Every test file runs whole in one xdist worker (its module fixtures start once), and the
# files of one group below share one worker, one after another: the network-namespace tests
# (each topology takes a /24 picked from its process id, so two at once could pick the same;
# ``make test`` runs them after the others, alone: see the Makefile).
# A plain ``pytest`` (no ``-n``) runs everything in one process, as before.
# The files of one shared deployment (tests/e2e/conftest.py's ``shared_pd``) are one group
# too: each worker process would start its own.
GROUPS = {"tests/net/": "tests/net/", **{f: SHARED_PD_GROUP for f in SHARED_PD_FILES}}

# Files that take longest start first, so that no long file is left to start last while the
# other workers sit idle; the rest keep their order. By the worker-seconds each took in a
# whole run (3 workers on a loaded 2-core machine, Triton's interpreter for the kernel tests):
SLOW_FIRST = (
    "tests/model/test_attention_backends.py",  # 257 s
    # est. from their CPU seconds alone since (not a whole run): Triton's interpreter without
    # its re-patching (tests/triton_interp.py), smaller MoE test shapes
    "tests/model/test_fp8_attention.py",  # ~240 s (was 375)
    "tests/model/test_triton_moe.py",  # ~180 s (was 401)
    SHARED_PD_GROUP,  # ~180 s (four files, one deployment)
    "tests/e2e/test_up_ports_and_logs.py",  # 121 s
    "tests/engine/test_engine_tp.py",  # 115 s
    "tests/model/test_triton_warmup.py",  # ~100 s (was 182)
    "tests/engine/test_speculative.py",  # 97 s
    "tests/model/test_moe_gguf.py",  # 91 s
    "tests/e2e/test_up_migration.py",  # 87 s
    "tests/model/test_gemv.py",  # ~80 s (was 95)
    "tests/engine/test_engine_parity.py",  # 80 s
    "tests/disagg/test_nixl_transfer.py",  # 75 s
    "tests/e2e/test_pd_tensor_parallel.py",  # 74 s
    "tests/model/test_tensor_parallel.py",  # 69 s
    "tests/model/test_fp8.py",  # 66 s
    "tests/e2e/test_pd_fp8.py",  # 66 s
    # est. from their CPU seconds alone since (not a whole run): `up` refuses a bad flag
    # before torch (test_cli_ports' 8 such runs ~4 CPU s less each); 1-s graceful shutdown
    "tests/server/test_worker_shutdown.py",  # ~60 s (was 74)
    "tests/test_cli_ports.py",  # ~60 s (was 106)
    "tests/e2e/test_pd_parity.py",  # 56 s
    "tests/model/test_moe.py",  # 57 s
    "tests/e2e/test_up_faults.py",  # 55 s
    "tests/e2e/test_tensor_parallel_e2e.py",  # 53 s
    "tests/engine/test_verify_graph.py",  # ~45 s (was 52; est., the interpreter as above)
)


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, torch computes on one thread: the workers (and the processes
    their tests start) already share the cores, and two OpenMP threads per worker on a
    2-core machine wait on each other (a CPU parity test ran 10 times slower)."""
    if hasattr(config, "workerinput"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def _module_environment() -> Iterator[None]:
    """Each test file starts from the environment the run started with: what one file's
    tests leave in ``os.environ`` (e.g. UCX's report variables, set by the code under test)
    must not reach a later file, whichever files share a worker (parallel runs put them
    in another order than a plain ``pytest``)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its file, or its file's group."""
    path = nodeid.split("::", 1)[0]
    return next((group for prefix, group in GROUPS.items() if path.startswith(prefix)), path)


def _start_rank(nodeid: str) -> int:
    unit = work_unit(nodeid)
    return next((i for i, p in enumerate(SLOW_FIRST) if unit.startswith(p)), len(SLOW_FIRST))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with the groups above as one unit each."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False  # the order is SLOW_FIRST's (below), not by size
    return GroupedFiles(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker, put SLOW_FIRST's files first (the controller schedules the work
    units in the order the workers collected them); stable, so a file keeps its order."""
    if hasattr(config, "workerinput"):
        items[:] = sorted(items, key=lambda item: _start_rank(item.nodeid))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test's report ends with the log tails of the pdserve processes this test
    process still runs (tests/pdserve_procs.py): a hang or error inside a worker shows in
    CI's output, not only the client's timeout."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("setup", "call"):
        from pdserve_procs import live_log_tails

        tails = live_log_tails()
        if tails:
            report.sections.append(("pdserve process logs", tails))
