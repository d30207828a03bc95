"""The README's reference section stays true: every flag of serve/router/up and every
environment variable appears in it, with the default the parser has; every request field
of the HTTP API appears with its type, default and meaning; every endpoint is listed."""

from __future__ import annotations

from pathlib import Path

from pdserve import envs
from pdserve.cli import build_parser
from pdserve.launch.flag_docs import _subparsers, flag_table
from pdserve.router.dispatch import MAX_ROOMS_PER_REQUEST
from pdserve.server.api_docs import api_tables, missing_meanings
from pdserve.server.protocol import MAX_N, GenerateSamplingParams
from pdserve.server.protocol import _OpenAISampling as OpenAISampling

README = (Path(__file__).parents[2] / "README.md").read_text()


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
    assert not missing, f"request fields without a meaning in pdserve/server/api_docs.py: {missing}"
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
