"""Bytes saved for backward by one meta step of the memory layer, on the CPU, as CUDA would save them.

    python -m ttt.experiments.neural_memory_saved                          # mac, full causal: about 10 s
    python -m ttt.experiments.neural_memory_saved --concat                 # the prefix concatenated per chunk
    python -m ttt.experiments.neural_memory_saved --variant mag --window 64 --sources 8

One `ttt.experiments.neural_memory_workload.memory_meta_step` (second order, 2 layers of d_model 64 with
memories in both,
depth-2 memory, chunks of 64, float32) per N. The attention runs the FlashBoB autograd chain of the
CUDA path (`flashbob.autograd`: forward, first backward and BoB Functions, which save q, k, v, out, lse,
and dout, dq) with the plain-PyTorch stages of `flashbob.reference` in place of the Triton launchers, so
what is saved is what the kernels save on CUDA (O(N) per call), not the N x N scores of the CPU path.
`SavedTensorMeter` counts each saved storage once; its peak is the activation memory of the step.

Prints per N: saved bytes per token (peak), and, at the end of the forward, the part first saved by the
attention chain (flashbob/) and the rest; --sources K adds the K largest savers by code line. --concat
reads with the per-chunk torch.cat of the prefix keys and values (`SuffixBlock.shares_prefix` off), the
computation before `PrefixCache`.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

import flashbob
from flashbob import autograd, reference, triton_ops
from ttt.experiments.gpu_memory_meters import SavedTensorMeter
from ttt.experiments.neural_memory_workload import memory_meta_step
from ttt.models import TransformerConfig


def _forward(q, k, v, *, fp32_precision=None, **options):
    return reference.forward_reference(q, k, v, **options)


def _backward(q, k, v, out, lse, dout, *, fp32_precision=None, **options):
    return reference.backward_reference(q, k, v, out, lse, dout, **options)


def _bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, *, fp32_precision=None, **options):
    return reference.bob_reference(q, k, v, out, lse, dout, u_q, u_k, u_v, **options)


def _chain_attention(q, k, v, *, causal=False, window=None, scale=None, backend="auto"):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return autograd.triton_attention(q, k, v, causal=causal, window=window, scale=scale)


@contextlib.contextmanager
def cuda_chain_on_cpu() -> Iterator[None]:
    """Inside: `flashbob.flash_attention` runs the Triton path's autograd chain with the reference stages
    as its launchers (any device, any dtype the references take)."""
    patched = {
        (triton_ops, "forward"): _forward,
        (triton_ops, "backward"): _backward,
        (triton_ops, "bob"): _bob,
        (flashbob, "flash_attention"): _chain_attention,
    }
    originals = {key: getattr(*key) for key in patched}
    try:
        for (module, name), replacement in patched.items():
            setattr(module, name, replacement)
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


def measure(n: int, *, variant: str, window: int | None, concat: bool, chunk_len: int = 64):
    """One meta step of N tokens -> (peak saved bytes, saved bytes by source at the end of the forward)."""
    cfg = TransformerConfig(
        vocab_size=64, d_model=64, n_layers=2, n_heads=2, window=window, attention="flashbob"
    )
    model, _ = memory_meta_step(cfg, n=n, chunk_len=chunk_len, depth=2, variant=variant, suffix_len=2)
    for block in model.suffix:
        block.shares_prefix = not concat
    tokens = torch.randint(cfg.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(0))
    with cuda_chain_on_cpu(), SavedTensorMeter(by_source=True) as meter:
        loss = model.token_losses(tokens).mean()
        sources = meter.live_by_source()
        loss.backward()
    return meter.peak_bytes, sources


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", choices=["mac", "mag"], default="mac")
    parser.add_argument("--window", type=int, default=None, help="sliding window (default: full causal)")
    parser.add_argument("--concat", action="store_true", help="concatenate the prefix per chunk (before)")
    parser.add_argument("--ns", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--sources", type=int, default=0, help="also list the K largest savers")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shared = args.window is None and not args.concat
    prefix = "one shared buffer (PrefixCache)" if shared else "concatenated per chunk"
    print(f"variant {args.variant}, window {args.window}, prefix keys and values: {prefix}")
    print(f"{'N':>6} {'saved B/token':>14} {'attention':>10} {'rest':>8}")
    for n in args.ns:
        peak, sources = measure(n, variant=args.variant, window=args.window, concat=args.concat)
        attention = sum(b for source, b in sources.items() if source.startswith("flashbob/"))
        rest = sum(sources.values()) - attention
        print(f"{n:>6} {peak / n:>14.0f} {attention / n:>10.0f} {rest / n:>8.0f}")
        for source, nbytes in sources.most_common(args.sources):
            print(f"{'':>8}{nbytes / n:>10.0f}  {source}")


if __name__ == "__main__":
    main()
