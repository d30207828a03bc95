"""The NIXL backend probe and ``pdserve doctor``.

:func:`probe_nixl` says whether NIXL imports, which plugins it has, and which backends can
be created here with the configured parameters, one readable line per problem. The test
suite uses :func:`nixl_problem` so that NIXL tests fail with the probe's reason (never skip).
"""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field
from functools import lru_cache

from pdserve import envs
from pdserve.disagg.base import PD_ROLES, Role
from pdserve.disagg.transfer_config import NixlInitSpec


@dataclass
class ProbeReport:
    """What :func:`probe_nixl` found. ``created``: backend -> None (created) or the error line."""

    configured_backend: str
    params: dict = field(default_factory=dict)
    version: str | None = None
    plugins: tuple[str, ...] = ()
    created: dict[str, str | None] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the configured backend was created."""
        return self.created.get(self.configured_backend, "not tried") is None


def probe_nixl(
    backends: list[str] | None = None,
    role: Role = Role.PREFILL,
    device: str = "cpu",
    gpu_id: int = 0,
    timeout_s: float | None = None,
) -> ProbeReport:
    """Probe NIXL. ``backends``: which to try creating (default: the configured one; ``["all"]``
    tries every plugin); the configured one gets the configured parameters (with ``role``'s
    thread count), others none. Never raises for NIXL problems: they land in ``problems``."""
    from pdserve.disagg.base import KVArgs, KVLayout
    from pdserve.disagg.deadline import run_with_deadline
    from pdserve.disagg.nixl.agent.init import select_device

    configured = envs.DISAGGREGATION_NIXL_BACKEND.get()
    report = ProbeReport(configured)
    try:
        spec = NixlInitSpec.from_env(role)
        report.params = spec.params
    except ValueError as exc:
        report.problems.append(f"configuration: {exc}")
        return report
    from pdserve.disagg.nixl.agent.api import NixlUnavailableError, load_nixl_api

    try:
        api = load_nixl_api()
    except NixlUnavailableError as exc:
        report.problems.append(str(exc))
        return report
    report.version = api.version
    try:
        agent = api.nixl_agent(
            f"pdserve-probe-{uuid.uuid4().hex[:8]}",
            api.nixl_agent_config(
                enable_prog_thread=False,
                enable_listen_thread=False,
                backends=[],
                num_threads=spec.num_threads,
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            ),
        )
        report.plugins = tuple(sorted(agent.get_plugin_list()))
    except Exception as exc:  # noqa: BLE001 - reported
        report.problems.append(f"NIXL agent cannot be created: {type(exc).__name__}: {exc}")
        return report
    wanted = list(report.plugins) if backends == ["all"] else (backends or [configured])
    if configured not in wanted:
        wanted.insert(0, configured)
    dummy = KVArgs(
        (0,), (1,), (1,), 0, 1, 1, KVLayout("", "", 1, 1, 1, 1), device=device, gpu_id=gpu_id
    )
    for name in wanted:
        if name not in report.plugins:
            line = f"NIXL plugin {name!r} is not available here (available: {', '.join(report.plugins)})"
            report.created[name] = line
            report.problems.append(line)
            continue
        params = spec.params if name == configured else {}

        def create(name=name, params=params) -> None:
            select_device(dummy)
            agent.create_backend(name, params)

        try:
            run_with_deadline(create, timeout_s or spec.timeout_s, f"NIXL create_backend({name!r})")
            report.created[name] = None
        except Exception as exc:  # noqa: BLE001 - reported
            line = f"backend {name} cannot be created with params {params}: {type(exc).__name__}: {exc}"
            report.created[name] = line
            report.problems.append(line)
    return report


@lru_cache(maxsize=1)
def nixl_problem() -> str | None:
    """None when the configured backend can be created here, else the probe's reason
    (cached per process; used by the test suite to fail NIXL tests with that reason)."""
    report = probe_nixl()
    return None if report.ok else "NIXL is not usable here: " + "; ".join(report.problems)


def _doctor_peer(peer: str, timeout_s: float) -> int:
    from pdserve.disagg.nixl.peer_check import check_peer, parse_peer

    try:
        host, port = parse_peer(peer)
    except ValueError as exc:
        print(f"pdserve doctor: error: {exc}")
        return 2
    try:
        spec = NixlInitSpec.from_env(Role.DECODE)
    except ValueError as exc:
        print(f"PROBLEM: configuration: {exc}")
        return 1
    report = check_peer(host, port, spec, timeout_s)
    for kind, text in report.lines:
        print(f"{ {'ok': 'OK', 'warn': 'WARNING', 'fail': 'PROBLEM'}[kind] }: {text}")
    return 0 if report.ok else 1


def _doctor(args: argparse.Namespace) -> int:
    if args.peer:
        return _doctor_peer(args.peer, args.timeout)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends else None
    report = probe_nixl(backends, role=args.role, device=args.device, gpu_id=args.gpu_id)
    unknown = [b for b in backends or [] if b != "all" and b not in report.plugins]
    if report.version is not None and unknown:
        known = ", ".join(report.plugins) or "(none)"
        print(f"pdserve doctor: error: --backends: no plugin {', '.join(unknown)}; known: {known}")
        return 2
    if report.version is not None:
        print(f"nixl {report.version} imported; plugins: {', '.join(report.plugins) or '(none)'}")
    for name, error in report.created.items():
        tag = (
            " (configured: PDSERVE_DISAGGREGATION_NIXL_BACKEND)"
            if name == report.configured_backend
            else ""
        )
        params = f" params {report.params}" if name == report.configured_backend else ""
        print(f"backend {name}{tag}{params}: {'OK' if error is None else 'FAILED'}")
    for line in report.problems:
        print(f"PROBLEM: {line}")
    if report.ok:
        print(f"OK: the configured backend {report.configured_backend} can be created here")
        return 0
    return 1


def add_parser(subparsers) -> None:
    """Register ``pdserve doctor``."""
    p = subparsers.add_parser(
        "doctor",
        help="check that NIXL and the configured transfer backend work here",
        description="Probe NIXL: import, plugins, which backends can be created with "
        "the configured parameters. Exit 1 when the configured one cannot, 2 when a "
        "--backends name has no NIXL plugin here.",
    )
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends to try, or 'all' (default: the configured one)",
    )
    p.add_argument(
        "--role",
        type=Role,
        choices=PD_ROLES,
        default="prefill",
        help="whose thread count to pass (prefill 8, decode 0 unless configured)",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="select this device first"
    )
    p.add_argument("--gpu-id", type=int, default=0, help="CUDA device index when --device cuda")
    p.add_argument(
        "--peer",
        default=None,
        metavar="HOST:PORT",
        help="instead: check a prefill worker's bootstrap server at HOST:PORT is reachable, a "
        "NIXL connection to it opens, and which UCX transport a READ from it uses; unset: probe "
        "the local backends",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds each --peer step may take (default %(default)s)",
    )
    p.set_defaults(func=_doctor)
