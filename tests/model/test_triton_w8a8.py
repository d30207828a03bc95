"""The FP8 kernels of ``model/triton_w8a8.py`` (Triton's interpreter on CPU, the kernels
themselves on CUDA) and ``fp8.linear``'s paths over them:

- ``quantize_rows`` (one launch) gives the same bits as the torch reference
  ``fp8.quantize_rows_torch``: scales and e4m3 values, ties to even, zero rows, -0, K
  over one tile;
- ``w8a8`` (e4m3 x e4m3, per-token x per-channel scales, bias) against the dequantized
  product in fp32, swapped and plain tiles, split K, ragged N, K and M (the interpreter
  runs the e4m3 ``tl.dot``; on CUDA the FP8 tensor cores run); the same tiles on fp16 and
  bf16 activations (``linear_w8a16``; on CPU bf16 through the kernel's fp32 ``EMULATE``
  branch, the interpreter's bf16 dot being wrong);
- the one-row ``gemv`` against the dequantized weight;
- ``fp8.path_for`` / ``choose_paths`` (with a timer of the test's: real timing needs a GPU)
  and ``fp8.linear`` through each Triton path.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.model import fp8, triton_w8a8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = fp8.quantize_per_channel(torch.randn(n, k, generator=g) * 0.1)
    return fp8.Fp8Weight(q.to(DEVICE), s.to(DEVICE), k)


def _bits(t):
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m, k", [(3, 160), (2, 8200)])  # one tile; two passes over 2 tiles
def test_quantize_rows_same_bits_as_torch(m, k, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, :3] = torch.tensor([-0.0, 1e-30, -1e-30])  # -0 and values that round to (-)0
    if m > 2:
        x[2] = 0.0  # an all-zero row: scale 1e-12 / 448, values 0
    # row 1 with amax 448 (scale 1): e4m3 ties (84 between 80 and 88, 12.5 between 12 and 13)
    # and just below a binade (124.3 -> 128, 447 -> 448)
    x[1, :6] = torch.tensor([448.0, 84.0, -12.5, 124.3, 447.0, 0.0068359375])
    x = x.to(DEVICE)
    q, s = triton_w8a8.quantize_rows(x)
    rq, rs = fp8.quantize_rows_torch(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k)
    assert s.dtype == torch.float32 and s.shape == (m, 1)
    assert torch.equal(s.cpu(), rs.cpu())
    # the same codes, but for the sign of a zero (CUDA's torch cast keeps -0, the kernel
    # writes +0: the H200 showed exactly those two codes differing, nothing else)
    nonzero = (rq.float() != 0).cpu()  # (a CPU mask: _bits is on the CPU)
    assert torch.equal(_bits(q)[nonzero], _bits(rq)[nonzero])
    assert torch.equal((q.float() == 0).cpu(), ~nonzero)
    assert q[1, 1].item() == 80.0 and q[1, 2].item() == -12.0 and q[1, 3].item() == 128.0
    # fp8.quantize_rows is the kernel on CUDA, the torch form elsewhere: the same codes
    # either way, but for the sign of a zero on CUDA (as above)
    fq = fp8.quantize_rows(x)[0]
    assert torch.equal(_bits(fq)[nonzero], _bits(rq)[nonzero])
    assert torch.equal((fq.float() == 0).cpu(), ~nonzero)


def _w8a8_ref(xq, xs, w, bias):
    return (xq.float().cpu() * xs.cpu()) @ w.dequantize().cpu().T + (
        0.0 if bias is None else bias.float().cpu()
    )


W8A8_CASES = [
    # (m, config, k): swapped and plain tiles, K whole or in 2-3 slices, 17 rows in a 32-row
    # tile, K ragged to BLOCK_K (160) or a multiple of it (256: EVEN_K). Few cases: each
    # constexpr set is a compile on CUDA.
    (1, ("w8a8", 16, 16, 32, 1, True, 4, 1), 160),
    (3, ("w8a8", 16, 32, 64, 3, True, 4, 1), 256),
    (17, ("w8a8", 32, 16, 32, 2, True, 4, 1), 160),
    (3, ("w8a8", 16, 16, 32, 1, False, 4, 1), 256),
    (40, ("w8a8", 16, 32, 64, 2, False, 4, 1), 160),
]


@pytest.mark.parametrize("m, config, k", W8A8_CASES)
def test_w8a8_matches_dequantized(m, config, k):
    n = 48  # not a multiple of BLOCK_N 32
    w = _weight(n, k)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    xq, xs = triton_w8a8.quantize_rows(x)
    for b in (bias, None):
        ref = _w8a8_ref(xq, xs, w, b)
        got = triton_w8a8.w8a8(xq, xs, w.weight, w.scale, b, torch.float32, config)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # exact products, fp32 sums in another order; on CUDA the FP8 tensor cores' own
        # accumulation (Hopper's e4m3 MMA keeps fewer accumulator bits than fp32)
        tol = 2e-3 if DEVICE == "cuda" else 1e-4
        assert (got.cpu() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())
    out = triton_w8a8.linear_w8a8(x, w.weight, w.scale, bias, config)  # quantize + w8a8
    assert out.dtype == torch.bfloat16
    ref = _w8a8_ref(xq, xs, w, bias)
    assert (out.float().cpu() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    # the same tiles on 16-bit activations (not quantized): x @ real(w).T; fp16 runs the
    # kernel's own dot under the interpreter too, bf16 its EMULATE branch there
    for dt in (torch.bfloat16, torch.float16) if DEVICE == "cpu" else (torch.bfloat16,):
        xh, bh = x.to(dt), bias.to(dt)
        out16 = triton_w8a8.linear_w8a16(xh, w.weight, w.scale, bh, config)
        ref16 = xh.float().cpu() @ w.dequantize().cpu().T + bh.float().cpu()
        assert out16.dtype == dt and out16.shape == (m, n)
        err = (out16.float().cpu() - ref16).abs().max().item()
        assert err < 1e-2 * ref16.abs().max().item()
    with pytest.raises(ValueError, match="bf16/fp16"):
        triton_w8a8.linear_w8a16(x.float(), w.weight, w.scale, bias, config)


def test_w8a8_default_and_candidates():
    assert triton_w8a8.default_w8a8_config(4, 4096, 4096)[:6] == ("w8a8", 16, 64, 128, 4, True)
    assert triton_w8a8.default_w8a8_config(256, 28672, 4096)[:6] == (
        "w8a8",
        64,
        128,
        128,
        1,
        False,
    )
    for m in (1, 2, 16, 48, 64, 128, 256):
        cands = triton_w8a8.candidate_configs(m, 4096, 14336)
        assert cands and all(min(c[1:4]) >= triton_w8a8.MIN_BLOCK for c in cands)
        assert any(c[4] > 1 for c in cands)  # 4096 / 64 tiles leave SMs idle: split offered
        assert all(c[1] >= min(m, 64) for c in cands)  # one row tile holds up to 64 rows
    with pytest.raises(ValueError, match="w8a8 tile"):
        w = _weight(48, 160)
        xq, xs = triton_w8a8.quantize_rows(torch.randn(2, 160).to(DEVICE))
        triton_w8a8.w8a8(
            xq, xs, w.weight, w.scale, None, torch.float32, ("w8a8", 8, 16, 32, 1, True, 4, 1)
        )


@pytest.mark.parametrize(
    "config, k",
    [(("gemv", 16, 32, 4, 1), 160), (("gemv", 16, 32, 4, 1), 256), (("gemv", 8, 128, 4, 1), 256)],
)
def test_gemv_matches_dequantized(config, k):
    n = 40
    w = _weight(n, k, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).to(DEVICE)
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16).to(DEVICE)
    ref = x.float().cpu() @ w.dequantize().cpu().T + bias.float().cpu()
    got = triton_w8a8.gemv(x, w.weight, w.scale, bias, config)
    assert got.shape == (1, n) and got.dtype == torch.bfloat16
    assert (got.float().cpu() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    xf = x.float()
    got32 = triton_w8a8.gemv(xf, w.weight, w.scale, None, config)
    assert (got32.cpu() - (ref - bias.float().cpu())).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="one row"):
        triton_w8a8.gemv(torch.cat([x, x]), w.weight, w.scale, None, config)


@pytest.mark.parametrize("config, k", [(("gemv", 16, 32, 4, 1), 160), (("gemv", 8, 64, 4, 1), 100)])
def test_gemv_with_silu_mul_equals_the_activation_then_the_gemv(config, k):
    """SwiGLU inside the FP8 gemv: ``[gate | up]`` in, the same output as
    ``fused_ops.silu_mul`` then the gemv (fp32: the same arithmetic), ragged K too."""
    from pdserve.model.fused_ops import silu_mul

    n = 40
    w = _weight(n, k, seed=6)
    g = torch.Generator().manual_seed(7)
    gate_up = (torch.randn(1, 2 * k, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(n, generator=g) * 0.1).to(DEVICE)
    want = triton_w8a8.gemv(silu_mul(gate_up), w.weight, w.scale, bias, config)
    got = triton_w8a8.gemv(gate_up, w.weight, w.scale, bias, config, silu_mul=True)
    assert got.shape == (1, n)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    with pytest.raises(ValueError, match="silu_mul"):
        triton_w8a8.gemv(gate_up[:, :k], w.weight, w.scale, None, config, silu_mul=True)


def test_linear_silu_mul_runs_only_where_the_gemv_is_the_path(monkeypatch):
    """fp8.linear_silu_mul: None (the caller runs the activation, then the linear) while
    FUSE_SILU_GEMV is off, off CUDA, for more than one row, or where the shape's one-row
    path is not the gemv."""
    w = _weight(48, 160)
    x = torch.randn(1, 320)
    monkeypatch.setattr(fp8, "FUSE_SILU_GEMV", False)
    assert fp8.linear_silu_mul(x, w, None) is None
    monkeypatch.setattr(fp8, "FUSE_SILU_GEMV", True)
    assert fp8.linear_silu_mul(x, w, None) is None  # a CPU tensor
    assert fp8.linear_silu_mul(torch.randn(2, 320), w, None) is None


def test_path_for_reads_the_table(monkeypatch):
    monkeypatch.setitem(
        fp8.PATHS, (48, 160), ((1, ("gemv", None)), (8, ("w8a8", None)), (64, ("w8a16", None)))
    )
    assert fp8.path_for(1, 48, 160) == ("gemv", None)
    assert fp8.path_for(5, 48, 160) == ("w8a8", None)
    assert fp8.path_for(48, 48, 160) == ("w8a16", None)
    assert fp8.path_for(65, 48, 160) == ("w8a16", None)  # past the table: its last entry
    assert fp8.path_for(4, 64, 64) == ("w8a16", None)  # a shape not timed
    assert fp8.path_for(32, 64, 64) == ("scaled_mm", None)
    assert fp8.path_for(32, 64, 40) == ("w8a16", None)  # K not a multiple of 16
    with pytest.raises(ValueError, match="path kind"):
        fp8.run_path(("cublas", None), torch.zeros(1, 160), _weight(48, 160), None)


def test_choose_paths_records_the_fastest(monkeypatch):
    """choose_paths with a timer of the test's: it runs each candidate once (so each
    Triton path runs here, the interpreter on CPU), raises for one kind (left out, logged)
    and times the w8a8 tiles fastest from 4 rows, the gemv at one row (the w8a16 kernel's
    bf16 dot is wrong under the interpreter, so on CPU it is left out from 4 rows: the
    check before timing)."""
    monkeypatch.setattr(fp8, "PATHS", {})
    monkeypatch.setattr(fp8, "PATH_TIMINGS", {})
    ran: list[tuple[int, str]] = []

    def timer(path, fns):
        kind, config = path
        if kind == "scaled_mm":
            raise RuntimeError("no cuBLAS here")
        out = fns[0]()
        ran.append((out.shape[0], kind))
        if kind == "gemv":
            return 1.0
        if kind == "w8a8":
            return 2.0 + config[1] / 1000.0  # the smallest BLOCK_M is fastest
        if kind == "w8a16s":
            return 2.5
        return 3.0 if out.shape[0] < 4 else 4.0

    ws = [_weight(64, 64, seed=i) for i in range(3)]
    block = fp8.Fp8Weight(*fp8.quantize_block(torch.randn(64, 64), (32, 32)), 32)
    if DEVICE == "cuda":
        block = fp8.Fp8Weight(block.weight.cuda(), block.scale.repeat_interleave(32, 0).cuda(), 32)
    chosen = fp8.choose_paths([*ws, block], rows=(1, 4, 16), copies=2, timer=timer)
    assert set(chosen) == {(64, 64)}  # the block-scaled weight is not timed
    entry = dict(chosen[(64, 64)])
    assert entry[1][0] == "gemv"
    assert entry[4][0] == "w8a8" and entry[4][1][1] == 16
    assert entry[16][0] == "w8a8"
    assert fp8.PATHS[(64, 64)] == chosen[(64, 64)]
    assert {kind for _, kind in ran} == {"gemv", "w8a8", "w8a16s", "w8a16"}
    timings = fp8.PATH_TIMINGS[(64, 64)]
    assert sorted(timings) == [1, 4, 16] and not any("scaled_mm" in p for p in timings[16])
    assert any("scaled_mm" in p for p in fp8.candidate_paths(16, 64, 64))  # tried, raised
    # linear now runs the recorded paths (on CPU linear dequantizes: run_path is the check)
    g = torch.Generator().manual_seed(6)
    for m in (1, 3, 12):
        x = torch.randn(m, 64, generator=g).to(torch.bfloat16).to(DEVICE)
        path = fp8.path_for(m, 64, 64)
        got = fp8.run_path(path, x, ws[0], None)
        ref = x.float().cpu() @ ws[0].dequantize().cpu().T
        assert (got.float().cpu() - ref).abs().max().item() < 0.05 * ref.abs().max().item()
        if DEVICE == "cuda":
            assert torch.equal(fp8.linear(x, ws[0], None), got)
    assert fp8.choose_paths(ws, rows=(1,), timer=timer) == {}  # already chosen: not again


def test_choose_paths_leaves_out_a_wrong_kernel(monkeypatch):
    """A candidate whose output is off (here the gemv returning zeros, timed fastest) is
    not chosen: choose_paths checks each against the dequantized product first."""
    monkeypatch.setattr(fp8, "PATHS", {})
    monkeypatch.setattr(fp8, "PATH_TIMINGS", {})
    monkeypatch.setattr(triton_w8a8, "gemv", lambda x, w, s, b, c=None: torch.zeros_like(x[:, :64]))
    timed: list[str] = []

    def timer(path, fns):
        timed.append(path[0])
        return {"gemv": 1.0, "w8a16": 2.0}.get(path[0], 3.0)

    chosen = fp8.choose_paths([_weight(64, 64)], rows=(1,), timer=timer)
    assert chosen[(64, 64)] == ((1, ("w8a16", None)),)
    assert "gemv" not in timed and "w8a16" in timed


def test_measured_table_is_taken_without_timing(monkeypatch):
    """A shape that fp8_paths_table lists for this card is copied into PATHS, not timed."""
    from pdserve.model import fp8_paths_table

    monkeypatch.setattr(fp8, "PATHS", {})
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    entry = ((1, ("gemv", ("gemv", 8, 512, 4, 1))), (64, ("w8a16", None)))
    monkeypatch.setitem(fp8_paths_table.TABLE, (card, 64, 64), entry)
    monkeypatch.setitem(fp8_paths_table.TABLE, ("another card", 48, 160), entry)

    def timer(path, fns):
        raise AssertionError("timed a listed shape")

    assert fp8.choose_paths([_weight(64, 64)], timer=timer) == {(64, 64): entry}
    assert fp8.path_for(1, 64, 64) == ("gemv", ("gemv", 8, 512, 4, 1))
    timed: list[str] = []
    fp8.choose_paths([_weight(48, 160)], rows=(1,), timer=lambda p, f: timed.append(p[0]) or 1.0)
    assert timed  # listed for another card only: timed here


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_choose_paths_times_on_the_gpu(monkeypatch):
    """On CUDA, with the real timer (CUDA graphs): choose_paths records a path for each row
    count from the timings of several kinds, and fp8.linear then agrees with the
    dequantized product at those row counts and between them."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    monkeypatch.setattr(fp8, "PATHS", {})
    monkeypatch.setattr(fp8, "PATH_TIMINGS", {})
    ws = [_weight(512, 1024, seed=i) for i in range(3)]
    chosen = fp8.choose_paths(ws, rows=(1, 4, 64))
    assert [m for m, _ in chosen[(512, 1024)]] == [1, 4, 64]
    timings = fp8.PATH_TIMINGS[(512, 1024)]
    kinds = {p.split("'")[1] for row in timings.values() for p in row}
    assert {"gemv", "w8a8", "w8a16s", "w8a16", "scaled_mm"} <= kinds
    assert all(us > 0 for row in timings.values() for us in row.values())
    g = torch.Generator().manual_seed(7)
    for m in (1, 3, 4, 40, 64, 100):
        x = torch.randn(m, 1024, generator=g).to(torch.bfloat16).cuda()
        ref = x.float() @ ws[0].dequantize().T
        err = fp8.relative_error(fp8.linear(x, ws[0], None), ref)
        assert err < 0.05, (m, fp8.path_for(m, 512, 1024), err)
    assert fp8.path_for(100, 512, 1024) == chosen[(512, 1024)][-1][1]  # past the last: it


@pytest.mark.parametrize("silu", [False, True])
def test_gemv_early_weight_read_gives_the_same_bits(monkeypatch, silu):
    """GEMV_EARLY_WEIGHTS moves only the first weight tile's read before the PDL wait: the
    same output bits, ragged K (one partial tile) and several tiles."""
    for k in (100, 160):
        w = _weight(24, k, seed=5)
        g = torch.Generator().manual_seed(k)
        x = torch.randn(1, 2 * k if silu else k, generator=g).to(DEVICE)
        config = ("gemv", 8, 64, 4, 1)
        monkeypatch.setattr(triton_w8a8, "GEMV_EARLY_WEIGHTS", False)
        want = triton_w8a8.gemv(x, w.weight, w.scale, None, config, silu_mul=silu)
        monkeypatch.setattr(triton_w8a8, "GEMV_EARLY_WEIGHTS", True)
        got = triton_w8a8.gemv(x, w.weight, w.scale, None, config, silu_mul=silu)
        assert torch.equal(got, want)
