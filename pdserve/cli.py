"""The ``pdserve`` command: a thin dispatcher; each room adds its own sub-command.

Sub-commands: ``serve`` (a worker), ``router``, ``up`` (prefill + decode + router on this
machine), ``bench`` (offline / transfer / serve), ``eval`` (gsm8k), ``doctor`` (NIXL probe),
``chat`` (one-shot offline chat), ``env`` (list environment variables).
Each module named in ``_COMMANDS`` defines ``add_parser(subparsers)`` which registers its
parser and sets ``func`` (called with the parsed namespace, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (module, what it adds); imported lazily so `pdserve --help` stays fast.
_COMMANDS: tuple[str, ...] = (
    "pdserve.server.launch",
    "pdserve.router.launch",
    "pdserve.launch.up",
    "pdserve.bench.cli",
    "pdserve.eval.cli",
    "pdserve.disagg.probe",
    "pdserve.engine.chat_cli",
)


def _env_command(args: argparse.Namespace) -> int:
    from pdserve import envs

    for var in envs.ALL:
        current = f"set: {os.environ[var.name]!r}" if var.is_set() else "unset"
        print(f"{var.name}  ({current}; default {var.default!r})\n    {var.help}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="LLM serving with prefill/decode disaggregation over NIXL.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("pdserve"):
                continue  # room not built yet
            raise
        module.add_parser(sub)
    env = sub.add_parser(
        "env", help="list every environment variable pdserve reads, its current value and default"
    )
    env.set_defaults(func=_env_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
