# ruff: noqa  (the script as it ran on the GPU, kept as a record)
"""The second-order step through torch.autograd.grad at 16K (B=1, H=8, bf16), back to back with torch's flash
and cuDNN forward+backward in one session: 10 calls queued per event pair, 5 rounds interleaved, medians."""
import json, os
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashbob
def t(f, calls=10):
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(calls): f()
    b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / calls
rows = []
for d in (64, 128):
    for causal in (True, False):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do, u = (torch.randn(1, 8, 16384, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(5))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        def step(passes):
            def f():
                os.environ["FLASHBOB_FIRST_PASSES"] = passes
                out = flashbob.flash_attention(q, k, v, causal=causal)
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), do, create_graph=True)
                torch.autograd.grad((dq, dk, dv), (q, k, v), (u, u, u))
            return f
        def sdpa(backend):
            def f():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.autograd.grad(out, (q, k, v), do)
            return f
        fns = {"flash_fb": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn_fb": sdpa(SDPBackend.CUDNN_ATTENTION),
               "step_own": step("triton"), "step_cudnn_passes": step("cudnn")}
        for f in fns.values():
            for _ in range(3): f()
        torch.cuda.synchronize()
        times = {k_: [] for k_ in fns}
        for _ in range(5):
            for k_, f in fns.items(): times[k_].append(t(f))
        row = {"d": d, "causal": causal, "gpu": torch.cuda.get_device_name(), "commit": os.environ.get("FLASHBOB_COMMIT")}
        for k_, ts in times.items():
            ts.sort(); row[k_] = [round(ts[2], 3), round(ts[0], 3), round(ts[-1], 3)]
        for k_ in ("step_own", "step_cudnn_passes"):
            row[k_ + "_over_flash"] = round(row[k_][0] / row["flash_fb"][0], 3)
            row[k_ + "_over_cudnn"] = round(row[k_][0] / row["cudnn_fb"][0], 3)
        print(json.dumps(row), flush=True); rows.append(row)
json.dump(rows, open(os.environ["OUT"] + "/step16k_b2b.json", "w"), indent=1)
