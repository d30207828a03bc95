"""``pdserve bench offline`` and then ``scripts/gpu_step_profile.py``'s profile on the same
engine: one model load for both (a load of ``random:llama-3.1-8b`` takes ~40-90 s of a
short GPU call).

Usage: ``python scripts/gpu_fp8_offline.py [--profile 1x200,32x4096] [--profile-steps 24]
[--profile-json NAME] -- BENCH-OFFLINE-FLAGS...``: the flags after ``--`` are ``pdserve
bench offline``'s (``--json`` included); once its rows ran, each profile shape
``ROWSxCONTEXT`` is profiled on its engine (``gpu_step_profile.profile_shapes``: step wall
time, GPU kernels per step by name, graph launches) and written to ``$OUT/NAME`` (default
``step_profile.json``). The engine is bench offline's: its running limit the largest row,
its pool and graphs sized for it. Exit status: bench offline's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_step_profile import profile_shapes

from pdserve.bench.offline import run_offline
from pdserve.cli import build_parser


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="1x200,32x4096", help="comma-separated shapes; '': none")
    ap.add_argument("--profile-steps", type=int, default=24)
    ap.add_argument("--profile-json", default="step_profile.json", help="file name under $OUT")
    own = ap.parse_args(argv[:split])
    args = build_parser().parse_args(["bench", "offline", *argv[split + 1 :]])
    shapes = [s for s in own.profile.split(",") if s]
    out = os.environ.get("OUT", ".")

    def after(llm) -> None:
        if not shapes:
            return
        print(f"== step profile on the same engine: {' '.join(shapes)}", flush=True)
        res: dict = {}
        for shape in shapes:  # written after each shape: a run cut short keeps what it measured
            res.update(profile_shapes(llm, [shape], own.profile_steps))
            with open(os.path.join(out, own.profile_json), "w") as f:
                json.dump(res, f, indent=1)

    return run_offline(args, after)


if __name__ == "__main__":
    sys.exit(main())
