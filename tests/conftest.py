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
