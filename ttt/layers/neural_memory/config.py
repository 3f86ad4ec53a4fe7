"""`MemoryConfig`: the neural memory's shape, how it is combined with attention, and its gates."""

from __future__ import annotations

from dataclasses import dataclass

from ttt.config.choice import Choice


class MemoryVariant(Choice):
    """memory.variant."""

    mac = "mac"
    mag = "mag"


class MacWriteSource(Choice):
    """memory.mac_write_from."""

    attention = "attention"
    input = "input"


class WriteGradient(Choice):
    """memory.write_grad."""

    partial = "partial"
    total = "total"


@dataclass
class MemoryConfig:
    """A gradient-trained memory in each of the last ttt.suffix_len blocks (Titans-style). Which blocks,
    the chunk length, warm-up of the learning rate, whether the memory is written at all (ttt.enabled)
    and passes per batch are the recipe's `ttt` section (`TTTConfig`, with ttt.extra_mlp=false)."""

    variant: MemoryVariant = MemoryVariant.mac
    """How the memory joins sliding-window attention: mac (memory as context: its read of each token is
    added to the attention's input, and it is written from the attention's output) or mag (memory as
    gate: the attention's output is gated by sigmoid of the memory's read; written from the block's
    input)."""
    depth: int = 2
    """Layers of the memory MLP: 1 is a linear map k -> k W; >= 2 is k + MLP(k) (SiLU between layers)."""
    dim: int | None = None
    """Width of the memory's keys, values and queries; null: model.d_model."""
    hidden: int | None = None
    """Hidden width of a memory MLP of depth >= 2; null: 2 * memory.dim."""
    write_grad: WriteGradient = WriteGradient.total
    """Gradient of a write: total (of the chunk's associative loss with respect to the memory weights
    along every path; with mac this includes the memory's own read of the chunk, through the attention,
    into the keys and values, so the outer gradient differentiates the attention's backward: second
    order through attention) or partial (keys and values taken as given, Titans' associative gradient;
    the same as total with mag)."""
    mac_write_from: MacWriteSource = MacWriteSource.attention
    """What mac writes from: attention (rms of the attention's output, as the published MAC) or input (the
    block's normalised input h, the vectors its queries come from: a key can then match the queries
    of the same content, and memory.tie_init makes them match at initialisation). mag always writes
    from the input."""
    next_token_values: bool = False
    """Write each token's key with the next token's value (v_t = u_{t+1} W_V, the chunk's last key left
    out): the memory stores what followed each context, so a read returns what came after similar
    contexts (an associative next-token memory) instead of the context itself. Needs ttt.chunk_len >= 2."""
    tie_init: bool = False
    """Initialise the key projection equal to the query projection (W_K = W_Q) and the read-out as the
    value projection's transpose (W_R = W_V^T): before meta-training a query then finds the keys of
    similar hidden states and its read returns (a projection of) what was written for them."""
    center_keys: bool = False
    """Subtract the chunk's mean key (of u W_K, per sequence) before a write's keys are scaled to unit
    norm, so that a write stores what tells the chunk's tokens apart instead of one direction they
    share (mac writes from the attention's output, whose tokens point almost the same way: mean cosine
    0.94 at initialisation, 0.9995 after the CPU recipe). Needs two keys per chunk (ttt.chunk_len >= 2,
    3 with memory.next_token_values)."""
    normalize_step: bool = False
    """Divide each memory layer's learning rate by rho = ||X^T X||_F / C, X (C, in) that layer's inputs
    over the chunk (the keys, for the first layer): an upper bound of the largest curvature of the
    write's loss along that layer (linear memory), 1 when the chunk's keys are all alike and about
    1 / sqrt(r) when they spread evenly over r directions. Without it a step of theta writes each of r
    such directions by about theta / r of its error."""
    max_lr: float = 1.0
    """Largest memory learning rate: theta = max_lr * sigmoid(linear(chunk's mean hidden state))."""
    lr_init: float = 0.5
    """theta / max_lr before meta-training (the gate's bias; its weights start at zero)."""
    momentum_init: float = 0.5
    """Momentum (surprise) gate eta before meta-training."""
    decay_init: float = 0.01
    """Decay (forgetting) gate alpha before meta-training."""
    grad_clip: float | None = 1.0
    """Clip each sequence's memory gradient to this L2 norm (differentiably); null: no clipping. The
    total write gradient's curvature is not bounded by the keys' norm: without a clip it can diverge."""
    first_order: bool = False
    """Treat the memory's gradients as constants in the outer backward (no second-order terms). The key
    and value projections (memory.wk, memory.wv) enter the outer loss only through those gradients, so
    they get no outer gradient and keep their initial values (under ddp: trainer.find_unused_parameters);
    with memory.normalize_step the keys also set the write's learning rate, so memory.wk gets one."""
    checkpoint: bool = False
    """Recompute each chunk in the outer backward instead of storing its activations."""

    def __post_init__(self):
        self.variant = MemoryVariant.parse(self.variant, "memory.variant")
        if self.depth < 1:
            raise ValueError(f"memory.depth must be a positive int, got {self.depth}")
        for name in ("dim", "hidden"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"memory.{name} must be a positive int or null, got {value}")
        self.write_grad = WriteGradient.parse(self.write_grad, "memory.write_grad")
        self.mac_write_from = MacWriteSource.parse(self.mac_write_from, "memory.mac_write_from")
        if self.max_lr <= 0:
            raise ValueError(f"memory.max_lr must be > 0, got {self.max_lr}")
        for name in ("lr_init", "momentum_init", "decay_init"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"memory.{name} must be in (0, 1) (a sigmoid gate's value), got {value}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"memory.grad_clip must be > 0 or null, got {self.grad_clip}")

    def keys_per_write(self, chunk_len: int) -> int:
        """How many (key, value) pairs a write of a chunk_len-token chunk has."""
        return chunk_len - 1 if self.next_token_values else chunk_len

    def width(self, d_model: int) -> int:
        """Memory width in use: memory.dim, or d_model when unset."""
        return d_model if self.dim is None else self.dim

    def hidden_width(self, d_model: int) -> int:
        """Hidden width of the memory MLP in use: memory.hidden, or 2 * width when unset."""
        return 2 * self.width(d_model) if self.hidden is None else self.hidden
