"""What both processes of ``bench transfer`` build alike: the run's configuration
(:class:`TransferBenchConfig`, the model shapes it names), the KV pool and aux buffer laid
out like the engine's (:class:`~pdserve.engine.kv.layout.KVCacheLayout`), and the digest
that checks decode's pages against prefill's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pdserve.bounds import check_min
from pdserve.disagg.base import PAGE_MAJOR, check_order

# (num_layers, num_kv_heads, head_dim) of public model configs.
MODEL_SHAPES = {
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (80, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "qwen3-8b": (36, 8, 128),
    "smollm2-135m": (30, 3, 64),
}
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")  # the last: an FP8 KV cache


@dataclass(frozen=True)
class TransferBenchConfig:
    """One benchmark run; ValueError naming the field when invalid."""

    model_shape: str = "llama-3.1-8b"
    prompt_len: int = 1024
    page_size: int = 16
    dtype: str = "bfloat16"
    device: str = "cpu"
    gpu_id: int = 0
    repeats: int = 7
    run_len: int = 1
    pool_factor: int = 2
    seed: int = 0
    hugepages: bool = True
    kv_order: str = PAGE_MAJOR
    pattern: str = "served"
    ab_env: str | None = None  # NAME=VALUE: the managed rows again with it set (transfer.py)

    def __post_init__(self) -> None:
        if self.model_shape not in MODEL_SHAPES:
            raise ValueError(
                f"model_shape must be one of {sorted(MODEL_SHAPES)}, got {self.model_shape!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        check_min(self, 1, "prompt_len", "page_size", "repeats", "run_len", "pool_factor")
        check_min(self, 0, "gpu_id")
        check_order(self.kv_order)
        if self.pattern not in ("served", "runs"):
            raise ValueError(f"pattern must be served or runs, got {self.pattern!r}")
        if self.ab_env is not None and (
            "=" not in self.ab_env or not self.ab_env.startswith("PDSERVE_")
        ):
            raise ValueError(f"ab_env must be PDSERVE_NAME=VALUE, got {self.ab_env!r}")

    @property
    def num_pages(self) -> int:
        return -(-self.prompt_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        return self.num_pages * self.pool_factor


def pool_layout(cfg: TransferBenchConfig):
    """The :class:`~pdserve.engine.kv.layout.KVCacheLayout` of both sides' pools."""
    import torch

    from pdserve.engine.kv.layout import KVCacheLayout

    layers, heads, dim = MODEL_SHAPES[cfg.model_shape]
    return KVCacheLayout(
        cfg.kv_order, layers, heads, dim, cfg.page_size, cfg.pool_pages, getattr(torch, cfg.dtype)
    )


def make_pool(cfg: TransferBenchConfig):
    """``(kv, aux uint8[4, AUX], KVArgs)`` on the configured device, laid out by :func:`pool_layout`."""
    import torch

    from pdserve.disagg.base import AUX_RECORD_BYTES, KVArgs

    lay = pool_layout(cfg)
    device = torch.device(cfg.device, cfg.gpu_id) if cfg.device == "cuda" else torch.device("cpu")
    if cfg.device == "cpu" and not cfg.hugepages:
        kv = torch.zeros(lay.shape, dtype=lay.dtype)
    else:
        kv = lay.allocate(device)
    aux = torch.zeros(4, AUX_RECORD_BYTES, dtype=torch.uint8)
    regions = lay.regions(kv)
    args = KVArgs(
        tuple(r[0] for r in regions),
        tuple(r[1] for r in regions),
        tuple(r[2] for r in regions),
        aux.data_ptr(),
        aux.numel(),
        AUX_RECORD_BYTES,
        lay.fingerprint(f"bench:{cfg.model_shape}"),
        device=cfg.device,
        gpu_id=cfg.gpu_id,
    )
    return kv, aux, args


def pages_digest(cfg: TransferBenchConfig, kv, pages: list[int]) -> str:
    """blake2b (16 bytes, hex) of ``pages`` of ``kv``, all buffers, in page order."""
    data = pool_layout(cfg).pages(kv, pages).contiguous().view(-1).view(__import__("torch").uint8)
    data = data.cpu().numpy()
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
