set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python -m ttt.experiments.scale recipe=ttt_e2e_125m --steps 3 --modes second --base f7ee1ca --rounds 2 --out $OUT/ab_second.jsonl > $OUT/ab.out 2> $OUT/ab.err
echo rc=$?
tail -25 $OUT/ab.out
grep -i "recompile\|error\|warn" $OUT/ab.err | sort | uniq -c | head -20
