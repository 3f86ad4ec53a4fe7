"""Generation with a `TTTTransformer`: read a prompt, then one token at a time, the fast weights training
on each chunk as the chunked read does, in constant memory per token of context (sliding window).

    state, logits = prefill(model, prompt)   # prompt (B, P) int64 -> logits (B, 1, V) of position P - 1
    logits = decode_step(state, token)         # token (B,) at position P -> (B, V); the state advances
    for token in generate(model, prompt, 100, temperature=0.8, top_p=0.95, seed=0): ...   # each (B,)

Exactness: prefill's logits, then each decode step's, are those of one chunked read
(`TTTTransformer.read(tokens, outer_grad=False, keep_logits=True)`, same adapt and lr_scale) of the prompt
followed by the tokens decoded, position by position, up to rounding.

Prefill (positions 0..P-1):
    the prefix blocks read the prompt once, each keeping its key/value cache (`SuffixBlock`'s: the
        window - 1 most recent keys and values; under full attention all of them, growing in place);
    the chunks the prompt closes are read by the reader's own loop (`ChunkedReader.read_chunks`, no outer
        graph): each scored, then the inner steps (`score_then_step`), handing back the fast weights and
        the suffix caches. Chunk c is closed once the token after it, its last target, is known: the
        prompt closes its first (P - 1) // chunk_len chunks;
    the rest of the prompt, the open chunk (1 to chunk_len tokens), is read with the fast weights of
        its chunk, without a step; its inputs (the prefix's output) and tokens are kept.
Decode, a token t at position p:
    when the open chunk is full, t is its last target (the token the logits of the chunk's last position
        chose): the chunk is closed, its inner steps taken (`read_chunks` on that one chunk, from the
        suffix caches at its start) -> the next chunk's fast weights; t then opens the next chunk;
    t goes through the prefix blocks and the suffix blocks (the fast weights of its chunk), each with its
        cache: the logits of position p.

The step's graph comes from reading the chunk again at its close (the suffix blocks over its kept
inputs, from the caches at its start) rather than from keeping each token's graph: it is then the same
function of the same values as the chunked read's step (clipping, the masked mean, and for inner.steps
> 1 the rescoring of the chunk with the stepped weights, which per-token graphs could not give), and no
graph lives between tokens. A decode step holds the caches, at most chunk_len kept inputs and the fast
weights, whatever the context's length; the cost is one more forward of the suffix per chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from .e2e import TTTTransformer
from .fast_weights import FastCarry, read_options
from .prefix_cache import PrefixCache
from .reader import Chunk, ReadOptions, check_tokens
from .ring_cache import RingCache
from .suffix_block import KVCache, SuffixBlock


@dataclass
class DecodeState:
    """Where a decoding stands: `prefill` makes it, `decode_step` advances it in place."""

    model: TTTTransformer
    options: ReadOptions
    """The reading's options (adapt, inner steps, lr_scale; no outer graph, no logits kept)."""
    prefix: list[SuffixBlock]
    """The prefix blocks, read with caches: each `Block`'s own modules in a `SuffixBlock` (no extra MLP)."""
    prefix_caches: list[KVCache]
    """Each prefix block's cache after the last position read."""
    caches: list[KVCache]
    """Each suffix block's cache after the last position read."""
    carry: FastCarry
    """The open chunk's fast weights (each (B, ...)), the inner optimizer's state, the inner lrs."""
    position: int
    """Positions read so far."""
    masked_target: int | None
    """Targets equal to this id are left out of the inner steps' loss (None: none)."""
    chunk_caches: list[KVCache] | None = None
    """Each suffix block's cache at the open chunk's start (None without inner steps)."""
    chunk_inputs: torch.Tensor | None = None
    """(B, chunk_len, d_model): the prefix's output of the open chunk's positions, its first
    `chunk_filled` rows written (None without inner steps)."""
    chunk_tokens: torch.Tensor | None = None
    """(B, chunk_len) int64: the open chunk's tokens, its first `chunk_filled` written."""
    chunk_filled: int = 0
    """Positions of the open chunk read so far."""
    chunk_step: Callable | None = None
    """What closes a chunk: step(carry, caches, chunk) -> (caches, carry) after it (a
    `ttt.layers.graphed.GraphedChunkStep` after prefill(graphs=True)); None: the reader's `read_chunks`."""

    @property
    def batch(self) -> int:
        """B, the sequences read side by side."""
        return next(iter(self.carry[0].values())).shape[0]


def _new_cache(block: SuffixBlock, capacity: int) -> KVCache:
    """A block's cache before the first position: under full attention a `PrefixCache` with room for
    `capacity` positions (it grows in place, doubling when full); with a window None (the pair of the
    window - 1 most recent keys and values follows)."""
    return PrefixCache.reserve(capacity) if block.kept_keys() is None else None


def _mask(targets: torch.Tensor, masked_target: int | None) -> torch.Tensor | None:
    """The targets (B, T) the inner steps count: those unequal to masked_target (None: all)."""
    return None if masked_target is None else targets != masked_target


def rope_tables(state: DecodeState, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (n, head_dim) of the next n positions, state.position.."""
    return state.model.rope_tables(state.position + n, device, start=state.position)


def _read_prefix(state: DecodeState, tokens: torch.Tensor, tables=None) -> Chunk:
    """Embedding and prefix blocks on tokens (B, n) at positions state.position.. (their RoPE tables:
    `tables`, default `rope_tables`), each block continuing its cache (advanced in state). Returns the
    positions for the suffix: inputs (B, n, d_model), their RoPE tables, targets (B, 0) (the caller sets
    them), no mask."""
    cos, sin = tables or rope_tables(state, tokens.shape[1], tokens.device)
    hidden = state.model.embed(tokens)
    for i, block in enumerate(state.prefix):
        hidden, state.prefix_caches[i] = block(hidden, cos, sin, state.prefix_caches[i])
    return Chunk(hidden, tokens[:, :0], cos, sin, mask=None, last=False)


def prefill(
    model: TTTTransformer,
    tokens: torch.Tensor,
    *,
    adapt: bool | None = None,
    lr_scale: float = 1.0,
    masked_target: int | None = None,
    all_logits: bool = False,
    capacity: int | None = None,
    on_chunk: Callable[[int], None] | None = None,
    graphs: bool = False,
) -> tuple[DecodeState, torch.Tensor]:
    """Read the prompts, tokens (B, P) int64 (module docstring). Returns (the decode state, the logits
    (B, P, V) of every position with all_logits, else (B, 1, V) of the last).

    adapt: take the inner steps (default ttt.enabled; False: the model without test-time training);
    lr_scale: factor on the inner learning rates (1.0: as at evaluation after the warm-up); masked_target:
    targets equal to it are left out of the inner loss (TTT-E2E's BOS under data.packing=stream);
    capacity: positions the full-attention caches reserve room for (default P; they double when full);
    on_chunk: called with the number of positions of each chunk once read (a progress bar; P in all);
    graphs: the closed chunks, and later the decoding's closes, by a `ttt.layers.graphed.GraphedChunkStep`
    (sliding-window models; a CUDA graph on CUDA; not with all_logits).
    Runs in grad mode also inside torch.no_grad (the inner steps need gradients) but not under
    torch.inference_mode; keeps no outer graph."""
    check_tokens(tokens)
    if not isinstance(model, TTTTransformer):
        raise TypeError(f"generation reads with a TTTTransformer, got {type(model).__name__}")
    with torch.enable_grad():
        options = read_options(
            model.ttt_cfg, model.inner_cfg, adapt=adapt, steps=None, first_order=None, lr_scale=lr_scale,
            outer_grad=False, keep_logits=False,
        )  # fmt: skip
    if options.steps and torch.is_inference_mode_enabled():
        raise RuntimeError("generation with test-time training cannot run under torch.inference_mode: "
                           "the inner steps need gradients (use torch.no_grad, or adapt=False)")  # fmt: skip
    batch, length = tokens.shape
    capacity = max(capacity or length, length)
    prefix = [SuffixBlock(block, model.cfg, None) for block in model.layers[: model.first_suffix]]
    state = DecodeState(
        model, options, prefix, [_new_cache(block, capacity) for block in prefix],
        [_new_cache(block, capacity) for block in model.suffix], model.start_carry(batch, options),
        position=0, masked_target=masked_target,
    )  # fmt: skip
    with torch.no_grad():
        whole = _read_prefix(state, tokens)
    whole = replace(whole, targets=tokens[:, 1:], mask=_mask(tokens[:, 1:], masked_target), last=True)
    chunk_len = model.ttt_cfg.chunk_len
    closed = (length - 1) // chunk_len * chunk_len if options.steps else 0
    logits = []
    if graphs and options.steps:
        if all_logits:
            raise ValueError("prefill's graphs keep no logits of the closed chunks: all_logits must be False")
        from .graphed import chunk_step_for  # it builds on this module

        state.chunk_step = chunk_step_for(model, options)
        for start in range(0, closed, chunk_len):
            part = whole.part(start, start + chunk_len)
            state.caches, state.carry = state.chunk_step(state.carry, state.caches, part)
            if on_chunk is not None:
                on_chunk(len(part))
    elif closed:
        with torch.enable_grad():
            closed_logits, _, state.caches, state.carry = model.read_chunks(
                state.carry, state.caches, whole.part(0, closed),
                replace(options, keep_logits=all_logits, on_chunk=on_chunk),
            )  # fmt: skip
        logits += [closed_logits] if all_logits else []
    open_chunk = whole.part(closed, length)
    if options.steps:
        state.chunk_caches = state.caches
        state.chunk_inputs = open_chunk.inputs.new_empty(batch, chunk_len, open_chunk.inputs.shape[2])
        state.chunk_tokens = tokens.new_empty(batch, chunk_len)
        state.chunk_filled = len(open_chunk)
        state.chunk_inputs[:, : len(open_chunk)] = open_chunk.inputs
        state.chunk_tokens[:, : len(open_chunk)] = tokens[:, closed:]
    with torch.no_grad():
        hidden, state.caches = model.read_suffix(state.carry[0], open_chunk, state.caches)
        logits.append(model.head(hidden if all_logits else hidden[:, -1:]))
    if on_chunk is not None:
        on_chunk(len(open_chunk))
    state.position = length
    return state, torch.cat(logits, dim=1)


def close_chunk(state: DecodeState, token: torch.Tensor) -> None:
    """The open (full) chunk's inner steps, its last target token (B,) now known: the chunk read again
    from the suffix caches at its start by the reader's loop (`read_chunks`, as the chunked read reads
    it), its fast weights stepped; the next chunk opens at state.position."""
    model, chunk_len = state.model, state.model.ttt_cfg.chunk_len
    targets = torch.cat([state.chunk_tokens[:, 1:], token[:, None]], dim=1)
    cos, sin = model.rope_tables(state.position, token.device, start=state.position - chunk_len)
    chunk = Chunk(state.chunk_inputs, targets, cos, sin, _mask(targets, state.masked_target), last=False)
    if state.chunk_step is not None:
        _, state.carry = state.chunk_step(state.carry, state.chunk_caches, chunk)
    else:
        with torch.enable_grad():
            _, _, _, state.carry = model.read_chunks(state.carry, state.chunk_caches, chunk, state.options)
    state.chunk_caches, state.chunk_filled = [in_order(cache) for cache in state.caches], 0


def in_order(cache: KVCache) -> KVCache:
    """A cache as a chunk's read continues from it: a `RingCache` (a graphed decoding's) as its pair of
    the window - 1 most recent positions in order; any other as it is."""
    return cache.pair() if isinstance(cache, RingCache) else cache


def decode_step(state: DecodeState, token: torch.Tensor) -> torch.Tensor:
    """Read token (B,) int64 at position state.position (module docstring: first the inner steps of the
    open chunk when it is full, token being its last target). Returns the next-token logits (B, V);
    the state advances in place. Same grad-mode rules as `prefill`."""
    batch = state.batch
    if token.shape != (batch,) or token.dtype != torch.long:
        raise ValueError(f"token must be a ({batch},) int64 tensor, one per sequence, got "
                         f"{tuple(token.shape)} {token.dtype}")  # fmt: skip
    if chunk_is_full(state):
        close_chunk(state, token)
    inputs, logits = read_token(state, token, state.carry[0])
    record_token(state, inputs, token)
    return logits


def chunk_is_full(state: DecodeState) -> bool:
    """Whether the open chunk holds chunk_len positions (the next token closes it); False without inner
    steps."""
    return state.chunk_inputs is not None and state.chunk_filled == state.model.ttt_cfg.chunk_len


def read_token(
    state: DecodeState, token: torch.Tensor, fast: dict[str, torch.Tensor], tables=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """token (B,) at position state.position through the prefix blocks and, with the fast weights
    `fast`, the suffix blocks and the head, each block's cache advanced in state; tables: its RoPE
    tables (default `rope_tables`). Returns (the prefix's output (B, d_model), the logits (B, V));
    state.position and the open chunk are left to `record_token`."""
    with torch.no_grad():
        position = _read_prefix(state, token[:, None], tables)
        hidden, state.caches = state.model.read_suffix(fast, position, state.caches)
        return position.inputs[:, 0], state.model.head(hidden[:, -1])


def record_token(state: DecodeState, inputs: torch.Tensor, token: torch.Tensor) -> None:
    """After `read_token`: the token (B,) and its prefix output inputs (B, d_model) join the open chunk;
    the state moves to the next position."""
    if state.chunk_inputs is not None:
        state.chunk_inputs[:, state.chunk_filled] = inputs
        state.chunk_tokens[:, state.chunk_filled] = token
        state.chunk_filled += 1
    state.position += 1


def check_sampling(*, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """ValueError naming the argument unless max_new_tokens >= 1, temperature >= 0, 0 < top_p <= 1."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: no nucleus cut), got {top_p}")


def sample(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row of logits (B, V): the argmax at temperature 0; else drawn from
    softmax(logits / temperature) restricted to its nucleus (the most likely tokens whose probabilities
    first reach top_p together; 1: all), with `generator`. Returns (B,) int64."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    if top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # the mass of the likelier tokens
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(before >= top_p, 0))
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def generate(
    model: TTTTransformer,
    tokens: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    adapt: bool | None = None,
    lr_scale: float = 1.0,
    masked_target: int | None = None,
    stop_token: int | None = None,
    on_chunk: Callable[[int], None] | None = None,
    graphs: bool = False,
) -> Iterator[torch.Tensor]:
    """Continue the prompts tokens (B, P) by up to max_new_tokens tokens, yielding each as it is chosen,
    (B,) int64 (`sample` with a generator seeded by seed on tokens' device); stops early once every row
    has produced stop_token. adapt, lr_scale, masked_target, on_chunk: as in `prefill`; graphs: prefill
    with graphs and decode with a `ttt.layers.graphed.GraphedDecoder` (sliding-window models; CUDA graphs
    on CUDA). Arguments are
    checked when called (ValueError naming the bad one), the model runs as the tokens are drawn."""
    check_tokens(tokens)
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    if graphs and model.cfg.window is None:
        raise ValueError("graphs need a sliding-window model (model.window set): full attention's "
                         "key/value caches grow with every token")  # fmt: skip

    def tokens_drawn() -> Iterator[torch.Tensor]:
        state, logits = prefill(
            model, tokens, adapt=adapt, lr_scale=lr_scale, masked_target=masked_target,
            capacity=tokens.shape[1] + max_new_tokens, on_chunk=on_chunk, graphs=graphs,
        )  # fmt: skip
        step = functools.partial(decode_step, state)
        if graphs:
            from .graphed import GraphedDecoder  # it builds on this module

            step = GraphedDecoder(state)
        generator = torch.Generator(device=tokens.device).manual_seed(seed)
        logits, stopped = logits[:, -1], torch.zeros_like(tokens[:, 0], dtype=torch.bool)
        for drawn in range(1, max_new_tokens + 1):
            token = sample(logits, temperature=temperature, top_p=top_p, generator=generator)
            yield token
            if stop_token is not None:
                stopped |= token == stop_token
            if drawn == max_new_tokens or stopped.all():
                return
            logits = step(token)

    return tokens_drawn()
