"""``pdserve serve``: one worker process (role mixed, prefill or decode)."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import envs
from pdserve.bounds import flag_message
from pdserve.cli import Flag, add_flags, flag_values, port_number
from pdserve.config import DisaggConfig, EngineConfig, ServerConfig
from pdserve.disagg.base import Role
from pdserve.disagg.registry import backend_names
from pdserve.server.engine_args import add_engine_args, engine_config_from_args

log = logging.getLogger("pdserve.server")


# ``serve`` and ``up`` (which passes it to its workers).
STRICT_FIELDS_FLAG = Flag(
    "--strict-request-fields",
    "answer 400 for an unknown request field; unset: ignore it with a warning and "
    "count it in pdserve_ignored_request_fields_total",
    bool,
    cls=ServerConfig,
    action="store_true",
)

# The worker's own flags, in --help order (the engine's follow: ``ENGINE_FLAGS``).
SERVE_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--role",
        "mixed serves whole requests; prefill/decode serve one half each",
        str,  # DisaggConfig parses it into a Role; a bad value is a usage error listing these
        cls=DisaggConfig,
        choices=tuple(r.value for r in Role),
    ),
    Flag("--host", "address to listen on", cls=ServerConfig),
    Flag("--port", "port to listen on; 0 = a free one", port_number, cls=ServerConfig),
    Flag(
        "--served-model-name",
        "model name of the OpenAI API; unset: the --model value",
        cls=ServerConfig,
    ),
    Flag(
        "--disaggregation-bootstrap-host",
        "address a prefill worker's bootstrap server and ZMQ control endpoint listen on; "
        "0.0.0.0 = every interface",
        cls=DisaggConfig,
        field="bootstrap_host",
    ),
    Flag(
        "--disaggregation-advertise-host",
        "address (IP or DNS name) decode peers and the router use to reach this prefill "
        "worker; unset: the bootstrap host, or for 0.0.0.0 this host's address on the network",
        cls=DisaggConfig,
        field="advertise_host",
    ),
    Flag(
        "--disaggregation-bootstrap-port",
        "port of a prefill worker's bootstrap server; 0 = a free one, reported by /get_server_info",
        port_number,
        cls=DisaggConfig,
        field="bootstrap_port",
    ),
    Flag(
        "--disaggregation-transfer-backend",
        "KV transfer backend of prefill/decode workers",
        cls=DisaggConfig,
        field="transfer_backend",
        choices=backend_names(),
    ),
    Flag(
        "--health-generate-timeout",
        "seconds /health_generate waits for its generation",
        float,
        cls=ServerConfig,
    ),
    Flag(
        "--num-threads",
        "torch CPU threads of this worker, set before the model loads; 0 = torch's default "
        "(OMP_NUM_THREADS or all cores)",
        int,
        cls=ServerConfig,
    ),
    Flag(
        "--max-request-body-bytes",
        "largest request body accepted, in bytes; 413 above",
        int,
        cls=ServerConfig,
    ),
    Flag(
        "--request-read-timeout",
        "seconds a request's line and headers may take to arrive, and its body may "
        "pause between two reads; then 408 and the connection is closed (a slow or "
        "stalled client holds nothing longer)",
        float,
        cls=ServerConfig,
    ),
    STRICT_FIELDS_FLAG,
    Flag(
        "--responses-store-size",
        "most /v1/responses answers kept in memory for GET /v1/responses/{id} and "
        "previous_response_id (the oldest dropped first); 0 keeps none",
        int,
        cls=ServerConfig,
    ),
    Flag(
        "--otlp-traces-endpoint",
        "OTLP/HTTP collector URL (e.g. http://127.0.0.1:4318; /v1/traces is added to a URL "
        "without a path) that gets this worker's traces: a span per request with one child "
        "span per phase; unset: tracing off",
        cls=ServerConfig,
        metavar="URL",
    ),
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``pdserve serve``."""
    p = subparsers.add_parser(
        "serve",
        help="run one worker (mixed, prefill or decode)",
        description="A worker: OpenAI-compatible API, native /generate, health and "
        "metrics over one engine. Prefill/decode workers take part in PD "
        "disaggregation behind `pdserve router`.",
    )
    add_flags(p, SERVE_FLAGS)
    add_engine_args(p)
    p.set_defaults(func=main)
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig, DisaggConfig]:
    """The three configs of a worker; ValueError naming the field when a flag is invalid."""
    return (
        engine_config_from_args(args),
        ServerConfig(**flag_values(args, SERVE_FLAGS, ServerConfig)),
        DisaggConfig(**flag_values(args, SERVE_FLAGS, DisaggConfig)),
    )


def main(args: argparse.Namespace) -> int:
    from pdserve.http.netutil import PortInUseError, bind_socket, configure_logging, serve_app
    from pdserve.supervised import watch_supervisor

    configure_logging(envs.LOG_LEVEL.get())
    watch_supervisor()  # a child of pdserve up stops once up is gone
    try:
        engine_cfg, server_cfg, disagg_cfg = configs_from_args(args)
        sock = bind_socket(server_cfg.host, server_cfg.port)
    except (ValueError, PortInUseError) as exc:
        print(f"pdserve serve: error: {flag_message(exc, args)}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    print(f"pdserve worker ({disagg_cfg.role}) loading {engine_cfg.model.model} ...", flush=True)
    from pdserve.http.loading import answer_503_while_loading
    from pdserve.server.worker import build_worker

    try:
        # the port is bound already: a probe gets 503 "loading" now, not a hung connection
        with answer_503_while_loading(
            sock, f"the {disagg_cfg.role} worker is loading {engine_cfg.model.model}"
        ):
            app, info = build_worker(engine_cfg, server_cfg, disagg_cfg)
    except (ValueError, OSError) as exc:  # bad model/device, taken bootstrap port, init timeout
        print(f"pdserve serve: error: {flag_message(exc, args)}", file=sys.stderr)
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
    serve_app(
        app,
        sock,
        log_level=envs.LOG_LEVEL.get(),
        request_read_timeout=server_cfg.request_read_timeout,
    )
    return 0
