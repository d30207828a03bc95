"""``pdserve up``: start N prefill + M decode workers and the router on this machine, wait
until all are ready (with a progress line while the model loads), print the URL and a
``curl`` example; then keep them serving: a child that dies is restarted with a backoff
while the others go on (the router finds it again through its health checks), saying so;
everything stops on Ctrl-C / SIGTERM, when a child dies before all were ready, or when one
child's restarts keep failing (``--max-restarts``)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bounds import flag_message
from pdserve.cli import Flag, add_flags, flag_values, int_list, port_number, positive
from pdserve.config import ROUTER_POLICIES, RouterConfig, ServerConfig
from pdserve.disagg.base import PD_ROLES
from pdserve.disagg.registry import backend_names
from pdserve.launch.plan import (
    UP_ROUTER_FLAGS,
    check_models,
    check_tp_sizes,
    plan_children,
    role_tp,
)
from pdserve.launch.supervisor import Child, Restarts, stop_all
from pdserve.process_exit import death_cause
from pdserve.router.launch import ROUTER_FLAGS
from pdserve.server.engine_args import add_engine_args, engine_config_from_args
from pdserve.server.launch import STRICT_FIELDS_FLAG


class _Stop(Exception):
    """SIGTERM/SIGINT arrived."""


# ``up``'s own flags, in --help order (the router's tuning flags and the engine's follow).
UP_FLAGS: tuple[Flag, ...] = (
    Flag("--num-prefill", "prefill workers", int, default=1),
    Flag("--num-decode", "decode workers", int, default=1),
    Flag("--host", "address of the router and the workers", cls=RouterConfig),
    Flag(
        "--port",
        "router port; 0 = a free one (the URL printed names it); fails at once if it is taken",
        port_number,
        cls=RouterConfig,
    ),
    Flag("--policy", "router policy", cls=RouterConfig, choices=ROUTER_POLICIES),
    Flag(
        "--transfer-backend",
        "KV transfer backend of the workers",
        default="nixl",
        choices=backend_names(),
    ),
    Flag(
        "--prefill-gpu-ids",
        "comma-separated CUDA device indices, one per prefill worker (cycled); unset: --gpu-id",
        int_list,
        metavar="IDS",
    ),
    Flag(
        "--decode-gpu-ids",
        "comma-separated CUDA device indices, one per decode worker (cycled); unset: --gpu-id",
        int_list,
        metavar="IDS",
    ),
    *(
        Flag(
            f"--{role}-tp",
            f"tensor-parallel size of each {role} worker (its ranks on --gpu-id + rank, "
            f"or from its --{role}-gpu-ids entry on); unset: --tensor-parallel-size",
            int,
            metavar="N",
        )
        for role in PD_ROLES
    ),
    Flag(
        "--ready-timeout",
        "seconds to wait for every process to become ready",
        positive(float),
        default=900.0,
    ),
    Flag(
        "--max-restarts",
        "restarts in a row of one process that died after start-up (the others keep "
        "serving meanwhile); its next death stops everything; 0 = the first death stops "
        "everything",
        int,
        default=4,
    ),
    Flag(
        "--restart-backoff",
        "seconds before the first restart of a process that died; doubled for each further "
        "death in a row, at most 30 (the count starts over once it served 60 s)",
        float,
        default=1.0,
    ),
    Flag(
        "--log-dir",
        "where each process writes its log, <name>.log (e.g. prefill-0.log), started "
        "fresh each run (an earlier run's log of that name is replaced); unset: a new "
        "temporary folder, removed when pdserve stops cleanly and kept (its path printed) "
        "when a process failed",
    ),
    Flag(
        "--served-model-name",
        "model name of the workers' OpenAI API; unset: the --model value",
        cls=ServerConfig,
    ),
    Flag(
        "--num-threads",
        "torch CPU threads of each worker; 0 = the cores shared over the CPU workers' "
        "ranks (none set when OMP_NUM_THREADS is)",
        int,
        default=0,
    ),
    Flag(
        "--max-request-body-bytes",
        "largest request body the router and the workers accept, in bytes; 413 above",
        int,
        cls=ServerConfig,
    ),
    Flag(
        "--request-read-timeout",
        "seconds a request's line and headers may take to arrive at the router or a "
        "worker, and its body may pause between two reads; then 408 and the connection "
        "is closed",
        float,
        cls=ServerConfig,
    ),
    STRICT_FIELDS_FLAG,
    Flag(
        "--otlp-traces-endpoint",
        "OTLP/HTTP collector URL (e.g. http://127.0.0.1:4318) that gets the traces of the "
        "router and of every worker (one trace per request, spans from each process); "
        "unset: tracing off",
        cls=RouterConfig,
        metavar="URL",
    ),
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``pdserve up``."""
    p = subparsers.add_parser(
        "up",
        help="start prefill + decode workers and a router on this machine",
        description="Start --num-prefill prefill workers, --num-decode decode workers and "
        "a router on free ports of this machine; a process that dies is restarted while the "
        "others keep serving; Ctrl-C stops them all.",
    )
    add_flags(p, UP_FLAGS)
    add_flags(p, [f for f in ROUTER_FLAGS if f.flag in UP_ROUTER_FLAGS], "router")
    add_engine_args(p)
    p.set_defaults(func=main)
    return p


def _check_router_flags(args: argparse.Namespace) -> None:
    """The router's flags that ``up`` passes on, checked as the router will check them
    (``RouterConfig``), before any process starts: ValueError naming the field."""
    from pdserve.config import RouterConfig

    flags = [f for f in ROUTER_FLAGS if f.flag in UP_ROUTER_FLAGS]
    RouterConfig(
        prefill_urls=("http://127.0.0.1:1",),  # placeholders: up plans the real ones
        decode_urls=("http://127.0.0.1:2",),
        **flag_values(args, flags, RouterConfig),
    )


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _check_children(children: list[Child]) -> None:
    for child in children:
        code = child.exit_code()
        if code is not None:
            # The tail is this run's (fresh log files), but its last lines need not be the
            # cause (e.g. a tensor-parallel rank's or a warning): label it as what it is.
            raise RuntimeError(
                f"{child.name} (pid {child.pid}) {death_cause(code)}; stopping everything.\n"
                f"  last lines of its log {child.log_path} (not necessarily the cause):\n"
                f"{child.log_tail()}"
            )


def _wait_ready(
    children: list[Child], everyone: list[Child], timeout: float, *, quiet: bool = False
) -> None:
    """Poll ``children``'s /health until all answer 200, printing progress; RuntimeError
    if any of ``everyone`` exits or the timeout passes."""
    start = time.monotonic()
    tty = sys.stdout.isatty()
    last_line = ""
    with httpx.Client() as client:
        while True:
            _check_children(everyone)
            states = {c.name: _healthy(client, c.url) for c in children}
            elapsed = time.monotonic() - start
            line = f"waiting for pdserve ({elapsed:4.0f} s): " + ", ".join(
                f"{name} {'ready' if ok else 'loading'}" for name, ok in states.items()
            )
            if quiet:
                pass
            elif tty:
                print("\r" + line, end="", flush=True)
            elif line.split(": ", 1)[1] != last_line:  # logs: print only when something changed
                print(line, flush=True)
                last_line = line.split(": ", 1)[1]
            if all(states.values()):
                if tty and not quiet:
                    print()
                return
            if elapsed > timeout:
                waiting = [n for n, ok in states.items() if not ok]
                raise RuntimeError(
                    f"not ready after {timeout:g} s: {', '.join(waiting)} (logs in "
                    f"{children[0].log_path.parent}); stopping everything."
                )
            time.sleep(0.5)


def _banner(args: argparse.Namespace, workers: list[Child], router: Child) -> str:
    """What ``up`` prints once everything is ready: the URL, the model name the API takes
    (``--served-model-name``, else ``--model``; the weights too when they differ), each
    process, and a ``curl`` and a Python (official ``openai`` client) example naming that
    model, both of which work as printed."""
    url = router.url
    name = args.served_model_name or args.model
    model = name if name == args.model else f"{name}, weights {args.model}"
    body = {
        "model": name,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 64,
        "temperature": 0,
    }
    lines = [
        f"pdserve is ready at {url}  (model {model}; "
        f"{args.num_prefill} prefill + {args.num_decode} decode, KV over {args.transfer_backend})"
    ]
    lines += [
        f"  {c.name:<10} pid {c.pid:<8} {c.url}  tp {role_tp(args, c.name.split('-')[0])}"
        for c in workers
    ]
    lines.append(f"  {router.name:<10} pid {router.pid:<8} {router.url}")
    lines += [
        f"  logs in {router.log_path.parent}",
        "",
        "Try:",
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d {shlex.quote(json.dumps(body))}",
        "",
        "or in Python, with the official openai client:",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{url}/v1", api_key="unused")',
        f"  reply = client.chat.completions.create(model={json.dumps(name)}, max_tokens=64,",
        '      messages=[{"role": "user", "content": "Name three colours."}], temperature=0)',
        "  print(reply.choices[0].message.content)",
        "",
        "Press Ctrl-C to stop.",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from pdserve.http.netutil import PortInUseError, bind_socket

    if args.num_prefill < 1 or args.num_decode < 1:
        print("pdserve up: error: --num-prefill and --num-decode must be >= 1", file=sys.stderr)
        return 2
    if args.max_restarts < 0 or not args.restart_backoff > 0:
        print(
            "pdserve up: error: --max-restarts must be >= 0 and --restart-backoff > 0",
            file=sys.stderr,
        )
        return 2
    try:  # the flags first: a bad one is named whatever holds the port
        # the rules on the flags alone before the models': resolving a model imports torch
        # and transformers (seconds), and a bad flag is refused without them
        engine_config_from_args(args)  # the rules between flags, as each worker checks them
        ServerConfig(**flag_values(args, UP_FLAGS, ServerConfig))  # as the workers will
        _check_router_flags(args)
        check_models(args)
        check_tp_sizes(args)
    except ValueError as exc:
        print(f"pdserve up: error: {flag_message(exc, args)}", file=sys.stderr)
        return 2
    try:
        probe = bind_socket(args.host, args.port)  # fail fast, before any model loads
    except PortInUseError as exc:
        hint = f"; choose another with --{exc.flag}" if exc.flag else ""
        print(f"pdserve up: error: router {exc}{hint}", file=sys.stderr)
        return 2
    # --port 0: the router gets the free port the kernel gave the probe (so the URL printed
    # and probed is the one it listens on); the probe holds it while the workers' free
    # ports are planned, so none of them is planned on it.
    args.port = probe.getsockname()[1]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(log_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as exc:  # a file of that name, a read-only or virtual file system
        probe.close()
        print(
            f"pdserve up: error: --log-dir {str(log_dir)!r}: cannot write logs there "
            f"({exc.strerror or exc})",
            file=sys.stderr,
        )
        return 2
    try:
        workers, router = plan_children(args, log_dir)
    except ValueError as exc:  # a bad --num-threads or tensor-parallel size
        if args.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        print(f"pdserve up: error: {flag_message(exc, args)}", file=sys.stderr)
        return 2
    finally:
        probe.close()
    children = workers + [router]

    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1  # whatever ends ``up`` but a signal is a failure (its logs are kept)
    restarts = Restarts(first_s=args.restart_backoff, give_up_after=args.max_restarts + 1)
    try:
        for child in children:
            child.start()
            print(
                f"started {child.name} (pid {child.pid}) on {child.url}, log {child.log_path}",
                flush=True,
            )
        _wait_ready(workers, children, args.ready_timeout)
        _wait_ready([router], children, 60.0, quiet=True)
        print(_banner(args, workers, router), flush=True)
        _supervise(children, restarts)
    except _Stop as exc:
        print(f"\n{exc} received: stopping pdserve ...", flush=True)
        code = 0
    except RuntimeError as exc:
        print(f"\npdserve up: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        stop_all(children)
        for s, handler in old.items():
            signal.signal(s, handler)
        print(
            f"pdserve stopped ({len(children)} processes, pids "
            f"{', '.join(str(c.pid) for c in children if c.proc)}).",
            flush=True,
        )
        died = restarts.total > 0  # its logs show why: keep them
        _keep_or_remove_logs(log_dir, children, 1 if died else code, created=args.log_dir is None)
    return code


def _supervise(children: list[Child], restarts: Restarts) -> None:
    """Keep ``children`` running until a signal (``_Stop``) or until one's restarts keep
    failing (RuntimeError naming it): each round :meth:`Restarts.poll` restarts the dead
    and its lines are printed."""
    with httpx.Client() as client:
        while True:
            lines = restarts.poll(children, lambda c: _healthy(client, c.url), time.monotonic())
            for line in lines:
                print(line, flush=True)
            if restarts.failed:
                raise RuntimeError(restarts.failed)
            time.sleep(0.5)


def _keep_or_remove_logs(log_dir: Path, children: list[Child], code: int, created: bool) -> None:
    """A clean stop (``code`` 0, every child ended by the SIGTERM it was sent, or exited
    0) removes the temporary log folder ``up`` ``created``; otherwise the logs are what
    the user needs to see what failed: they stay, and the last line names the folder."""
    clean = code == 0 and all(
        c.exit_code() in (0, -signal.SIGTERM) for c in children if c.proc is not None
    )
    if clean and created:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif not clean:
        print(f"pdserve up: logs kept in {log_dir}", file=sys.stderr, flush=True)
