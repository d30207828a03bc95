"""The README and the docs it sends a user to stay true. docs/reference.md (the generated
reference, which the README links to): every flag of serve/router/up and every environment
variable appears in it, with the default the parser has; every request field of the HTTP
API appears with its type, default and meaning. The README lists every endpoint and keeps
the two commands; its links reach files and headings that exist. The commands these pages
tell a user to type exist (make targets, `make run ARGS=...`, the `pdserve` command lines
of their shell blocks parse with pdserve's own parser)."""

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
from pdserve.disagg.base import MAX_ROOMS_PER_REQUEST
from pdserve.launch.api_docs import api_tables, missing_meanings
from pdserve.launch.flag_docs import _subparsers, flag_table
from pdserve.server.protocol import MAX_N, GenerateSamplingParams
from pdserve.server.protocol import _OpenAISampling as OpenAISampling

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
# The pages a user reads for what to type: the README and the two docs it sends them to
# (docs/architecture.md and docs/benchmarks.md quote commands of past runs, not checked here).
USER_PAGES = {
    name: (ROOT / name).read_text()
    for name in ("README.md", "docs/reference.md", "docs/deployment.md")
}
STALE = "regenerate with: python -m pdserve.launch.flag_docs --update docs/reference.md"


def test_reference_lists_every_flag_of_serve_router_up_and_every_env_var():
    commands = _subparsers(build_parser())
    for name in ("serve", "router", "up"):
        for row in flag_table(commands[name]).splitlines()[2:]:
            assert row in REFERENCE, (
                f"docs/reference.md is stale for `pdserve {name}`: {row}\n{STALE}"
            )
    for var in envs.ALL:
        assert f"`{var.name}`" in REFERENCE, var.name
    assert "make run" in README and "make test" in README


def test_the_generated_region_of_the_reference_is_current() -> None:
    """Every row of the generated region as ``flag_docs --update`` writes it now: a
    changed default or meaning (of a flag, an environment variable, a request field) fails
    here, not only a missing name."""
    from pdserve.launch.flag_docs import BEGIN, END, reference

    region = REFERENCE.split(BEGIN, 1)[1].split(END, 1)[0]
    assert region == f"\n{reference()}", STALE


def test_the_generated_reference_is_in_docs_reference_only_and_the_readme_links_to_it():
    """One generated region, in docs/reference.md (the file flag_docs --update names in its
    marker); the README carries none of it and links to it."""
    from pdserve.launch.flag_docs import BEGIN, END

    assert BEGIN.endswith("--update docs/reference.md) -->"), BEGIN
    assert REFERENCE.count(BEGIN) == 1 and REFERENCE.count(END) == 1
    assert REFERENCE.index(BEGIN) < REFERENCE.index(END)
    for name, text in USER_PAGES.items():
        if name != "docs/reference.md":
            assert "reference:begin" not in text and "| flag | default | meaning |" not in text, (
                name
            )
    assert "](docs/reference.md" in README


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but `-` and `_` dropped,
    spaces to `-`."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_links_of_the_readme_and_docs_reach_files_and_headings_that_exist():
    for name, text in USER_PAGES.items():
        base = (ROOT / name).parent
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            page = (base / path).resolve() if path else ROOT / name
            assert page.exists(), f"{name} links to {target}, which does not exist"
            if anchor:
                assert anchor in _anchors(page.read_text()), f"{name}: no heading for {target}"


def test_readme_lists_every_request_field_with_its_meaning():
    missing = missing_meanings()
    assert not missing, f"request fields without a meaning in pdserve/launch/api_docs.py: {missing}"
    for row in api_tables().splitlines():
        assert row in REFERENCE, (
            f"docs/reference.md is stale for the request fields: {row}\n{STALE}"
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
        for text in (README, REFERENCE):
            assert f"`POST {endpoint}`" in text or f"`GET {endpoint}`" in text, endpoint


def test_reference_states_the_limits_on_samples_that_are_enforced():
    """The reference's `n` rows give the limits the code enforces: n <= the request models'
    bound (OpenAI endpoints and /generate alike) and the PD router's samples per request."""
    bounds = {
        getattr(m, "le", None)
        for model in (OpenAISampling, GenerateSamplingParams)
        for m in model.model_fields["n"].metadata
    } - {None}
    assert bounds == {MAX_N}, bounds
    rows = [row for row in REFERENCE.splitlines() if row.startswith("| `n` |")]
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
    """Every `make X` the README (or a doc it sends a user to) names is a Makefile target;
    `make run` alone is exactly `.venv/bin/pdserve up`; each `make run ARGS="..."` example
    puts its flags on that command line, and they are flags `pdserve up` accepts."""
    targets: set[str] = set()
    for text in USER_PAGES.values():
        targets |= set(re.findall(r"`make (\w[\w-]*)", text))
        targets |= set(re.findall(r"^make (\w[\w-]*)", text, flags=re.M))
    assert {"run", "test"} <= set(re.findall(r"^make (\w[\w-]*)", README, flags=re.M))
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


def _shell_lines(text: str) -> list[str]:
    """The command lines of a page's ```bash blocks (continuations joined, comments and
    trailing `&` removed, `a & b` split)."""
    lines: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines += [part.strip() for part in line.split(" & ") if part.strip(" &")]
    return [line.rstrip(" &") for line in lines]


def test_readme_and_docs_pdserve_command_lines_parse():
    """Each `pdserve ...` line of the shell blocks of the README and the docs it sends a user
    to is a command pdserve's parser accepts (sub-command and flags), and each sub-command
    they name inline exists."""
    commands = [
        (name, line)
        for name, text in USER_PAGES.items()
        for line in _shell_lines(text)
        if line.startswith("pdserve ")
    ]
    assert len(commands) >= 8, commands
    for name, line in commands:
        try:
            args = build_parser().parse_args(shlex.split(line)[1:])
        except SystemExit as exc:
            raise AssertionError(f"{name}'s command does not parse: {line}") from exc
        assert args.func is not None, line
    names = set(_subparsers(build_parser()))
    for page, text in USER_PAGES.items():
        for name in set(re.findall(r"`pdserve (\w+)", text)):
            assert name in names, f"{page} names `pdserve {name}`, which is no sub-command"
    assert any(line.startswith("curl ") for line in _shell_lines(README)), "README: no curl"


def test_reference_names_every_bench_sub_command():
    line = next(x for x in REFERENCE.splitlines() if re.search(r"`pdserve bench \w+\|", x))
    listed = set(re.search(r"`pdserve bench ([\w|-]+)`", line).group(1).split("|"))
    assert listed == set(_subparsers(_subparsers(build_parser())["bench"])), line


# a backticked source path (`disagg/bootstrap.py`, `engine/kv/cache.py:KVCacheManager`,
# `prefill/manager.py` under disagg/nixl/): some tracked file's path ends with it
_SOURCE_PATH = re.compile(r"`([\w/-]*/[\w-]+\.py)(?::[\w.]+)?`")
# a line that says the file is gone names it on purpose
_GONE = re.compile(r"delet|remov|moved|renam|no longer", re.I)


def test_source_paths_the_docs_name_exist():
    files = [
        "/" + f
        for f in subprocess.run(
            ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    ]
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if _GONE.search(line):
                continue
            for path in _SOURCE_PATH.findall(line):
                if not any(f.endswith("/" + path) for f in files):
                    missing.append(f"{doc.relative_to(ROOT)}:{n}: {path}")
    assert not missing, "docs name files that do not exist:\n" + "\n".join(missing)


@pytest.mark.timeout(300)
def test_the_readmes_python_runs_and_prints_text(capsys):
    """Every ```python block of the README that uses the offline API (``LLM(``; the others
    talk to a running server) runs as written, but on the tiny random preset instead of the
    embedded model (the embedded model's output is tested in test_engine_parity; here the
    calls and attributes the README shows), and prints something."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "LLM(" in b]
    assert blocks, "the README shows the offline API in a python block"
    for block in blocks:
        assert "LLM()" in block, block  # the embedded model, swapped for the tiny preset
        exec(compile(block.replace("LLM()", 'LLM("random:tiny")'), "README.md", "exec"), {})
        assert capsys.readouterr().out.strip(), block
