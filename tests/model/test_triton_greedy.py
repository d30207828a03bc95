"""The one-pass greedy pick (``model/triton_greedy.py``): the token of ``torch.argmax`` and the
logprob of ``log_softmax(...).gather`` (CPU: Triton's interpreter, this folder's conftest)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from pdserve.model.triton_greedy import greedy_pick, greedy_splits, measured_params


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = x.argmax(dim=-1)
    return ids, torch.log_softmax(x, dim=-1).gather(1, ids[:, None])[:, 0].double()


@pytest.mark.parametrize(
    "rows, vocab, splits, block_v",
    [
        (3, 1000, 1, 256),  # one program a row, a partly filled last block
        (4, 5000, 6, 512),  # several chunks a row
        (2, 300, 8, 64),  # more chunks than the vocabulary fills: the last ones empty
        (5, 777, None, 128),  # the default split count
    ],
)
def test_greedy_pick_equals_argmax_and_log_softmax(rows, vocab, splits, block_v):
    """Random logits with equal maxima placed in different chunks (the lowest index wins,
    as ``torch.argmax``), a row of equal values (id 0, logprob -log V) and a row with -inf
    entries (a masked vocabulary): the ids equal torch's, the logprobs to fp32 rounding."""
    gen = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=gen) * 4
    x[0, vocab - 3] = x[0, vocab // 2] = x[0, 7] = 40.0  # a tie across chunks: 7 wins
    x[1] = 0.25  # every entry equal
    if rows > 2:
        x[2, : vocab // 2] = float("-inf")
    out = greedy_pick(x, splits=splits, block_v=block_v, num_warps=4)
    ids, lp = _reference(x)
    assert out.dtype == torch.float64 and out.shape == (rows, 2)
    assert torch.equal(out[:, 0].long(), ids)
    assert out[0, 0] == 7 and out[1, 0] == 0
    assert abs(out[1, 1].item() + math.log(vocab)) < 1e-5
    assert (out[:, 1] - lp).abs().max().item() < 1e-5


def test_greedy_pick_reads_a_strided_view_and_writes_the_given_buffer():
    """Logits as a slice of a wider buffer (a graph's shared logits) and an output view of
    a static ``[R, 2]`` float64 buffer: the pick writes there and returns it."""
    base = torch.randn(6, 700, generator=torch.Generator().manual_seed(1))
    x = base[1:5, 50:650]  # row stride 700, unit column stride
    out = torch.full((4, 2), -7.0, dtype=torch.float64)
    got = greedy_pick(x, out=out, splits=3, block_v=64, num_warps=4)
    ids, lp = _reference(x)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out[:, 0].long(), ids) and (out[:, 1] - lp).abs().max() < 1e-5


def test_greedy_pick_rejects_bad_input_and_sizes_its_splits():
    """Not ``[R, V]`` fp32 with unit column stride, a split count outside 1..64 or an
    output of another shape: ValueError naming the argument. The split count follows the
    rows and vocabulary only (a graph captures it), at most 64 and one a block."""
    x = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="logits"):
        greedy_pick(x.double())
    with pytest.raises(ValueError, match="logits"):
        greedy_pick(torch.zeros(100, 2).t())
    with pytest.raises(ValueError, match="splits"):
        greedy_pick(x, splits=65)
    with pytest.raises(ValueError, match="out"):
        greedy_pick(x, out=torch.zeros(3, 2, dtype=torch.float64))
    assert greedy_pick(torch.zeros(0, 100)).shape == (0, 2)
    assert greedy_splits(64, 128256, 528, 2048) == 9
    assert greedy_splits(1, 128256, 528, 2048) == 63  # one chunk a block of 2,048
    assert greedy_splits(1, 128256, 4096, 1024) == 64
    assert greedy_splits(600, 128256, 528, 2048) == 1
    assert greedy_splits(4, 100, 528, 2048) == 1
    assert measured_params(torch.device("cpu")) is None  # off CUDA: torch's ops


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_greedy_pick_on_cuda_at_llama_vocab(rows):
    """On the GPU (``make test-gpu``), Llama-3's vocabulary: ids equal ``torch.argmax``'s and
    logprobs ``log_softmax``'s to fp32 rounding, with the split count a decode graph uses."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 128256, device="cuda", generator=gen) * 4
    x[0, 100] = x[0, 128000] = 50.0  # a tie across chunks: 100 wins
    out = greedy_pick(x, splits=greedy_splits(rows, 128256), num_warps=8)
    ids = x.argmax(-1)
    lp = torch.log_softmax(x, -1).gather(1, ids[:, None])[:, 0].double()
    assert torch.equal(out[:, 0].long(), ids) and out[0, 0] == 100
    assert (out[:, 1] - lp).abs().max().item() < 1e-4


def test_graph_greedy_pick_off_listed_gpus_is_the_samplers_ops():
    """``cuda_graph.greedy_pick`` (what decode and verify graphs hand plain greedy rows) off
    a listed GPU: torch's argmax and ``log_softmax`` + ``gather``, bit for bit; the Triton
    pick gives the same ids and the logprobs to fp32 rounding."""
    from pdserve.engine.worker.cuda_graph import greedy_pick as graph_pick

    x = torch.randn(5, 999, generator=torch.Generator().manual_seed(3)) * 3
    packed = graph_pick(x)
    ids = x.argmax(-1)
    assert torch.equal(packed[:, 0].long(), ids)
    assert torch.equal(
        packed[:, 1], torch.log_softmax(x, -1).gather(1, ids[:, None])[:, 0].double()
    )
    tri = greedy_pick(x, splits=4, block_v=128, num_warps=4)
    assert torch.equal(tri[:, 0], packed[:, 0]) and (tri[:, 1] - packed[:, 1]).abs().max() < 1e-5
