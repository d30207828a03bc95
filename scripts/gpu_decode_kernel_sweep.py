"""Split-KV decode kernel sweep (issue 10): split count x BLOCK_N x num_warps of the split +
merge kernels at batch 1/64 and contexts 200/1000/4000 (bf16, Llama-8B heads, page size 16).
At batch 1 the timings are launch-bound (two kernels outside a graph): compare batch 64.

Run on the GPU machine from the repo root: ``python3 scripts/gpu_decode_kernel_sweep.py``.
"""
import torch, triton
from triton.testing import do_bench
from pdserve.model.triton_kernels import decode_split_kernel, decode_merge_kernel
from pdserve.model.triton_backend import num_decode_splits
torch.manual_seed(0)
Hq, Hkv, D, PS = 32, 8, 128, 16
G = Hq // Hkv
res = []
for B, ctx in ((1, 200), (64, 200), (64, 1000), (1, 4000)):
    npg = -(-ctx // PS)
    P = B * npg * 3  # several sets: rotate to defeat L2
    kc = torch.randn(P, PS, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = [torch.randperm(P, device="cuda")[: B * npg].view(B, npg).to(torch.int32).contiguous() for _ in range(3)]
    sl = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = 2 * B * ctx * Hkv * D * 2
    auto = num_decode_splits(B, Hkv, None)
    ref = None
    for S in sorted({auto, 1, 2, 4, 8, 16, 32}):
        if B == 1 and S < 4: continue
        for BN in (32, 64):
            for nw in (2, 4, 8):
                mid_o = torch.empty(B, Hq, S, D, device="cuda", dtype=torch.float32)
                mid_l = torch.empty(B, Hq, S, device="cuda", dtype=torch.float32)
                it = [0]
                def f():
                    it[0] = (it[0] + 1) % 3
                    t = tables[it[0]]
                    decode_split_kernel[(B, Hkv, S)](q, kc, vc, t, sl, mid_o, mid_l, 0.088, q.stride(0), q.stride(1), *kc.stride()[:3], *vc.stride()[:3], t.stride(0), *mid_o.stride()[:3], *mid_l.stride()[:2], G=G, D=D, PAGE_SIZE=PS, NUM_SPLITS=S, BLOCK_H=16, BLOCK_N=BN, BLOCK_D=128, IEEE=False, num_warps=nw)
                    decode_merge_kernel[(B, Hq)](mid_o, mid_l, out, *mid_o.stride()[:3], *mid_l.stride()[:2], out.stride(0), out.stride(1), D=D, NUM_SPLITS=S, BLOCK_S=max(1, triton.next_power_of_2(S)), BLOCK_D=128)
                try:
                    ms = do_bench(f, warmup=20, rep=60, return_mode="median")
                except Exception as e:
                    print("fail", B, ctx, S, BN, nw, str(e)[:80]); continue
                it[0] = 2; f(); torch.cuda.synchronize()
                o = out.float().clone()
                if ref is None: ref = o
                err = (o - ref).abs().max().item()
                res.append((B, ctx, S, BN, nw, ms * 1e3, kv_bytes / ms / 1e9, err, S == auto and BN == 64 and nw == 4))
    print(f"B={B} ctx={ctx} auto splits {auto}")
    mine = sorted([r for r in res if r[0] == B and r[1] == ctx], key=lambda r: r[5])
    cur = [r for r in mine if r[8]][0]
    print(f"  current S={cur[2]} BN=64 nw=4: {cur[5]:.1f} us {cur[6]:.0f} GB/s")
    for r in mine[:6]:
        print(f"  S={r[2]:2d} BN={r[3]:2d} nw={r[4]}: {r[5]:6.1f} us {r[6]:5.0f} GB/s err {r[7]:.1e}")
