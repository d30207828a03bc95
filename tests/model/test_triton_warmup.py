"""TritonBackend.warm_up: every eager decode configuration launched once (compiled at
start-up, not in a request's step), no KV written (CPU: TRITON_INTERPRET=1, conftest)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.timeout(300)
def test_triton_backend_warm_up_runs_every_eager_config_and_writes_no_kv(monkeypatch):
    pytest.importorskip("triton")
    from pdserve.model import triton_backend
    from pdserve.model.attention import get_attention_backend

    backend = get_attention_backend("triton")
    seen = []
    real = triton_backend.TritonBackend._decode

    def spy(self, q, k_cache, v_cache, out, attn, plan, *rest):
        real(self, q, k_cache, v_cache, out, attn, plan, *rest)
        seen.append(plan.config)
        assert torch.isfinite(out).all()

    monkeypatch.setattr(triton_backend.TritonBackend, "_decode", spy)
    k_cache = torch.randn(3, 16, 2, 32)
    v_cache = torch.randn(3, 16, 2, 32)
    k0, v0 = k_cache.clone(), v_cache.clone()
    n = backend.warm_up(k_cache, v_cache, 4, torch.float32)
    assert n == len(triton_backend.eager_decode_configs()) == len(seen)
    assert seen == list(triton_backend.eager_decode_configs())
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


class _Variants:
    """Stands in for a Triton kernel in ``triton_backend``'s namespace: records the key
    Triton compiles a variant for (each argument's specialization as Triton 3.x makes it:
    a tensor's dtype and whether its address is 16-byte aligned, an int's ``== 1`` and
    ``% 16 == 0`` unless ``do_not_specialize``, every constexpr and launch option), then
    launches the kernel."""

    def __init__(self, kernel, keys: set) -> None:
        self.kernel, self.keys = kernel, keys
        self.free = set(kernel.kwargs.get("do_not_specialize") or ())

    def _spec(self, name: str, value):
        if isinstance(value, torch.Tensor):
            return (name, str(value.dtype), value.data_ptr() % 16 == 0)
        if isinstance(value, bool):
            return (name, value)
        if isinstance(value, int):
            return (name, "int") if name in self.free else (name, value == 1, value % 16 == 0)
        if isinstance(value, float):
            return (name, "float")
        return (name, value)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = self.kernel.arg_names
            key = tuple(self._spec(n, a) for n, a in zip(names, args))
            key += tuple(sorted((k, str(v)) for k, v in kwargs.items()))
            self.keys.add((self.kernel.fn.__name__, key))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _metadata(q_lens: list[int], s_lens: list[int], page_size: int, width: int):
    """A step's metadata as ``ModelRunner.run_staged`` stages it (int64 everywhere; page
    ``b * width + i`` for row b's i-th page)."""
    from pdserve.model.attention import AttentionMetadata

    B = len(q_lens)
    qsl = torch.zeros(B + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    table = torch.arange(B * width, dtype=torch.int64).view(B, width)
    slots = torch.cat(
        [
            table[b, torch.arange(s - q, s) // page_size] * page_size
            + torch.arange(s - q, s) % page_size
            for b, (q, s) in enumerate(zip(q_lens, s_lens))
        ]
    )
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(s_lens, dtype=torch.int64),
        page_table=table,
        slot_mapping=slots,
        query_lens_host=tuple(q_lens),
        seq_lens_host=tuple(s_lens),
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("measured", [False, True, "fp8_one"])
def test_eager_steps_launch_only_variants_the_warm_up_launched(monkeypatch, measured):
    """Mixed steps with 1..3 leading decode rows, decode-only steps of several sizes and
    contexts, prefills of several lengths and page-table widths: every kernel launch is a
    variant (Triton's specialization key) that the warm-up's two steps and
    ``TritonBackend.warm_up`` launched already, so nothing compiles while serving. (A mixed
    step's extend rows were views sliced at the decode rows, 8 bytes apart per row: an odd
    count launched another alignment; its decode splits followed the context: 8, 9, 10...)
    ``measured``: the same under measured picks (``decode_attn_table``'s form: prefetching
    short-context entries from 2 rows x KV heads, a long-context rule that prefetches);
    ``"fp8_one"``: an e4m3 cache whose one-split steps take ``fp8_one``'s tiles from 6 rows x
    KV heads (one split from 4)."""
    from pdserve.model import triton_backend
    from pdserve.model.attention import get_attention_backend
    from pdserve.model.triton_backend import DecodeConfig, DecodePicks

    if measured == "fp8_one":
        one = DecodeConfig(1, 32, 2, 3)
        picks = DecodePicks(((1 << 20, one),), short_min=4, fp8_one=((6, (16, 1, 3)),))
        monkeypatch.setattr(triton_backend, "device_picks", lambda *args: picks)
    elif measured:
        a, b = DecodeConfig(1, 16, 4, 1, 0, 0, True), DecodeConfig(2, 16, 2, 1, 0, 0, True)
        picks = DecodePicks(((4, a), (8, b)), long_prefetch=True, short_min=2)
        monkeypatch.setattr(triton_backend, "device_picks", lambda *args: picks)
    keys: set = set()
    for name in ("decode_split_kernel", "decode_merge_kernel", "extend_kernel", "store_kv_kernel"):
        monkeypatch.setattr(triton_backend, name, _Variants(getattr(triton_backend, name), keys))
    backend = get_attention_backend("triton")
    ps, Hq, Hkv, D = 16, 4, 2, 32
    # 512 pages: the widest step below (5 rows of up to 1,552 tokens) uses 485 (there were
    # 400: its last pages were written and read past the cache's end)
    k_cache = torch.randn(512, ps, Hkv, D)
    v_cache = torch.randn(512, ps, Hkv, D)
    if measured == "fp8_one":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    qkv_heads = Hq + 2 * Hkv

    def step(q_lens: list[int], s_lens: list[int]) -> None:
        width = max(-(-s // ps) for s in s_lens)
        md = _metadata(q_lens, s_lens, ps, width)
        T = sum(q_lens)
        qkv = torch.randn(T, qkv_heads, D)
        q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv], qkv[:, Hq + Hkv :]
        plan = backend.plan(md, ps)
        backend.forward(q, k, v, k_cache, v_cache, md, plan, D**-0.5)

    # start-up: the engine's warm-up steps (a prefill of two prompts, a mixed step), then
    # the backend's decode configurations
    step([35, 16], [35, 16])
    step([1, 21], [36, 37])
    backend.warm_up(k_cache, v_cache, Hq, torch.float32)
    warm = set(keys)
    keys.clear()
    # serving: other batches, lengths and widths
    for lead in (1, 2, 3):
        step([1] * lead + [7, 40], [40 + 9 * i for i in range(lead)] + [30, 90])
    for rows, ctx in ((1, 600), (1, 640), (3, 70), (5, 1500), (2, 3000)):
        step([1] * rows, [ctx + 13 * i for i in range(rows)])
    for n in (1, 17, 64, 100):
        step([n], [n])
    if measured == "fp8_one":  # the rows' e4m3 tiles did launch while serving
        assert any({("BLOCK_N", "16"), ("num_warps", "1")} <= set(k[1]) for k in keys)
    new = keys - warm
    assert not new, sorted(new)
