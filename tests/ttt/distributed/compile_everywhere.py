"""`python tests/ttt/distributed/compile_everywhere.py key=value ...`: `python -m ttt.train key=value ...`
whose prefix blocks run through torch.compile on the CPU too (`ttt.layers.suffix_reader` compiles them
on CUDA only; here inductor's C++ kernels). A run that compiled no graph exits with status 3. Lightning
re-runs this script for the other devices, so every process compiles."""

from __future__ import annotations

import sys

from torch._dynamo.utils import counters

import ttt.train
from ttt.layers import suffix_reader

NO_GRAPH = 3


def main() -> int:
    run_block_over_sequence, train = suffix_reader.run_block_over_sequence, ttt.train.main

    def compiled_anywhere(*args, compiled: bool):
        return run_block_over_sequence(*args, compiled=True)

    def train_and_check() -> int:
        status = train()
        if status == 0 and not counters["stats"]["unique_graphs"]:
            print("compile_everywhere: the run compiled no graph", file=sys.stderr)
            return NO_GRAPH
        return status

    suffix_reader.run_block_over_sequence = compiled_anywhere
    ttt.train.main = train_and_check
    ttt.train.cli()


if __name__ == "__main__":
    main()
