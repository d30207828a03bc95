"""The Triton FP8-weight matmul (``model/triton_fp8.py``; Triton's interpreter on CPU, the
kernel itself on CUDA) against the dequantized weight: one row and several, ragged N and K,
one scale per row and block scales, K split or not, with and without bias; and
``fp8.linear``'s default path. References are computed on the CPU in fp32, so a CUDA run
compares against the same numbers (no TF32 in the reference); fp32 activations run the
kernel's dots in IEEE fp32 on CUDA too, hence the same 1e-4 bound on both devices."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import fp8, triton_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    if block is None:
        q, s = fp8.quantize_per_channel(w)
        return fp8.Fp8Weight(q.to(DEVICE), s.to(DEVICE), k)
    q, s = fp8.quantize_block(w, block)
    rows = s.repeat_interleave(block[0], 0)[:n].contiguous()
    return fp8.Fp8Weight(q.to(DEVICE), rows.to(DEVICE), block[1])


def _ref(x, w):
    """``x @ real(w).T`` in fp32 on the CPU (exact fp32 products, whatever the device)."""
    return x.float().cpu() @ w.dequantize().cpu().T


# Triton's CPU interpreter computes tl.dot of bf16 tiles wrongly (bf16 x bf16 of plain
# torch tensors gives 1e10-sized errors there), so on CPU the dot kernel is checked with fp32
# activations and bf16 only through the rows kernel; on CUDA every pair runs.
CASES = [
    (1, ("rows", 16, 64, 1, 4, 1), torch.bfloat16),
    (1, ("rows", 16, 64, 1, 4, 1), torch.float32),
    (1, ("rows", 16, 64, 2, 4, 1), torch.bfloat16),  # K in two slices
    (3, ("dot", 16, 32, 1, 4, 1), torch.float32),
    (17, ("dot", 32, 64, 3, 4, 1), torch.float32),  # 17 rows in a 32-row tile; three slices
]
if DEVICE == "cuda":
    CASES += [
        (3, ("dot", 16, 32, 1, 4, 1), torch.bfloat16),
        (64, ("dot", 64, 64, 2, 4, 2), torch.bfloat16),
    ]


@pytest.mark.parametrize("block", [None, (32, 32)])
@pytest.mark.parametrize("m, config, dtype", CASES)
def test_fp8_matmul_matches_dequantized(m, config, block, dtype):
    n, k = 48, 160  # N not a multiple of BLOCK_N, K not of BLOCK_K
    w = _weight(n, k, block)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    bias = (torch.randn(n, generator=g) * 0.1).to(dtype).to(DEVICE)
    ref = _ref(x, w) + bias.float().cpu()
    got = triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group, bias, config)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (got.float().cpu() - ref).abs().max().item() < tol
    nob = triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group, None, config)
    assert (nob.float().cpu() - (ref - bias.float().cpu())).abs().max().item() < tol


def test_default_configs_run_and_split_small_n():
    assert triton_fp8.default_config(1, 4096, 4096, 4096)[0] == "rows"
    assert triton_fp8.default_config(64, 28672, 4096, 4096)[3] == 1  # enough programs
    assert triton_fp8.default_config(1, 1024, 4096, 4096)[3] > 1  # too few: K is split
    w = _weight(48, 160, None)
    x = torch.randn(5, 160).to(DEVICE)
    got = triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group)  # table empty: the default
    assert (got.cpu() - _ref(x, w)).abs().max().item() < 1e-4


def test_table_entry_is_used(monkeypatch):
    monkeypatch.setitem(
        triton_fp8.TABLE, (48, 160), ((1, ("rows", 32, 32, 1, 4, 1)), (8, ("dot", 16, 32, 2, 4, 1)))
    )
    assert triton_fp8.config_for(1, 48, 160, 160) == ("rows", 32, 32, 1, 4, 1)
    assert triton_fp8.config_for(6, 48, 160, 160) == ("dot", 16, 32, 2, 4, 1)
    assert triton_fp8.config_for(9, 48, 160, 160) == triton_fp8.default_config(9, 48, 160, 160)


def test_block_group_must_hold_whole_tiles():
    w = _weight(48, 160, (32, 48))
    x = torch.randn(2, 160).to(DEVICE)
    with pytest.raises(ValueError, match="group"):
        triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group, None, ("dot", 16, 32, 1, 4, 1))


def test_linear_on_cpu_dequantizes():
    w = _weight(48, 160, (32, 32))
    x = torch.randn(4, 160)
    if DEVICE == "cpu":
        w = fp8.Fp8Weight(w.weight.cpu(), w.scale.cpu(), w.group)
        assert torch.allclose(fp8.linear(x, w, None), x @ w.dequantize().T, atol=1e-5)
    # an untimed shape: _scaled_mm from DEFAULT_SCALED_MM_MIN_ROWS rows on, w8a16 below
    assert fp8.path_for(fp8.DEFAULT_SCALED_MM_MIN_ROWS, 4096, 4096) == ("scaled_mm", None)
    assert fp8.path_for(fp8.DEFAULT_SCALED_MM_MIN_ROWS - 1, 4096, 4096) == ("w8a16", None)


@pytest.mark.parametrize("m", [1, 2])
def test_block_narrower_than_a_dot_tile(m):
    """8-column blocks: the one-row kernel takes them (no tl.dot); the dot kernel refuses a
    K tile under 16, which Triton cannot build on CUDA (the interpreter would run it), and
    a checkpoint with such blocks is refused at load (fp8.MIN_BLOCK_K)."""
    assert fp8.MIN_BLOCK_K == triton_fp8.MIN_DOT_K
    w = _weight(48, 160, (16, 8))
    x = torch.randn(m, 160).to(DEVICE)
    if m == 1:
        got = triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group)
        assert (got.cpu() - _ref(x, w)).abs().max().item() < 1e-4
    else:
        with pytest.raises(ValueError, match="BLOCK_K 8"):
            triton_fp8.fp8_matmul(x, w.weight, w.scale, w.group)
