#!/usr/bin/env bash
# GPU call: the cuDNN first-passes probe and tests, then the second-order step with and without them.
set -u
. .device/lib.sh
echo "== probe"; timeout 120 python .device/probe_cudnn.py 2>&1 | tail -25
echo "== tests"; timeout 150 python -m pytest -q -o addopts="" -p no:cacheprovider tests/flashbob/test_cudnn_passes.py 2>&1 | tail -15
T=150 run second_cudnn_first_passes env FLASHBOB_FIRST_PASSES=cudnn $S --steps 2 --modes second ttt.prefix_attention=sdpa_cudnn
T=150 run second_prefix_cudnn $S --steps 2 --modes second ttt.prefix_attention=sdpa_cudnn
