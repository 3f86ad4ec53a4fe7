"""The BoB rows kernel in one launch (smaller row tiles) against two (Q̄, then dŌ), at one head dim:
the time of the whole second-order call and its ratio to torch's flash forward + backward, all in
one process, plus the largest difference between the modes' outputs.

    python benchmarks/bob_rows_launches.py --d 128 --n 16384 --mask causal,full

Prints one JSON line per (mask, setting). "default" is what kernels/tiling.py launches today.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend

import kernels
from kernels import tiling
from kernels.bench import make_inputs, parse_mask, sdpa_attention, second_order_call, time_ms

ONE_LAUNCH = [(32, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 3), (32, 64, 4, 3)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mask", default="causal,full")
    args = p.parse_args()
    for mask in args.mask.split(","):
        compare_launches(args, mask)


def compare_launches(args, mask: str) -> None:
    """Print one JSON line per setting of the rows kernel at this mask."""
    causal, window = parse_mask(mask)
    q, k, v, dout, u_q, u_k, u_v = make_inputs(1, args.heads, args.n, args.d, torch.bfloat16)
    flash = sdpa_attention(SDPBackend.FLASH_ATTENTION, causal)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    flash_ms = time_ms(lambda: torch.autograd.grad(flash(qg, kg, vg), (qg, kg, vg), dout))

    def ours(q_, k_, v_):
        return kernels.flash_attention(q_, k_, v_, causal=causal, window=window, backend="triton")

    bob = second_order_call(ours, q, k, v, dout, u_q, u_k, u_v)
    reference = bob()
    settings = [("default", {})] + [
        (f"one launch {bm}x{bn} w{w} s{st}",
         dict(SPLIT=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st))
        for bm, bn, w, st in ONE_LAUNCH
    ]
    for name, override in settings:
        try:
            with tiling.override("bob_rows", **override):
                got = bob()
                ms = time_ms(bob)
            diff = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, reference))
            row = {"ms": ms, "ratio_to_flash_fwd_bwd": ms / flash_ms, "max_rel_diff_to_default": diff}
        except Exception as exc:  # a setting can exceed shared memory: report it and go on
            row = {"failed": type(exc).__name__}
        print(json.dumps({"d": args.d, "n": args.n, "mask": mask, "setting": name,
                          "flash_fwd_bwd_ms": flash_ms, **row}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
