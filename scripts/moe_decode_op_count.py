"""Count the kernel launches of one decoder layer's decode step (``--rows`` tokens, default 1) as the CUDA path
runs it, on CPU: a tiny random Qwen3-MoE (2 layers, both sparse) with every CUDA-side choice
taken (``llama.use_fused_ops`` forced on, ``PDSERVE_MOE_EXPERTS=fused``, the Triton
attention backend, Triton kernels under ``TRITON_INTERPRET=1``).

Counted per layer: each Triton launch (by kernel name) and each aten op that is not a view
or an allocation (each is >= 1 GPU kernel on CUDA), seen by a ``TorchDispatchMode``. CPU
dispatch differs from CUDA's in places: ``F.linear`` is one cuBLAS call there (``t`` is a
view; ``addmm``/``mm`` one kernel, or two with a split-K reduction), ``F.rms_norm`` one
fused kernel on CUDA where CPU decomposes it: the GPU profile
(``scripts/gpu_step_profile.py``) has the real figure. Prints the ops of the second layer
and the counts; ``--json PATH`` writes them.

Usage: ``TRITON_INTERPRET=1 python scripts/moe_decode_op_count.py`` (repository root).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PDSERVE_MOE_EXPERTS", "fused")

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model import llama
from pdserve.model.attention import build_attention_metadata

# ops that launch nothing on CUDA (views, metadata, allocations)
FREE = {
    "view", "_unsafe_view", "slice", "select", "as_strided", "t", "transpose", "reshape",
    "unsqueeze", "squeeze", "expand", "detach", "alias", "_reshape_alias", "split", "chunk",
    "unbind", "empty", "empty_like", "empty_strided", "new_empty", "split_with_sizes",
    "permute", "lift_fresh", "_to_copy_noop", "sym_size", "is_same_size", "narrow",
}  # fmt: skip

CURRENT: list[int] = [-1]  # the layer running (-1: outside the layers)
IN_TRITON: list[bool] = [False]  # inside an interpreted launch (its own host copies)
OPS: dict[int, list[str]] = collections.defaultdict(list)


class _Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in FREE and not IN_TRITON[0]:
            OPS[CURRENT[0]].append(f"aten::{name}")
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", type=int, default=1, help="sequences decoding (the batch)")
    args = ap.parse_args()
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    llama.use_fused_ops = lambda ids: True  # the CUDA path's kernels, on CPU
    model = llama.LlamaForCausalLM(cfg, torch.float32, "cpu", attn_backend="triton")
    model.load_weights(hf.state_dict().items())
    s, ps = model.shapes, 4
    R = args.rows
    pages = 2 * R
    lay = KVCacheLayout(
        "page_major", s.n_layers, s.n_kv_heads, s.head_dim, ps, pages, torch.float32
    )
    caches = lay.layer_views(lay.allocate("cpu"))
    tables = [[2 * r, 2 * r + 1] for r in range(R)]
    prompt = [5, 17, 99, 3, 2] * R
    md = build_attention_metadata([5] * R, [5] * R, tables, ps)
    model(torch.tensor(prompt), torch.arange(5).repeat(R), md, caches)  # prefill, not counted
    for i, layer in enumerate(model.decoder_layers()):
        layer.register_forward_pre_hook(lambda m, a, i=i: CURRENT.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: CURRENT.__setitem__(0, -1))
    real_call = interpreter.GridExecutor.__call__

    def counted(self, *a, **kw):
        OPS[CURRENT[0]].append(f"triton::{self.fn.__name__}")
        IN_TRITON[0] = True
        try:
            return real_call(self, *a, **kw)
        finally:
            IN_TRITON[0] = False

    interpreter.GridExecutor.__call__ = counted
    md = build_attention_metadata([1] * R, [6] * R, tables, ps)
    plan = model.backend.plan(md, ps)  # outside the step, as the model runner does
    with _Count():
        model(torch.tensor([7] * R), torch.tensor([5] * R), md, caches, plan)
    interpreter.GridExecutor.__call__ = real_call
    layer_ops = OPS[1]
    print(f"layer 1 of a {R}-row decode step: {len(layer_ops)} launches")
    for op, n in collections.Counter(layer_ops).items():
        print(f"  {n} x {op}")
    print(f"outside the layers: {len(OPS[-1])} ({', '.join(OPS[-1])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layer": layer_ops, "outside": OPS[-1]}, f, indent=1)


if __name__ == "__main__":
    main()
