"""BoB error in low precision against float64, for FlashBoB and for plain PyTorch run in the same dtype.

    python benchmarks/precision.py --n 2048 --d 64,128 --mask causal,full --dtype bf16

For each case and each BoB output (grad_q, grad_k, grad_v, grad_dout): relative error
||x - ref|| / ||ref|| of ours and of plain-PyTorch autograd attention in `dtype`, and their ratio.
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels
from kernels.bench import DTYPES, parse_mask
from kernels.reference import attention_naive


def bob_outputs(attention, q, k, v, dout, us):
    q, k, v, dout = (t.detach().clone().requires_grad_() for t in (q, k, v, dout))
    firsts = torch.autograd.grad(attention(q, k, v), (q, k, v), dout, create_graph=True)
    return torch.autograd.grad(firsts, (q, k, v, dout), us)


def rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d", default="64,128")
    p.add_argument("--mask", default="causal,full")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--heads", type=int, default=4)
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    for mask in args.mask.split(","):
        causal, window = parse_mask(mask)
        for d in (int(x) for x in args.d.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(0)
            full = [torch.randn(1, args.heads, args.n, d, device="cuda", dtype=torch.float64, generator=gen)
                    for _ in range(7)]
            low = [t.to(dtype) for t in full]
            ref_inputs = [t.double() for t in low]  # the same (rounded) inputs, computed exactly

            def naive(q, k, v, d=d, causal=causal, window=window):
                return attention_naive(q, k, v, causal=causal, window=window, scale=d**-0.5)

            def ours(q, k, v, causal=causal, window=window):
                return kernels.flash_attention(q, k, v, causal=causal, window=window, backend="triton")

            ref = bob_outputs(naive, *ref_inputs[:4], ref_inputs[4:])
            got_ours = bob_outputs(ours, *low[:4], low[4:])
            got_torch = bob_outputs(naive, *low[:4], low[4:])
            for name, r, a, b in zip(("grad_q", "grad_k", "grad_v", "grad_dout"), ref, got_ours, got_torch):
                e_ours, e_torch = rel(a, r), rel(b, r)
                print(json.dumps({"mask": mask, "d": d, "n": args.n, "dtype": args.dtype, "output": name,
                                  "err_ours": e_ours, "err_torch": e_torch, "ratio": e_ours / e_torch}))


if __name__ == "__main__":
    main()
