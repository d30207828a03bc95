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
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from pdserve.config import default_of
from pdserve.ports import check_port

# (module, what it adds); imported lazily so `pdserve --help` stays fast.
_COMMANDS: tuple[str, ...] = (
    "pdserve.server.launch",
    "pdserve.router.launch",
    "pdserve.launch.up",
    "pdserve.bench.cli",
    "pdserve.eval.cli",
    "pdserve.disagg.nixl.probe",
    "pdserve.engine.chat_cli",
)


def _env_command(args: argparse.Namespace) -> int:
    from pdserve import envs

    for var in envs.ALL:
        current = f"set: {os.environ[var.name]!r}" if var.is_set() else "unset"
        print(f"{var.name}  ({current}; default {var.default!r})\n    {var.help}")
    return 0


def port_number(text: str) -> int:
    """The argparse ``type`` of every port flag (``serve --port``,
    ``--disaggregation-bootstrap-port``, ``router --port``, ``up --port``): an integer in
    [0, 65535] (the range of a TCP port; 0 asks the kernel for a free one). An
    ``argparse.ArgumentTypeError`` otherwise, so a bad port is the usual ``argument --port:
    ...`` usage error (exit 2), before any socket or process."""
    try:
        return check_port(int(text), "port", allow_zero=True)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}") from None


def positive(cast: type) -> Callable[[str], Any]:
    """An argparse ``type``: ``cast(text)`` (``int`` or ``float``), finite and > 0 (a count,
    a rate, a duration in seconds); otherwise the usual ``argument --flag: expected a
    number > 0, got '...'`` usage error (exit 2)."""

    def convert(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return convert


class IntListError(ValueError, argparse.ArgumentTypeError):
    """A bad list of integers: a ValueError to its callers, and a flag's usage error
    (``argument --flag: ...``, exit 2) as an argparse ``type``."""


def int_list(text: str, low: int = 0, high: int | None = None, *, name: str = "") -> list[int]:
    """``"1,64"`` -> ``[1, 64]``: at least one integer, each in ``[low, high]`` (``high``
    None: no upper bound). Else IntListError ``"<name> must be comma-separated integers
    >= low (or in low..high), got '...'"`` (``"expected ..."`` without a ``name``: an
    argparse ``type``, whose error names the flag)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < low or (high is not None and v > high) for v in values):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        what = f"{name} must be" if name else "expected"
        raise IntListError(f"{what} comma-separated integers {bound}, got {text!r}")
    return values


class Flag(NamedTuple):
    """One flag of a command, declared once in its command's table (``ENGINE_FLAGS``,
    ``SERVE_FLAGS``, ``ROUTER_FLAGS``, ``UP_FLAGS``): :func:`add_flags` defines it,
    :func:`flag_values` reads it back into its config's fields."""

    flag: str
    help: str
    parse: Any = str  # the argparse type; bool: an on/off pair (--x / --no-x) unless store_true
    cls: type | None = None  # the config dataclass whose field the flag sets (and default)
    field: str = ""  # the field of ``cls``; "": the flag's name (--page-size: page_size)
    default: Any = None  # the default of a flag with no config (``cls`` None)
    choices: Any = None
    metavar: str | None = None
    action: str | None = None  # "store_true", or "append" (a list; a tuple in the config)
    aliases: tuple[str, ...] = ()
    required: bool = False

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def name(self) -> str:
        """The config field the flag sets."""
        return self.field or self.dest

    def default_value(self) -> Any:
        """The flag's default: its config field's declared default, else ``default``."""
        return default_of(self.cls, self.name) if self.cls else self.default


def add_flags(
    parser: argparse.ArgumentParser, flags: Iterable[Flag], group: str | None = None
) -> None:
    """Add ``flags`` (in that order) to ``parser``, in an argument group titled ``group``
    when one is given, each as its :class:`Flag` declares it. Each help ends with its
    default once :func:`build_parser` builds the tree (:func:`document_default`; a None
    default's help says what unset means: ``...; unset: MEANING``)."""
    target = parser.add_argument_group(group) if group else parser
    for f in flags:
        kwargs: dict[str, Any] = {"default": f.default_value(), "help": f.help}
        if f.action == "store_true":
            kwargs["action"] = f.action
        elif f.parse is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = f.parse
        if f.action == "append":
            kwargs.update(action="append", default=[])
        if f.choices is not None:
            kwargs["choices"] = f.choices
        if f.metavar is not None:
            kwargs["metavar"] = f.metavar
        if f.required:
            kwargs["required"] = True
        target.add_argument(f.flag, *f.aliases, dest=f.dest, **kwargs)


def flag_values(
    args: argparse.Namespace, flags: Iterable[Flag], cls: type | None = None
) -> dict[str, Any]:
    """``{field: parsed value}`` of the ``flags`` that set a field of ``cls`` (of any
    config when ``cls`` is None), for building that config."""
    return {
        f.name: tuple(getattr(args, f.dest)) if f.action == "append" else getattr(args, f.dest)
        for f in flags
        if f.cls is not None and (cls is None or f.cls is cls)
    }


# A default already written into a help text, in any of the spellings the modules use:
# "(default %(default)s)", "(default: X)", "(default X)" at the end.
_STATED_DEFAULT = re.compile(r"\s*\(default:? ((?:[^()]|\([^()]*\))*)\)\s*$")
# What an unset (None) default means, as the help says it: "...; unset: MEANING" at the end.
_UNSET = re.compile(r"[;,]?\s*\bunset: (.*)$")
DEFAULT_MARK, REQUIRED_MARK = " (default: ", " (required)"


def value_text(value: object) -> str:
    """How a default value is written in a help text (a list as comma-separated items)."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) if value else "none"
    return str(value)


def document_default(action: argparse.Action) -> None:
    """Rewrite ``action.help`` to end with its default in one format: ``(default: X)``, or
    ``(required)`` for a required option. X is the default value; for a default of None
    (or an unset on/off flag) it is what unset means, in the help's own words (its trailing
    ``unset: ...`` or ``(default: ...)`` text). ValueError naming the option when its help
    is empty or a None default has no such words (``tests/test_cli_help.py`` walks every
    sub-command)."""
    name = "/".join(action.option_strings) or action.dest
    text = (action.help or "").strip()
    if not text or text == argparse.SUPPRESS:
        raise ValueError(f"{name}: no help text")
    text = text.replace(" (default: %(default)s)", "")  # BooleanOptionalAction's, 3.10-3.12
    stated = None
    m = _STATED_DEFAULT.search(text)
    if m:
        text, stated = text[: m.start()], m.group(1)
    m = _UNSET.search(text)
    unset_like = action.default is None or (
        action.default is False and isinstance(action, argparse._StoreTrueAction)
    )
    if m and unset_like:
        text, stated = text[: m.start()], m.group(1)
    text = text.rstrip(" ;,")
    if action.required:
        action.help = text + REQUIRED_MARK
        return
    if not unset_like or stated in (None, "%(default)s"):
        if action.default is None:
            raise ValueError(f"{name}: default None, and the help does not say what unset means")
        stated = value_text(action.default).replace("%", "%%")
    action.help = f"{text}{DEFAULT_MARK}{stated})"


def split_help(help_text: str) -> tuple[str, str]:
    """``(meaning, default)`` of a help text that :func:`document_default` wrote; default is
    ``"required"`` for a required option. ``%%`` is unescaped."""
    if help_text.endswith(REQUIRED_MARK):
        meaning, default = help_text[: -len(REQUIRED_MARK)], "required"
    else:
        meaning, _, default = help_text.rpartition(DEFAULT_MARK)
        default = default[:-1]
    return meaning.replace("%%", "%"), default.replace("%%", "%")


def _document_defaults(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:  # argparse offers no public accessor for sub-commands
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _document_defaults(sub)
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            document_default(action)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered; each flag's
    help ends with its default (:func:`document_default`)."""
    from pdserve import __version__

    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="LLM serving with prefill/decode disaggregation over NIXL.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
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
    _document_defaults(parser)
    return parser


def _innermost(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The (sub-)sub-command's parser that ``args`` were parsed by, so that its usage is the
    one an error prints (``pdserve up --bad`` shows ``up``'s, not the top level's)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs and subs[0].dest else None
        if not subs or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # exits 2 with the sub-command's usage
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
