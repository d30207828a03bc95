"""``pdserve router``: the router process (PD pairs or regular mode over mixed workers)."""

from __future__ import annotations

import argparse
import sys

from pdserve import envs
from pdserve.cli import port_number
from pdserve.config import ROUTER_POLICIES, RouterConfig, default_of


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``pdserve router``."""
    d = lambda name: default_of(RouterConfig, name)  # noqa: E731
    p = subparsers.add_parser(
        "router",
        help="route requests to prefill/decode pairs or mixed workers",
        description="The router: OpenAI-compatible and native /generate API in front "
        "of prefill/decode worker pairs (PD mode, --prefill and --decode) or "
        "mixed workers (regular mode, --worker).",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="URL of a prefill worker (repeat for several); PD mode",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="URL of a decode worker (repeat for several); PD mode",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="URL of a mixed worker (repeat for several); regular mode",
    )
    p.add_argument("--host", default=d("host"), help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port",
        type=port_number,
        default=d("port"),
        help="port to listen on (default %(default)s)",
    )
    p.add_argument(
        "--policy",
        choices=ROUTER_POLICIES,
        default=d("policy"),
        help="how a worker of each role is picked (default %(default)s)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d("request_timeout"),
        help="seconds one request may take end to end; 504 after (default %(default)s)",
    )
    p.add_argument(
        "--health-check-interval",
        type=float,
        default=d("health_check_interval"),
        help="seconds between health probes of each worker (default %(default)s)",
    )
    p.add_argument(
        "--health-check-timeout",
        type=float,
        default=d("health_check_timeout"),
        help="seconds one health probe may take (default %(default)s)",
    )
    p.add_argument(
        "--health-failure-threshold",
        type=int,
        default=d("health_failure_threshold"),
        help="consecutive failed probes that eject a worker (default %(default)s)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=d("max_request_body_bytes"),
        help="largest request body accepted, in bytes; 413 above (default %(default)s)",
    )
    p.add_argument(
        "--mode",
        choices=("auto", "pd", "regular"),
        default=d("mode"),
        help="auto: PD when --prefill/--decode are given, else regular; pd/regular may start "
        "with no workers when the admin API is on (default %(default)s)",
    )
    p.add_argument(
        "--admin-token-file",
        default=None,
        metavar="PATH",
        help="file holding the bearer token of the admin API (/admin/workers: add, remove, "
        "list workers); unset: PDSERVE_ROUTER_ADMIN_TOKEN, and when that is empty too the "
        "admin API is off",
    )
    p.set_defaults(func=main)
    return p


def admin_token_from_args(args: argparse.Namespace) -> str | None:
    """The admin token: the file's content (stripped), else the environment's, else None.
    ValueError naming the flag when the file cannot be read or is empty."""
    if args.admin_token_file:
        try:
            with open(args.admin_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"--admin-token-file: cannot read it: {exc}") from exc
        if not token:
            raise ValueError(f"--admin-token-file: {args.admin_token_file} is empty")
        return token
    return envs.ROUTER_ADMIN_TOKEN.get() or None


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed flags (ValueError naming the field when invalid)."""
    return RouterConfig(
        prefill_urls=tuple(args.prefill),
        decode_urls=tuple(args.decode),
        worker_urls=tuple(args.worker),
        host=args.host,
        port=args.port,
        policy=args.policy,
        request_timeout=args.request_timeout,
        health_check_interval=args.health_check_interval,
        health_check_timeout=args.health_check_timeout,
        health_failure_threshold=args.health_failure_threshold,
        max_request_body_bytes=args.max_request_body_bytes,
        mode=args.mode,
        admin_token=admin_token_from_args(args),
    )


def main(args: argparse.Namespace) -> int:
    from pdserve.http.netutil import PortInUseError, bind_socket, configure_logging, serve_app
    from pdserve.router.app import build_router_app

    configure_logging(envs.LOG_LEVEL.get())
    try:
        config = config_from_args(args)
        sock = bind_socket(config.host, config.port)
    except (ValueError, PortInUseError) as exc:
        print(f"pdserve router: error: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    mode = (
        f"PD mode, {len(config.prefill_urls)} prefill + {len(config.decode_urls)} decode workers"
        if config.pd_mode
        else f"regular mode, {len(config.worker_urls)} mixed worker"
        + "s" * (len(config.worker_urls) != 1)
    )
    if config.admin_token is not None:
        mode += ", admin API on"
    print(
        f"pdserve router ({mode}, policy {config.policy}) on http://{config.host}:{port}",
        flush=True,
    )
    serve_app(build_router_app(config), sock, log_level=envs.LOG_LEVEL.get())
    return 0
