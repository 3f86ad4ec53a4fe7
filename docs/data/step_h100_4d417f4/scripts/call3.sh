python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null
SITE=$PWD/.site
export PYTHONPATH=$SITE:$PWD
python .gpu/addmm_check.py
timeout 120 python -m pytest -q -x tests/ttt/layers/test_memory_options.py tests/ttt/models/test_fused_ops.py tests/ttt/models/test_transformer.py 2>&1 | tail -3
run() { # label dir args
  label=$1; dir=$2; shift 2
  (cd $dir && PYTHONPATH=$SITE:$PWD timeout 300 python -m ttt.experiments.scale recipe=ttt_e2e_125m "$@" --out $OUT/$label.jsonl > $OUT/$label.out 2> $OUT/$label.err)
  python - $OUT/$label.jsonl $label <<'P'
import json, ast, sys
for l in open(sys.argv[1]):
    r = json.loads(l); p = r.get("profile"); p = ast.literal_eval(p) if isinstance(p, str) else p
    print(sys.argv[2], r["mode"], r["status"], "s/step %.3f" % r["s_per_step"], "first %.0f" % r["first_step_s"], "peak %.2f" % r["peak_gib"], "mfu %.4f" % r["mfu"], flush=True)
    if p:
        print("  ", {k: round(v) for k, v in p["categories"].items()}, "wall", round(p["wall_ms"]))
        for t in p["top"][:10]: print("   %8.1f %6d %-10s %s" % (t["ms"], t["calls"], t["category"], t["name"][:90]))
P
}
run cand . --steps 3 --modes second --profile
run base .gpu/base --steps 3 --modes second
run cand_off . --steps 3 --modes off --profile
run cand_sdpa . --steps 2 --modes second ttt.prefix_attention=sdpa
