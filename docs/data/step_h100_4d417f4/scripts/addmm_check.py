import time

import torch

g = torch.Generator(device="cuda").manual_seed(0)
V, R, d = 128256, 2093, 768
a = torch.randn(R, V, device="cuda", generator=g).to(torch.bfloat16)
b = torch.randn(R, d, device="cuda", generator=g).to(torch.bfloat16)
acc0 = torch.randn(V, d, device="cuda", generator=g)
ref = acc0.double() + a.double().t() @ b.double()
x = acc0.clone()
torch.addmm(x, a.t(), b, out_dtype=torch.float32, out=x)
y = acc0.clone()
y += a.t() @ b
scale = ref.abs().max().item()
print(
    "addmm out_dtype max err / max",
    (x.double() - ref).abs().max().item() / scale,
    " old",
    (y.double() - ref).abs().max().item() / scale,
)


def t(f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - s) / 20 * 1e3


print(
    "ms addmm out_dtype",
    t(lambda: torch.addmm(x, a.t(), b, out_dtype=torch.float32, out=x)),
    " old mm+add",
    t(lambda: y.add_(a.t() @ b)),
)
