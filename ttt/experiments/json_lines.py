"""One JSON line per measurement, printed and appended to a file as soon as it is measured, so that a
run stopped early keeps what it measured (the experiments' `--out`)."""

from __future__ import annotations

import json


def emit(row: dict, out: str | None) -> None:
    """Print row as one JSON line and append it to the file out (when given), both flushed at once."""
    text = json.dumps(row)
    print(text, flush=True)
    if out:
        with open(out, "a") as file:
            file.write(text + "\n")
