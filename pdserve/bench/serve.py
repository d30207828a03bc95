"""``pdserve bench serve``: a load generator for any OpenAI-compatible URL.

Streams requests so TTFT and ITL are what a user sees; fixed concurrency or Poisson
arrivals at one or more rates; random or GSM8K prompts; ``--compare URL`` runs a second
target on the same requests in interleaved blocks; ``--scenario interference`` measures
decode ITL while long prompts keep arriving. Prints tables, writes ``--json`` (results
and the full workload spec) and ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import math
import os
import platform
import resource
import shlex
import sys
from typing import TYPE_CHECKING, Any

from pdserve.bench.arrivals import parse_rates, poisson_arrivals
from pdserve.bench.workload import (
    DATASETS,
    ENDPOINTS,
    InterferenceSpec,
    WorkloadSpec,
    build_requests,
)
from pdserve.bounds import flag_message
from pdserve.cli import Flag, add_flags, flag_values

if TYPE_CHECKING:
    from pdserve.bench.runner import Series, Target
    from pdserve.gc_watch import GcWatch

# Per-scenario defaults of the lengths and concurrency (None in argparse = "not given").
_DEFAULTS = {
    "standard": {"input_len": 256, "output_len": 64, "concurrency": 8},
    "interference": {"input_len": 32, "output_len": 128, "concurrency": 4},
}


# The flags of each --help group, in order; a flag with a spec class sets its field.
TARGET_FLAGS: tuple[Flag, ...] = (
    Flag("--url", "server under test (http://host:port, /v1 optional)", required=True),
    Flag(
        "--compare",
        "second target, run on the same requests in interleaved blocks; ratios are compare / "
        "target; unset: the --url target alone",
        metavar="URL",
    ),
    Flag(
        "--model-name",
        "model field of the requests (default: first id of each target's /v1/models)",
    ),
    Flag("--timeout", "seconds allowed per request (default 600)", float, default=600.0),
)
# not in TARGET_FLAGS: ``pdserve eval`` takes those four as they are
STREAM_CLIENT = Flag(
    "--stream-client",
    "how streamed answers are read: socket: keep-alive connections parsed by httptools, "
    "each chunk timed when its bytes come off the socket (https URLs: httpx); httpx: "
    "httpx + httpx-sse, each chunk timed when parsed, which counts the client's own "
    "event-loop delays into TTFT and ITL (the older client, for an A/B)",
    default="socket",
    choices=("socket", "httpx"),
)
LOAD_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--scenario",
        "standard: the workload below at --concurrency / --request-rate; interference: "
        "decode ITL while long prompts arrive at --long-request-rate",
        default="standard",
        choices=("standard", "interference"),
    ),
    Flag(
        "--concurrency",
        "requests in flight (closed loop); with --request-rate, a cap (default 8; interference 4)",
        int,
    ),
    Flag(
        "--request-rate",
        "Poisson arrival rate(s) in req/s, comma-separated, e.g. 1,2,inf, each with prompts "
        "of its own (--seed + its index; GSM8K's questions are the same); unset: closed "
        "loop at --concurrency",
    ),
    Flag(
        "--num-requests",
        "requests per target and rate (interference: decode requests)",
        int,
        cls=WorkloadSpec,
    ),
    Flag("--num-warmups", "unmeasured requests per target first (default 1)", int, default=1),
    Flag(
        "--blocks",
        "interleaved blocks per target when comparing (default 4; 1 without --compare)",
        int,
    ),
)
WORKLOAD_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--dataset",
        "prompts: random words, GSM8K questions, groups sharing a system prompt, or "
        "multi-turn conversations",
        cls=WorkloadSpec,
        choices=DATASETS,
    ),
    Flag(
        "--input-len",
        "prompt words (≈ tokens) of random prompts (default 256; interference 32)",
        int,
    ),
    Flag("--output-len", "output tokens (default 64; interference 128)", int),
    Flag("--range-ratio", "lengths uniform in [len*(1-r), len*(1+r)]", float, cls=WorkloadSpec),
    Flag(
        "--endpoint",
        "API the requests go to (default: completions for random, chat for gsm8k)",
        cls=WorkloadSpec,
        choices=ENDPOINTS,
    ),
    Flag(
        "--ignore-eos",
        "ask for exactly max_tokens (pdserve extension field)",
        bool,
        cls=WorkloadSpec,
    ),
    Flag("--temperature", "sampling temperature; 0 = greedy", float, cls=WorkloadSpec),
    Flag(
        "--num-groups",
        "shared-prefix: groups of requests sharing one system prompt (default 4)",
        int,
        cls=WorkloadSpec,
    ),
    Flag(
        "--system-prompt-len",
        "shared-prefix: words (≈ tokens) of each group's system prompt (default 1024)",
        int,
        cls=WorkloadSpec,
    ),
    Flag(
        "--num-turns",
        "multi-turn: turns per conversation; --num-requests counts turns (default 4)",
        int,
        cls=WorkloadSpec,
    ),
    Flag("--seed", "seeds prompts, lengths and arrivals", int, cls=WorkloadSpec),
    Flag(
        "--phase-timing",
        "ask pdserve targets for each request's phase timings (return_timing): the report "
        "breaks TTFT down by phase (and names the phase that grew most against --compare), "
        "the JSON keeps them, and a PNG of the phases' median and p99 is written beside --json",
        bool,
        cls=WorkloadSpec,
        action="store_true",
    ),
)
INTERFERENCE_FLAGS: tuple[Flag, ...] = (
    Flag("--long-input-len", "words of the long prompts (default 1024)", int, cls=InterferenceSpec),
    Flag(
        "--long-request-rate",
        "Poisson rate of long prompts in req/s (default 1)",
        float,
        cls=InterferenceSpec,
    ),
)
NO_PROGRESS = Flag("--no-progress", "hide the progress bar", default=False, action="store_true")
OUTPUT_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--json",
        "write results and the full workload spec here; unset: not written",
        metavar="FILE",
    ),
    Flag(
        "--plot",
        "write latency CDFs (and throughput vs rate) here; unset: no plot",
        metavar="FILE.png",
    ),
    NO_PROGRESS,
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``serve`` under ``pdserve bench``."""
    p = subparsers.add_parser(
        "serve",
        help="serving benchmark against an OpenAI-compatible URL",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, (*TARGET_FLAGS, STREAM_CLIENT), "targets")
    add_flags(p, LOAD_FLAGS, "load")
    add_flags(p, WORKLOAD_FLAGS, "workload")
    add_flags(p, INTERFERENCE_FLAGS, "interference scenario")
    add_flags(p, OUTPUT_FLAGS, "output")
    p.set_defaults(func=run)
    return p


def _resolve(
    args: argparse.Namespace,
) -> tuple[WorkloadSpec, InterferenceSpec | None, tuple[float, ...], int | None, int]:
    """Validate the arguments into (workload, interference spec, rates, concurrency,
    blocks); ``ValueError`` naming the option on bad input."""
    d = _DEFAULTS[args.scenario]
    spec = WorkloadSpec(
        **flag_values(args, LOAD_FLAGS + WORKLOAD_FLAGS),
        input_len=args.input_len or d["input_len"],
        output_len=args.output_len or d["output_len"],
    )
    for name in ("input_len", "output_len", "concurrency", "blocks"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    ispec = None
    if args.scenario == "interference":
        if args.request_rate:
            raise ValueError(
                "--request-rate does not apply to --scenario interference (use --long-request-rate)"
            )
        ispec = InterferenceSpec(**flag_values(args, INTERFERENCE_FLAGS))
        rates: tuple[float, ...] = (math.inf,)
        concurrency: int | None = args.concurrency or d["concurrency"]
    elif args.request_rate:
        rates, concurrency = parse_rates(args.request_rate), args.concurrency
    else:
        rates, concurrency = (math.inf,), args.concurrency or d["concurrency"]
    blocks = args.blocks or (4 if args.compare else 1)
    return spec, ispec, rates, concurrency, blocks


async def _targets(client: Any, args: argparse.Namespace) -> list[Target]:
    from pdserve.bench.openai_client import fetch_model_name, normalize_base_url
    from pdserve.bench.runner import Target

    urls = [("target", args.url)] + ([("compare", args.compare)] if args.compare else [])
    out = []
    for name, url in urls:
        base = normalize_base_url(url)
        out.append(Target(name, base, args.model_name or await fetch_model_name(client, base)))
    return out


async def _run_async(args: argparse.Namespace) -> tuple[list[Series], list[Target], dict[str, Any]]:
    """Run the benchmark: (every series, the targets, the JSON's header)."""
    # Imported here so that building the CLI parser stays light.
    from pdserve.gc_watch import GcWatch

    spec, ispec, rates, concurrency, blocks = _resolve(args)
    reqs = build_requests(spec)
    # the client's own collections: its start-up heap frozen after the warm-up, and none
    # while streams are read (a collection stops every stream's reading; a full one of
    # the heap before the freeze took 22 ms on the CPU machine): the collector is off
    # during the load and collects between blocks (runner.run_load_point, untimed);
    # every pause under load is timed for the JSON (client_gc); the watch starts after the
    # warm-up's freeze (_measure): start-up collections are no pause under load
    watch = GcWatch(slow_s=0.01)
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        series, targets = await _measure(args, spec, ispec, reqs, rates, concurrency, blocks, watch)
    finally:
        gc.enable()
        watch.uninstall()
        gc.unfreeze()
    after = resource.getrusage(resource.RUSAGE_SELF)
    header = _header(args, targets, spec, ispec, rates, concurrency, blocks)
    header["client_gc"] = watch.stats()
    # whether the client had its CPU: its own time, and how often the kernel took the CPU
    # from it (a client descheduled under load reads every chunk late, however timed)
    header["client_process"] = {
        "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "involuntary_context_switches": after.ru_nivcsw - before.ru_nivcsw,
        "load_average_1m": os.getloadavg()[0],
    }
    return series, targets, header


def _collect_untimed(watch: GcWatch) -> None:
    """A full collection between blocks (the collector is off under load), not counted
    among the pauses of ``watch`` (no stream is read while it runs)."""
    watch.uninstall()
    try:
        gc.collect()
    finally:
        watch.install()


async def _measure(
    args: argparse.Namespace,
    spec: WorkloadSpec,
    ispec: InterferenceSpec | None,
    reqs: list,
    rates: tuple[float, ...],
    concurrency: int | None,
    blocks: int,
    watch: GcWatch,
) -> tuple[list[Series], list[Target]]:
    """Warm up, then run every load point (or the interference scenario) on the targets."""
    from tqdm import tqdm

    from pdserve.bench.interference import run_interference
    from pdserve.bench.openai_client import make_client
    from pdserve.bench.runner import run_load_point, warm_up

    async with make_client(args.timeout, socket_streams=args.stream_client == "socket") as client:
        targets = await _targets(client, args)
        await warm_up(client, targets, spec, reqs, args.num_warmups)
        watch.freeze()  # its own full collection is no pause under load: not watched yet
        watch.install()
        gc.disable()
        bar = tqdm(
            total=len(targets) * len(reqs) * len(rates),
            unit="req",
            desc="bench serve",
            disable=args.no_progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        on_done = lambda r: bar.update(1)  # noqa: E731
        series: list[Series] = []
        try:
            if ispec is not None:
                assert concurrency is not None
                series = await run_interference(
                    client, targets, spec, ispec, reqs, concurrency, blocks, on_done
                )
            else:
                for i, rate in enumerate(rates):
                    # each rate its own prompts (seed + i): a repeated rate would otherwise
                    # find the last one's prompts in the prefix cache
                    rspec = dataclasses.replace(spec, seed=spec.seed + i) if i else spec
                    rreqs = build_requests(rspec) if i else reqs
                    arrivals = (
                        [0.0] * len(rreqs)
                        if math.isinf(rate)
                        else poisson_arrivals(len(rreqs), rate, rspec.seed)
                    )
                    series += await run_load_point(
                        client,
                        targets,
                        rspec,
                        rreqs,
                        arrivals,
                        rate,
                        concurrency,
                        blocks,
                        on_done,
                        point=i,
                        between_blocks=lambda: _collect_untimed(watch),
                    )
        finally:
            bar.close()
    return series, targets


def _header(
    args: argparse.Namespace,
    targets: list[Target],
    spec: WorkloadSpec,
    ispec: InterferenceSpec | None,
    rates: tuple[float, ...],
    concurrency: int | None,
    blocks: int,
) -> dict[str, Any]:
    """The JSON's header: the command, the machine, the targets, the workload and load."""
    return {
        "version": 1,
        "tool": "pdserve bench serve",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command_line": shlex.join(sys.argv),
        "arguments": {k: v for k, v in vars(args).items() if k != "func"},
        "machine": {
            "host": platform.node(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "scenario": args.scenario,
        "targets": [{"name": t.name, "url": t.base_url, "model": t.model} for t in targets],
        "workload": spec.to_dict(),
        "load": {
            "request_rates": list(rates),
            "concurrency": concurrency,
            "blocks": blocks,
            "num_warmups": args.num_warmups,
        },
        "interference": ispec.to_dict() if ispec else None,
    }


def _report_phases(series: list[Series], json_path: str | None) -> list[dict[str, Any]]:
    """Print the TTFT stages of each load point (``bench/phases.py``), name the stage that
    grew most against ``--compare``, write the PNG beside ``json_path`` (the first load
    point's); returns the stages for the JSON."""
    from pdserve.bench.phases import phase_png_path, plot_stages, report_stages, stage_table
    from pdserve.bench.report import make_console

    console = make_console()
    entries = report_stages(series)
    for entry in entries:
        named = list(entry["stages"].items())
        skipped = {name: n for name, n in (entry.get("decode_only") or {}).items() if n}
        if skipped:
            console.print(
                "served decode-only by the router (selective PD: no prefill leg, no PD stages): "
                + ", ".join(f"{name} {n}" for name, n in skipped.items())
                + f" ({entry['label']})"
            )
        if not any(stats for _, stats in named):
            console.print(f"no phase timings in the answers ({entry['label']})")
            continue
        console.print(stage_table(f"TTFT by stage — {entry['label']}", named))
        grown = entry.get("grew_most")
        if grown is not None:
            print(
                f"stage that grew most, target vs compare ({entry['label']}): "
                f"{grown['stage']} (median {grown['delta_median_ms']:+.2f} ms)"
            )
    first = next((e for e in entries if any(e["stages"].values())), None)
    if json_path and first is not None:
        path = phase_png_path(json_path)
        plot_stages(list(first["stages"].items()), path)
        print(f"wrote {path}")
    return entries


def run(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve bench serve``; returns the exit code (0 ok, 1 when a
    target completed no request or could not be reached, 2 on bad arguments)."""
    from pdserve.bench.report import interference_headline, print_report, write_json

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):  # found now, not after the whole run
            print(f"error: {flag}: folder {folder} does not exist", file=sys.stderr)
            return 2
    try:
        series, targets, header = asyncio.run(_run_async(args))
    except ValueError as exc:
        print(f"error: {flag_message(exc, args)}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(series)
    if args.scenario == "interference":
        head = interference_headline(series)
        header["interference_headline"] = head
        line = ", ".join(f"{k} {v:.2f} ms" for k, v in head["decode_itl_p99_ms"].items())
        if len(targets) == 2:
            line += f"; compare ÷ target = {head['ratio_compare_over_target']:.3f}"
        print(f"decode ITL p99 under long-prompt interference: {line}")
    if args.phase_timing:
        header["ttft_stages"] = _report_phases(series, args.json)
    if args.json:
        write_json(args.json, header, series)
        print(f"wrote {args.json}")
    if args.plot:
        from pdserve.bench.plot import plot_series

        plot_series(series, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(s.summary().completed > 0 for s in series if s.stream != "long") else 1
