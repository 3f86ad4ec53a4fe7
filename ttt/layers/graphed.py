"""CUDA-graph replays of generation's two repeated units, for reading at batch 1, where the eager code is
bound by the host's launches: `GraphedDecoder`, a decoded token's pass through the blocks and the head,
and `GraphedChunkStep`, a chunk's read and inner steps (what a prompt's prefill repeats per chunk, and a
decoding per chunk_len tokens).

    state, logits = prefill(model, prompt, graphs=True)   # the prompt's chunks by a GraphedChunkStep
    decoder = GraphedDecoder(state)                      # capture=False runs the same pass eagerly
    logits = decoder(logits[:, -1].argmax(-1))           # as decode_step(state, token): (B,) -> (B, V)

A graph needs every address and shape to stay the same from one replay to the next, so each keeps
static buffers and copies into and out of them around its replay:
    GraphedDecoder  in: the token (B,), its RoPE tables (1, head_dim) (computed eagerly: the position is
                    a host number), the open chunk's fast weights (copied in again after each chunk's
                    inner steps); held: every block's key/value cache, (B, H, window - 1, head_dim): the
                    pass reads it, attends over it and the token's keys (as `SuffixBlock.attend` does)
                    and copies the window - 1 most recent back into it; out: the prefix's output of the
                    token (B, d_model) and its logits (B, V). Eager around it: a chunk's close (by a
                    GraphedChunkStep), the RoPE tables, the open chunk's bookkeeping (`record_token`).
    GraphedChunkStep  in: the carry (fast weights, inner optimizer state, learning rates), the suffix
                    caches, the chunk's inputs, targets, RoPE tables and mask; out: the caches and carry
                    after the chunk (`read_chunks` on that one chunk), handed back as copies.
Each runs the eager code until the shapes it keeps are reached (every cache holding window - 1
positions, a whole chunk), and builds its graph at the first call after. Sliding-window models only:
full attention's caches grow with every token.

Exactness: the replayed code is the eager code (`read_token`, `read_chunks`) on the same values: the
results equal the eager ones (tests/ttt/layers/test_generation.py, float64 on the CPU with
capture=False; the captured graphs on CUDA).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .generation import (
    DecodeState,
    chunk_is_full,
    close_chunk,
    decode_step,
    read_token,
    record_token,
    rope_tables,
)
from .reader import Chunk, ReadOptions


class GraphedDecoder:
    """decoder(token (B,) int64) -> logits (B, V): `decode_step(state, token)`, the state advancing in
    place, each token's pass replayed as a CUDA graph (module docstring). capture: record the graph
    (default: on CUDA tensors); False runs the same pass, static buffers included, eagerly."""

    def __init__(self, state: DecodeState, *, capture: bool | None = None):
        if any(block.kept_keys() is None for block in state.prefix + list(state.model.suffix)):
            raise ValueError("GraphedDecoder needs a sliding-window model (model.window set): full "
                             "attention's key/value caches grow with every token")  # fmt: skip
        self.state = state
        self.capture = capture
        self._pass = None
        if state.chunk_step is None and state.chunk_inputs is not None:
            state.chunk_step = GraphedChunkStep(state.model, state.options, capture=capture)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        state = self.state
        if self._pass is None:
            if not caches_full(state.prefix + list(state.model.suffix), state.prefix_caches + state.caches):
                return decode_step(state, token)
            self._build(token)
        if chunk_is_full(state):
            close_chunk(state, token)
            state.chunk_caches = [tuple(t.clone() for t in cache) for cache in self.caches]
            with torch.no_grad():
                for name, weight in state.carry[0].items():
                    self.fast[name].copy_(weight)
        self.token.copy_(token)
        cos, sin = rope_tables(state, 1, token.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self._pass()
        record_token(state, self.inputs, token)
        return self.logits.clone()

    def _build(self, token: torch.Tensor) -> None:
        """The static buffers (the state's caches become them), then the pass: captured on CUDA after one
        eager run (compilation, launch plans) whose effects on the buffers are undone."""
        state = self.state
        self.prefix_caches = [tuple(t.clone() for t in cache) for cache in state.prefix_caches]
        self.caches = [tuple(t.clone() for t in cache) for cache in state.caches]
        state.prefix_caches, state.caches = list(self.prefix_caches), list(self.caches)
        self.fast = {name: weight.detach().clone() for name, weight in state.carry[0].items()}
        self.token = torch.zeros_like(token)
        self.cos, self.sin = (t.clone() for t in rope_tables(state, 1, token.device))
        self.inputs, self.logits = (t.clone() for t in read_token(state, token, self.fast))
        state.prefix_caches, state.caches = list(self.prefix_caches), list(self.caches)  # undo that read
        if token.is_cuda if self.capture is None else self.capture:
            held = [t for cache in self.prefix_caches + self.caches for t in cache]
            self._pass = capture(self._eager_pass, held, token.device)
        else:
            self._pass = self._eager_pass

    def _eager_pass(self) -> None:
        """One token's pass on the static buffers: `read_token`, its new caches copied into the held ones,
        its outputs into inputs and logits."""
        state = self.state
        inputs, logits = read_token(state, self.token, self.fast, (self.cos, self.sin))
        for held, new in zip(self.prefix_caches + self.caches, state.prefix_caches + state.caches):
            held[0].copy_(new[0])
            held[1].copy_(new[1])
        state.prefix_caches, state.caches = list(self.prefix_caches), list(self.caches)
        self.inputs.copy_(inputs)
        self.logits.copy_(logits)


def caches_full(blocks: list, caches: list) -> bool:
    """Whether every block's cache holds its window - 1 keys (kept_keys): the shapes a graph keeps."""
    return all(cache is not None and cache[0].shape[2] == block.kept_keys()
               for block, cache in zip(blocks, caches))  # fmt: skip


def capture(body: Callable[[], None], buffers: list[torch.Tensor], device: torch.device) -> Callable:
    """body captured as a CUDA graph, returned as its replay: body runs once eagerly first on a side
    stream (compilation, launch plans), the buffers it changes restored afterwards. If the capture fails
    (an operation that a graph cannot hold), a warning and body itself: exact, only not replayed."""
    held = [buffer.clone() for buffer in buffers]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream(device).wait_stream(stream)
    with torch.no_grad():
        for buffer, before in zip(buffers, held):
            buffer.copy_(before)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            body()
    except RuntimeError as err:
        warnings.warn(f"ttt.layers.graphed runs uncaptured: the capture failed ({err})", stacklevel=3)
        return body
    return graph.replay


class GraphedChunkStep:
    """step(carry, caches, chunk) -> (caches, carry): `model.read_chunks(carry, caches, chunk,
    options)`'s end state for one chunk, without its logits and losses, replayed as a CUDA graph (module
    docstring) once the chunk is whole and the caches full; eager before. options: a first-order read
    without an outer graph (`prefill`'s). capture: record the graph (default: on CUDA); False runs the
    same step, static buffers included, eagerly. A carry whose non-tensor values change from chunk to
    chunk (an inner optimizer counting its steps in a Python number) is never captured."""

    def __init__(self, model, options: ReadOptions, *, capture: bool | None = None):
        if options.outer_grad or options.keep_logits:
            raise ValueError("GraphedChunkStep reads without an outer graph or logits (prefill's options)")
        self.model, self.options, self.capture = model, options, capture
        self._pass: Callable[[], None] | None = None
        self._eager_only = False

    def __call__(self, carry, caches: list, chunk: Chunk):
        if self._eager_only or not self._fits(caches, chunk):
            return self._eager(carry, caches, chunk)
        if self._pass is None:
            self._build(carry, caches, chunk)
        leaves, spec = tree_flatten((carry, caches, chunk))
        if self._eager_only or spec != self.in_spec:
            return self._eager(carry, caches, chunk)
        with torch.no_grad():
            for static, leaf in zip(self.inputs, leaves):
                if isinstance(static, torch.Tensor):
                    static.copy_(leaf)
        self._pass()
        copies = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in self.outputs]
        new_caches, new_carry = tree_unflatten(copies, self.out_spec)
        return new_caches, self.model._detached(new_carry)

    def _fits(self, caches: list, chunk: Chunk) -> bool:
        return len(chunk) == self.model.ttt_cfg.chunk_len and caches_full(list(self.model.suffix), caches)

    def _eager(self, carry, caches: list, chunk: Chunk):
        with torch.enable_grad():
            _, _, new_caches, new_carry = self.model.read_chunks(carry, caches, chunk, self.options)
        return new_caches, new_carry

    def _build(self, carry, caches: list, chunk: Chunk) -> None:
        """The static inputs (fast weights as leaves that require grad, as the eager carry's), one eager
        step on them that makes the static outputs, then the graph of the step."""
        leaves, self.in_spec = tree_flatten((carry, caches, chunk))
        self.inputs = [
            t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in leaves
        ]  # fmt: skip
        new_caches, new_carry = self._eager(*tree_unflatten(self.inputs, self.in_spec))
        out_leaves, self.out_spec = tree_flatten((new_caches, new_carry))
        self.outputs = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in out_leaves]
        numbers_in = [leaf for leaf in tree_flatten(carry)[0] if not isinstance(leaf, torch.Tensor)]
        numbers_out = [leaf for leaf in tree_flatten(new_carry)[0] if not isinstance(leaf, torch.Tensor)]
        if numbers_in != numbers_out:
            self._eager_only = True
            return
        device = chunk.inputs.device
        if not (device.type == "cuda" if self.capture is None else self.capture):
            self._pass = self._static_step
            return
        outputs = [t for t in self.outputs if isinstance(t, torch.Tensor)]
        self._pass = capture(self._static_step, outputs, device)

    def _static_step(self) -> None:
        """The step on the static inputs, its end state copied into the static outputs."""
        new_caches, new_carry = self._eager(*tree_unflatten(self.inputs, self.in_spec))
        with torch.no_grad():
            for static, leaf in zip(self.outputs, tree_flatten((new_caches, new_carry))[0]):
                if isinstance(static, torch.Tensor):
                    static.copy_(leaf)
