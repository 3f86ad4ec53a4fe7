"""`TTTConfig`: where the fast weights sit and how the context is read, chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass

from ttt.config.choice import Choice
from ttt.models.attention import AttentionBackend


class ExtraMlpInit(Choice):
    """ttt.extra_mlp_init."""

    zero_out = "zero_out"
    normal = "normal"


class LossAverage(Choice):
    """ttt.loss_average."""

    tokens = "tokens"
    chunks = "chunks"


@dataclass
class TTTConfig:
    """Test-time training of a `Transformer` while it reads (TTT-E2E style). The inner optimizer, its
    learning rate (learnable or not), steps per chunk, clipping, first-order and checkpointing options
    are the recipe's `inner` section (`InnerLoopConfig`); its `params` globs choose the fast weights."""

    enabled: bool = True
    """Update the fast weights while reading; false gives the same model without test-time training."""
    suffix_len: int = 1
    """The last suffix_len blocks are read chunk by chunk and may hold fast weights (TTT-E2E: 3 of 12)."""
    extra_mlp: bool = True
    """Give each suffix block an extra SwiGLU MLP (ttt_norm, ttt_mlp) between attention and its MLP."""
    extra_mlp_hidden: int | None = None
    """Hidden width of the extra MLP; null: the model's d_ff."""
    extra_mlp_init: ExtraMlpInit = ExtraMlpInit.zero_out
    """The extra MLP's initial weights: zero_out (gate and up N(0, model.init_std), down projection 0, so
    a fresh model computes what the plain one did) or normal (all three N(0, model.init_std): TTT-E2E)."""
    chunk_len: int = 64
    """Tokens per chunk: each chunk is scored, then the fast weights take inner.steps steps on its loss."""
    lr_warmup_steps: int = 0
    """Outer steps over which the inner learning rate rises linearly to its full value."""
    lr_warmup_start: float = 0.1
    """Fraction of the inner learning rate at the start of the warm-up (TTT-E2E: 0.1)."""
    lr_warmup_counts_current_step: bool = False
    """The warm-up counts the outer step being taken: the factor at outer step s (from 0) is
    start + (1 - start) * min(1, (s + 1) / lr_warmup_steps), full from step lr_warmup_steps - 1 on
    (TTT-E2E's official code: 0.101875 at the first of 480 steps); false: min(1, s / lr_warmup_steps),
    start at step 0 and full from step lr_warmup_steps on."""
    loss_average: LossAverage = LossAverage.tokens
    """How a sequence's next-token losses make its loss (the outer objective): tokens (their mean over
    the unmasked targets) or chunks (the mean over chunks of each chunk's masked mean: TTT-E2E). The
    inner step of a chunk always takes its chunk's masked mean."""
    sequences_per_pass: int | None = None
    """Sequences of a batch read side by side in one pass, each with its own fast weights; the training
    graph of one pass is alive at a time, so fewer bounds memory and more launch fewer, larger kernels.
    null: the whole batch."""
    fused_loss: bool = True
    """Score training chunks with `linear_cross_entropy`: the head and the next-token loss in blocks of
    rows, never the (sequences, chunk_len, vocab) float32 logits that autograd would keep (twice over in
    a second-order graph); same losses and exact first and second derivatives. Readings that return
    logits use the plain head."""
    fused_loss_keeps_logits: bool = False
    """With fused_loss, keep each scored row's logits in the compute dtype (bf16 under bf16-mixed: 2 bytes
    x vocab a row, 33.6 GB for a pass of 16 x 8,192 tokens of a 128,256 vocabulary) for the backward,
    which otherwise recomputes them: one product over the vocabulary fewer per row in a backward. Same
    values."""
    prefix_attention: AttentionBackend | None = None
    """The attention backend of the prefix blocks; null: model.attention. They need first derivatives
    only, also in second-order training (the inner gradients reach back to the suffix's input, never
    through the prefix), so sdpa (torch's fused kernels, flash first) or sdpa_cudnn (cuDNN's first) may
    run them while FlashBoB runs the suffix. A whole-model second derivative (a Hessian-vector product
    through the prefix) then stops with torch's error for a missing double backward."""
    compile_prefix: bool = False
    """Run the prefix blocks through torch.compile on CUDA
    (`ttt.layers.suffix_reader.run_block_over_sequence`; the CPU runs them eagerly): their element-wise
    ops, norms and casts fuse into a few kernels around the products and attention, and so does their
    first derivative. The prefix needs first derivatives only (see prefix_attention); a whole-model
    second derivative through it then stops with torch's error for a differentiable backward of a
    compiled graph. The first step compiles them. A read without adapting (ttt.enabled=false,
    read(adapt=False)) runs its suffix blocks the same way."""
    checkpoint_prefix: bool = False
    """Recompute each prefix block (the blocks before the suffix) in the outer backward: only its input
    is saved, one (sequences, seq_len, d_model) tensor a block, for one more forward of the prefix. A
    read without adapting recomputes its suffix blocks the same way (so does inner.checkpoint)."""

    checkpoint_segment: int | None = None
    """With chunk recomputation (inner.checkpoint; memory.checkpoint for a neural memory), also recompute
    runs of this many chunks as one piece: the outer graph keeps the carry (fast weights, caches) only
    at every checkpoint_segment-th chunk boundary, and a run's chunk carries only while its backward
    runs, for one more forward of each chunk. null: every chunk boundary's carry is kept."""
    checkpoint_segment_keeps_chunks: bool = False
    """With checkpoint_segment: the chunks of a run are not recomputed on their own as well: the run's
    forward and its recomputation in the outer backward hold their chunks' graphs (activations and inner
    steps of checkpoint_segment chunks, while that run is read or differentiated), so each chunk runs
    twice an outer step instead of three times (forward, the run's recomputation, and its own). Same
    losses and gradients. Needs checkpoint_segment (a ValueError without); without chunk recomputation
    (inner.checkpoint) there are no runs, and it changes nothing."""

    def __post_init__(self):
        if self.suffix_len < 1:
            raise ValueError(f"ttt.suffix_len must be a positive int, got {self.suffix_len}")
        if self.extra_mlp_hidden is not None and self.extra_mlp_hidden < 1:
            raise ValueError(
                f"ttt.extra_mlp_hidden must be a positive int or null, got {self.extra_mlp_hidden}"
            )
        if self.chunk_len < 1:
            raise ValueError(f"ttt.chunk_len must be a positive int, got {self.chunk_len}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"ttt.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.sequences_per_pass is not None and self.sequences_per_pass < 1:
            raise ValueError(
                f"ttt.sequences_per_pass must be a positive int or null, got {self.sequences_per_pass}"
            )
        if self.checkpoint_segment is not None and self.checkpoint_segment < 1:
            raise ValueError(
                f"ttt.checkpoint_segment must be a positive int or null, got {self.checkpoint_segment}"
            )
        if self.checkpoint_segment_keeps_chunks and self.checkpoint_segment is None:
            raise ValueError(
                "ttt.checkpoint_segment_keeps_chunks=true needs ttt.checkpoint_segment (runs of chunks), "
                "got null"
            )
        if not 0 <= self.lr_warmup_start <= 1:
            raise ValueError(f"ttt.lr_warmup_start must be in [0, 1], got {self.lr_warmup_start}")
        self.extra_mlp_init = ExtraMlpInit.parse(self.extra_mlp_init, "ttt.extra_mlp_init")
        self.loss_average = LossAverage.parse(self.loss_average, "ttt.loss_average")
        if self.prefix_attention is not None:
            self.prefix_attention = AttentionBackend.parse(self.prefix_attention, "ttt.prefix_attention")

    def lr_scale(self, outer_step: int) -> float:
        """Factor on the inner learning rates at outer step `outer_step` (0 for the first): a linear
        warm-up from lr_warmup_start (ttt.lr_warmup_counts_current_step says where it is counted from),
        then 1."""
        done = outer_step + 1 if self.lr_warmup_counts_current_step else outer_step
        if done >= self.lr_warmup_steps:
            return 1.0
        return self.lr_warmup_start + (1 - self.lr_warmup_start) * done / self.lr_warmup_steps
