"""What to say when a run runs out of accelerator memory: the config keys of this recipe that lower
memory, each with its value now and what it costs, instead of a bare CUDA trace."""

from __future__ import annotations

from typing import Any

MEMORY_KEYS = (
    # (key, value that saves memory, what it costs), most effective and cheapest first
    ("ttt.fused_loss", True, "none: exact; the head and loss in blocks of rows, no float32 logits kept"),
    ("ttt.fused_loss_keeps_logits", False, "one more product over the vocabulary per row in a backward"),
    (
        "ttt.checkpoint_prefix",
        True,
        "one more forward of the prefix blocks (3% of the 125M step, docs/scale.md)",
    ),
    ("inner.checkpoint", True, "one more forward and inner step of every chunk in the outer backward"),
    (
        "ttt.checkpoint_segment_keeps_chunks",
        False,
        "with segments, one more forward and inner step of every chunk (its own recomputation)",
    ),
    ("memory.checkpoint", True, "one more forward and write of every chunk in the outer backward"),
    ("trainer.precision", "bf16-mixed", "bf16 products instead of float32"),
)


def _get(cfg: Any, key: str) -> Any:
    """cfg's value at a dotted key, or a sentinel when the recipe has no such key."""
    value = cfg
    for part in key.split("."):
        if not hasattr(value, part):
            return _MISSING
        value = getattr(value, part)
    return value


_MISSING = object()


def out_of_memory_advice(cfg: Any, error: BaseException) -> str:
    """The message of a run that ran out of memory: the error's first line, then each key of this
    recipe that lowers memory and is not yet at its saving value (value now -> suggested, and its cost),
    then the keys that trade speed or change the task."""
    lines = [
        f"out of accelerator memory ({str(error).splitlines()[0] if str(error) else type(error).__name__})",
        "keys that lower memory, cheapest first (key: now -> try; cost):",
    ]
    for key, saving, cost in MEMORY_KEYS:
        now = _get(cfg, key)
        if now is not _MISSING and now != saving:
            lines.append(f"  {key}: {now} -> {saving}; {cost}")
    if _get(cfg, "ttt.checkpoint_segment") is None:  # a recipe with chunked reading, no segments yet
        lines.append(
            "  ttt.checkpoint_segment: null -> 8; with chunk recomputation, keeps the carry (fast weights) "
            "of every 8th chunk boundary only, for one more forward of every chunk"
        )
    per_pass = _get(cfg, "ttt.sequences_per_pass")
    batch = _get(cfg, "trainer.meta_batch_size")
    if per_pass is not _MISSING and batch is not _MISSING:
        now = per_pass or batch
        if now > 1:
            lines.append(
                f"  ttt.sequences_per_pass: {per_pass} -> {max(1, now // 2)}; same gradients, more passes "
                "of fewer sequences (slower per sequence)"
            )
    seq_len = _get(cfg, "data.seq_len")
    if seq_len is not _MISSING:
        lines.append(f"  data.seq_len: {seq_len} -> shorter; changes the task (memory is linear in it)")
    if _get(cfg, "inner.first_order") is False:
        lines.append("  inner.first_order: false -> true; drops the second-order term (other gradients)")
    lines.append("measure any of them with: python -m ttt.experiments.scale recipe=NAME key=value ...")
    return "\n".join(lines)
