"""``pdserve bench``: the benchmark commands, one sub-command per module.

Each module listed in ``_SUBCOMMANDS`` defines ``add_parser(subparsers)`` registering its
own sub-command under ``pdserve bench`` and setting ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

# Imported lazily so `pdserve --help` stays fast; a room not built yet is skipped.
_SUBCOMMANDS: tuple[str, ...] = (
    "pdserve.bench.offline",
    "pdserve.bench.attention",
    "pdserve.bench.tp_profile",
    "pdserve.bench.transfer",
    "pdserve.bench.serve",
    "pdserve.bench.grammar",
    "pdserve.bench.sampler",
    "pdserve.bench.host",
    "pdserve.bench.router",
    "pdserve.bench.quality",
)


def add_json_flag(p: argparse.ArgumentParser, what: str = "the results") -> None:
    """``--json FILE`` of a benchmark: ``what`` is written there (unset: not written)."""
    p.add_argument(
        "--json", default=None, metavar="FILE", help=f"write {what} here; unset: not written"
    )


def write_json(path: str, doc: Any, indent: int = 2) -> None:
    """Write a benchmark's JSON report ``doc`` to ``path``."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=indent)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench`` with its sub-commands."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: offline engine, attention, TP, KV transfer, serving, grammar, "
        "sampler, host, router, quality",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for module_name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # that benchmark is not built yet
            raise
        module.add_parser(sub)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
