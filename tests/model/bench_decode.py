"""Decode-step timing: pdserve's model vs. transformers on the same weights (not a test).

CPU, embedded model:  ``.venv/bin/python tests/model/bench_decode.py --threads 1``
CUDA, 8B shapes:      ``python3 tests/model/bench_decode.py --model random:llama-3.1-8b --device cuda
                        --dtype bfloat16 --batch 1 16 64 --prompt 512``
Each of ``--batch`` prompts has ``--prompt`` tokens; we time ``--steps`` greedy decode steps
(metadata build + forward + logits + argmax, median) and compare with transformers' forward
with its KV cache on the same batch, and with ``generate`` (greedy, ``--steps`` new tokens).
Random presets need no tokenizer here: transformers initialises the weights, ours copies them.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.model.attention import build_attention_metadata
from pdserve.model.llama import LlamaForCausalLM
from pdserve.model.presets import preset_config


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_model(model: str, dtype, device):
    if model.startswith("random:"):
        with torch.device(device):
            hf = transformers.AutoModelForCausalLM.from_config(
                preset_config(model[7:]), dtype=dtype
            )
    else:
        from pdserve.model.loader import load_model_source

        src = load_model_source(model)
        hf = transformers.AutoModelForCausalLM.from_config(src.hf_config, dtype=dtype)
        hf.load_state_dict(dict(src.weights()), strict=False)
        hf.tie_weights()
        hf.to(device)
    return hf.eval()


def ours(hf, dtype, device, batch, prompt, steps, page_size=16):
    m = LlamaForCausalLM(hf.config, dtype, device)
    m.load_weights(hf.state_dict().items())
    s = m.shapes
    pages_per_seq = (prompt + steps + page_size) // page_size + 1
    lay = KVCacheLayout(
        "page_major", s.n_layers, s.n_kv_heads, s.head_dim, page_size, batch * pages_per_seq, dtype
    )
    kv = lay.layer_views(lay.allocate(device))
    tables = [list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)]
    ids = torch.randint(100, 10000, (batch * prompt,), device=device)
    md = build_attention_metadata([prompt] * batch, [prompt] * batch, tables, page_size, device)
    _sync(device)
    t0 = time.perf_counter()
    h = m(ids, torch.arange(prompt, device=device).repeat(batch), md, kv)
    tok = m.compute_logits(h.view(batch, prompt, -1)[:, -1]).argmax(-1)
    _sync(device)
    prefill = time.perf_counter() - t0
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        n = prompt + i + 1
        md = build_attention_metadata([1] * batch, [n] * batch, tables, page_size, device)
        tok = m.compute_logits(m(tok, torch.full((batch,), n - 1, device=device), md, kv)).argmax(
            -1
        )
        tok.tolist()  # the engine reads sampled ids back every step
        times.append(time.perf_counter() - t0)
    del m, kv
    return prefill, sorted(times)[len(times) // 2]


def theirs(hf, device, batch, prompt, steps):
    ids = torch.randint(100, 10000, (batch, prompt), device=device)
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = hf(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            tok.tolist()
            times.append(time.perf_counter() - t0)
        del out, past
        _sync(device)
        t0 = time.perf_counter()
        hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=2,
        )
        _sync(device)
        gen = time.perf_counter() - t0
    return sorted(times)[len(times) // 2], gen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    print(
        f"{args.model} on {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"prompt {args.prompt}, {args.steps} steps",
        flush=True,
    )
    for dt in args.dtype:
        dtype = getattr(torch, dt)
        hf = hf_model(args.model, dtype, device)
        for b in args.batch:
            pre, step = ours(hf, dtype, device, b, args.prompt, args.steps)
            hf_step, gen = theirs(hf, device, b, args.prompt, args.steps)
            print(
                f"{dt:9s} batch {b:3d}: ours {step * 1e3:7.2f} ms/step ({b / step:7.1f} tok/s), "
                f"prefill {pre * 1e3:7.1f} ms | transformers forward {hf_step * 1e3:7.2f} ms/step, "
                f"generate {b * args.steps / gen:7.1f} tok/s | step speed-up {hf_step / step:4.2f}x",
                flush=True,
            )
        del hf
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
