"""A prefill worker's log: uvicorn's lifecycle lines appear once, the worker's own; its
bootstrap server (uvicorn on a thread, logging to the same process-wide logger) adds none
of them."""

from __future__ import annotations

import pytest

from pdserve_procs import start_worker, stop, wait_healthy


@pytest.mark.timeout(300)
def test_prefill_worker_logs_uvicorns_shutdown_lines_once(tmp_path):
    worker = start_worker(
        "prefill",
        "prefill",
        tmp_path,
        env={"PDSERVE_LOG_LEVEL": "INFO"},
        extra=["--disaggregation-bootstrap-port", "0"],
    )
    try:
        wait_healthy([worker])
    finally:
        stop([worker])
    log = worker.log_path.read_text()
    for line in (
        "Started server process",
        "Application startup complete.",
        "Shutting down",
        "Application shutdown complete.",
        "Finished server process",
    ):
        assert log.count(line) == 1, (line, log[-3000:])
