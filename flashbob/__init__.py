"""Exact softmax attention that can be differentiated twice (FlashBoB).

Public API
    flash_attention(q, k, v, *, causal=False, window=None, scale=None, backend="auto",
                    fp32_precision=None, key_start=None, key_end=None) -> out
    attention_forward / attention_backward / attention_bob: the three stages as plain functions.

Supported
    * layout (batch, heads, seq, head_dim); q (B, Hq, N, D), k and v (B, Hkv, M, D); GQA / MQA when
      Hq is a multiple of Hkv; any N and M (rectangular attention included);
    * masks: none, causal (bottom-right aligned: query i sees keys j <= i + M - N), and causal
      sliding window (also j > i + M - N - window); combined with any of them, per-batch-row key
      ranges (key_start, key_end: (B,) integer tensors; batch row b sees keys
      key_start[b] <= j < key_end[b]: left or right padding), on every path and derivative; rows
      that see no key output zero;
    * head dims 8 to 256, not only powers of two;
    * dtypes float16, bfloat16, float32 on the Triton path (float64 too on the torch path); float32
      products by fp32_precision: "tf32x3" (default), "ieee" or "tf32";
    * GPUs of compute capability 8.0 and newer (Ampere, Ada, Hopper): the tiles are fitted to the
      device's shared memory per block (flashbob/tiling.py; FLASHBOB_MAX_SHARED_MEM=163K or 99K
      imposes an A100's or an L4's on a larger GPU). The first forward of a kind of call whose
      inputs require grad compiles the kernels of forward, backward and BoB side by side on threads
      (flashbob.precompile; FLASHBOB_PRECOMPILE=0 compiles each at its first launch instead). On
      Hopper the BoB of 16-bit inputs at head dims 64 and 128 runs Gluon kernels with TMA and
      warpgroup MMAs: its rows pass always, warp-specialized (two consumer warpgroups share the
      key tiles a producer warp loads), its columns pass at head dim 64 (warp-specialized under a
      full mask), where each is faster (flashbob.hopper; FLASHBOB_SM90=1 runs both passes wherever
      they can, =0 never); they are written for Triton 3.6's Gluon and compile with 3.6 to 3.9
      (3.7 to 3.9 compiled for sm_90 only, not run): where a pass does not compile (a later
      Triton), one warning and the portable kernels for the rest of the process. Each launcher
      records its launches on its first call with an input layout and replays them after, checked
      against Triton's own launch path when recorded (flashbob.launch_plans;
      FLASHBOB_LAUNCH_PLANS=0 runs them as written every call);
    * derivatives: first and second order. The second (backward-over-backward) runs the FlashBoB
      kernels: exact, O(N) extra memory, no N x N tensor. A third derivative raises an error on the
      Triton path (use backend="torch");
    * `torch.func.grad` of `torch.func.grad`, and `torch.func.functional_call`;
    * forward mode on the Triton path (`torch.func.jvp`, `torch.autograd.forward_ad`), tangents of
      any subset of q, k, v: one fused forward-with-tangent kernel, O(N) extra memory. Through
      `torch.func.jvp` it runs after the forward kernel (PyTorch calls forward, then jvp);
    * gradients of a loss on the JVP's output (`torch.func.grad` of `torch.func.jvp`, or
      `torch.autograd.grad` through forward_ad duals), w.r.t. q, k, v and the tangents: the first
      backward and the FlashBoB kernels, exact, no N x N tensor;
    * `torch.func.vmap` (in_dims on any of q, k, v, None included), also of grad, jvp, grad of grad
      and grad of jvp: the vmapped dim is folded into the batch;
    * `torch.compile(fullgraph=True)` at first order on both backends (the Triton path is the custom
      op `flashbob::attention_forward` under compile, `flashbob.compiled`).

Backends
    "triton": the Triton kernels, on CUDA, or on CPU tensors when TRITON_INTERPRET=1 was set
    before flashbob was imported. "torch": plain PyTorch with the same semantics (the reference and
    the CPU training path; O(N*M) memory). "auto": triton on CUDA, torch otherwise.

Hugging Face transformers
    register_transformers(name="bob") makes `attn_implementation="bob"` run every attention call of a
    transformers model through flash_attention (flashbob.transformers_attention; transformers is
    imported only inside that call).

Known limits
    No dropout, no attention bias or arbitrary masks (a key range per batch row, not per query or
    with holes), no variable-length (packed) batches.
    Triton path: a third derivative, forward mode through a gradient (jvp of grad) or through a
    tangent (jvp of jvp) raise errors. Inside a compiled region only first order works: PyTorch's
    AOTAutograd raises on a second derivative (run second-order steps eagerly), and forward mode and
    vmap are not supported there. See docs/forward_mode.md.
    Float32 at head dim 256 needs, by the
    shared-memory estimate, ~112 KiB in the BoB even at the smallest tiles: on a 99 KiB GPU
    (L4, RTX 4090) Triton may refuse it (the error says so); use bfloat16 there.
"""

from .api import attention_backward, attention_bob, attention_forward, flash_attention
from .transformers_attention import register_transformers

__all__ = [
    "flash_attention",
    "attention_forward",
    "attention_backward",
    "attention_bob",
    "register_transformers",
]
