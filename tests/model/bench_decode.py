"""Decode-step timing of the embedded model: pdserve's model vs. transformers (not a test).

Run: ``.venv/bin/python tests/model/bench_decode.py [--dtype float32|bfloat16] [--batch 1 16]``.
Each prompt has ``--prompt`` tokens; we time ``--steps`` greedy decode steps (metadata build +
forward + logits + argmax) and compare with transformers' forward with a KV cache on the same
batch and with ``generate`` (greedy, ``--steps`` new tokens).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.loader import load_model_source


def ours(src, dtype, batch, prompt, steps, page_size=16):
    m = LlamaForCausalLM(src.hf_config, dtype, "cpu")
    m.load_weights(src.weights())
    s = m.shapes
    pages_per_seq = (prompt + steps + page_size) // page_size + 1
    kv = torch.zeros(s.n_layers, 2, batch * pages_per_seq, page_size, s.n_kv_heads, s.head_dim, dtype=dtype)
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)]
    ids = torch.randint(100, 10000, (batch * prompt,))
    md = build_attention_metadata([prompt] * batch, [prompt] * batch, tables, page_size)
    t0 = time.perf_counter()
    h = m(ids, torch.arange(prompt).repeat(batch), md, kv)
    prefill = time.perf_counter() - t0
    last = h.view(batch, prompt, -1)[:, -1]
    tok = m.compute_logits(last).argmax(-1)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        n = prompt + i + 1
        md = build_attention_metadata([1] * batch, [n] * batch, tables, page_size)
        tok = m.compute_logits(m(tok, torch.full((batch,), n - 1), md, kv)).argmax(-1)
        times.append(time.perf_counter() - t0)
    return prefill, sorted(times)[len(times) // 2]


def theirs(src, dtype, batch, prompt, steps):
    hf = transformers.AutoModelForCausalLM.from_config(src.hf_config, dtype=dtype)
    hf.load_state_dict(dict(src.weights()), strict=False)
    hf.tie_weights()
    hf.eval()
    ids = torch.randint(100, 10000, (batch, prompt))
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = hf(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                    do_sample=False, pad_token_id=2)
        gen = time.perf_counter() - t0
    return sorted(times)[len(times) // 2], gen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    src = load_model_source("smollm2-135m-instruct")
    print(f"torch threads {torch.get_num_threads()}")
    for dt in args.dtype:
        dtype = getattr(torch, dt)
        for b in args.batch:
            pre, step = ours(src, dtype, b, args.prompt, args.steps)
            hf_step, gen = theirs(src, dtype, b, args.prompt, args.steps)
            print(f"{dt:9s} batch {b:3d}: ours {step * 1e3:6.1f} ms/step ({b / step:7.1f} tok/s), "
                  f"prefill {pre * 1e3:6.1f} ms | transformers forward {hf_step * 1e3:6.1f} ms/step, "
                  f"generate {b * args.steps / gen:7.1f} tok/s | step speed-up {hf_step / step:4.2f}x", flush=True)


if __name__ == "__main__":
    main()
