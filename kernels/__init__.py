"""Exact softmax attention that can be differentiated twice (FlashBoB).

Public API
    flash_attention(q, k, v, *, causal=False, window=None, scale=None, backend="auto") -> out
    attention_forward / attention_backward / attention_bob: the three stages as plain functions.

Supported
    * layout (batch, heads, seq, head_dim); q (B, Hq, N, D), k and v (B, Hkv, M, D); GQA / MQA when
      Hq is a multiple of Hkv; any N and M (rectangular attention included);
    * masks: none, causal (bottom-right aligned: query i sees keys j <= i + M - N), and causal
      sliding window (also j > i + M - N - window); rows that see no key output zero;
    * head dims 8 to 256, not only powers of two;
    * dtypes float16, bfloat16, float32 on the Triton path (float64 too on the torch path);
    * derivatives: first and second order. The second (backward-over-backward) runs the FlashBoB
      kernels: exact, O(N) extra memory, no N x N tensor. A third derivative raises an error on the
      Triton path (use backend="torch");
    * `torch.func.grad` of `torch.func.grad`, and `torch.func.functional_call`.

Backends
    "triton": the Triton kernels, on CUDA, or on CPU tensors when TRITON_INTERPRET=1 was set
    before kernels was imported. "torch": plain PyTorch with the same semantics (the reference and
    the CPU training path; O(N*M) memory). "auto": triton on CUDA, torch otherwise.

Hugging Face transformers
    register_transformers(name="bob") makes `attn_implementation="bob"` run every attention call of a
    transformers model through flash_attention (kernels.transformers_attention; transformers is
    imported only inside that call).

Known limits
    No dropout, no attention bias or arbitrary masks, no variable-length (packed) batches.
    The Triton path does not support vmap over the op.
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
