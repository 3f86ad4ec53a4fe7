"""Seconds of the first forward, backward and BoB call of a (head dim, dtype, mask) family in a fresh
process: compilation included. Run it twice: the second process reads Triton's on-disk cache.

    python benchmarks/first_call.py --d 64 --mask causal
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import kernels
from kernels.bench import parse_mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--mask", default="causal")
    p.add_argument("--n", type=int, default=4096)
    args = p.parse_args()
    causal, window = parse_mask(args.mask)
    q, k, v, dout, u_q, u_k, u_v = (torch.randn(1, 8, args.n, args.d, device="cuda", dtype=torch.bfloat16)
                                    for _ in range(7))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = kernels.flash_attention(q, k, v, causal=causal, window=window)
    torch.cuda.synchronize()
    forward_s = time.perf_counter() - start
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    torch.cuda.synchronize()
    backward_s = time.perf_counter() - start - forward_s
    torch.autograd.grad((dq, dk, dv), (q, k, v), (u_q, u_k, u_v))
    torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    print(json.dumps({"d": args.d, "mask": args.mask, "forward_s": round(forward_s, 2),
                      "backward_s": round(backward_s, 2), "bob_s": round(total_s - forward_s - backward_s, 2),
                      "total_s": round(total_s, 2)}))


if __name__ == "__main__":
    main()
