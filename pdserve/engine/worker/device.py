"""Resolving ``device="auto"`` and ``dtype="auto"`` of a :class:`ModelConfig`."""

from __future__ import annotations

import torch

from pdserve.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: ModelConfig) -> torch.device:
    """``auto`` → ``cuda:<gpu_id>`` when CUDA is available, else ``cpu``; ``cuda`` →
    ``cuda:<gpu_id>``.  ValueError naming ``device`` when CUDA is asked but absent."""
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r} asked but CUDA is not available")
    device = torch.device(name) if ":" in name else torch.device("cuda", cfg.gpu_id)
    if device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device} does not exist ({torch.cuda.device_count()} CUDA devices)"
        )
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU, bfloat16 on CUDA; else the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def resolve_rank_device(cfg: ModelConfig, rank: int) -> torch.device:
    """Device of tensor-parallel rank ``rank``: ``cpu`` when :func:`resolve_device` gives
    the CPU, else ``cuda:<cfg.rank_gpu_id(rank)>``.  Rank 0 of a TP=1 engine is exactly
    :func:`resolve_device`.  ValueError naming ``gpu_ids`` when the device does not exist."""
    device = resolve_device(cfg)
    if device.type == "cpu" or cfg.tensor_parallel_size == 1:
        return device
    index = cfg.rank_gpu_id(rank)
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"gpu_ids: rank {rank} would run on cuda:{index}, but there are "
            f"{torch.cuda.device_count()} CUDA devices"
        )
    return torch.device("cuda", index)
