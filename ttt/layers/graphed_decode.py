"""`GraphedDecoder`: `decode_step` with each token's pass through the blocks and the head replayed as
one CUDA graph, for decoding at batch 1, where the eager step is bound by the host's launches.

    state, logits = prefill(model, prompt)
    decoder = GraphedDecoder(state)                  # on CUDA; capture=False runs the same pass eagerly
    logits = decoder(logits[:, -1].argmax(-1))       # as decode_step(state, token): (B,) -> (B, V)

The graph needs every address and shape of a token's pass to stay the same from token to token, so the
decoder keeps static buffers and copies into and out of them around the pass:
    in:   the token (B,), its RoPE tables (1, head_dim) (computed eagerly: the position is a host number),
          the open chunk's fast weights (copied in again after each chunk's inner steps);
    held: every block's key/value cache, (B, H, window - 1, head_dim) each: the pass reads the cache,
          attends over it and the token's keys (as `SuffixBlock.attend` does) and copies the window - 1
          most recent back into it;
    out:  the prefix's output of the token (B, d_model) and its logits (B, V).
What stays eager: a chunk's close (its inner steps, once per chunk_len tokens, `close_chunk`, from a copy
of the suffix caches taken at the chunk's start), the RoPE tables, the open chunk's bookkeeping
(`record_token`). Until every cache holds window - 1 positions (a prompt shorter than the window), the
decoder runs `decode_step`, and builds the pass at the first token after. Sliding-window models only:
full attention's caches grow with every token.

Exactness: the pass is `read_token`, the code of `decode_step`, on the same values: the decoder's logits
equal `decode_step`'s (tests/ttt/layers/test_generation.py, float64 on the CPU with capture=False;
the captured graph on CUDA).
"""

from __future__ import annotations

import torch

from .generation import (
    DecodeState,
    chunk_is_full,
    close_chunk,
    decode_step,
    read_token,
    record_token,
    rope_tables,
)


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

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        state = self.state
        if self._pass is None:
            if not self._caches_full():
                return decode_step(state, token)
            self._build(token)
        if chunk_is_full(state):
            close_chunk(state, token)
            state.chunk_caches = [tuple(t.clone() for t in cache) for cache in self.caches]
            for name, weight in state.carry[0].items():
                self.fast[name].copy_(weight)
        self.token.copy_(token)
        cos, sin = rope_tables(state, 1, token.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self._pass()
        record_token(state, self.inputs, token)
        return self.logits.clone()

    def _caches_full(self) -> bool:
        """Whether every block's cache holds its window - 1 keys: the shapes the pass keeps."""
        state = self.state
        blocks = state.prefix + list(state.model.suffix)
        caches = state.prefix_caches + state.caches
        return all(cache is not None and cache[0].shape[2] == block.kept_keys()
                   for block, cache in zip(blocks, caches))  # fmt: skip

    def _build(self, token: torch.Tensor) -> None:
        """The static buffers (the state's caches become them), then the pass: captured on CUDA after one
        eager run (compilation, launch plans) whose effects on the buffers are undone."""
        state = self.state
        self.prefix_caches = [tuple(t.clone() for t in cache) for cache in state.prefix_caches]
        self.caches = [tuple(t.clone() for t in cache) for cache in state.caches]
        state.prefix_caches, state.caches = list(self.prefix_caches), list(self.caches)
        self.fast = {name: weight.clone() for name, weight in state.carry[0].items()}
        self.token = torch.zeros_like(token)
        self.cos, self.sin = (t.clone() for t in rope_tables(state, 1, token.device))
        self.inputs, self.logits = (t.clone() for t in read_token(state, token, self.fast))
        state.prefix_caches, state.caches = list(self.prefix_caches), list(self.caches)  # undo that read
        capture = token.is_cuda if self.capture is None else self.capture
        if not capture:
            self._pass = self._eager_pass
            return
        held = [t.clone() for cache in self.prefix_caches + self.caches for t in cache]
        stream = torch.cuda.Stream(token.device)
        stream.wait_stream(torch.cuda.current_stream(token.device))
        with torch.cuda.stream(stream):
            self._eager_pass()  # compiles and records launch plans outside the capture
        torch.cuda.current_stream(token.device).wait_stream(stream)
        for buffer, before in zip((t for cache in self.prefix_caches + self.caches for t in cache), held):
            buffer.copy_(before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._eager_pass()
        self._pass = graph.replay

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
