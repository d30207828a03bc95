"""Where a decode step's time goes on the GPU (issue 10): per bucket, the captured graph's GPU
time and its kernels (torch.profiler), then whole engine decode steps and the host's pieces.

Run on the GPU machine from the repo root: ``python3 scripts/gpu_decode_profile.py``.
"""
import os, sys, time
import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

out = os.environ.get("OUT", ".")
llm = LLM("random:llama-3.1-8b", device="cuda", dtype="bfloat16", max_running_requests=64,
          gpu_memory_utilization=0.5)
eng = llm.engine
g = eng.executor.rank0.runner.graphs
print("buckets", g.sizes)
summary = []
CTX = 200
for bs in (1, 64):
    ids = np.zeros(bs, dtype="int64") + 5
    pos = np.zeros(bs, dtype="int64") + CTX - 1
    tables = [list(range(i * 14, i * 14 + 13)) for i in range(bs)]
    for _ in range(3):
        g.replay(ids, pos, tables)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        g._graphs[g._last_key].replay()
    e.record(); torch.cuda.synchronize()
    gpu_ms = s.elapsed_time(e) / 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g._graphs[g._last_key].replay()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    rows = sorted(ka, key=lambda a: -a.device_time_total)
    tot = sum(a.device_time_total for a in ka) / 5 / 1e3
    n = sum(a.count for a in ka) / 5
    print(f"\n== bs {bs} ctx {CTX}: graph {gpu_ms:.3f} ms; kernels sum {tot:.3f} ms over {n:.0f} kernels; gaps {gpu_ms - tot:.3f} ms")
    for a in rows[:22]:
        print(f"{a.device_time_total / 5 / 1e3:8.3f} ms {a.count // 5:5d}x  {a.key[:110]}")
    summary.append((bs, gpu_ms, tot, n))

# Whole decode steps through the engine: (time of 96 tokens - time of 32) / 64 = ms per decode step,
# and where the host time of a step goes (perf_counter around the engine's pieces, no profiler).
import collections
T = collections.defaultdict(float)
def timed(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); T[key] += time.perf_counter() - t0; return r
    setattr(obj, name, w)
timed(eng.scheduler, "schedule", "schedule")
timed(eng.executor.rank0.runner, "_graph_step", "graph_step(prep+launch)")
timed(eng.executor.rank0.runner.graphs, "greedy_tokens", "greedy_tokens(wait)")
timed(eng.executor.rank0.runner, "execute", "execute")
timed(eng, "_apply", "apply")
timed(eng, "_make_output", "make_output")
timed(eng, "step", "engine.step")
for n in (1, 64):
    prompts = [[1 + (i * 7 + j) % 4000 for j in range(CTX - 64)] for i in range(n)]
    t = {}
    for mt in (32, 96, 32, 96):
        p = SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True)
        T.clear()
        torch.cuda.synchronize(); t0 = time.perf_counter(); llm.generate(prompts, p); t[mt] = time.perf_counter() - t0
        tt = dict(T); tt["generate"] = t[mt]
        t[("T", mt)] = tt
    step = (t[96] - t[32]) / 64 * 1e3
    print(f"\n== engine decode step, {n} prompts: {step:.3f} ms/step; host pieces per step (96-32)/64:")
    for k in t[("T", 96)]:
        print(f"   {k:28s} {(t[('T', 96)][k] - t[('T', 32)].get(k, 0)) / 64 * 1e3:7.3f} ms")
    summary.append((f"engine {n}", step))

print("\nSUMMARY", summary)
