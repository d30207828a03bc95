"""``serve`` and ``up`` refuse a bad ``--dtype`` / ``--kv-order`` / ``--attention-backend``
/ ``--device`` while parsing (exit 2, the config's own message), before ``up`` starts any
process; and each flag's help lists the values the config accepts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.engine.kv.layout import KV_ORDERS
from pdserve.model.attention import available_backends

BAD = [
    ("--dtype", "foo", "dtype must be auto, float32, bfloat16 or float16, got 'foo'"),
    ("--kv-order", "foo", "kv_order: 'foo' is not a KV order"),
    ("--attention-backend", "foo", "attention_backend must be auto or one of"),
    ("--device", "tpu", "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
]


@pytest.mark.parametrize("command", ["serve", "up"])
@pytest.mark.parametrize(("flag", "value", "message"), BAD)
def test_bad_value_is_refused_at_parse_time(
    command: str, flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err


def test_good_values_parse_unchanged() -> None:
    backend = available_backends()[-1]
    args = build_parser().parse_args(
        ["up", "--dtype", "bfloat16", "--kv-order", KV_ORDERS[0]]
        + ["--attention-backend", backend, "--device", "cuda:1"]
    )
    assert (args.dtype, args.kv_order) == ("bfloat16", KV_ORDERS[0])
    assert (args.attention_backend, args.device) == (backend, "cuda:1")
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.dtype, defaults.kv_order, defaults.device) == ("auto", None, "auto")


def test_up_with_a_bad_dtype_starts_nothing(tmp_path) -> None:
    log_dir = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--dtype", "foo", "--log-dir", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "argument --dtype: dtype must be auto" in proc.stderr
    assert not log_dir.exists()  # no child was planned or started


def _help(command: str, flag: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if flag in a.option_strings).help or ""


@pytest.mark.parametrize("command", ["serve", "up"])
def test_help_lists_the_allowed_values(command: str) -> None:
    for value in ("auto", "float32", "bfloat16", "float16"):
        assert value in _help(command, "--dtype")
    for value in KV_ORDERS:
        assert value in _help(command, "--kv-order")
    for value in ("auto", *available_backends()):
        assert value in _help(command, "--attention-backend")
    for value in ("auto", "cpu", "cuda", "cuda:N"):
        assert value in _help(command, "--device")


@pytest.mark.parametrize("command", ["serve", "up"])
@pytest.mark.parametrize(
    "flags",
    [
        ["--speculative-algorithm", "draft", "--speculative-model", "random:tiny"],
        ["--speculative-model", "random:tiny", "--speculative-algorithm", "draft"],
        ["--speculative-ngram-min", "4", "--speculative-ngram-max", "6"],
        ["--speculative-ngram-max", "6", "--speculative-ngram-min", "4"],
    ],
)
def test_rules_between_two_flags_see_both_flags(command: str, flags: list[str]) -> None:
    """A rule between two flags (draft needs a model; ngram max >= min) is checked on the
    whole config, in either order: each flag alone passes its own parse-time check."""
    from pdserve.server.engine_args import engine_config_from_args

    args = build_parser().parse_args([*command.split(), *flags])
    sc = engine_config_from_args(args).scheduler
    assert (sc.speculative_model, sc.speculative_ngram_min, sc.speculative_ngram_max) in (
        ("random:tiny", 1, 3),
        (None, 4, 6),
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--speculative-algorithm", "draft"], "--speculative-model must be set"),
        (
            ["--speculative-ngram-min", "5", "--speculative-ngram-max", "2"],
            "--speculative-ngram-max (2) must be >= --speculative-ngram-min (5)",
        ),
    ],
)
def test_up_refuses_a_broken_rule_between_flags_before_starting(tmp_path, flags, message) -> None:
    log_dir = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", *flags, "--port", "0", "--log-dir", str(log_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"pdserve up: error: {message}" in proc.stderr
    assert not log_dir.exists()


def test_infinite_sizes_are_refused_naming_the_flag(capsys) -> None:
    from pdserve.cli import main

    assert main(["bench", "offline", "--kv-cache-memory", "inf", "--model", "random:tiny"]) == 2
    assert "--kv-cache-memory must be a finite number, got inf" in capsys.readouterr().err
