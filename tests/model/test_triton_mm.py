"""The persistent TMA matmul (``model/triton_mm.py``) equals ``F.linear`` for any row count,
tile and persistent grid; ``mm_table`` decides where it runs (only past the GEMV's 64
rows). Kernels run on CPU under Triton's interpreter (this folder's conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import linear, mm_table, triton_mm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "config", [("mm64", 16, 16, 4, 2), ("mm64_ws", 32, 32, 4, 2), ("mm128", 16, 32, 4, 1)]
)
@pytest.mark.parametrize("m", [65, 130])  # an M tail in the last tile; several M tiles
@pytest.mark.parametrize("programs", [1, 4])
def test_mm_matches_linear_with_bias_and_tails(config, m, programs):
    """N = 40 and K = 48 are not multiples of the 32-wide tiles: the boxes past N, K, M read
    zeros and the stores past them are clipped; every output is the fp32 sum over all of K,
    the same bits whatever the grid."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 48, generator=gen).to(DEVICE)
    w = torch.randn(40, 48, generator=gen).to(DEVICE)
    b = torch.randn(40, generator=gen).to(DEVICE)
    for bias in (None, b):
        got = triton_mm.mm(x, w, bias, config, programs)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.shape == (m, 40) and got.dtype == x.dtype
        assert (got.double() - ref).abs().max().item() <= 1e-4
        assert torch.equal(got, triton_mm.mm(x, w, bias, config, 7))


def test_mm_rejects_unknown_kinds_and_unaligned_operands():
    x, w = torch.zeros(70, 16), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="not an mm kernel kind"):
        triton_mm.mm(x, w, None, ("tma", 16, 16, 4, 1))
    with pytest.raises(ValueError, match="16-byte"):
        triton_mm.mm(torch.zeros(70, 17)[:, :16], w, None, ("mm64", 16, 16, 4, 1))
    assert not triton_mm.supported(x, torch.zeros(8, 16, dtype=torch.float64))
    assert triton_mm.parse_kind("mm256_ws") == (256, True)
    assert triton_mm.parse_kind("mm96") is None


def test_pick_leaves_the_gemv_rows_alone_and_takes_the_smallest_measured_m():
    cfg = ("mm128", 128, 64, 8, 4)
    table = {("float32", 8, 16): ((128, None), (256, cfg))}
    w = torch.zeros(8, 16)
    assert triton_mm.pick(table, torch.zeros(64, 16), w) is None  # the GEMV's rows
    assert triton_mm.pick(table, torch.zeros(100, 16), w) is None  # 128: cuBLAS
    assert triton_mm.pick(table, torch.zeros(129, 16), w) == cfg
    assert triton_mm.pick(table, torch.zeros(257, 16), w) is None  # past the last: cuBLAS
    assert triton_mm.pick(table, torch.zeros(200, 16), torch.zeros(8, 32)) is None


def test_committed_table_is_well_formed():
    for (dtype, n, k), rows in mm_table.TABLE.items():
        assert dtype in ("bfloat16", "float16") and n > 0 and k > 0
        ms = [m for m, _ in rows]
        assert ms == sorted(ms) and len(set(ms)) == len(ms) and ms[0] >= triton_mm.MIN_ROWS
        for _, config in rows:
            assert config is None or (len(config) == 5 and triton_mm.parse_kind(config[0]))


def test_linear_stays_on_f_linear_off_cuda(monkeypatch):
    """The table is consulted for CUDA tensors only: on CPU linear() is F.linear."""
    monkeypatch.setattr(mm_table, "TABLE", {("float32", 8, 16): ((256, ("mm64", 16, 16, 4, 1)),)})
    x, w = torch.randn(100, 16), torch.randn(8, 16)
    assert torch.equal(linear.linear(x, w, None, None), F.linear(x, w))
