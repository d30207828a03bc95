"""``pdserve doctor`` and the probe the test suite relies on (real NIXL)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def doctor(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "doctor", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(180)
def test_doctor_reports_the_configured_backend():
    ok = doctor({"PDSERVE_DISAGGREGATION_NIXL_BACKEND": "UCX"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "backend UCX (configured" in ok.stdout and "OK: the configured backend UCX" in ok.stdout
    missing = doctor({"PDSERVE_DISAGGREGATION_NIXL_BACKEND": "NOPE"})
    assert missing.returncode == 1
    assert "PROBLEM: NIXL plugin 'NOPE' is not available here (available: " in missing.stdout
    assert "UCX" in missing.stdout
    bad = doctor({"PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS": "[1]"})
    assert bad.returncode == 1
    assert (
        "PROBLEM: configuration: PDSERVE_DISAGGREGATION_NIXL_BACKEND_PARAMS must be a JSON object"
        in bad.stdout
    )


@pytest.mark.timeout(180)
def test_doctor_rejects_an_unknown_backend_name():
    bogus = doctor({"PDSERVE_DISAGGREGATION_NIXL_BACKEND": "UCX"}, "--backends", "UCX,bogus")
    assert bogus.returncode == 2, bogus.stdout + bogus.stderr
    assert "pdserve doctor: error: --backends: no plugin bogus; known: " in bogus.stdout
    assert "UCX" in bogus.stdout.split("known: ")[1]
