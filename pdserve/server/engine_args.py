"""Engine flags shared by ``pdserve serve`` and ``pdserve up`` (defaults read from the
config dataclasses, so each default is written once)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, default_of


def gpu_id_tuple(text: str) -> tuple[int, ...]:
    """``"0,1"`` -> ``(0, 1)`` (``--gpu-ids``); argparse error unless integers >= 0."""
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        ids = ()
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return ids


def config_value(cls: type, name: str, parse: Any = str) -> Any:
    """An argparse ``type`` for the flag of field ``name`` of config dataclass ``cls``: it
    parses the text with ``parse`` and checks the value by building ``cls(name=value)``,
    so the flag accepts exactly what the config's own ``__post_init__`` accepts (one list
    of allowed values, checked at parse time in ``serve`` and in ``up`` before any process
    starts). argparse error with the config's message (naming the field and the allowed
    values) otherwise."""

    def check(text: str) -> Any:
        value = parse(text)
        try:
            cls(**{name: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    check.__name__ = name  # argparse names the type in its "invalid ... value" message
    return check


# Short spellings of a few engine flags (vLLM's ``--tp`` among them).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"--tensor-parallel-size": ("--tp",)}

# (flag, config class, field, type, help) — ``up`` forwards exactly these to its workers.
ENGINE_FLAGS: tuple[tuple[str, type, str, Any, str], ...] = (
    (
        "--model",
        ModelConfig,
        "model",
        str,
        "HF folder, .gguf file, random:<preset> or the embedded id smollm2-135m-instruct",
    ),
    (
        "--dtype",
        ModelConfig,
        "dtype",
        config_value(ModelConfig, "dtype"),
        "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16",
    ),
    (
        "--device",
        ModelConfig,
        "device",
        config_value(ModelConfig, "device"),
        "auto, cpu, cuda or cuda:N",
    ),
    ("--gpu-id", ModelConfig, "gpu_id", int, "CUDA device index when --device does not name one"),
    (
        "--max-model-len",
        ModelConfig,
        "max_model_len",
        int,
        "context limit in tokens; unset: the model's",
    ),
    (
        "--seed",
        ModelConfig,
        "seed",
        int,
        "seed of random weights (random: models) and of unseeded sampling",
    ),
    (
        "--attention-backend",
        ModelConfig,
        "attention_backend",
        config_value(ModelConfig, "attention_backend"),
        "auto (triton on CUDA, torch_sdpa on CPU), triton or torch_sdpa",
    ),
    (
        "--enforce-eager",
        ModelConfig,
        "enforce_eager",
        bool,
        "never capture CUDA graphs of the decode step (every step eager)",
    ),
    (
        "--tensor-parallel-size",
        ModelConfig,
        "tensor_parallel_size",
        int,
        "ranks the model is split over (tensor parallelism): rank 0 in the worker, the "
        "others processes it starts; gloo on CPU, NCCL on CUDA",
    ),
    (
        "--gpu-ids",
        ModelConfig,
        "gpu_ids",
        gpu_id_tuple,
        "comma-separated CUDA device of each tensor-parallel rank; unset: --gpu-id + rank",
    ),
    (
        "--page-size",
        CacheConfig,
        "page_size",
        int,
        "tokens per KV page; unset: 16 on CPU, 128 on CUDA",
    ),
    (
        "--kv-cache-memory",
        CacheConfig,
        "kv_cache_memory",
        float,
        "KV pool size in GiB; unset: 1 GiB on CPU, --gpu-memory-utilization of free memory on CUDA",
    ),
    (
        "--gpu-memory-utilization",
        CacheConfig,
        "gpu_memory_utilization",
        float,
        "fraction of free GPU memory for the KV pool",
    ),
    (
        "--num-pages",
        CacheConfig,
        "num_pages",
        int,
        "exact KV page count (overrides --kv-cache-memory); unset: from --kv-cache-memory",
    ),
    (
        "--enable-prefix-caching",
        CacheConfig,
        "enable_prefix_caching",
        bool,
        "reuse the KV of cached full pages of a shared prefix",
    ),
    (
        "--kv-order",
        CacheConfig,
        "kv_order",
        config_value(CacheConfig, "kv_order"),
        "physical order of the KV pool: layer_major or page_major; unset: the device's "
        "default, page_major (chosen by bench transfer)",
    ),
    (
        "--max-num-batched-tokens",
        SchedulerConfig,
        "max_num_batched_tokens",
        int,
        "token budget of one step",
    ),
    (
        "--max-running-requests",
        SchedulerConfig,
        "max_running_requests",
        int,
        "requests in the running batch",
    ),
    (
        "--overlap-schedule",
        SchedulerConfig,
        "overlap_schedule",
        bool,
        "launch each greedy decode step from the previous step's tokens on the device while "
        "the host processes that step's results (--no-overlap-schedule turns it off); "
        "unset: on for CUDA, off on CPU",
    ),
)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every engine flag to ``parser``."""
    add_engine_flags(parser, [flag for flag, *_ in ENGINE_FLAGS])


def add_engine_flags(
    parser: argparse.ArgumentParser,
    flags: Iterable[str],
    *,
    notes: Mapping[str, str] | None = None,
) -> None:
    """Add the engine flags named in ``flags`` (in that order) to ``parser``, defined as for
    ``serve`` and ``up`` (type, default, aliases, help), for a command that takes only some
    of them (``bench offline``). ``notes``: text appended to a flag's help, for what the
    flag also means in that command. Each help ends with its default once ``pdserve.cli``
    builds the tree (:func:`pdserve.cli.document_default`; a None default's help says what
    unset means: ``...; unset: MEANING``). ValueError for a name not in :data:`ENGINE_FLAGS`."""
    known = {entry[0]: entry for entry in ENGINE_FLAGS}
    flags = list(flags)
    unknown = [flag for flag in flags if flag not in known]
    if unknown:
        raise ValueError(f"not engine flags: {', '.join(unknown)}")
    group = parser.add_argument_group("engine")
    for flag in flags:
        _, cls, name, typ, help_text = known[flag]
        if notes and flag in notes:  # before "; unset: ...", which ends a help
            text, unset, meaning = help_text.partition("; unset: ")
            help_text = f"{text}; {notes[flag]}{unset}{meaning}"
        if typ is bool:
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=default_of(cls, name),
                help=help_text,
            )
            continue
        group.add_argument(
            flag,
            *FLAG_ALIASES.get(flag, ()),
            dest=_dest(flag),
            type=typ,
            default=default_of(cls, name),
            help=help_text,
        )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags; ValueError naming the field when one is invalid."""
    return EngineConfig.from_fields(
        **{name: getattr(args, _dest(flag)) for flag, _, name, _, _ in ENGINE_FLAGS}
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as an argv list
    (how ``pdserve up`` passes them through to its workers)."""
    argv: list[str] = []
    for flag, cls, name, _, _ in ENGINE_FLAGS:
        value = getattr(args, _dest(flag))
        if value == default_of(cls, name):
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv
