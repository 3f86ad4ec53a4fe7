"""Back-of-envelope memory model of one meta step: the bytes autograd keeps for backward, per token.

Counted from the model's code (every tensor some autograd node saves, each storage once) for a
`Transformer` whose MLPs are the adapted parameters, with n_kv_heads == n_heads; checked against
`SavedTensorMeter` by the tests (within 3%; exact in float32). Symbols: d model width, w = n_heads *
head_dim, f MLP hidden width, H heads, V vocabulary, N sequence length, e bytes per element of the
model dtype (2 for bf16), a = 4 bytes per element inside SDPA's math backend (it upcasts bf16/fp16 to
float32). Bytes per token, per block, with the model's fused ops (model.fused_ops, the default; the
plain ops' terms in brackets: RMSNorm computes in float32, hence their 4-byte terms):

  forward graph A:
    norms 2 * 2e d [2(4d + 2e d + 4)] + MLP 3e f [4e f] + attention:
      flashbob    5e w + 4H                  q, k, v, out, the wo input; float32 log-sum-exp
      eager       4e w + N (e H + 1)         q, k, v, the wo input; P (N x N per head) and the mask
      sdpa_math   3a w + e w + N a H         float32 q, k, v, the wo input; P in float32
  graph of the inner gradient B (create_graph, second order only):
    residual grad e d + SwiGLU backward 3e f [8e f] + norms 2e d [2(e d + 12d + 8)] + attention:
      flashbob    6e w                       grads of the wo input, dO, dQ, grads into wq, wk, wv
      eager       5e w + N 2e H              dP and dS
      sdpa_math   4e w + a w + N 2a H

The first block's attention is not on the inner gradient's path (nothing before it is adapted): its
B is e d + 3e f [8e f]. The head adds a norm's forward, 4V + 16 (float32 logits, tokens) and a norm's
backward + (4 + e)V (inner gradient). Every forward (each inner step's and the outer one) makes its
own float32 RoPE tables, 8 head_dim per token. Fixed: the weights the linear layers save, one new
copy of the adapted weights per second-order inner step, and per inner step a new copy of the joined
q and k projection weights (`project_many` concatenates them in every forward; wv too with qk_norm).

The allocator's peak adds what backward passes hold only while they run (`transient_bytes`): for
eager and sdpa_math the double backward of one attention holds about 6 more N x N tensors per head
(in its dtype: e, or a for sdpa_math; a first-order backward 2: dP and dS), counted on the CPU with
`LiveTensorMeter`; for every backend the float32 logits' gradients, 8V per token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ttt.models import Transformer

SDPA_MATH_BYTES = 4


@dataclass(frozen=True)
class ModelDims:
    """The sizes the model needs, read off a built `Transformer`."""

    d: int
    """Model width."""
    w: int
    """n_heads * head_dim."""
    f: int
    """MLP hidden width."""
    heads: int
    """Query heads."""
    vocab: int
    """Vocabulary size."""
    layers: int
    """Transformer blocks."""
    head_dim: int
    """Width of one head (the float32 RoPE tables are N x head_dim each)."""
    weight_bytes: int
    """Bytes of the parameters other than the embedding (the linear layers save their weights)."""
    adapted_bytes: int
    """Bytes of the adapted parameters (each second-order inner step makes and keeps a new copy)."""
    param_bytes: int
    """Bytes of all parameters (and so of their gradients)."""
    joined_bytes: int
    """Bytes of the attention weights `project_many` concatenates in every forward (wq and wk of every
    block; wv too with qk_norm). The MLP's gate and up are concatenated too, but those copies stand in
    for the adapted weights' (adapted_bytes)."""
    fused: bool
    """Whether the model runs the fused RMSNorm, SwiGLU and RoPE ops (its cfg.fused_ops)."""

    @classmethod
    def of(cls, model: Transformer, adapted: list[str]) -> ModelDims:
        """Dims of `model` (from its weight shapes); `adapted`: names of the adapted parameters."""
        block = model.layers[0]
        nbytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
        return cls(
            d=model.embed.weight.shape[1],
            w=block.attn.wq.weight.shape[0],
            f=block.mlp.w_gate.weight.shape[0],
            heads=model.cfg.n_heads,
            vocab=model.embed.weight.shape[0],
            layers=len(model.layers),
            head_dim=block.attn.wq.weight.shape[0] // model.cfg.n_heads,
            weight_bytes=sum(b for name, b in nbytes.items() if not name.startswith("embed.")),
            adapted_bytes=sum(nbytes[name] for name in adapted),
            param_bytes=sum(nbytes.values()),
            joined_bytes=sum(
                nbytes[f"layers.{i}.attn.{name}.weight"]
                for i in range(len(model.layers))
                for name in ("wq", "wk", "wv")[: 3 if model.cfg.qk_norm else 2]
            ),
            fused=model.cfg.fused_ops,
        )


@dataclass(frozen=True)
class TokenBytes:
    """Bytes per token of one graph: linear + quadratic * N (N = sequence length)."""

    linear: float
    quadratic: float = 0.0

    def at(self, n: int) -> float:
        """Bytes per token at sequence length n."""
        return self.linear + self.quadratic * n

    def __add__(self, other: TokenBytes) -> TokenBytes:
        return TokenBytes(self.linear + other.linear, self.quadratic + other.quadratic)

    def __mul__(self, factor: float) -> TokenBytes:
        return TokenBytes(self.linear * factor, self.quadratic * factor)

    __rmul__ = __mul__


def _norm_forward(dims: ModelDims, e: int) -> float:
    """RMSNorm: fused, its input and its output (in e); plain, a float32 input copy (x itself when e == 4),
    rsqrt, normed in e, output in e."""
    return 2 * e * dims.d if dims.fused else 4 * dims.d + 2 * e * dims.d + 4


def _norm_backward(dims: ModelDims, e: int) -> float:
    """Grad of the norm output (e); plain adds three float32 d-wide terms of its backward, two float32
    scalars."""
    return e * dims.d if dims.fused else e * dims.d + 12 * dims.d + 8


def _mlp_forward(dims: ModelDims, e: int) -> float:
    """SwiGLU: gate, up and the product (the down projection's input); plain adds silu(gate)."""
    return (3 if dims.fused else 4) * e * dims.f


def _mlp_backward(dims: ModelDims, e: int) -> float:
    """SwiGLU in the inner gradient's graph: fused, the product's grad and the grads of gate and up;
    plain saves 8 f-wide tensors."""
    return (3 if dims.fused else 8) * e * dims.f


def forward_graph(dims: ModelDims, backend: str, e: int) -> TokenBytes:
    """Bytes per token saved by the forward of one transformer block (layer)."""
    w, h = dims.w, dims.heads
    common = 2 * _norm_forward(dims, e) + _mlp_forward(dims, e)
    if backend == "flashbob":
        return TokenBytes(common + 5 * e * w + 4 * h)
    if backend == "eager":
        return TokenBytes(common + 4 * e * w, e * h + 1)
    if backend == "sdpa_math":
        return TokenBytes(common + 3 * SDPA_MATH_BYTES * w + e * w, SDPA_MATH_BYTES * h)
    raise ValueError(f"unknown attention backend {backend!r}")


def backward_graph(dims: ModelDims, backend: str, e: int, *, attention: bool = True) -> TokenBytes:
    """Bytes per token saved by the create_graph backward of one block; attention=False: MLP part only."""
    w, h = dims.w, dims.heads
    mlp = e * dims.d + _mlp_backward(dims, e)
    if not attention:
        return TokenBytes(mlp)
    common = mlp + 2 * _norm_backward(dims, e)
    if backend == "flashbob":
        return TokenBytes(common + 6 * e * w)
    if backend == "eager":
        return TokenBytes(common + 5 * e * w, 2 * e * h)
    if backend == "sdpa_math":
        return TokenBytes(common + 4 * e * w + SDPA_MATH_BYTES * w, 2 * SDPA_MATH_BYTES * h)
    raise ValueError(f"unknown attention backend {backend!r}")


def head_graphs(dims: ModelDims, e: int) -> tuple[TokenBytes, TokenBytes]:
    """(forward, backward) bytes per token of the final norm, the float32 logits, the loss and the tokens."""
    v = dims.vocab
    return TokenBytes(_norm_forward(dims, e) + 4 * v + 16), TokenBytes(_norm_backward(dims, e) + (4 + e) * v)


def inner_step_graph(dims: ModelDims, backend: str, e: int) -> TokenBytes:
    """Bytes per token one second-order inner step keeps: its forward and its gradient's graph."""
    head_fwd, head_bwd = head_graphs(dims, e)
    layers = dims.layers * forward_graph(dims, backend, e) + (dims.layers - 1) * backward_graph(
        dims, backend, e
    )
    mlp_only = backward_graph(dims, backend, e, attention=False)
    return layers + mlp_only + head_fwd + head_bwd + _rope_tables(dims)


def outer_graph(dims: ModelDims, backend: str, e: int) -> TokenBytes:
    """Bytes per token of the outer forward (one forward graph of the whole model)."""
    return dims.layers * forward_graph(dims, backend, e) + head_graphs(dims, e)[0] + _rope_tables(dims)


def _rope_tables(dims: ModelDims) -> TokenBytes:
    """The float32 cos and sin tables (N, head_dim) each forward makes and its attention blocks save."""
    return TokenBytes(8 * dims.head_dim)


def predicted_bytes(
    dims: ModelDims, backend: str, e: int, *, n: int, k: int, order: str, checkpoint: bool
) -> float:
    """Predicted peak bytes of tensors saved for backward during one meta step at sequence length n.

    Second order: k inner-step graphs (each with its new copy of the adapted weights) plus the outer
    forward graph (checkpointing: the larger of one inner step and the outer graph). First order: one
    forward graph (the inner gradients are not kept). Both: the saved weights (the first forward's joined
    q, k weights among them; each inner step's forward after it keeps its own, joined_bytes).
    """
    fixed = dims.weight_bytes
    outer = n * outer_graph(dims, backend, e).at(n)
    if order == "first":
        return fixed + outer
    step = dims.adapted_bytes + dims.joined_bytes + n * inner_step_graph(dims, backend, e).at(n)
    return fixed + (max(step, outer) if checkpoint else k * step + outer)


def transient_bytes(dims: ModelDims, backend: str, e: int, *, n: int, order: str) -> float:
    """Bytes a meta step holds at its peak on top of its saved graphs: N x N working tensors of the
    attention's (double) backward for eager / sdpa_math, and the logits' gradients."""
    per_head = {"flashbob": 0, "eager": e, "sdpa_math": SDPA_MATH_BYTES}[backend]
    return n * 8 * dims.vocab + (6 if order == "second" else 2) * per_head * dims.heads * n * n


def predicted_peak_bytes(
    dims: ModelDims, backend: str, e: int, *, n: int, k: int, order: str, checkpoint: bool
) -> float:
    """Predicted peak of all memory during the step: the parameters and their gradients, the saved
    graphs (`predicted_bytes`, whose saved weights are the parameters) and `transient_bytes`. An upper
    estimate: when the peak comes, the outer backward has already freed some linear activations."""
    saved = predicted_bytes(dims, backend, e, n=n, k=k, order=order, checkpoint=checkpoint)
    return (
        saved - dims.weight_bytes + 2 * dims.param_bytes + transient_bytes(dims, backend, e, n=n, order=order)
    )
