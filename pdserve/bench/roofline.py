"""The memory roofline of a decode step (``bench offline``): the bytes a step must read and
the device's copy bandwidth, measured in the same run (GPU.md: ~4.3 TB/s read+write on an
H200).  A decode step reads every weight once (the input embedding table only for its rows
unless it is tied to the LM head) and the KV of every context token."""

from __future__ import annotations

import time


def copy_bandwidth(device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Read+write bytes/s of a device-to-device copy of ``nbytes`` (default 1 GiB on CUDA,
    256 MiB on CPU), best of ``repeats`` after a warm-up: 2 * nbytes / seconds."""
    import torch

    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def step_bytes(engine, num_seqs: int, mean_context: float) -> int:
    """Bytes one decode step of ``num_seqs`` sequences must read: every weight of the model
    (the input embeddings only when tied to the LM head) + the KV of ``mean_context`` tokens
    per sequence (all layers, K and V)."""
    from pdserve.engine.worker.kv_storage import kv_bytes_per_token

    model = engine.executor.rank0.model
    s = model.shapes
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(
        t.numel() * t.element_size() for layer in model.layers for t in layer.packed.values()
    )
    if not s.tied:
        weights -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    weights -= unrouted_expert_bytes(model, num_seqs)  # a mixture of experts: the routed ones
    kv_dtype = engine.executor.rank0.storage.kv.dtype  # an FP8 pool reads 1 byte an element
    kv = kv_bytes_per_token(s.n_layers, s.n_kv_heads, s.head_dim, kv_dtype)
    return int(weights + num_seqs * mean_context * kv)


def unrouted_expert_bytes(model, num_seqs: int) -> int:
    """Bytes of the experts a decode step of ``num_seqs`` sequences did not read on average,
    which :func:`step_bytes` leaves out: a mixture-of-experts step reads only the experts
    its batch routes to. Per sparse layer ``(E - routed) * one expert's bytes``, ``routed``
    measured over the decode steps of that size since the last call
    (:func:`pdserve.model.moe.routed_experts`, ``PDSERVE_MOE_ROUTING_STATS=1``; reset here,
    so each concurrency of ``bench offline`` gets its own); 0 for a dense model or when
    routing was not counted (every expert)."""
    from pdserve.model.moe import routed_experts

    blocks = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
    routed = routed_experts(blocks, num_seqs) if blocks else None
    if routed is None:
        return 0
    total = 0.0
    for b in blocks:
        per_expert = (b.w13[0].numel() + b.w2[0].numel()) * b.w13.element_size()
        total += (b.w13.shape[0] - routed) * per_expert
    return int(total)
