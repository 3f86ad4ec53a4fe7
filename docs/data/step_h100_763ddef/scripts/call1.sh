set -u
. .device/lib.sh
echo "== gpu tests (t=$((SECONDS-start)))"
timeout 150 python -m pytest -q -o addopts="" -p no:cacheprovider -m gpu tests/ttt/layers/test_memory_options.py 2>&1 | tail -5
echo "== step16k b2b (t=$((SECONDS-start)))"
timeout 150 python .device/step16k_b2b.py 2>&1 | tail -6
T=${T_AB:-270} run ab_second $S --steps 2 --modes second ttt.prefix_attention=sdpa_cudnn --base ${BASE:-696424e} --rounds 2 --budget $(( ${T_AB:-270} - 20 ))
