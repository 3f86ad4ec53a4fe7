# ruff: noqa  (the script as it ran on the GPU, kept as a record)
"""Kernels of the 16K second-order step (cuDNN first passes) at head dim 128: name, calls, device ms per step."""
import json, os
import torch
from torch.profiler import profile, ProfilerActivity
import flashbob
os.environ["FLASHBOB_FIRST_PASSES"] = "cudnn"
rows = {}
for d in (64, 128):
    for causal in (True, False):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do, u = (torch.randn(1, 8, 16384, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(5))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        def step():
            out = flashbob.flash_attention(q, k, v, causal=causal)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do, create_graph=True)
            torch.autograd.grad((dq, dk, dv), (q, k, v), (u, u, u))
        for _ in range(3): step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5): step()
            torch.cuda.synchronize()
        ks = [(e.key, e.count / 5, e.device_time_total / 5 / 1000) for e in p.key_averages() if e.device_time_total > 0]
        ks.sort(key=lambda r: -r[2])
        key = f"d{d}_{'causal' if causal else 'full'}"
        rows[key] = [[n[:110], c, round(ms, 4)] for n, c, ms in ks[:25]]
        print(key, "total ms", round(sum(r[2] for r in ks), 3))
        for r in rows[key][:14]: print("  ", r)
json.dump(rows, open(os.environ["OUT"] + "/prof16k.json", "w"), indent=1)
