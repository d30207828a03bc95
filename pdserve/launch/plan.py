"""What ``pdserve up`` starts: each worker's and the router's command line and environment
(ports, roles, tensor-parallel sizes, CPU threads, the engine and router flags passed
through), planned
before any process starts."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pdserve import envs
from pdserve.disagg.base import PD_ROLES, Role
from pdserve.launch.supervisor import Child
from pdserve.server.engine_args import engine_argv

# The router's tuning flags that ``up`` takes (as ``pdserve router``'s ``ROUTER_FLAGS``
# declares them) and puts on its router's command line.
UP_ROUTER_FLAGS = (
    "--request-timeout",
    "--health-check-interval",
    "--health-check-timeout",
    "--health-failure-threshold",
    "--max-migrations",
    "--migration-wait",
    "--pd-min-prefill-tokens",
)


def on_cpu(args: argparse.Namespace) -> bool:
    """Whether the workers run on CPU (``--device cpu``, or ``auto`` without CUDA)."""
    if args.device == "auto":
        import torch

        return not torch.cuda.is_available()
    return args.device == "cpu"


def cpu_threads_plan(
    num_cpu_workers: int, environ: Mapping[str, str]
) -> tuple[int | None, dict[str, str]]:
    """Threads per CPU worker and the environment of every child.

    Co-located torch processes spinning OpenMP threads against each other slow a CPU
    matmul many times over (docs/benchmarks.md, "Notes moved from model/server/router
    docstrings"); each CPU worker therefore gets
    ``max(1, os.cpu_count() // num_cpu_workers)`` threads (None: leave torch's default,
    because the user set ``OMP_NUM_THREADS`` or no worker runs on CPU) and the children
    ``OMP_WAIT_POLICY=PASSIVE`` (idle threads sleep) unless the user set it.
    """
    env = dict(environ)
    if envs.OMP_WAIT_POLICY.name not in env:
        env[envs.OMP_WAIT_POLICY.name] = "PASSIVE"
    if num_cpu_workers < 1 or envs.OMP_NUM_THREADS.name in environ:
        return None, env
    return max(1, (os.cpu_count() or 1) // num_cpu_workers), env


def role_tp(args: argparse.Namespace, role: str) -> int:
    """Tensor-parallel size of ``role``'s workers: ``--{role}-tp`` or
    ``--tensor-parallel-size``.  ValueError naming the flag when < 1."""
    value = getattr(args, f"{role}_tp")
    if value is None:
        return int(args.tensor_parallel_size)
    if value < 1:
        raise ValueError(f"--{role}-tp must be >= 1, got {value}")
    return int(value)


def check_models(args: argparse.Namespace) -> None:
    """Resolve ``--model`` (and ``--speculative-model`` when given) to their configs, as
    every worker will, before any process starts: ValueError naming the model when it is
    not an existing folder, ``.gguf`` file, random preset or the embedded model id (read
    from its config or metadata alone; a folder must also list ``*.safetensors`` files).
    A model whose config resolves but whose weights do not load still fails in the
    workers, with their log's excerpt."""
    from pdserve.model.loader import model_config

    model_config(args.model, weights=True)
    draft = getattr(args, "speculative_model", None)
    if draft:
        model_config(draft, weights=True)


def check_tp_sizes(args: argparse.Namespace) -> None:
    """ValueError naming the flag and the valid sizes when a role's tensor-parallel size
    (:func:`role_tp`) does not split ``--model`` (checked on its config alone, before any
    worker loads weights; TP=1 needs no check).  Raises the model's own ValueError when it
    cannot be resolved."""
    tp = {role: role_tp(args, role) for role in PD_ROLES}
    if max(tp.values()) == 1:
        return
    from pdserve.model.loader import model_config
    from pdserve.model.shapes import valid_tp_sizes

    valid = valid_tp_sizes(model_config(args.model))
    for role, size in tp.items():
        if size not in valid:
            flag = (
                f"--{role}-tp"
                if getattr(args, f"{role}_tp") is not None
                else "--tensor-parallel-size"
            )
            raise ValueError(
                f"{flag} {size}: model {args.model} cannot be split over {size} "
                f"tensor-parallel ranks; valid sizes: {', '.join(map(str, valid))}"
            )


def plan_children(args: argparse.Namespace, log_dir: Path) -> tuple[list[Child], Child]:
    """The workers (``--num-prefill`` prefill then ``--num-decode`` decode, each on a free
    port of ``--host``, with the engine flags passed through) and the router that
    ``pdserve up`` starts, not started; each child logs to ``log_dir/<name>.log`` (a PD
    worker's UCX report goes there too, unless ``PDSERVE_UCX_LOG_DIR`` is set).
    ValueError naming the flag for a bad ``--num-threads`` or tensor-parallel size."""
    from pdserve.http.netutil import free_port

    py = [sys.executable, "-m", "pdserve"]
    passthrough = engine_argv(args)
    tp = {role: role_tp(args, role) for role in PD_ROLES}
    # Every rank is a torch process: the CPU threads are shared over all of them.
    ranks = args.num_prefill * tp[Role.PREFILL] + args.num_decode * tp[Role.DECODE]
    threads, env = cpu_threads_plan(ranks if on_cpu(args) else 0, os.environ)
    # UCX's report of a worker that dies stays beside its log (removed with a clean stop's)
    env.setdefault(envs.UCX_LOG_DIR.name, str(log_dir))
    if args.num_threads < 0:
        raise ValueError(f"--num-threads must be >= 0, got {args.num_threads}")
    if args.num_threads > 0:
        threads = args.num_threads  # the user's count wins over the plan
    if threads is not None:
        passthrough += ["--num-threads", str(threads)]
    if args.strict_request_fields:
        passthrough.append("--strict-request-fields")
    if args.served_model_name is not None:
        passthrough += ["--served-model-name", args.served_model_name]
    # flags the workers and the router both get (the same collector for all of them)
    shared = ["--max-request-body-bytes", str(args.max_request_body_bytes)]
    shared += ["--request-read-timeout", str(args.request_read_timeout)]
    if args.otlp_traces_endpoint:
        shared += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    passthrough += shared
    workers: list[Child] = []
    for role, count in ((Role.PREFILL, args.num_prefill), (Role.DECODE, args.num_decode)):
        gpu_ids = getattr(args, f"{role}_gpu_ids")
        for i in range(count):
            port = free_port(args.host)
            argv = py + [
                "serve",
                "--role",
                str(role),
                "--host",
                args.host,
                "--port",
                str(port),
                "--disaggregation-transfer-backend",
                args.transfer_backend,
                *passthrough,
            ]
            if gpu_ids:
                argv += ["--gpu-id", str(gpu_ids[i % len(gpu_ids)])]  # the last --gpu-id wins
            argv += ["--tensor-parallel-size", str(tp[role])]  # the last one wins
            if role == Role.PREFILL:
                argv += [
                    "--disaggregation-bootstrap-host",
                    args.host,
                    "--disaggregation-bootstrap-port",
                    "0",
                ]
            workers.append(
                Child(
                    f"{role}-{i}",
                    f"http://{args.host}:{port}",
                    argv,
                    log_dir / f"{role}-{i}.log",
                    env=env,
                )
            )
    router_argv = py + [
        "router",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--policy",
        args.policy,
        *shared,
    ]
    for flag in UP_ROUTER_FLAGS:
        router_argv += [flag, str(getattr(args, flag[2:].replace("-", "_")))]
    for w in workers:
        router_argv += ["--prefill" if w.name.startswith("prefill") else "--decode", w.url]
    router = Child(
        "router", f"http://{args.host}:{args.port}", router_argv, log_dir / "router.log", env=env
    )
    return workers, router
