"""Every port flag of every sub-command takes a port, 0 to 65535, and refuses anything else
as an argparse usage error (``argument --port: ...``, exit 2) while parsing: no traceback,
no socket bound, no process started (``pdserve up --port 70000`` once ended in
``OverflowError`` from ``bind()``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pdserve.cli import build_parser, port_number
from pdserve.model.presets import preset_config


def _port_flags(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], str, argparse.Action]]:
    """(sub-command path, flag, action) of every option whose name ends in ``port``, in
    every sub-command (nested ones too)."""
    found = []
    for action in parser._actions:  # argparse offers no public accessor for sub-commands
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _port_flags(sub, (*path, name))
        for flag in action.option_strings:
            if flag.endswith("port"):
                found.append((path, flag, action))
    return found


PORT_FLAGS = [(path, flag) for path, flag, _ in _port_flags(build_parser())]


def test_every_port_flag_is_found_and_typed_as_a_port() -> None:
    assert {
        (("serve",), "--port"),
        (("serve",), "--disaggregation-bootstrap-port"),
        (("router",), "--port"),
        (("up",), "--port"),
    } <= set(PORT_FLAGS), PORT_FLAGS
    for path, flag, action in _port_flags(build_parser()):
        assert action.type is port_number, f"pdserve {' '.join(path)} {flag}: {action.type}"


@pytest.mark.parametrize(("path", "flag"), PORT_FLAGS)
@pytest.mark.parametrize("value", ["-1", "70000", "65536", "abc", "80.5"])
def test_a_bad_port_is_a_usage_error(
    path: tuple[str, ...], flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*path, f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a port in [0, 65535], got '{value}'" in err, err


@pytest.mark.parametrize(("path", "flag"), PORT_FLAGS)
@pytest.mark.parametrize("value", [0, 1, 65535])
def test_a_good_port_parses_to_an_int(path: tuple[str, ...], flag: str, value: int) -> None:
    args = build_parser().parse_args([*path, flag, str(value)])
    action = next(a for p, f, a in _port_flags(build_parser()) if (p, f) == (path, flag))
    assert getattr(args, action.dest) == value


@pytest.mark.parametrize("value", ["-1", "70000"])
def test_up_with_a_bad_port_exits_2_without_a_traceback(tmp_path, value: str) -> None:
    log_dir = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--port", value, "--log-dir", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"pdserve up: error: argument --port: expected a port in [0, 65535], got '{value}'" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert not log_dir.exists()  # nothing was planned or started


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--pd-min-prefill-tokens", "-1", "--pd-min-prefill-tokens must be >= 0, got -1"),
        ("--health-check-interval", "0", "--health-check-interval must be > 0 s, got 0.0"),
        ("--request-timeout", "-1", "--request-timeout must be > 0 s, got -1.0"),
        ("--page-size", "0", "--page-size must be >= 1, got 0"),
        ("--ready-timeout", "0", "argument --ready-timeout: expected a number > 0, got '0'"),
        ("--served-model-name", "", "--served-model-name must be non-empty when given"),
        ("--model", "nosuchmodel", "--model 'nosuchmodel': not an existing folder"),
        ("--model", "random:nope", "--model 'random:nope': unknown random preset 'nope'"),
        ("--model", "{bad_config}", "--model '{bad_config}': cannot read its config.json"),
        ("--model", "{junk_gguf}", "--model '{junk_gguf}': cannot read the GGUF's metadata"),
        ("--model", "{no_weights}", "--model '{no_weights}': folder has no *.safetensors"),
    ],
)
def test_up_refuses_a_bad_router_or_worker_flag_before_starting_anything(
    tmp_path, flag, value, message
):
    log_dir = tmp_path / "logs"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")  # a folder, its config broken
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")  # a file named .gguf, not one
    (tmp_path / "empty").mkdir()  # a readable config.json and no weights
    (tmp_path / "empty" / "config.json").write_text(json.dumps(preset_config("tiny").to_dict()))
    paths = {
        "bad_config": tmp_path / "bad",
        "junk_gguf": tmp_path / "junk.gguf",
        "no_weights": tmp_path / "empty",
    }
    value, message = value.format(**paths), message.format(**paths)
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", "0", flag, value]
    proc = subprocess.run(
        [*cmd, "--log-dir", str(log_dir)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert f"pdserve up: error: {message}" in proc.stderr
    assert not log_dir.exists()  # nothing was planned or started


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--prefill", "http://127.0.0.1:1"], "--decode must be non-empty in PD mode"),
        ([], "--worker must be non-empty (or give --prefill and --decode,"),
        (["--worker", "notaurl"], "--worker: 'notaurl' must start with http://"),
    ],
)
def test_router_errors_name_the_flags_not_the_config_fields(capsys, flags, message):
    """``decode_urls`` is set by ``--decode``: the error line names what the user typed
    (in process: the router refuses before it binds or starts anything)."""
    args = build_parser().parse_args(["router", "--port", "0", *flags])
    assert args.func(args) == 2
    assert f"pdserve router: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_up_refuses_a_log_dir_it_cannot_write_with_one_line(tmp_path, capsys, kind):
    taken = tmp_path / "taken"
    taken.write_text("a file, not a folder")
    log_dir = taken if kind == "a file" else taken / "logs"
    args = build_parser().parse_args(
        ["up", "--model", "random:tiny", "--port", "0", "--log-dir", str(log_dir)]
    )
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert f"pdserve up: error: --log-dir '{log_dir}': cannot write logs there (" in err, err
    assert "Traceback" not in err
