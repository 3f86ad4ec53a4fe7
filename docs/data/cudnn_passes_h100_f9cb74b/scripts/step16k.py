# ruff: noqa  (the script as it ran on the GPU, kept as a record)
"""The second-order step through torch.autograd.grad at 16K (B=1, H=8, bf16): flashbob with its own first
passes, with cuDNN's (FLASHBOB_FIRST_PASSES), against torch's flash and cuDNN forward+backward."""
import json, os
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashbob
def t(f, reps=10):
    for _ in range(3): f()
    torch.cuda.synchronize(); times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b))
    times.sort(); return round(times[len(times) // 2], 3), round(times[0], 3), round(times[-1], 3)
rows = []
for d in (64, 128):
    for causal in (True, False):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do, u = (torch.randn(1, 8, 16384, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(5))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        def step():
            out = flashbob.flash_attention(q, k, v, causal=causal)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), do, create_graph=True)
            torch.autograd.grad((dq, dk, dv), (q, k, v), (u, u, u))
        def sdpa(backend):
            def f():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.autograd.grad(out, (q, k, v), do)
            return f
        row = {"d": d, "causal": causal, "flash_fb": t(sdpa(SDPBackend.FLASH_ATTENTION)), "cudnn_fb": t(sdpa(SDPBackend.CUDNN_ATTENTION))}
        os.environ["FLASHBOB_FIRST_PASSES"] = "triton"; row["step_own"] = t(step)
        os.environ["FLASHBOB_FIRST_PASSES"] = "cudnn"; row["step_cudnn_passes"] = t(step)
        os.environ["FLASHBOB_FIRST_PASSES"] = "triton"; row["step_own_again"] = t(step)
        row["own_over_flash"] = round(row["step_own"][0] / row["flash_fb"][0], 3)
        row["cudnn_passes_over_flash"] = round(row["step_cudnn_passes"][0] / row["flash_fb"][0], 3)
        print(json.dumps(row), flush=True); rows.append(row)
json.dump(rows, open(os.environ["OUT"] + "/step16k.json", "w"), indent=1)
