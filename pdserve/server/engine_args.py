"""Engine flags shared by ``pdserve serve`` and ``pdserve up`` (defaults read from the
config dataclasses, so each default is written once)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.bounds import CrossFieldError
from pdserve.cli import Flag, add_flags, flag_values, int_list
from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig


def gpu_id_tuple(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)`` (``--gpu-ids``); argparse error unless integers >= 0."""
    return tuple(int_list(text))


def config_value(cls: type, name: str, parse: Any = str) -> Any:
    """An argparse ``type`` for the flag of field ``name`` of config dataclass ``cls``: it
    parses the text with ``parse`` and checks the value by building ``cls(name=value)``,
    so the flag accepts exactly what the config's own ``__post_init__`` accepts (one list
    of allowed values, checked at parse time in ``serve`` and in ``up`` before any process
    starts). argparse error with the config's message (naming the field and the allowed
    values) otherwise. A rule between two fields (:class:`~pdserve.bounds.CrossFieldError`)
    is left to the whole config (``engine_config_from_args``; ``up`` builds it before any
    process starts)."""

    def check(text: str) -> Any:
        value = parse(text)
        try:
            cls(**{name: value})
        except CrossFieldError:
            pass  # a rule with another flag: checked when the whole config is built
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    check.__name__ = name  # argparse names the type in its "invalid ... value" message
    return check


# ``up`` forwards exactly these to its workers (``--tp`` is vLLM's short spelling).
ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag(
        "--model",
        "HF folder, .gguf file, random:<preset> or the embedded id smollm2-135m-instruct",
        cls=ModelConfig,
    ),
    Flag(
        "--dtype",
        "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16",
        config_value(ModelConfig, "dtype"),
        cls=ModelConfig,
    ),
    Flag(
        "--device",
        "auto, cpu, cuda or cuda:N",
        config_value(ModelConfig, "device"),
        cls=ModelConfig,
    ),
    Flag("--gpu-id", "CUDA device index when --device does not name one", int, cls=ModelConfig),
    Flag("--max-model-len", "context limit in tokens; unset: the model's", int, cls=ModelConfig),
    Flag(
        "--seed",
        "seed of random weights (random: models) and of unseeded sampling",
        int,
        cls=ModelConfig,
    ),
    Flag(
        "--attention-backend",
        "auto (triton on CUDA, torch_sdpa on CPU), triton or torch_sdpa",
        config_value(ModelConfig, "attention_backend"),
        cls=ModelConfig,
    ),
    Flag(
        "--quantization",
        "fp8: quantize the decoder's linear weights to e4m3 at load (one scale per output "
        "channel); fp8_block: one scale per output row and 128 input columns (closer to "
        "bf16, never through cuBLAS's FP8 matmul); unset: as the checkpoint is (an FP8 "
        "checkpoint loads as FP8 either way)",
        config_value(ModelConfig, "quantization"),
        cls=ModelConfig,
    ),
    Flag(
        "--enforce-eager",
        "never capture CUDA graphs of the decode step (every step eager)",
        bool,
        cls=ModelConfig,
    ),
    Flag(
        "--tensor-parallel-size",
        "ranks the model is split over (tensor parallelism): rank 0 in the worker, the "
        "others processes it starts; gloo on CPU, NCCL on CUDA",
        int,
        cls=ModelConfig,
        aliases=("--tp",),
    ),
    Flag(
        "--gpu-ids",
        "comma-separated CUDA device of each tensor-parallel rank; unset: --gpu-id + rank",
        gpu_id_tuple,
        cls=ModelConfig,
    ),
    Flag("--page-size", "tokens per KV page; unset: 16 on CPU, 128 on CUDA", int, cls=CacheConfig),
    Flag(
        "--kv-cache-dtype",
        "auto (the model's dtype) or fp8_e4m3 (per-tensor K/V scales: 1.0 or the "
        "checkpoint's k_scale/v_scale)",
        config_value(CacheConfig, "kv_cache_dtype"),
        cls=CacheConfig,
    ),
    Flag(
        "--kv-cache-memory",
        "KV pool size in GiB (with a draft model, --speculative-model, its pool too: split by "
        "bytes per token, as many pages each); unset: 1 GiB on CPU, --gpu-memory-utilization "
        "of free memory on CUDA",
        float,
        cls=CacheConfig,
    ),
    Flag(
        "--gpu-memory-utilization",
        "fraction of free GPU memory for the KV pool",
        float,
        cls=CacheConfig,
    ),
    Flag(
        "--num-pages",
        "exact KV page count (overrides --kv-cache-memory); unset: from --kv-cache-memory",
        int,
        cls=CacheConfig,
    ),
    Flag(
        "--enable-prefix-caching",
        "reuse the KV of cached full pages of a shared prefix",
        bool,
        cls=CacheConfig,
    ),
    Flag(
        "--kv-order",
        "physical order of the KV pool: layer_major or page_major; unset: the device's "
        "default, page_major (chosen by bench transfer)",
        config_value(CacheConfig, "kv_order"),
        cls=CacheConfig,
    ),
    Flag("--max-num-batched-tokens", "token budget of one step", int, cls=SchedulerConfig),
    Flag(
        "--max-running-requests",
        "requests in the running batch (and the largest CUDA-graph batch); unset: 256 on "
        "CUDA, 64 on CPU",
        int,
        cls=SchedulerConfig,
    ),
    Flag(
        "--overlap-schedule",
        "launch each greedy decode step from the previous step's tokens on the device while "
        "the host processes that step's results (--no-overlap-schedule turns it off); "
        "unset: on for CUDA, off on CPU",
        bool,
        cls=SchedulerConfig,
    ),
    Flag(
        "--speculative-algorithm",
        "speculative decoding: ngram (prompt lookup) or draft (a draft model, "
        "--speculative-model); unset: off",
        config_value(SchedulerConfig, "speculative_algorithm"),
        cls=SchedulerConfig,
    ),
    Flag(
        "--speculative-model",
        "the draft model of draft-model speculation (as --model takes it); "
        "unset: none (ngram needs none)",
        cls=SchedulerConfig,
    ),
    Flag(
        "--num-speculative-tokens",
        "drafts verified per sequence per step (k)",
        config_value(SchedulerConfig, "num_speculative_tokens", int),
        cls=SchedulerConfig,
    ),
    Flag(
        "--speculative-ngram-min",
        "shortest n-gram the ngram drafter matches",
        config_value(SchedulerConfig, "speculative_ngram_min", int),
        cls=SchedulerConfig,
    ),
    Flag(
        "--speculative-ngram-max",
        "longest n-gram the ngram drafter matches (tried first)",
        config_value(SchedulerConfig, "speculative_ngram_max", int),
        cls=SchedulerConfig,
    ),
    Flag(
        "--pd-compute-ahead-fraction",
        "PD prefill: share of the KV pool that prompts computed before decode's "
        "destination arrived may hold between them (each counted as its whole prompt); "
        "beyond it a request waits for its destination before it is computed; 0: all wait",
        config_value(SchedulerConfig, "pd_compute_ahead_fraction", float),
        cls=SchedulerConfig,
    ),
    Flag(
        "--pd-compute-ahead-timeout",
        "PD prefill: seconds a prompt computed before decode's destination arrived keeps "
        "its KV pages waiting for it; then it gives them back (full pages stay in the "
        "prefix cache) and waits for the destination without pages, to be computed again "
        "when it comes; the request does not fail "
        "(PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT bounds the whole wait)",
        config_value(SchedulerConfig, "pd_compute_ahead_timeout_s", float),
        cls=SchedulerConfig,
        field="pd_compute_ahead_timeout_s",
    ),
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag to ``parser``."""
    add_flags(parser, ENGINE_FLAGS, "engine")


def add_engine_flags(
    parser: argparse.ArgumentParser,
    flags: Iterable[str],
    *,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Add the engine flags named in ``flags`` (in that order) to ``parser``, defined as for
    ``serve`` and ``up`` (type, default, aliases, help), for a command that takes only some
    of them (``bench offline``). ``notes``: text appended to a flag's help, for what the
    flag also means in that command. ValueError for a name not in :data:`ENGINE_FLAGS`."""
    known = {f.flag: f for f in ENGINE_FLAGS}
    flags = list(flags)
    unknown = [flag for flag in flags if flag not in known]
    if unknown:
        raise ValueError(f"not engine flags: {', '.join(unknown)}")
    chosen = []
    for flag in flags:
        f = known[flag]
        if notes and flag in notes:  # before "; unset: ...", which ends a help
            text, unset, meaning = f.help.partition("; unset: ")
            f = f._replace(help=f"{text}; {notes[flag]}{unset}{meaning}")
        chosen.append(f)
    add_flags(parser, chosen, "engine")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags; ValueError naming the field when one is invalid."""
    return EngineConfig.from_fields(**flag_values(args, ENGINE_FLAGS))


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as an argv list
    (how ``pdserve up`` passes them through to its workers)."""
    argv: list[str] = []
    for f in ENGINE_FLAGS:
        value = getattr(args, f.dest)
        if value == f.default_value():
            continue
        if isinstance(value, bool):
            argv.append(f.flag if value else "--no-" + f.flag[2:])
        elif isinstance(value, tuple):
            argv += [f.flag, ",".join(str(v) for v in value)]
        else:
            argv += [f.flag, str(value)]
    return argv
