"""`attn_implementation="bob"`: Hugging Face transformers models on `flashbob.flash_attention`.

After `register_transformers()`, a model built with `attn_implementation="bob"` runs every attention
call through `flash_attention`, so it can be differentiated twice (MAML, Hessian-vector products)
at long context without an N x N tensor. transformers is imported only inside that call.

What transformers hands an attention function, and what we do with it
    query (B, Hq, N, D), key / value (B, Hkv, M, D): passed to the op as they are (GQA without
    repeating k/v); the output goes back as (B, N, Hq, D), the layout transformers expects.
    scaling -> scale; sliding_window=w -> window=w (transformers' sliding mask keeps key j for query
    i when i - w < j <= i, ours when j > i + (M - N) - w: the same keys); causal from `is_causal`
    (or `module.is_causal`).
    attention_mask: transformers builds it with the mask function registered under the same name.
    Ours (`bob_mask`) evaluates the pattern transformers asks for (its mask function, the padding
    mask, the cache offsets) and accepts it when it is the op's causal (sliding window) mask,
    bottom-right aligned, restricted to one contiguous range of keys per batch row (a padding mask:
    left, right or both sides). It returns None without padding and a `PaddingKeyRanges` with
    padding, which the attention function passes on as the op's key_start / key_end; anything else
    raises `UnsupportedAttentionError`. Any other mask reaching the attention function was prepared
    by the caller (a custom 4-D mask): refused too.

Refused, with an error that names the problem
    padding masks whose valid keys are not one contiguous range per row (holes), packed sequences,
    block-wise or custom overlays, static-cache slots, prepared 4-D masks, bidirectional attention,
    attention dropout (training with attention_dropout > 0), logit soft-capping (Gemma-2), attention
    sinks (`s_aux`), position biases, output_attentions=True.
"""

from __future__ import annotations

import dataclasses

import torch

from .api import flash_attention

MASK_ROWS_PER_CHECK = 1024
"""Query rows evaluated at once when a mask pattern is checked (bounds its memory to rows x M)."""


class UnsupportedAttentionError(ValueError):
    """transformers asked for an attention the op cannot compute exactly."""


def _refuse(name: str, problem: str) -> UnsupportedAttentionError:
    return UnsupportedAttentionError(f"attn_implementation={name!r}: {problem}")


@dataclasses.dataclass(frozen=True)
class PaddingKeyRanges:
    """What `bob_mask` hands the attention function for a padded batch, in place of a mask tensor:
    batch row b sees keys key_start[b] <= j < key_end[b] of the layer's kv_length keys, on top of the
    causal / sliding-window mask. key_start, key_end: (B,) int64 on the mask's device."""

    key_start: torch.Tensor
    key_end: torch.Tensor
    kv_length: int


def padding_key_ranges(name: str, keys: torch.Tensor) -> PaddingKeyRanges | None:
    """keys: (B, K) bool, True at the keys each batch row may see (transformers' 2-D padding mask,
    cut to the layer's keys). Returns None when every key is valid, the per-row [start, end) when
    each row's valid keys are one contiguous range (an all-padding row gives an empty range), and
    raises `UnsupportedAttentionError` when some row has holes."""
    if bool(keys.all()):
        return None
    n_keys = keys.shape[-1]
    idx = torch.arange(n_keys, device=keys.device)
    count = keys.sum(-1)
    start = torch.where(keys, idx, n_keys).amin(-1)
    end = torch.where(keys, idx + 1, 0).amax(-1)
    start, end = torch.where(count > 0, start, 0), torch.where(count > 0, end, 0)
    holes = count != end - start
    if bool(holes.any()):
        rows = holes.nonzero().flatten().tolist()
        raise _refuse(
            name,
            f"the padding mask (attention_mask) of batch row(s) {rows} has holes: the op expresses a "
            "padding mask only when each row's valid keys form one contiguous range (left or right "
            "padding). Use attn_implementation='eager' for this mask.",
        )
    return PaddingKeyRanges(start, end, n_keys)


def _expected_pattern(rows: torch.Tensor, n_keys: int, n_queries: int, window: int | None) -> torch.Tensor:
    """The op's causal mask for query rows `rows` (R,) over n_keys keys -> bool (R, n_keys)."""
    cols = torch.arange(n_keys, device=rows.device)[None, :]
    last = rows[:, None] + (n_keys - n_queries)
    visible = cols <= last
    if window is not None:
        visible &= cols > last - window
    return visible


def check_mask_pattern(
    name: str,
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    mask_function,
    padding_mask: torch.Tensor | None,
    window: int | None,
    device,
) -> PaddingKeyRanges | None:
    """Check that transformers' mask is the op's causal mask restricted to one key range per row.

    mask_function(batch_idx, head_idx, q_idx, kv_idx) -> bool is transformers' index-based mask;
    padding_mask (B, >= kv_offset + kv_length) bool or None; window the sliding window or None.
    The pattern is evaluated exactly, MASK_ROWS_PER_CHECK query rows at a time. Returns the padding
    mask's key ranges (`padding_key_ranges`), or None without padding; raises
    `UnsupportedAttentionError` for anything else.
    """
    ranges = None
    if padding_mask is not None:
        keys = padding_mask[:, kv_offset : kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if keys.shape != (batch_size, kv_length):
            raise _refuse(
                name,
                f"the padding mask (attention_mask) of shape {tuple(padding_mask.shape)} does not cover "
                f"the {kv_length} keys from offset {kv_offset} of a batch of {batch_size}.",
            )
        ranges = padding_key_ranges(name, keys)
    batch = torch.arange(batch_size, device=device)[:, None, None, None]
    head = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    kv_idx = torch.arange(kv_length, device=device)[None, None, None, :] + kv_offset
    for start in range(0, q_length, MASK_ROWS_PER_CHECK):
        rows = torch.arange(start, min(start + MASK_ROWS_PER_CHECK, q_length), device=device)
        q_idx = (rows + q_offset)[None, None, :, None]
        try:
            asked = mask_function(batch, head, q_idx, kv_idx)
        except Exception as err:  # a mask function that is not index-based cannot be evaluated here
            raise _refuse(name, f"the mask function {mask_function!r} is not index-based ({err})") from err
        asked = torch.as_tensor(asked, device=device).expand(batch_size, 1, len(rows), kv_length)
        expected = _expected_pattern(rows, kv_length, q_length, window)
        if not torch.equal(asked, expected.expand_as(asked)):
            kind = f"causal with a sliding window of {window}" if window is not None else "causal"
            raise _refuse(
                name,
                f"the attention mask transformers asked for is not the op's {kind} mask (bottom-right "
                f"aligned, q_length={q_length}, kv_length={kv_length}, q_offset={q_offset}, "
                f"kv_offset={kv_offset}): packed sequences, block-wise or custom mask overlays, "
                "bidirectional attention and static-cache slots cannot be expressed.",
            )
    return ranges


def make_mask_function(name: str):
    """transformers' AttentionMaskInterface entry for `name`: checks the pattern, returns None or,
    for a padded batch, its `PaddingKeyRanges` (what the attention function then receives).

    Called by transformers' create_causal_mask / create_sliding_window_causal_mask /
    create_bidirectional_mask with (batch_size, q_length, kv_length, q_offset, kv_offset,
    mask_function, attention_mask (B, K) bool or None, local_size=sliding window, ...).
    """

    def bob_mask(
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int = 0,
        mask_function=None,
        attention_mask: torch.Tensor | None = None,
        local_size: int | None = None,
        device=None,
        **kwargs,
    ) -> PaddingKeyRanges | None:
        if mask_function is None:
            raise _refuse(name, "transformers passed no mask function; cannot tell which mask it wants")
        if isinstance(q_offset, torch.Tensor):
            q_offset = int(q_offset)
        if isinstance(kv_offset, torch.Tensor):
            kv_offset = int(kv_offset)
        return check_mask_pattern(
            name,
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function,
            padding_mask=attention_mask,
            window=local_size,
            device=device if device is not None else "cpu",
        )

    return bob_mask


def make_attention_function(name: str, backend: str):
    """transformers' AttentionInterface entry for `name`, running `flash_attention(backend=backend)`.

    Signature as transformers calls it: (module, query (B, Hq, N, D), key (B, Hkv, M, D),
    value (B, Hkv, M, D), attention_mask (None or the mask function's `PaddingKeyRanges`), scaling,
    dropout, sliding_window, softcap, is_causal, **kwargs) -> (out (B, N, Hq, D), None).
    """

    def bob_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        ranges = {}
        if isinstance(attention_mask, PaddingKeyRanges):
            if attention_mask.kv_length != key.shape[2] or attention_mask.key_start.shape[0] != key.shape[0]:
                raise _refuse(
                    name,
                    f"the padding mask was built for {attention_mask.key_start.shape[0]} rows of "
                    f"{attention_mask.kv_length} keys, the layer has {key.shape[0]} of {key.shape[2]}.",
                )
            ranges = {"key_start": attention_mask.key_start.to(key.device),
                      "key_end": attention_mask.key_end.to(key.device)}
        elif attention_mask is not None:
            raise _refuse(
                name,
                f"got a prepared attention mask of shape {tuple(attention_mask.shape)}; arbitrary masks "
                "cannot be expressed (only the causal / sliding-window pattern, checked when transformers "
                "builds the mask for this implementation).",
            )
        if dropout:
            raise _refuse(
                name,
                f"attention dropout ({dropout}) is not supported; set the config's attention_dropout to 0 "
                "or call model.eval().",
            )
        if softcap is not None:
            raise _refuse(
                name,
                f"attention logit soft-capping (softcap={softcap}) is not supported; set the config's "
                "attn_logit_softcapping to None (changes the model) or use attn_implementation='eager'.",
            )
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if not causal:
            raise _refuse(name, "bidirectional (non-causal) attention is not supported: causal LMs only.")
        for unsupported in ("s_aux", "sinks", "position_bias"):
            if kwargs.get(unsupported) is not None:
                raise _refuse(name, f"{unsupported!r} (attention sinks / biases) is not supported.")
        if kwargs.get("output_attentions"):
            raise _refuse(name, "output_attentions=True: the op never forms the attention weights.")
        window = None if sliding_window is None else int(sliding_window)
        out = flash_attention(query, key, value, causal=True, window=window, scale=scaling, backend=backend,
                              **ranges)
        return out.transpose(1, 2), None

    return bob_attention


def register_transformers(name: str = "bob", backend: str = "auto") -> str:
    """Register `flash_attention` with transformers as `attn_implementation=name`.

    Registers both the attention function (AttentionInterface) and its mask function
    (AttentionMaskInterface; without it transformers would drop padding masks silently).
    backend: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch", as in `flash_attention`.
    Returns name. Names beginning with "flash" are refused: transformers reads them as hub kernels.
    """
    if not isinstance(name, str) or not name or name.startswith("flash") or name in ("eager", "sdpa"):
        raise ValueError(
            f"name must be a new attention name that does not begin with 'flash' and is not 'eager' or "
            f"'sdpa', got {name!r}"
        )
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'torch'), got {backend!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, make_attention_function(name, backend))
    AttentionMaskInterface.register(name, make_mask_function(name))
    return name
