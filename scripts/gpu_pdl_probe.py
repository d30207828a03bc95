"""PDL probe: a 32-layer chain shaped like a bs-64 Llama-8B decode step (norm, qkv GEMV,
add+norm, o_proj, add+norm, gate_up, silu*mul, down split-K 2 + reduce, add), captured in one
CUDA graph, with GEMVs by cuBLAS or by a Triton dot kernel, and Triton kernels launched with
and without programmatic dependent launch (gdc_wait / gdc_launch_dependents)."""

import json
import os
import statistics

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

M, H, L = 64, 4096, 32


@triton.jit
def gemv_k(
    x_ptr,
    w_ptr,
    o_ptr,
    N,
    K,
    K_SPLIT,
    s_xm,
    s_wn,
    s_om,
    s_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = k_lo + K_SPLIT
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    wp = w_ptr + rn[None, :].to(tl.int64) * s_wn + rk[:, None]
    if PDL:
        gdc_launch_dependents()
        if PREFETCH:
            w0 = tl.load(wp + k_lo)
            gdc_wait()
            x0 = tl.load(x_ptr + rm[:, None] * s_xm + (k_lo + rk)[None, :])
            acc += tl.dot(x0, w0)
            k_lo += BLOCK_K
        else:
            gdc_wait()
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = tl.load(x_ptr + rm[:, None] * s_xm + (k0 + rk)[None, :])
        w = tl.load(wp + k0)
        acc += tl.dot(x, w)
    if SPLIT_K == 1:
        tl.store(o_ptr + rm[:, None] * s_om + rn[None, :], acc.to(o_ptr.dtype.element_ty))
    else:
        tl.store(o_ptr + tl.program_id(1) * s_os + rm[:, None] * s_om + rn[None, :], acc)


@triton.jit
def reduce_k(p_ptr, res_ptr, MN, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """res += p[0] + p[1] (split-K 2 partials, fp32), fused residual add."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(p_ptr + r) + tl.load(p_ptr + MN + r)
    h = tl.load(res_ptr + r).to(tl.float32)
    tl.store(res_ptr + r, (h + acc.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16))


@triton.jit
def add_norm_k(
    y_ptr, s_y, h_ptr, w_ptr, x_ptr, ADD: tl.constexpr, N: tl.constexpr, PDL: tl.constexpr
):
    """h += y (if ADD); x = rmsnorm(h) * w; one program a row."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    c = tl.arange(0, N)
    h = tl.load(h_ptr + row * N + c).to(tl.float32)
    if ADD:
        h = (h + tl.load(y_ptr + row * s_y + c).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        tl.store(h_ptr + row * N + c, h.to(tl.bfloat16))
    var = tl.sum(h * h, 0) / N
    x = h * tl.rsqrt(var + 1e-5) * tl.load(w_ptr + c).to(tl.float32)
    tl.store(x_ptr + row * N + c, x.to(tl.bfloat16))


@triton.jit
def silu_k(g_ptr, o_ptr, I: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(g_ptr + row * 2 * I + c).to(tl.float32)
    u = tl.load(g_ptr + row * 2 * I + I + c).to(tl.float32)
    tl.store(o_ptr + row * I + c, (g / (1 + tl.exp(-g)) * u).to(tl.bfloat16))


CFG = {  # name: (N, K, BLOCK_N, BLOCK_K, warps, stages, split)
    "qkv": (6144, 4096, 64, 128, 4, 4, 1),
    "o_proj": (4096, 4096, 32, 128, 4, 5, 1),
    "gate_up": (28672, 4096, 256, 64, 8, 4, 1),
    "down": (4096, 14336, 64, 128, 4, 4, 2),
}


def main():
    dev = "cuda"
    torch.manual_seed(0)
    W = {
        n: [torch.randn(c[0], c[1], device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(L)]
        for n, c in CFG.items()
    }
    nw = torch.ones(H, device=dev, dtype=torch.bfloat16)
    h0 = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    h = h0.clone()
    x = torch.empty(M, H, device=dev, dtype=torch.bfloat16)
    y = {n: torch.empty(M, c[0], device=dev, dtype=torch.bfloat16) for n, c in CFG.items()}
    part = torch.empty(2, M, H, device=dev, dtype=torch.float32)
    act = torch.empty(M, 14336, device=dev, dtype=torch.bfloat16)

    def lin(name, inp, l, mode, pdl, pre):
        N, K, bn, bk, w, st, sp = CFG[name]
        wt = W[name][l]
        if mode == "cublas":
            if name == "down":
                torch.matmul(inp, wt.t(), out=y["down"])
                return y["down"]
            torch.matmul(inp, wt.t(), out=y[name])
            return y[name]
        dst = part if sp > 1 else y[name]
        kw = dict(num_warps=w, num_stages=st)
        if pdl:
            kw["launch_pdl"] = True
        gemv_k[(N // bn, sp)](
            inp,
            wt,
            dst,
            N,
            K,
            K // sp,
            inp.stride(0),
            wt.stride(0),
            N,
            M * N,
            BLOCK_M=64,
            BLOCK_N=bn,
            BLOCK_K=bk,
            SPLIT_K=sp,
            PDL=pdl,
            PREFETCH=pre,
            **kw,
        )
        return None if sp > 1 else y[name]

    def step(mode, pdl, pre):
        kw = dict(launch_pdl=True) if pdl else {}
        for l in range(L):
            add_norm_k[(M,)](h, H, h, nw, x, ADD=False, N=H, PDL=pdl, num_warps=8, **kw)
            q = lin("qkv", x, l, mode, pdl, pre)
            add_norm_k[(M,)](q, q.stride(0), h, nw, x, ADD=True, N=H, PDL=pdl, num_warps=8, **kw)
            o = lin("o_proj", x, l, mode, pdl, pre)
            add_norm_k[(M,)](o, o.stride(0), h, nw, x, ADD=True, N=H, PDL=pdl, num_warps=8, **kw)
            g = lin("gate_up", x, l, mode, pdl, pre)
            silu_k[(M, 14336 // 2048)](g, act, I=14336, BLOCK=2048, PDL=pdl, num_warps=8, **kw)
            d = lin("down", act, l, mode, pdl, pre)
            if d is None:
                reduce_k[(M * H // 1024,)](part, h, M * H, BLOCK=1024, PDL=pdl, num_warps=4, **kw)
            else:
                add_norm_k[(M,)](
                    d, d.stride(0), h, nw, x, ADD=True, N=H, PDL=pdl, num_warps=8, **kw
                )

    res = {}
    outs = {}
    for tag, mode, pdl, pre in [
        ("cublas", "cublas", False, False),
        ("cublas+pdl_small", "cublas", True, False),
        ("triton", "triton", False, False),
        ("triton+pdl", "triton", True, False),
        ("triton+pdl+prefetch", "triton", True, True),
    ]:
        try:
            h.copy_(h0)
            step(mode, pdl, pre)  # compile / warm
            torch.cuda.synchronize()
            h.copy_(h0)
            step(mode, pdl, pre)
            torch.cuda.synchronize()
            outs[tag] = h.clone()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                step(mode, pdl, pre)
            torch.cuda.synchronize()
            ts = []
            for _ in range(7):
                h.copy_(h0)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(5):
                    g.replay()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) / 5)
            h.copy_(h0)
            g.replay()
            torch.cuda.synchronize()
            same = torch.equal(h, outs[tag])
            res[tag] = dict(ms=statistics.median(ts), runs=ts, graph_equals_eager=same)
            print(
                f"{tag:24s} {statistics.median(ts):.3f} ms per 32-layer step  graph==eager {same}",
                flush=True,
            )
        except Exception as e:  # noqa
            res[tag] = dict(error=repr(e)[:400])
            print(tag, "FAILED", repr(e)[:400], flush=True)
    for t in outs:
        if t.startswith("triton") and "triton" in outs:
            print(t, "equal to triton no-pdl:", torch.equal(outs[t], outs["triton"]))
    with open(os.path.join(os.environ.get("OUT", "."), "pdl_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
