"""``pdserve bench router``: what the router adds, against stub workers that answer at once.

Processes (all on this machine): a stub prefill and a stub decode worker (one asyncio
process each: a minimal HTTP/1.1 server answering ``/health``, ``/get_server_info`` as its
role and ``POST /v1/completions`` with a fixed one-token completion, keep-alive, no
model), and one real ``pdserve router`` process over them (PD mode, every request through
both legs: ``--pd-min-prefill-tokens 0`` unless a ``--router-arg`` sets it). The load
comes from this process through raw keep-alive HTTP/1.1 connections (a fixed request, the
answer read by its ``Content-Length``), so the client costs as little as it can on both
paths.

Two measurements:

- ``latency``: open-loop arrivals at ``--rate`` requests/s for ``--seconds`` seconds,
  alternating the decode stub asked directly and the router (one run, so both see the same
  machine); each request's latency; the router's added latency is the difference of the
  two paths' percentiles (p50, p99).
- ``throughput``: ``--concurrency`` connections each sending its next non-streamed request
  as soon as the last answered, for ``--seconds`` seconds, to the router: requests/s of one
  router process (and to the decode stub directly: the stub's own ceiling); also the
  router's CPU time per request (``/proc``), which other load on a shared machine leaves
  as it is (``req_per_cpu_s``: the rate one router process could reach on a core of its
  own).

JSON on stdout (and under ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.cli import positive

BODY = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
ANSWER = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 0,
        "model": "stub",
        "choices": [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "total_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
).encode()


# --- the stub worker -----------------------------------------------------------------------
def _response(body: bytes, status: str = "200 OK") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _stub(role: str, port: int, bootstrap_port: int) -> None:
    info: dict[str, str | int] = {"role": role, "served_model_name": "stub"}
    if role == "prefill":
        info |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port}
    answers = {
        b"/health": _response(b'{"status":"ok"}'),
        b"/get_server_info": _response(json.dumps(info).encode()),
        b"/v1/completions": _response(ANSWER),
    }

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                if length:
                    await reader.readexactly(length)
                writer.write(answers.get(path) or _response(b"{}", "404 Not Found"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# --- the load ------------------------------------------------------------------------------
class Conn:
    """One keep-alive HTTP/1.1 connection sending the bench's request."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self) -> float:
        """One request; its latency in seconds. RuntimeError for a non-200 answer."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        start = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        body = await self.reader.readexactly(length)
        elapsed = time.perf_counter() - start
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"port {self.port} answered {head[:40]!r}: {body[:200]!r}")
        return elapsed

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Pool:
    """Idle connections to one port, opened as needed."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[Conn] = []

    async def send(self) -> float:
        conn = self.idle.pop() if self.idle else Conn(self.port)
        try:
            took = await conn.send()
        except BaseException:
            conn.close()
            raise
        self.idle.append(conn)
        return took

    def close(self) -> None:
        for conn in self.idle:
            conn.close()


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


async def latency(direct_port: int, router_port: int, rate: float, seconds: float) -> dict:
    """Open-loop arrivals at ``rate``/s, alternating the two paths; percentiles in ms."""
    pools = {"direct": Pool(direct_port), "router": Pool(router_port)}
    for pool in pools.values():  # warm the connections and the router's own pool
        for _ in range(20):
            await pool.send()
    times: dict[str, list[float]] = {"direct": [], "router": []}
    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)

    async def one(path: str) -> None:
        times[path].append(await pools[path].send())

    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one("router" if i % 2 else "direct")))
    await asyncio.gather(*tasks)
    for pool in pools.values():
        pool.close()
    out: dict[str, Any] = {"rate": rate, "requests": n}
    for path, values in times.items():
        out[path] = {"p50_ms": _ms(values, 0.5), "p99_ms": _ms(values, 0.99)}
    out["added_p50_ms"] = round(out["router"]["p50_ms"] - out["direct"]["p50_ms"], 3)
    out["added_p99_ms"] = round(out["router"]["p99_ms"] - out["direct"]["p99_ms"], 3)
    return out


async def throughput(port: int, concurrency: int, seconds: float) -> dict:
    """Closed loop: ``concurrency`` connections back to back for ``seconds``."""
    done = 0
    stop = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal done
        conn = Conn(port)
        try:
            while time.perf_counter() < stop:
                await conn.send()
                done += 1
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": done, "req_per_s": round(done / elapsed, 1)}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the command ---------------------------------------------------------------------------
def _free_port() -> int:
    from pdserve.http.netutil import free_port

    return free_port("127.0.0.1")


def _wait_port(
    port: int,
    path: str = "/health",
    timeout: float = 60.0,
    proc: subprocess.Popen | None = None,
    name: str = "",
) -> None:
    """Until ``GET path`` on ``port`` answers 200. RuntimeError after ``timeout`` s, or at
    once when ``proc`` (the process that should serve there, called ``name``) exited."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"the {name or 'process'} exited with code {proc.returncode} before serving "
                "(its error is above)"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing healthy on port {port} after {timeout:g} s")
        time.sleep(0.1)


def run(args: argparse.Namespace) -> dict:
    """Start the stubs and the router, measure, stop them; the report."""
    ports = {"prefill": _free_port(), "decode": _free_port(), "router": _free_port()}
    py = [sys.executable, "-m", "pdserve.bench.router", "--stub"]
    procs = [
        subprocess.Popen([*py, role, str(ports[role]), str(_free_port())])
        for role in ("prefill", "decode")
    ]
    router_argv = [
        sys.executable,
        "-m",
        "pdserve",
        "router",
        "--port",
        str(ports["router"]),
        "--prefill",
        f"http://127.0.0.1:{ports['prefill']}",
        "--decode",
        f"http://127.0.0.1:{ports['decode']}",
        # both legs for every request, as before selective PD's default (the figures of
        # docs/benchmarks.md are PD's); a --router-arg may set another threshold
        "--pd-min-prefill-tokens",
        "0",
        *args.router_arg,
    ]
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    procs.append(subprocess.Popen(router_argv, env=env, stdout=subprocess.DEVNULL))
    try:
        for i, role in enumerate(("prefill", "decode", "router")):
            _wait_port(ports[role], proc=procs[i], name=f"{role} process")
        report: dict[str, Any] = {"router_argv": router_argv[3:]}
        report["latency"] = asyncio.run(
            latency(ports["decode"], ports["router"], args.rate, args.seconds)
        )
        cpu_before = _cpu_seconds(procs[-1].pid)
        report["throughput_router"] = asyncio.run(
            throughput(ports["router"], args.concurrency, args.seconds)
        )
        cpu = _cpu_seconds(procs[-1].pid) - cpu_before
        done = report["throughput_router"]["requests"]
        # the router's own CPU time per request (user + system, from /proc): what a
        # shared machine's other load does not change, unlike the wall-clock rates
        report["throughput_router"]["router_cpu_ms_per_request"] = round(
            1000 * cpu / max(done, 1), 3
        )
        report["throughput_router"]["req_per_cpu_s"] = round(done / cpu, 1) if cpu else None
        report["throughput_stub"] = asyncio.run(
            throughput(ports["decode"], args.concurrency, args.seconds)
        )
        report["cpu_count"] = os.cpu_count()
        return report
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def main(args: argparse.Namespace) -> int:
    if args.json and not Path(args.json).resolve().parent.is_dir():
        print(f"pdserve bench router: --json {args.json}: no such folder", file=sys.stderr)
        return 2
    try:
        report = run(args)
    except RuntimeError as exc:
        print(f"pdserve bench router: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``pdserve bench router``."""
    p = subparsers.add_parser(
        "router",
        help="the router's added latency and requests/s against stub workers",
        description="Start a stub prefill and a stub decode worker (answering at once, no "
        "model) and one pdserve router over them; report the router's added latency "
        "(direct vs through the router, open loop at --rate) and its non-streamed "
        "requests/s (closed loop at --concurrency).",
    )
    p.add_argument(
        "--rate", type=positive(float), default=100.0, help="arrivals per second (latency)"
    )
    p.add_argument(
        "--seconds", type=positive(float), default=5.0, help="length of each measurement"
    )
    p.add_argument(
        "--concurrency",
        type=positive(int),
        default=32,
        help="connections of the throughput run",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra argument of the router's command line (repeat)",
    )
    p.add_argument(
        "--json",
        "--out",
        dest="json",
        metavar="FILE",
        help="also write the JSON report to this file (--out: the same); unset: stdout only",
    )
    p.set_defaults(func=main)
    return p


if __name__ == "__main__":  # the stub worker: --stub ROLE PORT BOOTSTRAP_PORT
    if len(sys.argv) == 5 and sys.argv[1] == "--stub":
        asyncio.run(_stub(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
