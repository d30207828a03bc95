#!/usr/bin/env python3
"""How late the serve bench's client is: ``bench serve`` against stub servers streaming at a
decode engine's cadence (``pdserve/bench/sse_stub.py``), one directly and one behind a real
``pdserve router``, PD's relay path (``--compare``: the stub directly). Per target, the
median / p99 of ``to_client`` (the server's, or the router's relay's, hand-off of the first
chunk → the client having it), the TTFT, and through the router its hop (the stub's write →
the relay's hand-off). Run from the repository root:

    .venv/bin/python scripts/bench_client_lateness.py [--rate 8] [--num-requests 64]
        [--step-ms 9.4] [--json FILE] [-- extra bench serve flags]

JSON to ``--json`` (and a summary on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(port: int, path: str = "/health", timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"nothing healthy on {port}")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def to_client_ms(req: dict) -> float | None:
    """The first chunk's last server-side write (the router's relay, else the stub) → the
    client having it, ms."""
    timing = req.get("timing") or {}
    block = next(
        (b for b in timing.values() if isinstance(b, dict) and "first_chunk_unix" in b), None
    )
    if block is None or req.get("ttft_ms") is None or not req.get("start_unix"):
        return None
    out = (timing.get("relay") or {}).get("first_chunk_out_unix") or block["first_chunk_unix"]
    return (req["start_unix"] + req["ttft_ms"] / 1e3 - out) * 1e3


def router_hop_ms(req: dict) -> float | None:
    """Through a router: the stub's write of the first chunk → the router's relay handing
    it on (``relay_in`` + ``relay`` of bench serve's stages), ms; None direct."""
    timing = req.get("timing") or {}
    relay = timing.get("relay") or {}
    block = next(
        (b for b in timing.values() if isinstance(b, dict) and "first_chunk_unix" in b), None
    )
    if block is None or not relay.get("first_chunk_out_unix"):
        return None
    return (relay["first_chunk_out_unix"] - block["first_chunk_unix"]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rate", default="8")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=9.4)
    p.add_argument("--prefill-ms", type=float, default=20.0)
    p.add_argument(
        "--direct-head-late",
        action="store_true",
        help="the direct stub writes its head with the first chunk (as the relay)",
    )
    p.add_argument("--json")
    p.add_argument("--serve-json", help="keep bench serve's own JSON here")
    p.add_argument("extra", nargs="*", help="more bench serve flags (after --)")
    args = p.parse_args()
    py = sys.executable
    ports = {k: free_port() for k in ("direct", "decode", "prefill", "router")}
    stub = [
        py,
        "-m",
        "pdserve.bench.sse_stub",
        "--step-ms",
        str(args.step_ms),
        "--prefill-ms",
        str(args.prefill_ms),
    ]
    procs = [
        subprocess.Popen(
            [*stub, "--port", str(ports["direct"]), "--role", "mixed"]
            + ([] if args.direct_head_late else ["--head-early"])
        ),
        subprocess.Popen([*stub, "--port", str(ports["decode"]), "--role", "decode"]),
        subprocess.Popen([*stub, "--port", str(ports["prefill"]), "--role", "prefill"]),
    ]
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    procs.append(
        subprocess.Popen(
            [
                py,
                "-m",
                "pdserve",
                "router",
                "--port",
                str(ports["router"]),
                "--prefill",
                f"http://127.0.0.1:{ports['prefill']}",
                "--decode",
                f"http://127.0.0.1:{ports['decode']}",
                "--pd-min-prefill-tokens",
                "100000000",
            ],  # every request whole to the decode stub
            env=env,
            stdout=subprocess.DEVNULL,
        )
    )
    try:
        for k in ports:
            wait(ports[k])
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "serve.json")
            cmd = [
                py,
                "-m",
                "pdserve",
                "bench",
                "serve",
                "--no-progress",
                "--url",
                f"http://127.0.0.1:{ports['router']}",
                "--compare",
                f"http://127.0.0.1:{ports['direct']}",
                "--request-rate",
                args.rate,
                "--num-requests",
                str(args.num_requests),
                "--input-len",
                "16",
                "--output-len",
                str(args.output_len),
                "--ignore-eos",
                "--json",
                out,
                *args.extra,
            ]
            t0 = time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            wall = time.time() - t0
            with open(out) as f:
                doc = json.load(f)
            if args.serve_json:
                with open(args.serve_json, "w") as f:
                    json.dump(doc, f)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    client = (doc.get("arguments") or {}).get("stream_client", "?")
    report: dict = {
        "stream_client": client,
        "command": cmd[2:],
        "wall_s": wall,
        "load_avg": os.getloadavg(),
        "points": [],
    }
    for s in doc["series"]:
        late = [x for r in s["requests"] if r["ok"] and (x := to_client_ms(r)) is not None]
        ttft = [r["ttft_ms"] for r in s["requests"] if r["ok"]]
        row = {
            "target": "router (relay)" if s["target"] == "target" else "stub direct",
            "rate": s["request_rate"],
            "load_point": s.get("load_point"),
            "requests": len(ttft),
            "to_client_median_ms": statistics.median(late) if late else None,
            "to_client_p99_ms": pct(late, 99) if late else None,
            "ttft_median_ms": statistics.median(ttft) if ttft else None,
            "ttft_p99_ms": pct(ttft, 99) if ttft else None,
            "to_client_ms": [round(x, 3) for x in late],
        }
        hop = [x for r in s["requests"] if r["ok"] and (x := router_hop_ms(r)) is not None]
        if hop:
            row["router_hop_median_ms"] = statistics.median(hop)
            row["router_hop_p99_ms"] = pct(hop, 99)
        report["points"].append(row)
        print(
            f"[{client} client] {row['target']:15s} @{row['rate']} req/s: to_client median {row['to_client_median_ms']:.2f} "
            f"p99 {row['to_client_p99_ms']:.2f} ms; TTFT median {row['ttft_median_ms']:.2f} "
            f"p99 {row['ttft_p99_ms']:.2f} ms ({row['requests']} ok)"
            + (
                f"; the router's hop (stub's write → relay's) median "
                f"{row['router_hop_median_ms']:.2f} p99 {row['router_hop_p99_ms']:.2f} ms"
                if hop
                else ""
            )
        )
    print(f"load average {report['load_avg']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
