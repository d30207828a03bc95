"""A PD deployment over three namespace "hosts" (tests/net/netns.py): prefill, decode and
a router each in their own, plus a mixed worker (the reference) next to the router.

Every process listens on its host's address or on 0.0.0.0 with fixed ports (each
namespace has its own network stack, so nothing clashes); the router reaches the workers
by DNS name (``prefill.pdnet.test``, from ``/etc/netns/<ns>/hosts``). The test process
reaches everything over the root namespace's veth.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import netns
import pytest

from pdserve_procs import TINY, Proc, stop, wait_healthy

WORKER_PORT, MIXED_PORT, ROUTER_PORT, BOOTSTRAP_PORT = 30000, 30001, 8000, 8998
TCP_ONLY = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


def spawn_in(host: netns.Host, name: str, args: list[str], url: str, log_dir: Path, env: dict):
    """``python -m pdserve <args>`` inside ``host``'s namespace (own process group)."""
    log_path = log_dir / f"{name}.log"
    full_env = dict(
        __import__("os").environ,
        PDSERVE_LOG_LEVEL="INFO",
        PDSERVE_UCX_LOG_DIR=str(log_dir),  # a worker a test kills leaves its UCX report there
        **env,
    )
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            host.argv(sys.executable, "-m", "pdserve", *args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )
    return Proc(name, url, popen, log_path)


@contextmanager
def pd_cluster(log_dir: Path, ucx_env: dict[str, str], *, advertise_dns: bool):
    """Yield ``{"topo", "prefill", "decode", "mixed", "router", "procs"}``; on exit stop
    every process, remove the namespaces and check nothing is left.

    advertise_dns: prefill advertises its DNS name (explicit --disaggregation-advertise-host)
    instead of letting the 0.0.0.0 listener find its address.
    """
    reason = netns.problem()
    if reason is not None:
        pytest.fail(f"network namespaces cannot be created here, so this test cannot run: {reason}")
    topo = netns.Topology(("prefill", "decode", "router"))
    procs: list[Proc] = []
    with topo:
        p, d, r = (topo.hosts[n] for n in ("prefill", "decode", "router"))
        advertise = ["--disaggregation-advertise-host", p.dns_name] if advertise_dns else []
        common = ["--model", TINY, "--port", str(WORKER_PORT)]
        try:
            prefill = spawn_in(
                p,
                "prefill",
                ["serve", "--role", "prefill", *common, "--host", "0.0.0.0"]
                + ["--disaggregation-bootstrap-host", "0.0.0.0"]
                + ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT), *advertise],
                f"http://{p.address}:{WORKER_PORT}",
                log_dir,
                ucx_env,
            )
            procs.append(prefill)
            decode = spawn_in(
                d,
                "decode",
                ["serve", "--role", "decode", *common, "--host", "0.0.0.0"],
                f"http://{d.address}:{WORKER_PORT}",
                log_dir,
                ucx_env,
            )
            procs.append(decode)
            mixed = spawn_in(
                r,
                "mixed",
                ["serve", "--role", "mixed", "--model", TINY, "--host", r.address]
                + ["--port", str(MIXED_PORT)],
                f"http://{r.address}:{MIXED_PORT}",
                log_dir,
                {},
            )
            procs.append(mixed)
            router = spawn_in(
                r,
                "router",
                ["router", "--host", r.address, "--port", str(ROUTER_PORT)]
                + ["--prefill", f"http://{p.dns_name}:{WORKER_PORT}"]
                + ["--decode", f"http://{d.dns_name}:{WORKER_PORT}"]
                + ["--health-check-interval", "0.5", "--health-failure-threshold", "1"]
                # one decode: a stream it dropped has nowhere to move; end it within 1 s
                + ["--migration-wait", "1"]
                # the KV crosses the network for every prompt, short ones too
                + ["--pd-min-prefill-tokens", "0"],
                f"http://{r.address}:{ROUTER_PORT}",
                log_dir,
                {},
            )
            procs.append(router)
            wait_healthy(procs)
            yield {
                "topo": topo,
                "prefill": prefill,
                "decode": decode,
                "mixed": mixed,
                "router": router,
                "procs": procs,
            }
        finally:
            stop(procs)
    left = topo.leftovers()
    assert not left, f"namespaces/veths left behind: {left}"


def run_in(host: netns.Host, *cmd: str, env: dict | None = None, timeout: float = 120):
    """Run ``cmd`` in ``host``'s namespace; CompletedProcess with text output."""
    full_env = dict(__import__("os").environ, **(env or {}))
    return subprocess.run(
        host.argv(*cmd), capture_output=True, text=True, timeout=timeout, env=full_env
    )
