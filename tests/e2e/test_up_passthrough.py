"""``pdserve up`` takes the worker flags of ``pdserve serve`` that are not engine flags
(``--served-model-name``, ``--num-threads``, ``--max-request-body-bytes``) and passes them
to its workers (and the body limit to its router): each child's argv, parsed by the real
``serve`` / ``router`` parsers, carries the value."""

from __future__ import annotations

import os

import pytest

from pdserve.cli import build_parser
from pdserve.launch.plan import UP_ROUTER_FLAGS
from pdserve.launch.plan import plan_children as _plan


def _parsed(argv: list[str]):
    assert argv[1:3] == ["-m", "pdserve"]
    return build_parser().parse_args(argv[3:])


def test_up_passes_worker_flags_through(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    args = build_parser().parse_args(
        ["up", "--device", "cpu", "--served-model-name", "tiny", "--num-threads", "3"]
        + ["--max-request-body-bytes", "4096", "--model", "random:tiny"]
    )
    workers, router = _plan(args, tmp_path)
    assert len(workers) == 2
    for w in workers:
        parsed = _parsed(w.argv)
        assert parsed.command == "serve"
        assert (parsed.served_model_name, parsed.num_threads) == ("tiny", 3)  # not the plan's 4
        assert (parsed.max_request_body_bytes, parsed.model) == (4096, "random:tiny")
    parsed = _parsed(router.argv)
    assert parsed.command == "router" and parsed.max_request_body_bytes == 4096


def test_up_defaults_leave_the_workers_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    up = build_parser().parse_args(["up", "--device", "cpu"])
    serve = build_parser().parse_args(["serve"])
    workers, router = _plan(up, tmp_path)
    for w in workers:
        parsed = _parsed(w.argv)
        assert parsed.served_model_name is None
        assert parsed.max_request_body_bytes == serve.max_request_body_bytes
        assert parsed.num_threads == 4  # the plan: 8 cores // 2 CPU workers
    assert _parsed(router.argv).max_request_body_bytes == serve.max_request_body_bytes


def test_up_refuses_negative_threads(tmp_path):
    args = build_parser().parse_args(["up", "--device", "cpu", "--num-threads", "-1"])
    with pytest.raises(ValueError, match="--num-threads"):
        _plan(args, tmp_path)


def test_up_passes_router_flags_through(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = build_parser().parse_args(
        ["up", "--device", "cpu", "--request-timeout", "12.5", "--health-check-interval", "0.5"]
        + ["--health-check-timeout", "0.25", "--health-failure-threshold", "7"]
        + ["--pd-min-prefill-tokens", "0"]
    )
    _, router = _plan(args, tmp_path)
    parsed = _parsed(router.argv)
    assert parsed.command == "router"
    assert (parsed.request_timeout, parsed.health_check_interval) == (12.5, 0.5)
    assert (parsed.health_check_timeout, parsed.health_failure_threshold) == (0.25, 7)
    assert parsed.pd_min_prefill_tokens == 0  # PD for every request, as asked


def test_up_router_flags_are_the_routers(tmp_path, monkeypatch):
    """Same defaults and help as ``pdserve router``'s, and the router gets its defaults."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    up, router = sub["up"], sub["router"]
    flags = list(UP_ROUTER_FLAGS)
    assert "--pd-min-prefill-tokens" in flags
    for flag in flags:
        (mine,) = [a for a in up._actions if flag in a.option_strings]
        (theirs,) = [a for a in router._actions if flag in a.option_strings]
        assert (mine.type, mine.default, mine.help) == (theirs.type, theirs.default, theirs.help)
    _, child = _plan(parser.parse_args(["up", "--device", "cpu"]), tmp_path)
    parsed, defaults = _parsed(child.argv), parser.parse_args(["router"])
    for flag in flags:
        dest = flag[2:].replace("-", "_")
        assert getattr(parsed, dest) == getattr(defaults, dest)
    # selective PD is on under up as under router: short prompts run on decode alone
    assert parsed.pd_min_prefill_tokens == defaults.pd_min_prefill_tokens == 64


def test_up_passes_the_traces_endpoint_to_every_child(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    url = "http://127.0.0.1:4318"
    args = build_parser().parse_args(["up", "--device", "cpu", "--otlp-traces-endpoint", url])
    workers, router = _plan(args, tmp_path)
    for child in [*workers, router]:
        assert _parsed(child.argv).otlp_traces_endpoint == url
    workers, router = _plan(build_parser().parse_args(["up", "--device", "cpu"]), tmp_path)
    for child in [*workers, router]:
        assert _parsed(child.argv).otlp_traces_endpoint is None  # tracing off by default
