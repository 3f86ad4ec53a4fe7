"""Time each Triton stage under several tile settings, to choose the defaults in kernels/tiling.py.

    python benchmarks/sweep_tiles.py --n 16384 --d 64,128 --mask causal

Prints one line per (kernel, settings) with the stage's median milliseconds. The stage timed is
the one that launches the kernel: forward, backward (both its kernels) or BoB (both its kernels).
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels
from kernels import tiling
from kernels.bench import make_inputs, parse_mask, time_ms

CANDIDATES = {
    "forward": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 3)],
    "backward_kv": [(64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 2)],
    "backward_q": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 3), (64, 32, 4, 2)],
    "bob_rows": [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 8, 2),
                 (128, 32, 8, 2), (64, 64, 4, 3)],
    "bob_cols": [(64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (32, 64, 8, 2),
                 (32, 128, 8, 2), (64, 64, 4, 3)],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", default="64,128")
    p.add_argument("--mask", default="causal")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kernels", default=",".join(CANDIDATES))
    args = p.parse_args()
    for d in (int(x) for x in args.d.split(",")):
        sweep_head_dim(args, d)


def sweep_head_dim(args, d: int) -> None:
    causal, window = parse_mask(args.mask)
    opts = dict(causal=causal, window=window, backend="triton")
    q, k, v, dout, u_q, u_k, u_v = make_inputs(1, args.heads, args.n, d, torch.bfloat16)
    out, lse = kernels.attention_forward(q, k, v, **opts)
    dq, _, _ = kernels.attention_backward(q, k, v, out, lse, dout, **opts)
    stages = {
        "forward": lambda: kernels.attention_forward(q, k, v, **opts),
        "backward": lambda: kernels.attention_backward(q, k, v, out, lse, dout, **opts),
        "bob": lambda: kernels.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts),
    }
    for kernel in args.kernels.split(","):
        stage = "forward" if kernel == "forward" else "backward" if "backward" in kernel else "bob"
        for bm, bn, warps, num_stages in CANDIDATES[kernel]:
            if d > 64 and bm * bn > 64 * 64 and kernel.startswith("bob"):
                continue  # three (BLOCK_M, D) float32 accumulators do not fit the registers
            settings = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=num_stages)
            try:
                with tiling.override(kernel, **settings):
                    ms = time_ms(stages[stage], budget_s=0.5)
            except Exception as exc:  # a setting can exceed shared memory: report it and go on
                ms = f"failed: {type(exc).__name__}"
            print(json.dumps({"n": args.n, "d": d, "mask": args.mask, "kernel": kernel, **settings,
                              "stage_ms": ms}), flush=True)

if __name__ == "__main__":
    main()
