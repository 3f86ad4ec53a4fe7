"""Time each Triton kernel under several tile settings, to choose the defaults in kernels/tiling.py.

    python benchmarks/sweep_tiles.py --n 16384 --d 64,128 --mask causal

Prints one line per (kernel, settings): the stage's median milliseconds (the stage that launches the
kernel: forward, backward, BoB or JVP), the kernel's own GPU time from the profiler, and its registers and
spills as compiled.
"""

from __future__ import annotations

import argparse
import json

import torch

import kernels
from kernels import tiling, triton_ops
from kernels.bench import kernel_times, make_inputs, parse_mask, time_ms

CANDIDATES = {
    "forward": [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
    "backward_kv": [(64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2)],
    "backward_q": [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2)],
    "bob_rows": [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3),
                 # a fifth entry sets SPLIT: one launch with smaller row tiles, against the default
                 (32, 32, 4, 2, False), (32, 64, 4, 2, False), (32, 32, 4, 3, False), (32, 64, 4, 3, False)],
    "bob_cols": [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2)],
    "jvp": [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (32, 64, 4, 2)],
}


KERNEL_NAMES = {
    "forward": "attention_forward_kernel",
    "backward_kv": "attention_backward_dkdv_kernel",
    "backward_q": "attention_backward_dq_kernel",
    "bob_rows": "attention_bob_rows_kernel",
    "bob_cols": "attention_bob_cols_kernel",
    "jvp": "attention_jvp_kernel",
}


def compiled_resources(kernel_name: str) -> list[dict]:
    """Registers and spills of every compiled variant of a kernel (empty if Triton hides them)."""
    from kernels import _backward, _bob, _forward, _jvp

    for module in (_forward, _backward, _bob, _jvp):
        fn = getattr(module, kernel_name, None)
        if fn is None:
            continue
        found = []
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in cache[0].values():
                found.append({"regs": getattr(compiled, "n_regs", None),
                              "spills": getattr(compiled, "n_spills", None)})
        return found
    return []


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
        "jvp": lambda: triton_ops.jvp(q, k, v, u_q, u_k, u_v, causal=causal, window=window, scale=d**-0.5),
    }
    for kernel in args.kernels.split(","):
        stage = kernel if kernel in ("forward", "jvp") else "backward" if "backward" in kernel else "bob"
        for bm, bn, warps, num_stages, *split in CANDIDATES[kernel]:
            settings = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=num_stages)
            settings.update({"SPLIT": split[0]} if split else {})
            try:
                with tiling.override(kernel, **settings):
                    ms = time_ms(stages[stage], budget_s=0.5)
                    own_ms = kernel_times(stages[stage], [KERNEL_NAMES[kernel]])[KERNEL_NAMES[kernel]]
            except Exception as exc:  # a setting can exceed shared memory: report it and go on
                ms = own_ms = f"failed: {type(exc).__name__}"
            print(json.dumps({"n": args.n, "d": d, "mask": args.mask, "kernel": kernel, **settings,
                              "stage_ms": ms, "kernel_ms": own_ms}), flush=True)
        print(json.dumps({"d": d, "kernel": kernel, "compiled": compiled_resources(KERNEL_NAMES[kernel])}))

if __name__ == "__main__":
    main()
