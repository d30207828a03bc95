"""``pdserve serve``: one worker process (role mixed, prefill or decode)."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import envs
from pdserve.cli import port_number
from pdserve.config import DisaggConfig, EngineConfig, ServerConfig, default_of
from pdserve.disagg.base import Role
from pdserve.disagg.registry import backend_names
from pdserve.server.engine_args import add_engine_args, engine_config_from_args

log = logging.getLogger("pdserve.server")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``pdserve serve``."""
    s = lambda name: default_of(ServerConfig, name)  # noqa: E731
    d = lambda name: default_of(DisaggConfig, name)  # noqa: E731
    p = subparsers.add_parser(
        "serve",
        help="run one worker (mixed, prefill or decode)",
        description="A worker: OpenAI-compatible API, native /generate, health and "
        "metrics over one engine. Prefill/decode workers take part in PD "
        "disaggregation behind `pdserve router`.",
    )
    p.add_argument(
        "--role",
        type=Role,
        choices=tuple(Role),
        default=d("role"),
        help="mixed serves whole requests; prefill/decode serve one half each (default %(default)s)",
    )
    p.add_argument("--host", default=s("host"), help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port",
        type=port_number,
        default=s("port"),
        help="port to listen on; 0 = a free one (default %(default)s)",
    )
    p.add_argument(
        "--served-model-name",
        default=s("served_model_name"),
        help="model name of the OpenAI API; unset: the --model value",
    )
    p.add_argument(
        "--disaggregation-bootstrap-host",
        default=d("bootstrap_host"),
        help="address a prefill worker's bootstrap server and ZMQ control endpoint listen on; "
        "0.0.0.0 = every interface (default %(default)s)",
    )
    p.add_argument(
        "--disaggregation-advertise-host",
        default=d("advertise_host"),
        help="address (IP or DNS name) decode peers and the router use to reach this prefill "
        "worker; unset: the bootstrap host, or for 0.0.0.0 this host's address on the network",
    )
    p.add_argument(
        "--disaggregation-bootstrap-port",
        type=port_number,
        default=d("bootstrap_port"),
        help="port of a prefill worker's bootstrap server; 0 = a free one, reported by "
        "/get_server_info (default %(default)s)",
    )
    p.add_argument(
        "--disaggregation-transfer-backend",
        choices=backend_names(),
        default=d("transfer_backend"),
        help="KV transfer backend of prefill/decode workers (default %(default)s)",
    )
    p.add_argument(
        "--health-generate-timeout",
        type=float,
        default=s("health_generate_timeout"),
        help="seconds /health_generate waits for its generation (default %(default)s)",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=s("num_threads"),
        help="torch CPU threads of this worker, set before the model loads; 0 = torch's default "
        "(OMP_NUM_THREADS or all cores) (default %(default)s)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=s("max_request_body_bytes"),
        help="largest request body accepted, in bytes; 413 above (default %(default)s)",
    )
    add_strict_fields_arg(p)
    add_engine_args(p)
    p.set_defaults(func=main)
    return p


def add_strict_fields_arg(p: argparse.ArgumentParser) -> None:
    """``--strict-request-fields`` (``serve`` and ``up``, which passes it to its workers)."""
    p.add_argument(
        "--strict-request-fields",
        action="store_true",
        default=default_of(ServerConfig, "strict_request_fields"),
        help="answer 400 for an unknown request field; unset: ignore it with a warning and "
        "count it in pdserve_ignored_request_fields_total",
    )


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig, DisaggConfig]:
    """The three configs of a worker; ValueError naming the field when a flag is invalid."""
    return (
        engine_config_from_args(args),
        ServerConfig(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            health_generate_timeout=args.health_generate_timeout,
            num_threads=args.num_threads,
            max_request_body_bytes=args.max_request_body_bytes,
            strict_request_fields=args.strict_request_fields,
        ),
        DisaggConfig(
            role=args.role,
            transfer_backend=args.disaggregation_transfer_backend,
            bootstrap_host=args.disaggregation_bootstrap_host,
            bootstrap_port=args.disaggregation_bootstrap_port,
            advertise_host=args.disaggregation_advertise_host,
        ),
    )


def main(args: argparse.Namespace) -> int:
    from pdserve.http.netutil import PortInUseError, bind_socket, configure_logging, serve_app

    configure_logging(envs.LOG_LEVEL.get())
    try:
        engine_cfg, server_cfg, disagg_cfg = configs_from_args(args)
        sock = bind_socket(server_cfg.host, server_cfg.port)
    except (ValueError, PortInUseError) as exc:
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    print(f"pdserve worker ({disagg_cfg.role}) loading {engine_cfg.model.model} ...", flush=True)
    from pdserve.server.worker import build_worker

    try:
        app, info = build_worker(engine_cfg, server_cfg, disagg_cfg)
    except (ValueError, OSError) as exc:  # bad model/device, taken bootstrap port, init timeout
        print(f"pdserve serve: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. the transfer backend cannot start: one readable line
        log.debug("start-up failed", exc_info=True)
        print(
            f"pdserve serve: error: {type(exc).__name__}: {exc} (PDSERVE_LOG_LEVEL=DEBUG for the traceback)",
            file=sys.stderr,
        )
        return 1
    extra = f", bootstrap port {info['bootstrap_port']}" if info.get("bootstrap_port") else ""
    print(
        f"pdserve worker ({disagg_cfg.role}) serving {info['served_model_name']} on "
        f"http://{server_cfg.host}:{port}{extra}",
        flush=True,
    )
    serve_app(app, sock, log_level=envs.LOG_LEVEL.get())
    return 0
