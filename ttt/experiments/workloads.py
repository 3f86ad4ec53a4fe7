"""The meta-learning workloads the gradient-memory experiment measures: build one, get its meta step.

    maml      a `Transformer` (the maml_longctx architecture) whose adapted weights (default: every
              MLP) take k inner SGD steps on the next-token loss of one sequence; the outer loss is
              the next-token loss of a second sequence (`ttt.inner.meta_step`, one task).
    ttt_e2e   a `TTTTransformer` (TTT-E2E): its last suffix_len blocks read the sequence in chunks of
              chunk_len tokens and their fast weights (default: the extra MLPs) take k inner SGD steps
              on each chunk's loss after scoring it; the outer loss is the mean next-token loss.
Either way the step ends with the outer backward into every parameter.
    hvp       a `Transformer` and the next-token loss of one sequence, differentiated with respect to
              every parameter: order "second" is one Hessian-vector product (`ttt.second_order.hvp`,
              reverse over reverse, along a Rademacher vector), order "first" the plain gradient it is
              measured against (one forward and one backward, `torch.autograd.grad`). k and
              checkpointing do not apply.
    neural_memory  a `NeuralMemoryTransformer` (ttt.layers.neural_memory, memory as context): its last
                   suffix_len
              blocks read the sequence in chunks of chunk_len tokens, each read of the memory followed
              by one gated-momentum write (second order through the attention unless order "first");
              k is the memory MLP's depth (a memory writes once per chunk: there are no k inner steps);
              the outer loss is the mean next-token loss.
A task is two random token sequences, `inner` and `outer`, each (N + 1,) int64 (hvp reads `inner`):
random tokens are enough, memory and time do not depend on the values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ttt.config.choice import Choice
from ttt.inner import InnerLoop, InnerLoopConfig, functional_forward, meta_step, select_parameters
from ttt.layers import TTTConfig, TTTTransformer
from ttt.models import Transformer, TransformerConfig, next_token_losses
from ttt.second_order.hvp import hvp, rademacher_like


class Workload(Choice):
    """What one meta step is (the module docstring)."""

    maml = "maml"
    ttt_e2e = "ttt_e2e"
    hvp = "hvp"
    neural_memory = "neural_memory"


class Order(Choice):
    """Order of the meta-gradient."""

    first = "first"
    second = "second"


DEFAULT_ADAPTED = {
    "maml": ["layers.*.mlp.*"],
    "ttt_e2e": ["layers.*.ttt_mlp.*"],
    "hvp": ["*"],
    "neural_memory": ["layers.*.memory.init.*"],
}


@dataclass(frozen=True)
class Point:
    """One measurement of the sweep."""

    backend: str
    """Attention backend: flashbob, eager or sdpa_math."""
    n: int
    """Sequence length (tokens) of the inner and of the outer sequence."""
    k: int
    """Inner steps (ttt_e2e: per chunk)."""
    order: Order
    """second (differentiate through the inner gradients) or first (first-order MAML); hvp: second is
    the Hessian-vector product, first the gradient."""
    checkpoint: bool
    """Recompute each inner step (ttt_e2e: each chunk) in the outer backward instead of storing it."""


@dataclass
class ProbeSetup:
    """What stays fixed over the sweep."""

    model: TransformerConfig
    """The transformer; its `attention` field is replaced by each point's backend."""
    adapted: list[str]
    """Glob patterns of the adapted (inner-loop) parameters."""
    inner_lr: float
    """Inner SGD learning rate."""
    device: torch.device
    """Where the step runs."""
    dtype: torch.dtype
    """Parameter (and so activation) dtype."""
    seed: int
    """Seed of the weights and of the tokens."""
    workload: Workload = Workload.maml
    """maml or ttt_e2e."""
    ttt: TTTConfig = dataclasses.field(default_factory=TTTConfig)
    """Chunking and suffix of the ttt_e2e workload."""


def random_task(n: int, vocab_size: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """{"inner": (n + 1,), "outer": (n + 1,)} int64 tokens in [0, vocab_size), reproducible from seed."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (2, n + 1), generator=gen)
    return {"inner": tokens[0].to(device), "outer": tokens[1].to(device)}


def sequence_loss(model: Transformer, params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Mean `next_token_losses` (scalar) of `model` with `params` predicting tokens[1:] from tokens[:-1]
    (tokens: (N + 1,))."""
    logits = functional_forward(model, params, tokens[None, :-1])
    return next_token_losses(logits, tokens[None, 1:], reduction="mean")


class NextTokenObjective:
    """`ttt.inner.TaskObjective` of `random_task` tasks: next-token loss on task["inner"] (the same
    sequence at every inner step), then on task["outer"] with the adapted params."""

    def __init__(self, model: Transformer):
        self.model = model

    def inner_loss(self, params: dict[str, torch.Tensor], task: dict, step: int) -> torch.Tensor:
        return sequence_loss(self.model, params, task["inner"])

    def outer_loss(self, params: dict[str, torch.Tensor], task: dict) -> tuple[torch.Tensor, dict]:
        return sequence_loss(self.model, params, task["outer"]), {}


def _inner_config(setup: ProbeSetup, point: Point) -> InnerLoopConfig:
    return InnerLoopConfig(
        params=list(setup.adapted),
        steps=point.k,
        lr=setup.inner_lr,
        first_order=point.order == "first",
        checkpoint=point.checkpoint,
    )


def derivative_step(
    model: Transformer, task: dict[str, torch.Tensor], point: Point, setup: ProbeSetup
) -> Callable[[], None]:
    """The step of the hvp workload: with point.order "second", one `ttt.second_order.hvp` of the
    next-token loss of task["inner"] (N + 1,) over every parameter of `model` (on setup.device, in
    setup.dtype) along a Rademacher vector drawn with setup.seed; with "first", the gradient of that
    loss (`torch.autograd.grad`: .grad is not touched). Either result is dropped."""
    params = dict(model.named_parameters())

    def loss_fn(substituted: dict[str, torch.Tensor]) -> torch.Tensor:
        return sequence_loss(model, substituted, task["inner"])

    def gradient() -> None:
        torch.autograd.grad(loss_fn(params), tuple(params.values()))

    generator = torch.Generator(device=setup.device).manual_seed(setup.seed)
    vector = {name: rademacher_like(p.detach(), generator) for name, p in params.items()}

    def hessian_vector_product() -> None:
        hvp(loss_fn, params, vector)

    return gradient if point.order == "first" else hessian_vector_product


def build(setup: ProbeSetup, point: Point) -> tuple[nn.Module, Callable[[], None]]:
    """The model of `point` (seeded, on setup.device in setup.dtype) and a function that runs one full
    meta step on fixed random tokens (inner steps, outer loss, outer backward; .grad accumulates), or
    for the hvp workload one Hessian-vector product or gradient (`derivative_step`)."""
    torch.manual_seed(setup.seed)
    base = Transformer(dataclasses.replace(setup.model, attention=point.backend))
    task = random_task(point.n, setup.model.vocab_size, setup.device, setup.seed)
    if setup.workload == "maml":
        model = base.to(device=setup.device, dtype=setup.dtype)
        params = select_parameters(model, setup.adapted)
        inner = InnerLoop(params, _inner_config(setup, point))

        def maml_step() -> None:
            meta_step(NextTokenObjective(model), inner, params, [task])

        return model, maml_step
    if setup.workload == "ttt_e2e":
        model = TTTTransformer(base, setup.ttt, _inner_config(setup, point)).to(setup.device, setup.dtype)

        def ttt_step() -> None:
            model.token_losses(task["inner"][None]).mean().backward()

        return model, ttt_step
    if setup.workload == "hvp":
        model = base.to(device=setup.device, dtype=setup.dtype)
        return model, derivative_step(model, task, point, setup)
    if setup.workload == "neural_memory":
        from ttt.experiments.neural_memory_workload import memory_meta_step

        return memory_meta_step(
            setup.model,
            n=point.n,
            chunk_len=setup.ttt.chunk_len,
            depth=point.k,
            suffix_len=setup.ttt.suffix_len,
            first_order=point.order == "first",
            checkpoint=point.checkpoint,
            attention=point.backend,
            device=setup.device,
            dtype=setup.dtype,
            seed=setup.seed,
        )
    raise ValueError(f"workload must be one of {', '.join(Workload.values())}, got {setup.workload!r}")
