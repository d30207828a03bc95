"""The roofline of a decode step (``bench offline``): the bytes a step must read and the
FLOPs it must compute, against the device's copy bandwidth and bf16 (the model dtype's)
matmul rate held under sustained load (:func:`matmul_rate`), both measured in the same run (GPU.md: ~4.3 TB/s read+write and ~790 TFLOP/s
bf16 on an H200).

A decode step reads every weight once (the input embedding table only for its rows unless
it is tied to the LM head) and the KV of every context token. Its time can be no less than
``max(bytes / bandwidth, flops / matmul rate)``: at a few rows it is the bytes, at a few
hundred rows of an 8B model the matmuls (GPU.md: 256 rows ≈ 4.1 TFLOP ≈ 5.2 ms), so a large
batch is judged against compute, not against a memory floor it cannot reach.

FLOP count of a forward pass per token, after PaLM (Chowdhery et al. 2022,
arXiv:2204.02311, Appendix B: ``6N + 12·L·H·Q·T`` per token for training, i.e. ``2N +
4·L·H·Q·T`` for the forward): 2 FLOPs (a multiply and an add) per weight of every matmul,
and ``4·L·H·Q·T`` for attention (``QKᵀ`` and ``PV``, 2 FLOPs each per head dimension and
context position) with ``L`` layers, ``H`` query heads, ``Q`` head dim and ``T`` the
context the token attends to. Elementwise work (norms, RoPE, SwiGLU, softmax) is left out.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _timed_best(device: torch.device, fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` after one warm-up."""
    import torch

    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Read+write bytes/s of a device-to-device copy of ``nbytes`` (default 1 GiB on CUDA,
    256 MiB on CPU), best of ``repeats`` after a warm-up: 2 * nbytes / seconds."""
    import torch

    device = torch.device(device)
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = _timed_best(device, lambda: dst.copy_(src), repeats)
    return 2 * nbytes / best


def matmul_rate(
    device,
    dtype: torch.dtype | None = None,
    n: int | None = None,
    repeats: int = 5,
    sustain_s: float = 0.0,
) -> float:
    """FLOP/s of an ``[n, n] @ [n, n]`` matmul in ``dtype`` (default n = 8192 on CUDA, 512
    elsewhere): ``2 * n**3 / seconds`` (a multiply and an add per term; dtype ``None``:
    bfloat16). With ``sustain_s`` = 0, the best of ``repeats`` calls after a warm-up: the
    card's burst rate. With ``sustain_s`` > 0, the rate it holds under load: matmuls back to
    back for ``sustain_s`` seconds first, then the median of ``repeats`` calls. A GPU lowers
    its SM clock under its power cap after about a second of full load (an H200 held
    ~1,600 of its 1,980 MHz through the compute-bound parts of session 9's runs,
    ``scripts/gpu_clocks.py``), and a prefill or a many-row decode step runs at that clock,
    not at the burst's. ``torch.float8_e4m3fn``: ``torch._scaled_mm`` (unit scales, bf16
    out), the path FP8 weights take at many rows. Raises whatever torch raises for a dtype
    the device cannot multiply."""
    import statistics

    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    device = torch.device(device)
    if n is None:
        n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if dtype == torch.float8_e4m3fn:  # FP8 weights' large-batch path: cuBLAS's scaled matmul
        one = torch.ones((), device=device)
        b_cols = b.t()  # the second operand column-major, as _scaled_mm takes it

        def mm() -> None:
            torch._scaled_mm(a, b_cols, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        out = torch.empty(n, n, device=device, dtype=dtype)

        def mm() -> None:
            torch.matmul(a, b, out=out)

    if sustain_s <= 0:
        best = _timed_best(device, mm, repeats)
        return 2 * n**3 / best
    end = time.perf_counter() + sustain_s
    while time.perf_counter() < end:
        for _ in range(8):
            mm()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def matmul_weights_per_token(shapes) -> int:
    """Weights one token multiplies with in a forward pass of one rank (``ModelShapes``):
    per layer the fused QKV (``hidden × (Hq + 2·Hkv)·D``), o_proj (``Hq·D × hidden``) and
    the MLP: gate, up and down (``3 × hidden × intermediate``), or in a mixture-of-experts
    layer the router (``hidden × experts``) and ``top_k`` experts' gate, up and down
    (``top_k × 3 × hidden × expert intermediate``); plus the LM head (``hidden × vocab
    shard``, tied or not: it is a matmul either way). Biases and norms are left out."""
    s = shapes
    attn = (
        s.hidden * (s.n_heads + 2 * s.n_kv_heads) * s.head_dim + s.n_heads * s.head_dim * s.hidden
    )
    sparse = len(s.moe_layers)
    mlp = (s.n_layers - sparse) * 3 * s.hidden * s.intermediate
    if sparse:
        mlp += sparse * s.hidden * (s.n_experts + 3 * s.top_k * s.moe_intermediate)
    return s.n_layers * attn + mlp + s.hidden * s.vocab_shard


def forward_flops(shapes, num_tokens: int, mean_context: float) -> float:
    """FLOPs of ``num_tokens`` tokens each attending to ``mean_context`` positions on one
    rank (the module docstring's formula): ``num_tokens * (2 * weights + 4 * L * Hq * D *
    mean_context)`` with weights from :func:`matmul_weights_per_token`."""
    s = shapes
    per_token = (
        2 * matmul_weights_per_token(s) + 4 * s.n_layers * s.n_heads * s.head_dim * mean_context
    )
    return float(num_tokens * per_token)


def step_flops(engine, num_seqs: int, mean_context: float) -> float:
    """FLOPs of one decode step of ``num_seqs`` sequences (one new token each) whose
    contexts average ``mean_context`` tokens, on rank 0 (:func:`forward_flops`)."""
    return forward_flops(engine.executor.rank0.model.shapes, num_seqs, mean_context)


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


def roofline_seconds(
    nbytes: float, flops: float, bandwidth: float, flop_rate: float
) -> tuple[float, str]:
    """The least time of a step that reads ``nbytes`` at ``bandwidth`` bytes/s and computes
    ``flops`` at ``flop_rate`` FLOP/s, and which bounds it: ``(max(nbytes / bandwidth, flops
    / flop_rate), "memory" | "compute")``. Raises ``ValueError`` when a rate is not
    positive."""
    if bandwidth <= 0 or flop_rate <= 0:
        raise ValueError(f"rates must be > 0, got bandwidth={bandwidth}, flop_rate={flop_rate}")
    mem, comp = nbytes / bandwidth, flops / flop_rate
    return (mem, "memory") if mem >= comp else (comp, "compute")


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


class SteadyStepError(ValueError):
    """The all-decoding step could not be measured; the message says why."""


def steady_decode_step(llm, prompts: list[list[int]], steps: int, warm: int = 2) -> dict:
    """Time decode steps in which every prompt's request decodes, the step the roofline
    describes: the prompts are prefilled first (outside the timing; the prefix cache is
    emptied so each is computed), then ``warm`` steps, then ``steps`` steps timed as one
    span (the overlap scheduler keeps running; the device is synchronized at both ends).

    ``llm`` is a :class:`pdserve.engine.llm.LLM`; greedy, ``ignore_eos``. Returns
    ``{"step_s": seconds per step, "mean_context": tokens each row attends to at the
    middle of the span}``. Raises :class:`SteadyStepError` naming the reason when the step
    cannot be one of all ``len(prompts)`` rows: more prompts than
    ``max_running_requests``, a span longer than the context leaves room for, a request
    preempted (the pool too small) or ended (its context full) during the run. The
    requests are aborted at the end and the engine drained.
    """
    import torch

    from pdserve.engine.sampling_params import SamplingParams

    core = llm.engine
    n, limit = len(prompts), core.config.scheduler.max_running_requests
    if n > limit:
        raise SteadyStepError(f"{n} prompts do not fit one batch (max_running_requests {limit})")
    longest = max(len(p) for p in prompts)
    room = core.max_model_len - longest
    if warm + steps + 1 > room:
        raise SteadyStepError(
            f"{warm + steps + 1} decode steps do not fit a {longest}-token prompt's context "
            f"(max_model_len {core.max_model_len}): fewer --steady-steps"
        )
    llm.reset_prefix_cache()
    # Enough tokens that no request ends inside the span, however many its row decoded
    # while later prompts were still being prefilled; they are aborted after it.
    params = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
    ids = [f"steady-{id(prompts)}-{i}" for i in range(n)]
    for rid, prompt in zip(ids, prompts):
        core.add_request(rid, list(prompt), params)
    preempted = core.scheduler.num_preemptions
    reqs = [core._requests[rid] for rid in ids]
    while any(len(r.output_token_ids) == 0 for r in reqs):
        core.step()  # prefill (with a few decode rows) until every request decodes
    for _ in range(warm):
        core.step()
    sync = torch.cuda.synchronize if core.device.type == "cuda" else (lambda: None)
    sync()
    done = sum(len(r.output_token_ids) for r in reqs) / n
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync()
    step_s = (time.perf_counter() - t0) / steps
    preemptions = core.scheduler.num_preemptions - preempted
    ended = sum(r.finished for r in reqs)
    for rid in ids:
        core.abort_request(rid)
    while core.has_unfinished_requests():
        core.step()
    if preemptions:
        raise SteadyStepError(
            f"{preemptions} preemption(s) during the span: the KV pool does not hold {n} "
            "prompts' contexts (a larger --kv-cache-memory)"
        )
    if ended:
        raise SteadyStepError(f"{ended} request(s) reached the context limit inside the span")
    mean_prompt = sum(len(p) for p in prompts) / n
    return {"step_s": step_s, "mean_context": mean_prompt + done + steps / 2}
