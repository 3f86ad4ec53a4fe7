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
                    inner steps); held: every block's key/value cache as a `RingCache`, (B, H, window,
                    head_dim), the token's keys written in place over the oldest and attended to with
                    the rest; out: the prefix's output of the token (B, d_model) and its logits (B, V).
                    Eager around it: a chunk's close (by a GraphedChunkStep, from the rings' windows in
                    order), the RoPE tables, the open chunk's bookkeeping (`record_token`).
    GraphedChunkStep  in: the carry (fast weights, inner optimizer state, learning rates), the suffix
                    caches, the chunk's inputs, targets, RoPE tables and mask; out: the caches and carry
                    after the chunk (`read_chunks` on that one chunk), handed back as copies.
The decoder runs the eager code until every cache holds window - 1 positions, and builds its graph at
the first call after. The chunk step keeps a graph per input shape (a prompt's first chunks see shorter
caches), captured at the shape's first call and kept with the model for its later reads
(`chunk_step_for`). Sliding-window models only: full attention's caches grow with every token.

Exactness: the replayed code is the eager code (`read_token`, `read_chunks`) on the same values, the
decoder's attention over its rings up to the order of the softmax's sums: the results equal the eager
ones to rounding (tests/ttt/layers/test_generation.py, float64 on the CPU with capture=False; the
captured graphs on CUDA).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

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
from .ring_cache import RingCache


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
            state.chunk_step = chunk_step_for(state.model, state.options, capture=capture)

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        state = self.state
        if self._pass is None:
            if not caches_full(state.prefix + list(state.model.suffix), state.prefix_caches + state.caches):
                return decode_step(state, token)
            self._build(token)
        if chunk_is_full(state):
            close_chunk(state, token)
        if state.carry is not self._carry:  # stepped since the last pass (here, or by decode_step)
            with torch.no_grad():
                for name, weight in state.carry[0].items():
                    self.fast[name].copy_(weight)
            self._carry = state.carry
        self.token.copy_(token)
        cos, sin = rope_tables(state, 1, token.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self._pass()
        record_token(state, self.inputs, token)
        return self.logits.clone()

    def _build(self, token: torch.Tensor) -> None:
        """The static buffers (the state's caches become `RingCache`s), then the pass: captured on CUDA
        after one eager run (compilation, launch plans) whose effects on the rings are undone."""
        state = self.state
        with torch.no_grad():  # a state decoded by another GraphedDecoder already holds rings
            self.prefix_caches = [as_ring(cache) for cache in state.prefix_caches]
            self.caches = [as_ring(cache) for cache in state.caches]
        state.prefix_caches, state.caches = list(self.prefix_caches), list(self.caches)
        self.fast = {name: weight.detach().clone() for name, weight in state.carry[0].items()}
        self._carry = state.carry
        self.token = torch.zeros_like(token)
        self.cos, self.sin = (t.clone() for t in rope_tables(state, 1, token.device))
        held = [t for ring in self.prefix_caches + self.caches for t in ring.buffers()]
        before = [t.clone() for t in held]
        self.inputs, self.logits = (t.clone() for t in read_token(state, token, self.fast))
        with torch.no_grad():  # undo that read
            for buffer, saved in zip(held, before):
                buffer.copy_(saved)
        if token.is_cuda if self.capture is None else self.capture:
            self._pass = capture(self._eager_pass, held, token.device)
        else:
            self._pass = self._eager_pass

    def _eager_pass(self) -> None:
        """One token's pass on the static buffers: `read_token` (writing the token's keys and values into
        the rings), its outputs copied into inputs and logits."""
        inputs, logits = read_token(self.state, self.token, self.fast, (self.cos, self.sin))
        self.inputs.copy_(inputs)
        self.logits.copy_(logits)


def caches_full(blocks: list, caches: list) -> bool:
    """Whether every block's cache holds its window - 1 keys (kept_keys; a `RingCache` always does): the
    shapes a graph keeps."""
    return all(isinstance(cache, RingCache) or (cache is not None and cache[0].shape[2] == block.kept_keys())
               for block, cache in zip(blocks, caches))  # fmt: skip


def as_ring(cache) -> RingCache:
    """A full window cache as a `RingCache`: a pair converted (new buffers), a ring as it is."""
    return cache if isinstance(cache, RingCache) else RingCache.from_pair(*cache)


def capture(
    body: Callable[[], None], buffers: list[torch.Tensor], device: torch.device, pool=None
) -> Callable:
    """body captured as a CUDA graph, returned as its replay: body runs once eagerly first on a side
    stream (compilation, launch plans), the buffers it changes restored afterwards. pool: the memory pool
    of graphs never replayed at once (`torch.cuda.graph_pool_handle`; None: the graph's own). If the
    capture fails (an operation that a graph cannot hold), a warning and body itself: exact, only not
    replayed."""
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
        with torch.cuda.graph(graph, pool=pool):
            body()
    except RuntimeError as err:
        warnings.warn(f"ttt.layers.graphed runs uncaptured: the capture failed ({err})", stacklevel=3)
        return body
    return graph.replay


class GraphedChunkStep:
    """step(carry, caches, chunk) -> (caches, carry): `model.read_chunks(carry, caches, chunk, options)`'s
    end state for one whole chunk (chunk_len positions), without its logits and losses, replayed as a CUDA
    graph (module docstring). One graph per shape of its inputs (the suffix caches' lengths: a prompt's
    first window / chunk_len chunks each have their own, then one serves every later chunk), captured at
    its first call and kept: `chunk_step_for` hands the same step to every read of a model, so a model
    captures each shape once. The graphs read the model's weights where they lie: they are dropped and
    captured again when a parameter moves (`model.to`, a new tensor assigned), not when its values
    change in place (an optimizer's step, load_state_dict). options: a first-order read without an outer
    graph (`prefill`'s). capture: record the graphs (default: on CUDA); False runs the same steps, static
    buffers included, eagerly. A partial chunk runs eagerly, and so does every chunk of a carry whose
    non-tensor values change from chunk to chunk (an inner optimizer counting its steps in a Python
    number)."""

    def __init__(self, model, options: ReadOptions, *, capture: bool | None = None):
        if options.outer_grad or options.keep_logits:
            raise ValueError("GraphedChunkStep reads without an outer graph or logits (prefill's options)")
        self.model, self.options, self.capture = model, options, capture
        self._replays: dict[tuple, _Replay] = {}
        self._weights: tuple[int, ...] = ()
        self._eager_only = False
        self._pool = None

    def __call__(self, carry, caches: list, chunk: Chunk):
        if self._eager_only or len(chunk) != self.model.ttt_cfg.chunk_len:
            return self._eager(carry, caches, chunk)
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        if weights != self._weights:  # the old graphs go, and their pool with them
            self._replays.clear()
            self._weights, self._pool = weights, None
        leaves, spec = tree_flatten((carry, caches, chunk))
        key = (spec, self.model.training, *map(_signature, leaves))
        replay = self._replays.get(key)
        if replay is None:
            replay = self._replays[key] = self._build(leaves, spec)
        if replay is None:
            return self._eager(carry, caches, chunk)
        with torch.no_grad():
            for static, leaf in zip(replay.inputs, leaves):
                if isinstance(static, torch.Tensor):
                    static.copy_(leaf)
        replay.run()
        copies = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in replay.outputs]
        new_caches, new_carry = tree_unflatten(copies, replay.out_spec)
        return new_caches, self.model._detached(new_carry)

    @property
    def shapes(self) -> int:
        """Input shapes with a graph (or static buffers) kept."""
        return len(self._replays)

    def _eager(self, carry, caches: list, chunk: Chunk):
        with torch.enable_grad():
            _, _, new_caches, new_carry = self.model.read_chunks(carry, caches, chunk, self.options)
        return new_caches, new_carry

    def _build(self, leaves: list, spec) -> _Replay | None:
        """One shape's static inputs (fast weights as leaves that require grad, as the eager carry's), one
        eager step on them that makes the static outputs, then the graph of the step. None (and every
        later chunk eager) when the step changes the carry's non-tensor values."""
        inputs = [
            t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
            for t in leaves
        ]  # fmt: skip
        new_caches, new_carry = self._eager(*tree_unflatten(inputs, spec))
        out_leaves, out_spec = tree_flatten((new_caches, new_carry))
        carry = tree_unflatten(inputs, spec)[0]
        if _numbers(carry) != _numbers(new_carry):
            self._eager_only = True
            return None
        replay = _Replay(inputs, spec, [t.detach().clone() if isinstance(t, torch.Tensor) else t
                                        for t in out_leaves], out_spec)  # fmt: skip
        device = leaves[0].device
        if not (device.type == "cuda" if self.capture is None else self.capture):
            replay.run = functools.partial(self._static_step, replay)
            return replay
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        outputs = [t for t in replay.outputs if isinstance(t, torch.Tensor)]
        replay.run = capture(functools.partial(self._static_step, replay), outputs, device, self._pool)
        return replay

    def _static_step(self, replay: _Replay) -> None:
        """The step on one shape's static inputs, its end state copied into its static outputs."""
        new_caches, new_carry = self._eager(*tree_unflatten(replay.inputs, replay.in_spec))
        with torch.no_grad():
            for static, leaf in zip(replay.outputs, tree_flatten((new_caches, new_carry))[0]):
                if isinstance(static, torch.Tensor):
                    static.copy_(leaf)


@dataclass
class _Replay:
    """One input shape of a `GraphedChunkStep`: its static input and output leaves (pytree specs beside)
    and run, the graph's replay (or the eager step on the static buffers)."""

    inputs: list
    in_spec: object
    outputs: list
    out_spec: object
    run: Callable[[], None] | None = None


def _signature(leaf) -> tuple | object:
    """What a graph's input leaf must keep from one replay to the next: a tensor's shape, dtype, device
    and requires_grad; any other value itself."""
    if isinstance(leaf, torch.Tensor):
        return leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad
    return leaf


def _numbers(tree) -> list:
    """The leaves of tree that are not tensors."""
    return [leaf for leaf in tree_flatten(tree)[0] if not isinstance(leaf, torch.Tensor)]


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {(options, capture): its GraphedChunkStep}: the steps, and their graphs, kept with each model."""


def chunk_step_for(model, options: ReadOptions, *, capture: bool | None = None) -> GraphedChunkStep:
    """The model's `GraphedChunkStep` for these read options: made at the first call, then the same one
    (with the graphs it has captured) for every later prefill and decoding of the model; it goes with
    the model."""
    steps = _STEPS.setdefault(model, {})
    if (options, capture) not in steps:
        steps[options, capture] = GraphedChunkStep(model, options, capture=capture)
    return steps[options, capture]
