"""The README's reference section stays true: every flag of serve/router/up and every
environment variable appears in it, with the default the parser has; every request field
of the HTTP API appears with its type, default and meaning; every endpoint is listed; the
commands it tells a user to type exist (make targets, `make run ARGS=...`, the `pdserve`
command lines of its shell blocks parse with pdserve's own parser)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pdserve import envs
from pdserve.cli import build_parser
from pdserve.disagg.room_plan import MAX_ROOMS_PER_REQUEST
from pdserve.launch.api_docs import api_tables, missing_meanings
from pdserve.launch.flag_docs import _subparsers, flag_table
from pdserve.server.protocol import MAX_N, GenerateSamplingParams
from pdserve.server.protocol import _OpenAISampling as OpenAISampling

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_lists_every_flag_of_serve_router_up_and_every_env_var():
    commands = _subparsers(build_parser())
    for name in ("serve", "router", "up"):
        for row in flag_table(commands[name]).splitlines()[2:]:
            assert row in README, (
                f"README is stale for `pdserve {name}`: {row}\n"
                "regenerate with: python -m pdserve.launch.flag_docs --update README.md"
            )
    for var in envs.ALL:
        assert f"`{var.name}`" in README, var.name
    assert "make run" in README and "make test" in README


def test_readme_lists_every_request_field_with_its_meaning():
    missing = missing_meanings()
    assert not missing, f"request fields without a meaning in pdserve/launch/api_docs.py: {missing}"
    for row in api_tables().splitlines():
        assert row in README, (
            f"README is stale for the request fields: {row}\n"
            "regenerate with: python -m pdserve.launch.flag_docs --update README.md"
        )
    for endpoint in (
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/tokenize",
        "/detokenize",
        "/version",
        "/v1/models",
    ):
        assert f"`POST {endpoint}`" in README or f"`GET {endpoint}`" in README, endpoint


def test_readme_states_the_limits_on_samples_that_are_enforced():
    """The README's `n` rows give the limits the code enforces: n <= the request models'
    bound (OpenAI endpoints and /generate alike) and the PD router's samples per request."""
    bounds = {
        getattr(m, "le", None)
        for model in (OpenAISampling, GenerateSamplingParams)
        for m in model.model_fields["n"].metadata
    } - {None}
    assert bounds == {MAX_N}, bounds
    rows = [row for row in README.splitlines() if row.startswith("| `n` |")]
    assert len(rows) == 2, rows  # the OpenAI table and /generate's sampling_params
    for row in rows:
        assert f"1 to {MAX_N};" in row and f"at most {MAX_ROOMS_PER_REQUEST} samples" in row, row


def _make_dry_run(*make_args: str) -> list[str]:
    """The commands ``make -n`` would run in the repository (nothing runs), one per line;
    the environment of an outer make (``make test`` runs pytest) is left out."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed (the README's two commands need it)")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "-C", str(ROOT), *make_args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_readme_make_commands_exist_and_run_passes_its_args_to_up():
    """Every `make X` the README names is a Makefile target; `make run` alone is exactly
    `.venv/bin/pdserve up`; each `make run ARGS="..."` example puts its flags on that
    command line, and they are flags `pdserve up` accepts."""
    targets = set(re.findall(r"`make (\w[\w-]*)", README)) | set(
        re.findall(r"^make (\w[\w-]*)", README, flags=re.M)
    )
    assert {"run", "test"} <= targets, targets
    for target in sorted(targets):
        _make_dry_run(target)  # make fails on an unknown target
    runs = [line for line in _make_dry_run("run") if "bin/pdserve" in line]
    assert [line.strip() for line in runs] == [".venv/bin/pdserve up"], runs
    examples = re.findall(r'make run ARGS="([^"]*)"', README)
    assert examples, 'README shows no `make run ARGS="..."` example'
    parser = build_parser()
    for flags in examples:
        runs = [line for line in _make_dry_run("run", f"ARGS={flags}") if "bin/pdserve" in line]
        assert [line.strip() for line in runs] == [f".venv/bin/pdserve up {flags}"], runs
        args = parser.parse_args(["up", *shlex.split(flags)])  # SystemExit 2 on a bad flag
        assert args.func is not None


def test_readme_says_how_to_run_pdserve_itself():
    """The README's commands say `pdserve ...`: it names where setup puts that command
    (the Makefile's virtual environment) and how to put it on PATH."""
    venv = re.search(r"^VENV := (\S+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert venv, "Makefile defines no VENV"
    assert f"`{venv.group(1)}/bin/pdserve" in README
    assert f"`source {venv.group(1)}/bin/activate`" in README


def _shell_lines() -> list[str]:
    """The command lines of the README's ```bash blocks (continuations joined, comments
    and trailing `&` removed, `a & b` split)."""
    lines: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", README, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines += [part.strip() for part in line.split(" & ") if part.strip(" &")]
    return [line.rstrip(" &") for line in lines]


def test_readme_pdserve_command_lines_parse():
    """Each `pdserve ...` line of the README's shell blocks is a command pdserve's parser
    accepts (sub-command and flags), and each sub-command it names inline exists."""
    commands = [line for line in _shell_lines() if line.startswith("pdserve ")]
    assert len(commands) >= 8, commands
    for line in commands:
        try:
            args = build_parser().parse_args(shlex.split(line)[1:])
        except SystemExit as exc:
            raise AssertionError(f"README's command does not parse: {line}") from exc
        assert args.func is not None, line
    names = set(_subparsers(build_parser()))
    for name in set(re.findall(r"`pdserve (\w+)", README)):
        assert name in names, f"README names `pdserve {name}`, which is no sub-command"
