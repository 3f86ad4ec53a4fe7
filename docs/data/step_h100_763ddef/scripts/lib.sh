# sourced by the call scripts: wheels, paths, and run NAME ARGS... (T: its timeout) writing $OUT/NAME.jsonl
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD
export FLASHBOB_COMMIT=${FLASHBOB_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$SECONDS
S="python -m ttt.experiments.scale recipe=ttt_e2e_125m"
run() { local name=$1; shift; echo "== $name (t=$((SECONDS-start)))"; timeout "$T" "$@" --out "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1; echo "rc=$? t=$((SECONDS-start))"; tail -3 "$OUT/$name.log" | cut -c1-300; grep -h '"s_per_step"' "$OUT/$name.jsonl" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); print(d['mode'], d.get('overrides'), d.get('status'), d.get('commit'), round(d.get('s_per_step',0),3), round(d.get('peak_gib',0),1), round(d.get('mfu',0),4))
"; }
