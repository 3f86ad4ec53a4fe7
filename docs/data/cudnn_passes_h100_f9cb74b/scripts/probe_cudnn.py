# ruff: noqa  (the script as it ran on the GPU, kept as a record)
"""Probe: torch's cuDNN attention ops as FlashBoB's first two passes at the suffix's shapes."""
import json, math, os, sys
import torch
import flashbob
aten = torch.ops.aten
dev = "cuda"
torch.manual_seed(0)
print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name())

def cudnn_fwd(q, k, v, causal, scale):
    r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r

def cudnn_bwd(dout, q, k, v, out, lse, r, causal, scale):
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, r[6], r[7], None, r[2], r[3], q.shape[2], k.shape[2], 0.0, causal, scale=scale)

def ref(q, k, v, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    n, m = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(n, device=dev)[:, None] + (m - n)
        j = torch.arange(m, device=dev)[None]
        s = s.masked_fill(j > i, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.double(), lse

# 1. shapes, lse units, causal alignment
B, H, D = 2, 3, 64
q = torch.randn(B, H, 5, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, H, 9, D, device=dev, dtype=torch.bfloat16)
v = torch.randn(B, H, 9, D, device=dev, dtype=torch.bfloat16)
r = cudnn_fwd(q, k, v, True, D ** -0.5)
print("out", tuple(r[0].shape), r[0].stride(), "lse", tuple(r[1].shape), r[1].stride(), r[1].dtype)
o_br, l_br = ref(q, k, v, True)
s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
tl_mask = torch.arange(9, device=dev)[None] > torch.arange(5, device=dev)[:, None]
o_tl = torch.softmax(s.masked_fill(tl_mask, float("-inf")), -1) @ v.double()
print("causal N<M: err vs bottom-right", (r[0].double() - o_br).abs().max().item(), "vs top-left", (r[0].double() - o_tl).abs().max().item())
o_full = torch.softmax(s, -1) @ v.double()
r = cudnn_fwd(q, k, v, False, D ** -0.5)
print("full: err", (r[0].double() - o_full).abs().max().item(), "lse err", (r[1].reshape(B, H, 5).double() - torch.logsumexp(s, -1)).abs().max().item())

# 2. split keys at the suffix's shapes; strided keys (views of a buffer); merged out/lse into both backwards
def split_fwd(q, k, v, scale):
    n, m = q.shape[2], k.shape[2]
    if m == n:
        r = cudnn_fwd(q, k, v, True, scale)
        return r[0], r[1].reshape(q.shape[:3]), [(r, 0, m, True)]
    ra = cudnn_fwd(q, k[:, :, : m - n], v[:, :, : m - n], False, scale)
    rb = cudnn_fwd(q, k[:, :, m - n :], v[:, :, m - n :], True, scale)
    la, lb = ra[1].reshape(q.shape[:3]), rb[1].reshape(q.shape[:3])
    lse = torch.logaddexp(la, lb)
    out = (ra[0].float() * (la - lse).exp()[..., None] + rb[0].float() * (lb - lse).exp()[..., None]).to(q.dtype)
    return out, lse, [(ra, 0, m - n, False), (rb, m - n, m, True)]

def split_bwd(dout, q, k, v, out, lse, parts, scale):
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for r, a, b, causal in parts:
        l4 = lse.reshape(r[1].shape).contiguous() if lse.dim() != r[1].dim() else lse
        g = cudnn_bwd(dout, q, k[:, :, a:b], v[:, :, a:b], out, l4, r, causal, scale)
        dq += g[0].float(); dk[:, :, a:b] = g[1]; dv[:, :, a:b] = g[2]
    return dq.to(q.dtype), dk, dv

rows = []
B, H = 16, 12
for n, m in ((64, 200), (1024, 1024), (1024, 4096), (1024, 8192), (8192, 8192)):
    cap = 8192 + 1024
    kb = torch.randn(B, H, cap, D, device=dev, dtype=torch.bfloat16)
    vb = torch.randn(B, H, cap, D, device=dev, dtype=torch.bfloat16)
    k, v = kb[:, :, :m], vb[:, :, :m]
    q = torch.randn(B, H, n, D, device=dev, dtype=torch.bfloat16)
    dout = torch.randn(B, H, n, D, device=dev, dtype=torch.bfloat16)
    scale = D ** -0.5
    out, lse, parts = split_fwd(q, k, v, scale)
    dq, dk, dv = split_bwd(dout, q, k, v, out, lse, parts, scale)
    fo, fl = flashbob.attention_forward(q, k, v, causal=True)
    fdq, fdk, fdv = flashbob.attention_backward(q, k, v, fo, fl, dout, causal=True)
    if n * m <= 1024 * 8192 and B * H * n * m < 2**31:
        qs, ks, vs = (t[:2].double().requires_grad_() for t in (q, k, v))
        ro, rl = ref(qs, ks, vs, True)
        gq, gk, gv = torch.autograd.grad(ro, (qs, ks, vs), dout[:2].double())
        err = lambda a, b: (a[:2].double() - b).abs().max().item()
        print(n, m, "cudnn err out/lse/dq/dk/dv", [f"{e:.1e}" for e in (err(out, ro), err(lse, rl), err(dq, gq), err(dk, gk), err(dv, gv))],
              "flashbob", [f"{e:.1e}" for e in (err(fo, ro), err(fl, rl), err(fdq, gq), err(fdk, gk), err(fdv, gv))])
    def t(f, reps=20):
        for _ in range(3): f()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record(); f(); b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b))
        times.sort(); return times[len(times) // 2], times[0], times[-1]
    def fb_cudnn():
        o, l, p = split_fwd(q, k, v, scale); split_bwd(dout, q, k, v, o, l, p, scale)
    def fb_flashbob():
        o, l = flashbob.attention_forward(q, k, v, causal=True); flashbob.attention_backward(q, k, v, o, l, dout, causal=True)
    row = {"n": n, "m": m, "cudnn_ms": t(fb_cudnn), "flashbob_ms": t(fb_flashbob),
           "cudnn_fwd_ms": t(lambda: split_fwd(q, k, v, scale)), "flashbob_fwd_ms": t(lambda: flashbob.attention_forward(q, k, v, causal=True))}
    print(json.dumps(row)); rows.append(row)
json.dump(rows, open(os.environ.get("OUT", ".") + "/probe_cudnn.json", "w"), indent=1)
