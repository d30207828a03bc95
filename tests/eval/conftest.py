"""Fixtures of the eval tests: the servers of tests/bench (a real tiny worker, fakes)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))

from bench_servers import fake_urls, pdserve_url  # noqa: F401
