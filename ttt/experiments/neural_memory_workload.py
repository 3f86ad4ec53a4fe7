"""One meta step of a neural-memory model, for memory and time measurements (`ttt.experiments`).

model, step = memory_meta_step(TransformerConfig(...), n=4096, chunk_len=512, depth=2, device=dev)
loss = step()        # memory reads and writes over n tokens, outer loss, outer backward (.grad adds up)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ttt.layers import TTTConfig
from ttt.layers.neural_memory import MemoryConfig, NeuralMemoryTransformer
from ttt.models import Transformer, TransformerConfig


def memory_meta_step(
    model: TransformerConfig,
    *,
    n: int,
    chunk_len: int,
    depth: int,
    variant: str = "mac",
    suffix_len: int = 1,
    first_order: bool = False,
    checkpoint: bool = False,
    attention: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[NeuralMemoryTransformer, Callable[[], torch.Tensor]]:
    """A `NeuralMemoryTransformer` of `model` (attention backend replaced by `attention` when given) whose
    last suffix_len blocks hold a memory of `depth` layers written once per chunk_len tokens, seeded, on
    `device` in `dtype`, and a function that runs one full meta step on fixed random tokens (1, n + 1):
    every chunk's read and write, the mean next-token loss (second order unless first_order; chunks
    recomputed in the backward with checkpoint), and its backward into every parameter. The function
    returns the loss, detached."""
    if attention is not None:
        model = dataclasses.replace(model, attention=attention)
    torch.manual_seed(seed)
    memory = MemoryConfig(variant=variant, depth=depth, first_order=first_order, checkpoint=checkpoint)
    reading = TTTConfig(suffix_len=suffix_len, extra_mlp=False, chunk_len=chunk_len)
    net = NeuralMemoryTransformer(Transformer(model), reading, memory).to(device=device, dtype=dtype)
    tokens = torch.randint(model.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(device)

    def step() -> torch.Tensor:
        loss = net.token_losses(tokens).mean()
        loss.backward()
        return loss.detach()

    return net, step
