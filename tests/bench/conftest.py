"""Fixtures of the bench tests: a real tiny ``pdserve serve`` worker and fake OpenAI servers."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_servers import fake_urls, pdserve_url  # noqa: F401
