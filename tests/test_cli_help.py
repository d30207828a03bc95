"""Every option of every ``pdserve`` sub-command documents itself: a help text that ends
with its default in one format (or says it is required), never two defaults, and a None
default shown as what unset means (``pdserve.cli.document_default``)."""

from __future__ import annotations

import argparse
import re

import pytest

from pdserve import __version__
from pdserve.cli import build_parser, document_default, main, split_help


def _walk(parser: argparse.ArgumentParser, title: str = "pdserve"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{title} {name}")
        else:
            yield title, action


def _options() -> list[tuple[str, argparse.Action]]:
    return list(_walk(build_parser()))


def test_every_option_states_its_default_once() -> None:
    options = _options()
    commands = {title for title, _ in options}
    # the tree really was walked: nested bench commands among them
    assert {
        "pdserve serve",
        "pdserve up",
        "pdserve bench serve",
        "pdserve bench tp-profile",
    } <= commands
    checked = 0
    for title, action in options:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue  # flag-only: print and exit
        name = f"{title} {'/'.join(action.option_strings) or action.dest}"
        text = action.help or ""
        meaning, default = split_help(text)
        assert meaning.strip(), f"{name}: no help text"
        assert default.strip(), f"{name}: no default stated: {text!r}"
        if action.required:
            assert text.endswith("(required)"), name
        else:
            assert text.endswith(f"(default: {default.replace('%', '%%')})"), name
        # one default, one format: no second "(default ...)", no argparse placeholder,
        # no "None" shown for an unset option, no leftover "unset:" words
        assert len(re.findall(r"\(default\b", text)) == (0 if action.required else 1), name
        assert "%(default)" not in text, name
        assert "unset:" not in text, name
        if action.default is None and not action.required:
            assert default != "None", f"{name}: a None default must say what unset means"
        checked += 1
    assert checked > 150


def test_help_renders_for_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    titles = sorted({title for title, _ in _options()})
    for title in titles:
        with pytest.raises(SystemExit) as exc:
            main([*title.split()[1:], "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert "(default None)" not in out and "(default %(default)s)" not in out, title
    serve = {
        a.option_strings[0]: a.help
        for t, a in _options()
        if t == "pdserve serve" and a.option_strings
    }
    assert serve["--page-size"] == "tokens per KV page (default: 16 on CPU, 128 on CUDA)"
    assert serve["--max-model-len"] == "context limit in tokens (default: the model's)"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pdserve {__version__}"


@pytest.mark.parametrize(
    ("kwargs", "help_after"),
    [
        ({"default": 3, "help": "runs (default %(default)s)"}, "runs (default: 3)"),
        ({"default": 3, "help": "runs (default 4)"}, "runs (default: 3)"),
        ({"default": None, "help": "limit; unset: the model's"}, "limit (default: the model's)"),
        ({"default": None, "help": "lens (default 8; other 4)"}, "lens (default: 8; other 4)"),
        ({"default": "5%", "help": "share"}, "share (default: 5%%)"),
        ({"required": True, "help": "target"}, "target (required)"),
    ],
)
def test_document_default_formats(kwargs: dict, help_after: str) -> None:
    action = argparse.ArgumentParser().add_argument("--x", **kwargs)
    document_default(action)
    assert action.help == help_after


@pytest.mark.parametrize("kwargs", [{"default": 1}, {"default": None, "help": "a file"}])
def test_document_default_refuses_undocumented(kwargs: dict) -> None:
    action = argparse.ArgumentParser().add_argument("--x", **kwargs)
    with pytest.raises(ValueError, match="--x"):
        document_default(action)


@pytest.mark.parametrize(
    "argv,prog",
    [
        (["up", "--bogus-flag"], "pdserve up"),
        (["bench", "offline", "--bogus"], "pdserve bench offline"),
        (["--bogus"], "pdserve"),
    ],
)
def test_an_unknown_flag_is_named_with_its_commands_usage(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error: unrecognized arguments: {argv[-1]}" in err
    assert err.startswith(f"usage: {prog} "), err[:200]
