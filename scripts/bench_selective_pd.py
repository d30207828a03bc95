"""Selective PD's TTFT against PD's, side by side in one run (issue 29).

Starts ``pdserve up`` (1 prefill + 1 decode, ``--model``, default the embedded model) and a
second router over the same two workers with ``--pd-min-prefill-tokens``; sends
``--requests`` streamed chat requests of each kind, alternating the two routers, one at a
time: ``short`` (about ``--short-tokens`` tokens), ``long`` (about ``--long-tokens``) and
``long_cached`` (a long prefix both workers hold from a warm-up, then a short question:
the selective router's decode prefix index sends it to decode alone). Every timed prompt
is new to both workers' prefix caches (a number first, another for each router), so no
path profits from the other's pages. Reports each path's TTFT p50/p90 (ms), the ratio
PD / selective per kind (> 1: selective is faster; about 1 for ``long``: both
disaggregated) and the selective router's ``pdserve_router_pd_decisions_total``; greedy
outputs of both routers are compared on two more prompts of each kind. JSON to stdout and
to ``$OUT/selective_pd.json`` when ``OUT`` is set.

    python scripts/bench_selective_pd.py [--model random:tiny] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    from pdserve.http.netutil import free_port as fp

    return fp("127.0.0.1")


def wait_ok(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout:g} s")


def ttft(url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    first = None
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                content = choice.get("delta", {}).get("content")
                if content and first is None:
                    first = time.perf_counter() - start
                text += content or ""
    return (first if first is not None else time.perf_counter() - start), text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threshold", type=int, default=64, help="--pd-min-prefill-tokens")
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=20, help="per router and prompt kind")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="selective-pd-"))
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--model", args.model, "--device", args.device]
        + ["--port", str(port), "--log-dir", str(logs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    selective = None
    try:
        for line in up.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "pdserve is ready at" in line:
                break
        else:
            raise RuntimeError("pdserve up ended:\n" + "".join(lines[-30:]))
        text = "".join(lines)
        urls = dict(re.findall(r"started (prefill-0|decode-0) \(pid \d+\) on (\S+),", text))
        pd_url = f"http://127.0.0.1:{port}"
        sel_port = free_port()
        selective = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "router", "--port", str(sel_port)]
            + ["--prefill", urls["prefill-0"], "--decode", urls["decode-0"]]
            + ["--pd-min-prefill-tokens", str(args.threshold)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        sel_url = f"http://127.0.0.1:{sel_port}"
        wait_ok(sel_url, 120)
        # about 4 bytes a token (the router's estimate): "word " is 1-2 tokens
        sea = "Tell me about the sea. " * max(1, args.long_tokens // 6)
        cached_prefix = "Tell me about the ocean. " * max(1, args.long_tokens // 6)
        hi = "Say hi. " * max(1, args.short_tokens // 3)
        prompts = {
            "short": lambda tag: f"{tag} {hi}",
            "long": lambda tag: f"{tag} {sea}",
            "long_cached": lambda tag: f"{cached_prefix} Question {tag}?",
        }
        for url in (pd_url, sel_url):  # warm-up; the cached prefix on both workers
            for make in prompts.values():
                ttft(url, make("warm"), args.max_tokens)
        times: dict[str, dict[str, list[float]]] = {k: {"pd": [], "selective": []} for k in prompts}
        for kind, make in prompts.items():
            for i in range(args.requests):
                for name, url in (("pd", pd_url), ("selective", sel_url))[:: 1 if i % 2 else -1]:
                    took, _ = ttft(url, make(f"{i}{name[0]}"), args.max_tokens)
                    times[kind][name].append(took)
        same = all(
            ttft(pd_url, make(f"same{j}"), args.max_tokens)[1]
            == ttft(sel_url, make(f"same{j}"), args.max_tokens)[1]
            for make in prompts.values()
            for j in range(2)
        )
        report: dict = {"model": args.model, "threshold": args.threshold, "same_output": same}
        for kind, by in times.items():
            row = {
                name: {
                    "ttft_p50_ms": round(1000 * statistics.median(v), 2),
                    "ttft_p90_ms": round(1000 * sorted(v)[int(0.9 * len(v))], 2),
                }
                for name, v in by.items()
            }
            row["pd_over_selective_p50"] = round(
                row["pd"]["ttft_p50_ms"] / row["selective"]["ttft_p50_ms"], 3
            )
            report[kind] = row
        metrics = httpx.get(sel_url + "/metrics", timeout=10).text
        report["decisions"] = dict(
            re.findall(r'pdserve_router_pd_decisions_total\{path="(\w+)"\} (\S+)', metrics)
        )
        out = json.dumps(report, indent=2)
        print(out)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "selective_pd.json").write_text(out + "\n")
        return 0
    finally:
        if selective is not None:
            selective.terminate()
            selective.wait(30)
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(120)


if __name__ == "__main__":
    sys.exit(main())
