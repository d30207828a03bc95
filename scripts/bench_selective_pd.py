"""Selective PD's TTFT against PD's, side by side over the same two workers (issue 29).

Starts ``pdserve up`` (1 prefill + 1 decode, ``--model``, default the embedded model) with
``--pd-min-prefill-tokens 0`` (every request through PD) and a second router over the same
two workers with ``--pd-min-prefill-tokens THRESHOLD`` (``selective``); ``direct`` is the
decode worker itself, which runs a request without bootstrap fields whole, as a mixed worker
would (what selective PD sends it, without the router). Streamed ``/v1/completions``
requests of these kinds, in ``--rounds`` rounds:

- ``short``: about ``--short-tokens`` tokens of text, new to both workers' caches;
- ``short_chat``: the same text as a chat message (this model's chat template adds its
  system prompt: ~50 tokens, the template's first page cached on both workers);
- ``mid``: about ``--mid-tokens`` tokens of the same text (just under the threshold by
  the router's estimate, which counts this text's 8 bytes a 3 tokens as 2 tokens);
- ``long``: about ``--long-tokens`` tokens, new to both caches (both routers disaggregate it);
- ``long_cached``: a long prefix both workers hold from the warm-up, then a short question
  (the selective router's decode prefix index sends it to decode alone);
- ``short_rate``: ``short`` prompts arriving at ``--rate`` requests/s (Poisson), so that a
  request may find others running on the decode worker; also the streams' times between
  text chunks (ITL), which a prefill on the decode worker lengthens.

One request at a time except ``short_rate``, the paths taking turns request by request in
an order alternating from one request to the next (a burst of the machine's other load
falls on every path alike); ``short_rate`` runs a block of arrivals per path, the order
alternating from round to round. Every timed prompt begins with a number of its own, so no
path profits from another's pages. TTFT is the time from sending the request to its first
non-empty text chunk, over one keep-alive ``httpx.Client`` per path made before timing (a
new client costs ~30 ms of SSL set-up here, which would be timed otherwise).

Reports per kind and path TTFT p50/p90 (ms), pooled over the rounds and per round; the
prompts' token counts (from the stream's usage); PD / selective of the pooled p50 (> 1:
selective is faster) and, for the one-at-a-time kinds, the median of the ratios of the
requests sent one after the other (``pd_over_selective_paired_median``); both routers'
``pdserve_router_pd_decisions_total``; whether greedy outputs through both routers are
equal (two more prompts of each kind); the load average before and after. JSON to stdout
and to ``$OUT/selective_pd.json`` when ``OUT`` is set.

    python scripts/bench_selective_pd.py [--model random:tiny] [--device cpu] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PATHS = ("pd", "selective", "direct")


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


def ttft(
    client: httpx.Client, prompt: str, max_tokens: int, chat: bool
) -> tuple[float, str, int, list[float]]:
    """(seconds to the first non-empty text chunk, the whole text, prompt tokens, the
    seconds between one text chunk and the next after the first)."""
    body: dict = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        endpoint = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        endpoint = "/v1/completions"
    start = time.perf_counter()
    first = None
    text = ""
    prompt_tokens = -1
    arrivals: list[float] = []
    with client.stream("POST", endpoint, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices") or []:
                piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
                if piece:
                    arrivals.append(time.perf_counter())
                    if first is None:
                        first = arrivals[-1] - start
                text += piece or ""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return (first if first is not None else time.perf_counter() - start), text, prompt_tokens, gaps


def at_rate(
    client: httpx.Client, prompts: list[str], rate: float, max_tokens: int, seed: int
) -> list[tuple[float, str, int]]:
    """Send ``prompts`` with Poisson arrivals at ``rate``/s, each on its own thread; the
    results in prompt order (every thread joined)."""
    rng = random.Random(seed)
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = ttft(client, prompts[i], max_tokens, False)

    threads = []
    for i in range(len(prompts)):
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(rng.expovariate(rate))
    for t in threads:
        t.join()
    if any(r is None for r in results):
        raise RuntimeError("a request of the rate run failed (see its thread's traceback)")
    return results


def summary(values: list[float]) -> dict:
    v = sorted(values)
    return {
        "n": len(v),
        "ttft_p50_ms": round(1000 * statistics.median(v), 2),
        "ttft_p90_ms": round(1000 * v[min(len(v) - 1, int(0.9 * len(v)))], 2),
    }


def decisions(url: str) -> dict:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return {
        k: float(v)
        for k, v in re.findall(r'pdserve_router_pd_decisions_total\{path="(\w+)"\} (\S+)', metrics)
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threshold", type=int, default=64, help="--pd-min-prefill-tokens")
    ap.add_argument("--short-tokens", type=int, default=16)
    ap.add_argument("--mid-tokens", type=int, default=60)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=10, help="per round, path and short kind")
    ap.add_argument("--long-requests", type=int, default=3, help="per round, path and long kind")
    ap.add_argument("--rate", type=float, default=1.0, help="short_rate's requests/s")
    ap.add_argument("--rate-requests", type=int, default=20, help="per round and path")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kinds", default="short,short_chat,mid,long,long_cached,short_rate")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    logs = Path(tempfile.mkdtemp(prefix="selective-pd-"))
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--model", args.model, "--device", args.device]
        + ["--port", str(port), "--log-dir", str(logs), "--pd-min-prefill-tokens", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    selective = None
    clients: dict[str, httpx.Client] = {}
    load_before = os.getloadavg()
    try:
        for line in up.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "pdserve is ready at" in line:
                break
        else:
            raise RuntimeError("pdserve up ended:\n" + "".join(lines[-30:]))
        text = "".join(lines)
        urls = dict(re.findall(r"started (prefill-0|decode-0) \(pid \d+\) on (\S+),", text))
        sel_port = free_port()
        selective = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "router", "--port", str(sel_port)]
            + ["--prefill", urls["prefill-0"], "--decode", urls["decode-0"]]
            + ["--pd-min-prefill-tokens", str(args.threshold)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = {
            "pd": f"http://127.0.0.1:{port}",
            "selective": f"http://127.0.0.1:{sel_port}",
            "direct": urls["decode-0"],
        }
        wait_ok(base["selective"], 120)
        clients = {p: httpx.Client(base_url=u, timeout=600) for p, u in base.items()}
        # ~4 bytes a token (the router's estimate); " Say hi." is 3 tokens, a digit one;
        # a timed prompt's tag is a 4-digit number of its own (warm-up and checks: 2 digits)
        tags = map(str, itertools.count(1000))
        sea = "Tell me about the sea. " * max(1, args.long_tokens // 6)
        cached_prefix = "Tell me about the ocean. " * max(1, args.long_tokens // 6)
        hi = " Say hi." * max(1, round((args.short_tokens - 4) / 3))
        mid = " Say hi." * max(1, round((args.mid_tokens - 4) / 3))
        make = {
            "mid": lambda tag: f"{tag}{mid}",
            "short": lambda tag: f"{tag}{hi}",
            "short_chat": lambda tag: f"{tag}{hi}",
            "long": lambda tag: f"{tag} {sea}",
            "long_cached": lambda tag: f"{cached_prefix} Question {tag}?",
            "short_rate": lambda tag: f"{tag}{hi}",
        }
        chat = {"short_chat"}
        for path in PATHS:  # warm-up; the cached prefix on both workers
            for kind in ("short", "short_chat", "long_cached"):
                ttft(clients[path], make[kind](f"9{PATHS.index(path)}"), 2, kind in chat)
        times = {k: {p: [[] for _ in range(args.rounds)] for p in PATHS} for k in kinds}
        tokens: dict[str, list[int]] = {k: [] for k in kinds}
        gaps = {k: {p: [] for p in PATHS} for k in kinds}  # inter-chunk times, s
        for rnd in range(args.rounds):
            order = PATHS if rnd % 2 == 0 else PATHS[::-1]
            for kind in kinds:
                n = args.long_requests if kind.startswith("long") else args.requests
                paths = [p for p in order if not (kind.startswith("long") and p == "direct")]
                if kind == "short_rate":  # a block of arrivals per path
                    for path in paths:
                        prompts = [make[kind](next(tags)) for _ in range(args.rate_requests)]
                        got = at_rate(clients[path], prompts, args.rate, args.max_tokens, rnd)
                        times[kind][path][rnd] = [g[0] for g in got]
                        gaps[kind][path] += [x for g in got for x in g[3]]
                        tokens[kind] += [g[2] for g in got]
                else:  # one request a path in turn, the order alternating: a burst of
                    # the machine's other load falls on every path alike
                    for i in range(n):
                        for path in paths if i % 2 == 0 else paths[::-1]:
                            prompt = make[kind](next(tags))
                            got = ttft(clients[path], prompt, args.max_tokens, kind in chat)
                            times[kind][path][rnd].append(got[0])
                            tokens[kind].append(got[2])
                print(f"round {rnd} {kind} done", file=sys.stderr, flush=True)
        same = all(
            ttft(clients["pd"], make[k](f"8{j}"), args.max_tokens, k in chat)[1]
            == ttft(clients["selective"], make[k](f"8{j}"), args.max_tokens, k in chat)[1]
            for k in ("short", "short_chat", "mid", "long", "long_cached")
            for j in range(2)
        )
        report: dict = {
            "model": args.model,
            "device": args.device,
            "threshold": args.threshold,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "rate": args.rate,
            "same_output": same,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        }
        for kind, by in times.items():
            row: dict = {
                "prompt_tokens": {"min": min(tokens[kind]), "max": max(tokens[kind])},
            }
            for path, rounds in by.items():
                pooled = [t for r in rounds for t in r]
                if not pooled:
                    continue
                row[path] = summary(pooled)
                if kind == "short_rate":  # what a prefill on decode costs running streams
                    g = sorted(gaps[kind][path])
                    row[path]["itl_p50_ms"] = round(1000 * statistics.median(g), 2)
                    row[path]["itl_p90_ms"] = round(1000 * g[int(0.9 * len(g))], 2)
                    row[path]["itl_p99_ms"] = round(1000 * g[int(0.99 * len(g))], 2)
                row[path]["per_round_p50_ms"] = [
                    round(1000 * statistics.median(r), 2) for r in rounds
                ]
            row["pd_over_selective_p50"] = round(
                row["pd"]["ttft_p50_ms"] / row["selective"]["ttft_p50_ms"], 3
            )
            if kind != "short_rate":  # the i-th PD request beside the i-th selective one
                pairs = [a / b for ra, rb in zip(by["pd"], by["selective"]) for a, b in zip(ra, rb)]
                row["pd_over_selective_paired_median"] = round(statistics.median(pairs), 3)
            row["pd_over_selective_p50_per_round"] = [
                round(a / b, 3)
                for a, b in zip(row["pd"]["per_round_p50_ms"], row["selective"]["per_round_p50_ms"])
            ]
            report[kind] = row
        report["decisions"] = {
            "pd_router": decisions(base["pd"]),
            "selective_router": decisions(base["selective"]),
        }
        out = json.dumps(report, indent=2)
        print(out)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "selective_pd.json").write_text(out + "\n")
        return 0
    finally:
        for c in clients.values():
            c.close()
        if selective is not None:
            selective.terminate()
            selective.wait(30)
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(120)


if __name__ == "__main__":
    sys.exit(main())
