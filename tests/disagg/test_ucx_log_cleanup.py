"""A PD worker on NIXL points UCX's log at ``pdserve-ucx-<pid>.log`` in the temp folder
(``pdserve.disagg.nixl.agent.ucx_transports``); a real worker stopped by SIGINT or SIGTERM
removes it (uvicorn re-raises SIGTERM with the default handler, so atexit never runs: the
app's lifespan end does it), leaves every other file of the folder alone and prints no
traceback."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from pdserve.disagg.nixl.probe import nixl_problem
from pdserve_procs import start_worker, stop, wait_healthy

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_pd_worker_leaves_no_ucx_log(tmp_path, sig):
    if problem := nixl_problem():
        pytest.fail(problem)  # fail, never skip (CI has NIXL)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    other = tmp / "pdserve-ucx-1.log"  # not this worker's: must stay
    other.write_text("someone else's\n")
    worker = start_worker(
        "decode",
        "decode",
        tmp_path,
        # the default folder: the temporary one (the launcher points it at the test's logs)
        env={"TMPDIR": str(tmp), "PDSERVE_UCX_LOG_DIR": ""},
        extra=["--disaggregation-transfer-backend", "nixl"],
    )
    try:
        wait_healthy([worker])
        log = tmp / f"pdserve-ucx-{worker.pid}.log"
        assert log.exists(), sorted(p.name for p in tmp.iterdir())
        assert worker.get_info()["ucx"]["log_file"] == str(log)
        os.kill(worker.pid, sig)  # the worker only (its own group), like Ctrl-C or `kill`
        try:
            worker.popen.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker did not stop:\n" + worker.log_tail())
        assert not log.exists(), worker.log_tail()
        # Ctrl-C (SIGINT) and `kill` stop it without a traceback
        assert "Traceback" not in worker.log_path.read_text(errors="replace"), worker.log_tail()
        assert other.read_text() == "someone else's\n"
    finally:
        stop([worker])
