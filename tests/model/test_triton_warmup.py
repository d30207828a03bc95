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
