"""`python -m flashbob.bench SUBCOMMAND [options]`: see `flashbob.bench` for the subcommands."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {"speed": "speed", "ab": "ab", "jvp": "jvp", "ranges": "ranges", "precision": "precision",
               "first-call": "first_call", "tiles": "tiles", "sm90": "sm90", "host": "host",
               "compile": "compile_family", "decode": "decode"}
"""Subcommand -> module of flashbob.bench; each module has main(argv)."""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        import flashbob.bench

        print(flashbob.bench.__doc__)
        return
    name, rest = (argv[0], argv[1:]) if not argv[0].startswith("-") else ("speed", argv)
    if name not in SUBCOMMANDS:
        raise SystemExit(f"unknown subcommand {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    importlib.import_module(f"flashbob.bench.{SUBCOMMANDS[name]}").main(rest)


if __name__ == "__main__":
    main()
