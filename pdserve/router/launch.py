"""``pdserve router``: the router process (PD pairs or regular mode over mixed workers)."""

from __future__ import annotations

import argparse
import sys

from pdserve import envs
from pdserve.bounds import flag_message
from pdserve.cli import Flag, add_flags, flag_values, port_number
from pdserve.config import ROUTER_POLICIES, RouterConfig

# Every router flag, in --help order; ``pdserve up`` takes the tuning ones too.
ROUTER_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--prefill",
        "URL of a prefill worker (repeat for several); PD mode",
        cls=RouterConfig,
        field="prefill_urls",
        metavar="URL",
        action="append",
    ),
    Flag(
        "--decode",
        "URL of a decode worker (repeat for several); PD mode",
        cls=RouterConfig,
        field="decode_urls",
        metavar="URL",
        action="append",
    ),
    Flag(
        "--worker",
        "URL of a mixed worker (repeat for several); regular mode",
        cls=RouterConfig,
        field="worker_urls",
        metavar="URL",
        action="append",
    ),
    Flag("--host", "address to listen on", cls=RouterConfig),
    Flag("--port", "port to listen on", port_number, cls=RouterConfig),
    Flag(
        "--policy", "how a worker of each role is picked", cls=RouterConfig, choices=ROUTER_POLICIES
    ),
    Flag(
        "--request-timeout",
        "seconds one request may take end to end; 504 after",
        float,
        cls=RouterConfig,
    ),
    Flag(
        "--health-check-interval",
        "seconds between health probes of each worker",
        float,
        cls=RouterConfig,
    ),
    Flag("--health-check-timeout", "seconds one health probe may take", float, cls=RouterConfig),
    Flag(
        "--health-failure-threshold",
        "consecutive failed probes that eject a worker",
        int,
        cls=RouterConfig,
    ),
    Flag(
        "--max-request-body-bytes",
        "largest request body accepted, in bytes; 413 above",
        int,
        cls=RouterConfig,
    ),
    Flag(
        "--request-read-timeout",
        "seconds a request's line and headers may take to arrive, and its body may "
        "pause between two reads; then 408 and the connection is closed (a slow or "
        "stalled client holds nothing longer)",
        float,
        cls=RouterConfig,
    ),
    Flag(
        "--max-migrations",
        "times one request may move to another worker after its worker failed: a stream "
        "goes on from the tokens already sent, a non-streamed request is sent again; 0 = "
        "never",
        int,
        cls=RouterConfig,
    ),
    Flag(
        "--migration-wait",
        "seconds a request whose worker failed waits for a healthy one to move to when "
        "there is none (a restarting worker) before it ends with its failure",
        float,
        cls=RouterConfig,
    ),
    Flag(
        "--pd-min-prefill-tokens",
        "selective PD: a request whose uncached prompt part is below this many tokens "
        "runs whole on a decode worker (no prefill leg, no KV transfer); the part is the "
        "prompt's length (token ids counted, text estimated as UTF-8 bytes / 4) less the "
        "leading share that a decode worker holds by the router's index of the prompts "
        "it sent there (that worker takes it); a chat's estimate counts its message "
        "texts, not the chat template; batches of prompts and /v1/responses always go "
        "through PD; 0 = always PD; the default is measured (docs/benchmarks.md, row X: "
        "through PD, 16-token prompts' TTFT p50 was 1.10-1.13 times that of decode alone on CPU)",
        int,
        cls=RouterConfig,
    ),
    Flag(
        "--mode",
        "auto: PD when --prefill/--decode are given, else regular; pd/regular may start "
        "with no workers when the admin API is on",
        cls=RouterConfig,
        choices=("auto", "pd", "regular"),
    ),
    Flag(
        "--admin-token-file",
        "file holding the bearer token of the admin API (/admin/workers: add, remove, "
        "list workers); unset: PDSERVE_ROUTER_ADMIN_TOKEN, and when that is empty too the "
        "admin API is off",
        metavar="PATH",
    ),
    Flag(
        "--otlp-traces-endpoint",
        "OTLP/HTTP collector URL (e.g. http://127.0.0.1:4318; /v1/traces is added to a URL "
        "without a path) that gets the router's traces; the router continues the client's "
        "W3C traceparent (or starts a trace) and passes it to both legs; unset: tracing off",
        cls=RouterConfig,
        metavar="URL",
    ),
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``pdserve router``."""
    p = subparsers.add_parser(
        "router",
        help="route requests to prefill/decode pairs or mixed workers",
        description="The router: OpenAI-compatible and native /generate API in front "
        "of prefill/decode worker pairs (PD mode, --prefill and --decode) or "
        "mixed workers (regular mode, --worker).",
    )
    add_flags(p, ROUTER_FLAGS)
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
    return RouterConfig(**flag_values(args, ROUTER_FLAGS), admin_token=admin_token_from_args(args))


def main(args: argparse.Namespace) -> int:
    from pdserve.gc_watch import process_watch
    from pdserve.http.netutil import PortInUseError, bind_socket, configure_logging, serve_app
    from pdserve.router.app import build_router_app
    from pdserve.supervised import watch_supervisor

    configure_logging(envs.LOG_LEVEL.get())
    watch_supervisor()  # a child of pdserve up stops once up is gone
    try:
        config = config_from_args(args)
        sock = bind_socket(config.host, config.port)
    except (ValueError, PortInUseError) as exc:
        renamed = {f.field: f.flag for f in ROUTER_FLAGS if f.field}  # decode_urls: --decode
        print(f"pdserve router: error: {flag_message(exc, args, renamed)}", file=sys.stderr)
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
    app = build_router_app(config)
    process_watch().freeze()  # start-up is over: a collection walks only what requests make
    serve_app(
        app,
        sock,
        log_level=envs.LOG_LEVEL.get(),
        loop="auto",  # uvloop and httptools (dependencies; the standard ones if absent)
        http="auto",
        request_read_timeout=config.request_read_timeout,
    )
    return 0
