"""``make test-gpu``'s collection on a machine without the CPU tests' extra packages (the
GPU image has no xgrammar, jsonschema, openai or kubernetes_validate): every gpu-marked
test is collected and nothing fails to import (tests/conftest.py). Run here with those
imports blocked in the collecting process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
ABSENT_ON_GPU = ("xgrammar", "jsonschema", "openai", "kubernetes_validate")

COLLECT = """
import sys
for name in {absent!r}:
    sys.modules[name] = None  # `import name` raises ImportError, as if not installed
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", {expr!r}, "tests"]))
"""


def _collect(expr: str) -> subprocess.CompletedProcess:
    code = COLLECT.format(absent=ABSENT_ON_GPU, expr=expr)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def _gpu_tests_in_source() -> set[str]:
    """``module::function`` of every gpu-marked test function, read from the sources."""
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        text = path.read_text()
        for m in re.finditer(r"@pytest\.mark\.gpu\n(?:@.*\n)*def (test_\w+)", text):
            found.add(f"{path.relative_to(ROOT).as_posix()}::{m.group(1)}")
    return found


@pytest.mark.timeout(600)
def test_gpu_run_collects_every_gpu_test_without_the_cpu_only_packages():
    result = _collect("gpu")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    collected = {line.split("[")[0] for line in result.stdout.splitlines() if "::" in line}
    expected = _gpu_tests_in_source()
    assert expected and expected == collected, (expected ^ collected, result.stdout[-2000:])
    assert "error" not in result.stdout.lower().splitlines()[-1]
