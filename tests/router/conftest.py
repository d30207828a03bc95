"""Makes the process helpers of tests/e2e importable (``import pdserve_procs``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "e2e"))
