"""Layout conformance: pool <-> attention <-> transfer agree for every supported KV order.

The K/V that attention writes at a token's slot must be exactly the bytes the transfer
layer moves for that page (the byte ranges of ``KVCacheLayout.regions``), and a pool that
received those bytes (through a real NIXL WRITE) must let attention continue as if it had
computed them itself.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.disagg.base import AUX_RECORD_BYTES, KVArgs
from pdserve.disagg.nixl.probe import nixl_problem
from pdserve.disagg.wire import BufferDescs
from pdserve.engine.kv.layout import KV_ORDERS, KVCacheLayout, check_order
from pdserve.engine.worker.kv_storage import KVStorage
from pdserve.model.attention import build_attention_metadata
from pdserve.model.sdpa_backend import TorchSDPABackend

L, H, D, PS, P = 3, 2, 4, 4, 12


def _layout(order: str, dtype=torch.float32) -> KVCacheLayout:
    return KVCacheLayout(order, L, H, D, PS, P, dtype)


def _raw(kv: torch.Tensor, offset: int, nbytes: int) -> bytes:
    return ctypes.string_at(kv.data_ptr() + offset, nbytes)


@pytest.mark.parametrize("order", KV_ORDERS)
def test_shapes_strides_regions_and_fingerprint(order):
    lay = _layout(order)
    kv = lay.allocate("cpu")
    expected_shape = (L, 2, P, PS, H, D) if order == "layer_major" else (P, L, 2, H, PS, D)
    assert kv.shape == expected_shape and kv.is_contiguous()
    views = lay.layer_views(kv)
    assert len(views) == L
    for k, v in views:
        assert k.shape == v.shape == (P, PS, H, D)
        assert k.stride() == v.stride() == lay.view_strides()
    regions = lay.regions(kv)
    assert len(regions) == lay.descs_per_page == (2 * L if order == "layer_major" else 1)
    assert sum(n for _, n, _ in regions) == kv.numel() * 4 == P * lay.page_bytes
    assert all(item == lay.item_bytes for _, _, item in regions)
    # the byte ranges of one page are the page, every layer, K and V, nothing else
    kv.view(torch.uint8).copy_(torch.randint(0, 256, kv.view(torch.uint8).shape, dtype=torch.uint8))
    for page in (0, 5, P - 1):
        moved = b"".join(_raw(kv, off, n) for off, n in lay.page_byte_ranges(page))
        assert len(moved) == lay.page_bytes
        assert moved == lay.pages(kv, [page]).contiguous().numpy().tobytes()
    fp = lay.fingerprint("m")
    assert fp.kv_order == order and fp.dtype == "float32" and fp.page_size == PS
    other = _layout([o for o in KV_ORDERS if o != order][0]).fingerprint("m")
    assert fp.first_difference(other).startswith("kv_order:")
    with pytest.raises(ValueError, match="kv_order"):
        check_order("head_major")
    with pytest.raises(ValueError, match="page_size"):
        KVCacheLayout(order, L, H, D, 0, P, torch.float32)
    with pytest.raises(ValueError, match="shape"):
        lay.layer_views(torch.zeros(3))


@pytest.mark.parametrize("order", KV_ORDERS)
def test_kv_args_are_the_regions_and_the_rank_share(order):
    """One rank's pool of a TP=2 split: 2 of the model's 4 KV heads; any other share raises."""
    lay = _layout(order)
    kv = lay.allocate("cpu")
    aux = torch.zeros(3, AUX_RECORD_BYTES, dtype=torch.uint8)
    args = lay.kv_args(
        kv, aux.data_ptr(), aux.numel(), lay.fingerprint("m", 2 * H), engine_rank=1, tp_size=2
    )
    regions = lay.regions(kv)
    assert args.kv_data_ptrs == tuple(r[0] for r in regions)
    assert args.kv_data_lens == tuple(r[1] for r in regions)
    assert args.kv_item_lens == tuple(r[2] for r in regions)
    assert (args.aux_data_ptr, args.aux_data_len) == (aux.data_ptr(), aux.numel())
    assert args.num_aux_slots == 3 and args.device == "cpu" and args.kv_heads == (H, 2 * H)
    with pytest.raises(ValueError, match="num_kv_heads: the pool holds 2 KV heads"):
        lay.kv_args(kv, aux.data_ptr(), aux.numel(), lay.fingerprint("m", 4 * H), tp_size=2)


def _token_bytes(lay: KVCacheLayout, kv: torch.Tensor, layer: int, s: int, page: int, off: int):
    """K (s=0) or V (s=1) of one token, every head, read from the bytes NIXL moves for its
    page, following the order's definition (docstring of pdserve.engine.kv.layout)."""
    e = 4
    ranges = lay.page_byte_ranges(page)
    if lay.order == "layer_major":  # buffer (layer, s) holds [ps, H, D] a page
        base, _ = ranges[2 * layer + s]
        return [_raw(kv, base + (off * H + h) * D * e, D * e) for h in range(H)]
    ((base, _),) = ranges  # one range: [L, 2, H, ps, D]
    return [
        _raw(kv, base + ((((layer * 2 + s) * H + h) * PS) + off) * D * e, D * e) for h in range(H)
    ]


@pytest.mark.parametrize("order", KV_ORDERS)
def test_attention_writes_the_bytes_the_transfer_moves(order):
    pool = KVStorage(
        num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float32,
        device=torch.device("cpu"), page_size=PS, num_pages=P, num_aux_slots=1,
        model_fingerprint="m", kv_order=order,
    )  # fmt: skip
    lay, backend = pool.kv_layout, TorchSDPABackend()
    table = [7, 2, 9]  # scattered pages
    n = 10
    md = build_attention_metadata([n], [n], [table], PS)
    plan = backend.plan(md, PS)
    gen = torch.Generator().manual_seed(0)
    written = {}
    for layer, (k_cache, v_cache) in enumerate(pool.layer_caches):
        q = torch.randn(n, 2 * H, D, generator=gen)
        k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
        backend.forward(q, k, v, k_cache, v_cache, md, plan, D**-0.5)
        written[layer] = (k, v)
    for layer, (k, v) in written.items():
        for j in range(n):
            page, off = table[j // PS], j % PS
            for s, t in ((0, k), (1, v)):
                got = _token_bytes(lay, pool.kv, layer, s, page, off)
                assert got == [t[j, h].numpy().tobytes() for h in range(H)], (layer, s, j)
    untouched = sorted(set(range(P)) - set(table))
    assert lay.pages(pool.kv, untouched).abs().max().item() == 0.0


def _attend(pool: KVStorage, table: list[int], n: int, q: torch.Tensor) -> torch.Tensor:
    """Decode one new token at position ``n`` over ``table`` (every layer), its output."""
    backend = TorchSDPABackend()
    md = build_attention_metadata([1], [n + 1], [table], PS)
    plan = backend.plan(md, PS)
    outs = []
    for layer, (k_cache, v_cache) in enumerate(pool.layer_caches):
        kv_new = torch.full((1, H, D), float(layer))
        outs.append(backend.forward(q, kv_new, kv_new, k_cache, v_cache, md, plan, D**-0.5))
    return torch.stack(outs)


def _pool(order: str) -> KVStorage:
    return KVStorage(
        num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.float32,
        device=torch.device("cpu"), page_size=PS, num_pages=P, num_aux_slots=2,
        model_fingerprint="m", kv_order=order,
    )  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", KV_ORDERS)
def test_pages_moved_by_nixl_let_attention_continue(order):
    """Prefill's pool filled by attention, its pages WRITTEN by NIXL (the engine's
    prepared descriptor lists) onto other page ids of decode's pool: decode's attention
    over the moved pages equals prefill's over its own."""
    problem = nixl_problem()
    if problem:
        pytest.fail(problem)  # fail, never skip
    from pdserve.disagg.nixl.agent.api import load_nixl_api
    from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine
    from pdserve.disagg.transfer_config import NixlInitSpec

    src, dst = _pool(order), _pool(order)
    n, src_pages, dst_pages = 10, [7, 2, 9], [3, 4, 11]
    md = build_attention_metadata([n], [n], [src_pages], PS)
    backend = TorchSDPABackend()
    plan = backend.plan(md, PS)
    gen = torch.Generator().manual_seed(1)
    for k_cache, v_cache in src.layer_caches:
        k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
        backend.forward(
            torch.randn(n, 2 * H, D, generator=gen), k, v, k_cache, v_cache, md, plan, 1.0
        )

    api = load_nixl_api()
    p_spec, d_spec = NixlInitSpec.from_env("prefill"), NixlInitSpec.from_env("decode")
    p_eng = NixlTransferEngine(api, src.kv_args(), "prefill", f"conf-p-{order}", p_spec)
    d_eng = NixlTransferEngine(api, dst.kv_args(), "decode", f"conf-d-{order}", d_spec)
    try:
        name = p_eng.add_remote(d_eng.metadata())
        remote = p_eng.prepare_remote(name, d_eng.kv_descs, d_eng.aux_descs)
        for h in p_eng.post_room_write(remote, src_pages, dst_pages, 0, 1):
            while (state := p_eng.state(h)) == "PROC":
                d_eng.new_notifs()  # one process, two agents: the target progresses too
            assert state == "DONE"
            p_eng.release(h)
        p_eng.release_remote(remote)
        p_eng.remove_remote(name)
    finally:
        p_eng.close()
        d_eng.close()
    lay = src.kv_layout
    assert torch.equal(lay.pages(dst.kv, dst_pages), lay.pages(src.kv, src_pages))
    q = torch.randn(1, 2 * H, D, generator=gen)
    assert torch.equal(_attend(dst, dst_pages, n, q), _attend(src, src_pages, n, q))
    assert isinstance(d_eng.kv_descs, BufferDescs) and AUX_RECORD_BYTES > 0
    assert isinstance(src.kv_args(), KVArgs)
