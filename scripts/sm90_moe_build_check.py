"""Build the MoE kernels (``pdserve/model/triton_moe.py``) for Hopper (sm_90) on a machine
without a GPU, with ``scripts/sm90_build_check.py``'s ``build``: the grouped GEMMs at
Qwen3-30B-A3B's shapes for each ``pick_config`` tile set (bf16 and fp32), the one-launch
routing + alignment at 2 and 64 tokens, and the few-token path's two GEMV kernels at each
``GemvConfig`` that ``gpu_moe_layer_ab.py`` times (2026-12-02: all built, no spills but one
register of the default bf16 gate/up GEMV). Prints shared memory, whether the dots became
warpgroup (HGMMA) or warp (HMMA) MMAs, and spills (LDL/STL). Builds, not speed.

``python3 scripts/sm90_moe_build_check.py [--new | --s7 | --s11]`` (TRITON_INTERPRET unset;
``--new``: session 6's kernels only, ``--s7``: session 7's, ``--s11``: the persistent
grouped GEMMs at ``scripts/gpu_s11_moegemm.py``'s tiles, with registers: the programs per SM
a plan asks for must fit beside each other). On 2026-12-02 with
Triton 3.9: every kernel built; bf16 tiles of 16/32 rows use HMMA, 64 rows HGMMA; no bf16
spills; route_align 2 KB / 32 KB of shared memory at 2 / 64 tokens, no spills.
"""

from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_build_check import build as _build
from sm90_build_check import sass_counts

from pdserve.model import triton_moe as tm

I32, I64, F32, BF16 = torch.int32, torch.int64, torch.float32, torch.bfloat16
H, INTER, E, K = 2048, 768, 128, 8
CONFIGS = [tm.pick_config(n * K, E) for n in (1, 1024, 16384)]


def _t(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(16, dtype=dtype)


def build(fn, args: dict, consts: dict, warps: int, stages: int):
    """``sm90_build_check.build`` with the kernels' optional features off where a call
    leaves them out (PDL, the routing counters, the fused top-k sum; the few-token gate/up
    on tensor cores): their arguments filled with placeholders."""
    off = dict(PDL=False, STATS=False, SUM=False, ROUTE=True, DOT=True, IEEE=False)
    off.update(TOP_K=K, BLOCK_J=K)
    consts = {**{k: v for k, v in off.items() if k in fn.arg_names}, **consts}
    filler = dict(stats_ptr=_t(torch.float64), sum_ptr=_t(BF16), cnt_ptr=_t(I32), s_st=H)
    args = {**{k: v for k, v in filler.items() if k in fn.arg_names}, **args}
    return _build(fn, args, consts, warps, stages)


def _report(name: str, kernel) -> None:
    c = sass_counts(kernel)
    print(
        f"{name:<58} shared {kernel.metadata.shared:>7}  HGMMA {c['HGMMA']:>3}  "
        f"HMMA {c['HMMA']:>3}  LDL {c['LDL']:>3}  STL {c['STL']:>3}"
    )


def main() -> None:
    if sys.argv[1:] == ["--new"]:
        new_kernels()
        return
    if sys.argv[1:] == ["--s7"]:
        s7_kernels()
        return
    if sys.argv[1:] == ["--s11"]:
        s11_kernels()
        return
    for cfg in CONFIGS:
        tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        for ieee, dt in ((False, BF16), (True, F32)):
            up = dict(x_ptr=_t(dt), w_ptr=_t(dt), act_ptr=_t(dt), ids_ptr=_t(I32))
            up.update(bexp_ptr=_t(I32), used_ptr=_t(I32), N=64 * K, K=H, INTER=INTER)
            up.update(s_xt=H, s_we=2 * INTER * H, s_wn=H, s_an=INTER)
            k1 = build(
                tm._gate_up_kernel,
                up,
                dict(TOP_K=K, IEEE=ieee, **tiles),
                cfg.num_warps,
                cfg.num_stages,
            )
            _report(f"gate_up {tuple(cfg)} {dt}", k1)
            down = dict(act_ptr=_t(dt), w_ptr=_t(dt), out_ptr=_t(dt), rw_ptr=_t(F32))
            down.update(ids_ptr=_t(I32), bexp_ptr=_t(I32), used_ptr=_t(I32), N=64 * K, K=INTER)
            down.update(HID=H, s_an=INTER, s_we=H * INTER, s_wn=INTER, s_on=H)
            k2 = build(
                tm._down_kernel, down, dict(IEEE=ieee, **tiles), cfg.num_warps, cfg.num_stages
            )
            _report(f"down {tuple(cfg)} {dt}", k2)
    for T in (2, 64):  # (an int argument of 1 is a constexpr to Triton: not buildable here)
        rows = tm.max_rows(T * K, E, 16)
        args = dict(logits_ptr=_t(BF16), w_ptr=_t(F32), ids_ptr=_t(I64), sorted_ptr=_t(I32))
        args.update(bexp_ptr=_t(I32), used_ptr=_t(I32), T=T, E=E, ROWS=rows, s_lt=E)
        consts = dict(TOP_K=K, RENORM=True, BLOCK_M=16, BLOCK_T=triton.next_power_of_2(T))
        consts.update(BLOCK_E=E, BLOCK_K=K, BLOCK_R=triton.next_power_of_2(rows))
        consts.update(BLOCK_B=triton.next_power_of_2(rows // 16), RANK_DOT=False, ROUTE=True)
        consts.update(PDL=False)
        warps = 8 if T * E > 2048 else 4
        _report(f"route_align {T} tokens", build(tm._route_align_kernel, args, consts, warps, 1))

    # the few-token path (route_experts_gemv), each GemvConfig the GPU A/B times
    for g in (
        tm.GemvConfig(),
        tm.GemvConfig(32, 256, 8, 8, 128, 8),
        tm.GemvConfig(8, 1024, 8, 2, 512, 8),
    ):
        for dt in (BF16, F32):
            args = dict(logits_ptr=_t(BF16), x_ptr=_t(dt), w_ptr=_t(dt), act_ptr=_t(dt))
            args.update(rw_ptr=_t(F32), ids_ptr=_t(I64), E=E, K=H, INTER=INTER, s_lt=E, s_xt=H)
            args.update(s_we=2 * INTER * H, s_wn=H, s_an=INTER)
            consts = dict(TOP_K=K, RENORM=True, BLOCK_E=E, BLOCK_N=g.up_n, BLOCK_K=g.up_k)
            consts.update(DOT=False, IEEE=False, PDL=False)
            k1 = build(tm._route_gate_up_kernel, args, consts, g.up_warps, 1)
            _report(f"route_gate_up_gemv {tuple(g)[:3]} {dt}", k1)
            args = dict(act_ptr=_t(dt), w_ptr=_t(dt), out_ptr=_t(dt), rw_ptr=_t(F32))
            args.update(ids_ptr=_t(I64), K=INTER, HID=H, s_an=INTER, s_we=H * INTER, s_wn=INTER)
            args.update(s_ot=H)
            consts = dict(TOP_K=K, BLOCK_J=K, BLOCK_N=g.down_n, BLOCK_K=g.down_k, PDL=False)
            k2 = build(tm._down_sum_gemv_kernel, args, consts, g.down_warps, 1)
            _report(f"down_sum_gemv {tuple(g)[3:]} {dt}", k2)

    new_kernels()


def new_kernels() -> None:
    """Session 6's kernels (scripts/gpu_s6_moe.py times them): the tensor-core few-token
    gate/up, the one-launch down + weights + top-k sum on tensor cores, the Triton top-k
    sum, and the grouped GEMMs at the sweep's smallest and largest tiles."""
    for bn, bk, warps, stages in ((16, 256, 4, 4), (32, 128, 4, 4), (16, 512, 4, 3)):
        args = dict(logits_ptr=_t(F32), x_ptr=_t(BF16), w_ptr=_t(BF16), act_ptr=_t(BF16))
        args.update(rw_ptr=_t(F32), ids_ptr=_t(I64), E=E, K=H, INTER=INTER, s_lt=E, s_xt=H)
        args.update(s_we=2 * INTER * H, s_wn=H, s_an=INTER)
        consts = dict(TOP_K=K, RENORM=True, BLOCK_E=E, BLOCK_N=bn, BLOCK_K=bk, IEEE=False)
        consts.update(DOT=True, PDL=False)
        k = build(tm._route_gate_up_kernel, args, consts, warps, stages)
        _report(f"route_gate_up_dot {(bn, bk, warps, stages)}", k)
    for bn, bk, warps, stages in (
        (16, 128, 4, 4),
        (16, 256, 4, 4),
        (16, 128, 4, 6),
        (32, 128, 4, 4),
    ):
        args = dict(act_ptr=_t(BF16), w_ptr=_t(BF16), out_ptr=_t(BF16), rw_ptr=_t(F32))
        args.update(ids_ptr=_t(I64), K=INTER, HID=H, s_an=INTER, s_we=H * INTER, s_wn=INTER)
        args.update(s_ot=H)
        consts = dict(TOP_K=K, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, PDL=False)
        k = build(tm._down_sum_dot_kernel, args, consts, warps, stages)
        _report(f"down_sum_dot {(bn, bk, warps, stages)}", k)
    args = dict(src_ptr=_t(BF16), dst_ptr=_t(BF16), H=H)
    k = build(tm._topk_sum_kernel, args, dict(TOP_K=K, BLOCK_K=K, BLOCK_H=1024), 4, 1)
    _report("topk_sum", k)
    for cfg in (tm.MoEConfig(16, 16, 512, 4, 3), tm.MoEConfig(64, 64, 128, 4, 3)):
        tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        up = dict(x_ptr=_t(BF16), w_ptr=_t(BF16), act_ptr=_t(BF16), ids_ptr=_t(I32))
        up.update(bexp_ptr=_t(I32), used_ptr=_t(I32), N=64 * K, K=H, INTER=INTER)
        up.update(s_xt=H, s_we=2 * INTER * H, s_wn=H, s_an=INTER)
        k = build(
            tm._gate_up_kernel,
            up,
            dict(TOP_K=K, IEEE=False, **tiles),
            cfg.num_warps,
            cfg.num_stages,
        )
        _report(f"gate_up {tuple(cfg)}", k)


def s7_kernels() -> None:
    """Session 7's kernels (scripts/gpu_s7_moe.py times them): route_align in one program
    with the rank as a cumsum or a tensor-core product, the split launches (routing in
    programs of a few tokens, then the alignment)."""
    for T in (2, 8, 16, 64):
        rows = tm.max_rows(T * K, E, 16)
        for dot in (False, True):
            bt = max(triton.next_power_of_2(T), 16 if dot else 1)
            align = dict(BLOCK_M=16, BLOCK_T=bt, BLOCK_E=E, BLOCK_R=triton.next_power_of_2(rows))
            align.update(BLOCK_B=triton.next_power_of_2(rows // 16), RANK_DOT=dot, TOP_K=K)
            args = dict(logits_ptr=_t(F32), w_ptr=_t(F32), ids_ptr=_t(I64), sorted_ptr=_t(I32))
            args.update(bexp_ptr=_t(I32), used_ptr=_t(I32), T=T, E=E, ROWS=rows, s_lt=E)
            for warps in (1, 8):
                consts = dict(RENORM=True, BLOCK_K=K, ROUTE=True, PDL=False, **align)
                k = build(tm._route_align_kernel, args, consts, warps, 1)
                _report(f"route_align one {T} tokens w{warps} dot {dot}", k)
            consts = dict(RENORM=True, BLOCK_K=K, ROUTE=False, PDL=False, **align)
            k = build(tm._route_align_kernel, args, consts, 4, 1)
            _report(f"align (ids) {T} tokens dot {dot}", k)
        for tpp, warps in ((1, 1), (4, 1), (16, 4)):
            args = dict(logits_ptr=_t(F32), w_ptr=_t(F32), ids_ptr=_t(I64), T=T, E=E, s_lt=E)
            consts = dict(TOP_K=K, RENORM=True, BLOCK_T=min(tpp, triton.next_power_of_2(T)))
            consts.update(BLOCK_E=E, BLOCK_K=K, PDL=False)
            k = build(tm._route_kernel, args, consts, warps, 1)
            _report(f"route {T} tokens tpp {tpp} w{warps}", k)


def s11_kernels() -> None:
    """Session 11's persistent grouped GEMMs (``_gate_up_persist_kernel``,
    ``_down_persist_kernel``, bf16, PDL on, the half tile where the row block is >= 32) at
    the tiles of ``scripts/gpu_s11_moegemm.py``'s plans (and one with the tiles handed out by
    the device counter, ``DYN``): shared memory, registers, MMAs,
    cp.async loads (LDGSTS: the K loop pipelined) and spills. (2026-12-04, Triton 3.9 and
    3.6: all built, HMMA, no spills but one register of (32, 64, 128, 4, 3)'s gate/up on 3.6.)"""
    from sm90_build_check import registers

    tiles = [(16, 64, 128, 4, 3), (32, 32, 128, 4, 4), (32, 64, 128, 4, 3), (32, 64, 64, 4, 4),
             (32, 16, 256, 4, 4), (32, 32, 256, 4, 3)]  # fmt: skip
    for cfg, dyn in [(tm.MoEConfig(*t), False) for t in tiles] + [(tm.MoEConfig(*tiles[1]), True)]:
        consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        consts.update(HALF=cfg.block_m >= 32, DYN=dyn, IEEE=False, PDL=True)
        up = dict(x_ptr=_t(BF16), w_ptr=_t(BF16), act_ptr=_t(BF16), ids_ptr=_t(I32))
        up.update(bexp_ptr=_t(I32), used_ptr=_t(I32), cnt_ptr=_t(I32), N=64 * K, K=H)
        up.update(INTER=INTER, s_xt=H, s_we=2 * INTER * H, s_wn=H, s_an=INTER)
        k1 = build(tm._gate_up_persist_kernel, up, dict(TOP_K=K, **consts), cfg.num_warps,
                   cfg.num_stages)  # fmt: skip
        down = dict(act_ptr=_t(BF16), w_ptr=_t(BF16), out_ptr=_t(BF16), rw_ptr=_t(F32))
        down.update(ids_ptr=_t(I32), bexp_ptr=_t(I32), used_ptr=_t(I32), cnt_ptr=_t(I32))
        down.update(N=64 * K, K=INTER, HID=H, s_an=INTER, s_we=H * INTER, s_wn=INTER, s_on=H)
        k2 = build(tm._down_persist_kernel, down, consts, cfg.num_warps, cfg.num_stages)
        tag = " dyn" if dyn else ""
        for name, k in ((f"gate_up persist {tuple(cfg)}{tag}", k1),
                        (f"down persist {tuple(cfg)}{tag}", k2)):  # fmt: skip
            c = sass_counts(k)
            print(f"{name:<44} shared {k.metadata.shared:>6}  regs {registers(k):>3}  "
                  f"HMMA {c['HMMA']:>3}  HGMMA {c['HGMMA']:>2}  LDGSTS {c['LDGSTS']:>3}  "
                  f"LDL {c['LDL']:>2}  STL {c['STL']:>2}")  # fmt: skip


if __name__ == "__main__":
    main()
