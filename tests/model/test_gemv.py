"""The Triton GEMV (``model/triton_gemv.py``) equals ``F.linear``; the measured table decides
where it runs. Kernels run on CPU under Triton's interpreter (this folder's conftest), on the
GPU in the model (the ``gpu``-marked test, run on the GPU machine by path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_gpu_backends import SCENARIOS, scenario_logits

from pdserve.model import gemv_table, triton_gemv
from pdserve.model.llama import LlamaForCausalLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 only on the GPU: the interpreter converts fp32 -> bf16 by truncation, not rounding.
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
CONFIGS = [
    ("rows", 8, 32, 4, 1),
    ("dot", 16, 32, 4, 2),
    ("dot", 32, 64, 4, 3),
    ("splitk2", 16, 32, 4, 2),  # K = 104 in slices of 64: the second one's tail masked
    ("splitk8", 32, 16, 4, 1),  # slices of 16: the last one lies wholly past K
    # TMA-fed kernels (host tensor descriptors; the interpreter zero-fills boxes past N, K, M)
    ("tma", 16, 32, 4, 2),
    ("tma_sk2", 16, 32, 4, 2),
    ("tma_ws_sk8", 32, 16, 4, 1),  # the last slice wholly past K: its boxes read zeros
    ("tma_stream", 16, 16, 4, 2),  # 5 tiles x 7 boxes (3 programs on CPU): tiles shared
    ("tma_ws_stream", 32, 32, 4, 3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("m", [1, 3, 16, 20, 48, 64])  # row tiles of 16, 32 and 64
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemv_matches_linear(dtype, config, m, with_bias):
    if config[0] == "rows" and m != 1:
        with pytest.raises(ValueError, match="one row"):
            triton_gemv.gemv(torch.zeros(m, 4), torch.zeros(2, 4), None, config)
        return
    gen = torch.Generator().manual_seed(m)
    N, K = 72, 104  # neither a multiple of the tiles: the masked tails count nothing
    # (rows of 208 bytes in bf16: the tma kinds need a 16-byte row stride)
    x = torch.randn(m, 2 * K, generator=gen).to(dtype).to(DEVICE)[:, :K]  # a strided view
    w = torch.randn(N, K, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    got = triton_gemv.gemv(x, w, b, config)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (m, N) and got.dtype == dtype
    # fp32: summation order only; bf16: one rounding of the output.
    tol = 1e-4 if dtype == torch.float32 else 2**-7 * ref.abs().max().item()
    assert (got.float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[3], CONFIGS[5], CONFIGS[8]])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_gemv_with_silu_mul_equals_silu_mul_then_gemv(config, m):
    """SwiGLU computed inside the GEMV's loads gives the bits of silu_mul, then the GEMV."""
    from pdserve.model.fused_ops import silu_mul

    if config[0] == "rows" and m != 1:
        return
    gen = torch.Generator().manual_seed(10 + m)
    N, K = 40, 68  # the weight's rows 272 bytes: TMA-aligned for the tma kinds
    gate_up = torch.randn(m, 2 * K, generator=gen).to(DEVICE)
    w = torch.randn(N, K, generator=gen).to(DEVICE)
    got = triton_gemv.gemv(gate_up, w, None, config, silu_mul=True)
    ref = triton_gemv.gemv(silu_mul(gate_up), w, None, config)
    assert torch.equal(got, ref)


def test_gemv_split_k_is_deterministic_and_sums_slices_in_order():
    """The split-K result is the same bits on every call, and equals the fp32 sum of the
    slices' products taken in slice order (what the reduce kernel promises)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 96, generator=gen).to(DEVICE)
    w = torch.randn(40, 96, generator=gen).to(DEVICE)
    config = ("splitk4", 16, 16, 4, 1)  # slices of 32 (= 96 / 4 rounded up to BLOCK_K 16)
    got = triton_gemv.gemv(x, w, None, config)
    assert torch.equal(got, triton_gemv.gemv(x, w, None, config))
    ref = sum(x[:, s : s + 32].double() @ w[:, s : s + 32].double().T for s in (0, 32, 64))
    assert (got.double() - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["tma", "tma_sk3", "tma_stream", "tma_ws_stream"])
@pytest.mark.parametrize("programs", [1, 2, 5, 7, 64])
def test_tma_kernels_match_linear_for_any_persistent_grid(kind, programs):
    """Whatever the persistent grid (one program, programs that split a tile, a grid capped
    at the work), every output is the fp32 sum over all of K, the same bits on every call."""
    from pdserve.model import triton_gemv_tma

    gen = torch.Generator().manual_seed(programs)
    m, N, K = 37, 80, 96  # 5 tiles of 16 x 6 boxes of 16
    x = torch.randn(m, K, generator=gen).to(DEVICE)
    w = torch.randn(N, K, generator=gen).to(DEVICE)
    b = torch.randn(N, generator=gen).to(DEVICE)
    outs = []
    for _ in range(2):
        out = x.new_empty(m, N)
        triton_gemv_tma.gemv_tma(x, w, b, out, (kind, 16, 16, 4, 2), 64, False, programs)
        outs.append(out)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (outs[0].double() - ref).abs().max().item() <= 1e-4
    assert torch.equal(outs[0], outs[1])


def test_tma_stream_fixup_sums_shared_tiles_in_program_order():
    """Stream-K: with 4 programs over 2 tiles x 6 boxes (3 boxes each) every tile is shared by
    two programs; the fixup's fp32 sum is theirs in program order: (boxes 0-2) + (boxes 3-5)."""
    from pdserve.model import triton_gemv_tma

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, generator=gen).to(DEVICE)
    w = torch.randn(32, 96, generator=gen).to(DEVICE)
    out = x.new_empty(3, 32)
    triton_gemv_tma.gemv_tma(x, w, None, out, ("tma_stream", 16, 16, 4, 2), 16, False, 4)
    halves = [x[:, s : s + 48].double() @ w[:, s : s + 48].double().T for s in (0, 48)]
    assert (out.double() - (halves[0] + halves[1])).abs().max().item() <= 1e-4


@pytest.mark.parametrize("kind", ["tma", "tma_sk2", "tma_stream"])
def test_tma_kernels_read_an_unaligned_x_through_pointers(kind):
    """x whose base is 4 bytes off a 16-byte boundary cannot have a TMA descriptor: the
    kernels then load it with masked pointer loads, same result."""
    gen = torch.Generator().manual_seed(2)
    buf = torch.randn(20, 101, generator=gen).to(DEVICE)
    x = buf[:, 1:]  # base 4 bytes in, row stride 404 bytes
    w = torch.randn(40, 100, generator=gen).to(DEVICE)
    got = triton_gemv.gemv(x, w, None, (kind, 16, 32, 4, 2))
    assert (got.double() - x.double() @ w.double().T).abs().max().item() <= 1e-4


def test_tma_kernels_reject_an_unaligned_weight():
    w = torch.zeros(8, 6)  # rows of 24 bytes: no TMA descriptor
    with pytest.raises(ValueError, match="16-byte aligned"):
        triton_gemv.gemv(torch.zeros(2, 6), w, None, ("tma", 16, 16, 4, 1))


def test_tma_kind_names():
    from pdserve.model.triton_gemv_tma import parse_kind

    assert parse_kind("tma") == (1, False, False)
    assert parse_kind("tma_sk4") == (4, False, False)
    assert parse_kind("tma_ws_sk16") == (16, False, True)
    assert parse_kind("tma_stream") == (1, True, False)
    assert parse_kind("tma_ws_stream") == (1, True, True)
    for other in ("dot", "tma_", "tma_sk", "tma_ws_ws", "tma_stream_sk2", "splitk2"):
        assert parse_kind(other) is None
    with pytest.raises(ValueError, match="2..32"):
        parse_kind("tma_sk1")
    with pytest.raises(ValueError, match="2..32"):
        parse_kind("tma_sk64")


def test_gemv_rejects_too_many_rows_and_unknown_kernels():
    with pytest.raises(ValueError, match="at most 64"):
        triton_gemv.gemv(torch.zeros(65, 4), torch.zeros(2, 4), None, ("dot", 16, 16, 4, 1))
    with pytest.raises(ValueError, match="at most 64"):
        triton_gemv.gemv(torch.zeros(65, 4), torch.zeros(2, 4), None, ("splitk2", 16, 16, 4, 1))
    with pytest.raises(ValueError, match="at most 64"):
        triton_gemv.gemv(torch.zeros(65, 4), torch.zeros(2, 4), None, ("tma_stream", 16, 16, 4, 1))
    for bogus in ("bogus", "tmax", "tma_sk"):
        with pytest.raises(ValueError, match="unknown GEMV kernel"):
            triton_gemv.gemv(torch.zeros(1, 4), torch.zeros(2, 4), None, (bogus, 16, 16, 4, 1))


def test_block_m_rounds_rows_up_to_a_dot_tile():
    assert [triton_gemv.block_m(m) for m in (1, 16, 17, 32, 33, 48, 64)] == [
        16,
        16,
        32,
        32,
        64,
        64,
        64,
    ]


def test_pick_takes_the_smallest_measured_row_count_at_or_above_m():
    rows = ("rows", 4, 1024, 4, 1)
    dot = ("dot", 16, 256, 4, 4)
    split = ("splitk2", 64, 128, 4, 4)
    table = {("bfloat16", 8, 4): ((1, rows), (2, None), (8, dot), (32, None), (64, split))}
    w = torch.zeros(8, 4, dtype=torch.bfloat16)

    def picked(m, dtype=torch.bfloat16, weight=w):
        return triton_gemv.pick(table, torch.zeros(m, 4, dtype=dtype), weight)

    assert picked(1) == rows
    assert picked(2) is None  # measured: cuBLAS won there
    assert picked(3) == dot and picked(8) == dot
    assert picked(9) is None and picked(32) is None  # measured: cuBLAS won there
    assert picked(33) == split and picked(64) == split
    assert picked(65) is None  # past the last measured row count
    assert picked(1, torch.float32) is None  # another dtype
    assert picked(1, weight=torch.zeros(8, 5, dtype=torch.bfloat16)) is None  # another shape


def _sweep_script():
    """scripts/gpu_gemv_sweep.py as a module (it is a script, not a package module)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "scripts" / "gpu_gemv_sweep.py"
    spec = importlib.util.spec_from_file_location("gpu_gemv_sweep", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_sweep_probe_skips_configurations_that_fail_and_keeps_those_that_run(monkeypatch):
    """The sweep's probe runs each configuration in its own process (here on CPU, under the
    interpreter): one that raises is skipped with the reason its process printed, one that
    does not answer in time is killed and skipped, the others are kept; every TMA kind the
    sweep tries is a name gemv knows."""
    sweep = _sweep_script()
    monkeypatch.setattr(sweep, "DEVICE", "cpu")
    good = [("tma_stream", 16, 32, 4, 2), ("dot", 16, 16, 4, 1)]
    bad = ("tma_sk64", 16, 16, 4, 1)  # 64 K slices: gemv raises ValueError
    failed = sweep.probe({"tiny": (40, 96)}, [20], 2, [*good, bad])
    assert list(failed) == [bad]
    assert "PROBE FAILED: 40x96 M=20: ValueError" in failed[bad] and "2..32" in failed[bad]
    monkeypatch.setattr(sweep, "PROBE_TIMEOUT", 0.01)
    assert sweep.probe({"tiny": (40, 96)}, [20], 1, good[:1]) == {
        good[0]: "no answer within 0.01 s (killed)"
    }
    from pdserve.model.triton_gemv_tma import parse_kind

    kinds = {cfg[0] for m in sweep.MS for cfg in sweep.configs_for(m)}
    assert {k for k in kinds if k.startswith("tma")} and all(
        k in ("rows", *triton_gemv.SPLITS) or parse_kind(k) for k in kinds
    )


@pytest.mark.timeout(600)
def test_tma_kernels_build_for_hopper_with_wgmma_fed_by_tma_copies(sm90_build):
    """Compiled for sm_90 without a GPU (scripts/sm90_build_check.py: Triton's own ptxas,
    the interpreter off): at 64 rows the stream-K and the warp-specialized kernels use wgmma
    (HGMMA, no HMMA) fed by bulk tensor copies (UTMALDG), spill nothing, store 16 bytes at a
    time and fit the H200's 227 KB of shared memory; warp specialization adds warps (producer
    warps beside the 4 of the MMA)."""
    cfgs = ["('tma_stream', 128, 128, 4, 3)", "('tma_ws', 64, 128, 4, 4)"]
    rows, log = sm90_build("--configs", *cfgs, "--ms", "64", "--json", timeout=540)
    assert len(rows) == 2, log[-3000:]
    for row in rows:
        assert "error" not in row, row
        sass = row["sass"]
        assert sass["HGMMA"] > 0 and sass["HMMA"] == 0 and sass["UTMALDG"] > 0, row
        assert sass["LDL"] == sass["STL"] == 0 and sass["STG.E.U16"] == 0, row
        assert sass["STG.E.128"] > 0 and row["shared"] <= 227 * 1024, row
    assert rows[0]["warps"] == 4 and rows[1]["warps"] > 4


def test_committed_table_is_well_formed():
    from pdserve.model.triton_gemv_tma import parse_kind

    for (dtype, n, k), rows in gemv_table.TABLE.items():
        assert dtype in ("bfloat16", "float16", "float32") and n > 0 and k > 0
        ms = [m for m, _ in rows]
        assert ms == sorted(ms) and len(set(ms)) == len(ms)
        for m, config in rows:
            if config is not None:
                assert len(config) == 5
                assert config[0] in ("rows", *triton_gemv.SPLITS) or parse_kind(config[0])
                assert m == 1 or config[0] != "rows"
                assert m <= triton_gemv.MAX_ROWS


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernels", ["pointer", "tma"])
def test_model_through_the_gemv_agrees_with_cublas(tiny_hf_builder, monkeypatch, kernels):
    """bf16: the tiny model with every linear layer routed through the GEMV (every kernel,
    every row count <= 64; ``tma``: the TMA-fed kinds from 2 rows) keeps >= 0.99 top-1
    agreement with the cuBLAS path."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    hf = tiny_hf_builder("qwen2")  # biases on q/k/v: the bias path too
    model = LlamaForCausalLM(hf.config, torch.bfloat16, "cuda", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    table = {}
    for p in model.parameters():
        if p.dim() == 2:
            table[("bfloat16", p.shape[0], p.shape[1])] = _EveryShape.KERNELS[kernels]
    agree = total = 0
    one_seq = ([[7]] + [[1]] * 6, 4)  # M = 1 decode rows: the rows kernel
    for i, (steps, ps) in enumerate([*SCENARIOS, one_seq]):
        monkeypatch.setattr(gemv_table, "TABLE", {})
        ref = scenario_logits(model, steps, ps, seed=i)
        monkeypatch.setattr(gemv_table, "TABLE", table)
        got = scenario_logits(model, steps, ps, seed=i)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += ref.shape[0]
    assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"


class _EveryShape(dict):
    """A GEMV table that routes every bf16 linear layer through the GEMV (tests only)."""

    KERNELS = {
        "pointer": (
            (1, ("rows", 8, 64, 4, 1)),
            (16, ("dot", 16, 64, 4, 3)),
            (32, ("dot", 32, 64, 4, 3)),
            (64, ("splitk2", 16, 64, 4, 3)),
        ),
        "tma": (
            (1, ("rows", 8, 64, 4, 1)),
            (4, ("tma", 64, 64, 4, 3)),
            (16, ("tma_stream", 64, 64, 4, 3)),
            (32, ("tma_sk2", 64, 64, 4, 3)),
            (64, ("tma_ws_stream", 64, 64, 4, 3)),
        ),
    }

    def __init__(self, kernels: str = "pointer") -> None:
        self.rows = self.KERNELS[kernels]
        super().__init__({("bfloat16", 0, 0): self.rows})  # non-empty: the dispatch looks

    def get(self, key, default=None):
        return self.rows if key[0] == "bfloat16" else default


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernels", ["pointer", "tma"])
def test_captured_graphs_through_the_gemv_match_eager(monkeypatch, kernels):
    """Greedy bf16 decode with every linear layer on the GEMV: the captured graphs (buckets
    1, 2, 4, 8, 16, 32, 48; 3, 5, 20 and 40 rows pad) give the eager run's tokens (the TMA
    kinds' descriptors are built at capture and replayed by value)."""
    if not torch.cuda.is_available():
        pytest.fail("this gpu-marked test needs a CUDA device (run it with make test-gpu)")
    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    monkeypatch.setattr(gemv_table, "TABLE", _EveryShape(kernels))
    prompts = [[1 + (7 * i + j) % 300 for j in range(5 + 3 * (i % 8))] for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(
            "random:tiny",
            device="cuda",
            dtype="bfloat16",
            max_running_requests=48,
            kv_cache_memory=0.25,
            enforce_eager=eager,
        )
        assert (llm.engine.executor.rank0.runner.graphs is None) == eager
        runs[eager] = [
            [o.outputs[0].token_ids for o in llm.generate(prompts[:n], params)]
            for n in (1, 3, 5, 20, 40)
        ]
        del llm
        torch.cuda.empty_cache()
    assert runs[False] == runs[True]
