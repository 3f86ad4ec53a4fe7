"""The end-of-run summary: `summary.json` in the run directory and a table on stdout.

summary.json is strict JSON (RFC 8259, which has no NaN or Infinity): a non-finite figure is written
as the string "nan", "inf" or "-inf" (`strict_json`), so every JSON parser reads the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .atomic import atomic_write_text
from .directory import RunPaths


def finite_or_name(value: Any) -> Any:
    """`value` with every non-finite float, at any depth of dicts and lists, replaced by "nan", "inf"
    or "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite_or_name(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_name(item) for item in value]
    return value


def strict_json(value: Any, **dumps_kwargs: Any) -> str:
    """json.dumps of `value` as strict JSON: non-finite floats become the strings "nan", "inf", "-inf"."""
    return json.dumps(finite_or_name(value), allow_nan=False, **dumps_kwargs)


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write the summary dict as indented strict JSON (`strict_json`), atomically."""
    atomic_write_text(path, strict_json(summary, indent=2, sort_keys=True) + "\n")


def finished_at(paths: RunPaths, outer_step: int) -> bool:
    """Whether the run in `paths` finished after `outer_step` outer steps: its summary.json (readable JSON)
    reports them, and no preemption mark (preempted.json) came after it."""
    if paths.preempted.exists():
        return False
    try:
        summary = json.loads(paths.summary.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("outer_steps") == outer_step


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "-" if value is None else str(value)


def format_summary_table(summary: dict[str, Any]) -> str:
    """The query figures as an unadapted-vs-adapted table, then the other scalar entries."""
    metrics = sorted(
        {key[: -len("_unadapted")] for key in summary if key.endswith("_unadapted")}
        & {key[: -len("_adapted")] for key in summary if key.endswith("_adapted")}
    )
    rows = [("metric", "unadapted", "adapted")]
    rows += [(m, _cell(summary[f"{m}_unadapted"]), _cell(summary[f"{m}_adapted"])) for m in metrics]
    paired = {f"{m}_{tag}" for m in metrics for tag in ("unadapted", "adapted")}
    extra = [(key, _cell(value)) for key, value in sorted(summary.items()) if key not in paired]
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, width)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in width))
    key_width = max((len(key) for key, _ in extra), default=0)
    lines += [""] + [f"{key.ljust(key_width)}  {value}" for key, value in extra]
    return "\n".join(lines)
