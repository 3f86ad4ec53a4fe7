python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m ttt.experiments.scale recipe=ttt_e2e_125m --steps 2 --modes off --base f7ee1ca --rounds 2 --out $OUT/ab_off.jsonl > $OUT/ab_off.out 2> $OUT/ab_off.err
echo rc=$?; tail -4 $OUT/ab_off.out
timeout 130 python -m ttt.experiments.scale recipe=ttt_e2e_125m --steps 1 --modes second --profile --out $OUT/prof.jsonl > $OUT/prof.out 2> $OUT/prof.err
echo rc=$?
python - <<'P'
import json, ast, os
for l in open(os.environ["OUT"] + "/prof.jsonl"):
    r = json.loads(l); p = r.get("profile"); p = ast.literal_eval(p) if isinstance(p, str) else p
    print(r["mode"], r["status"], "s/step %.3f" % r["s_per_step"], "peak %.2f" % r["peak_gib"], "mfu %.4f" % r["mfu"], flush=True)
    if p:
        print("  ", {k: round(v) for k, v in p["categories"].items()}, "wall", round(p["wall_ms"]))
        for t in p["top"][:25]: print("   %8.1f %6d %-10s %s" % (t["ms"], t["calls"], t["category"], t["name"][:110]))
P
timeout 230 python -m ttt.experiments.scale recipe=ttt_e2e_125m --steps 3 --modes second --base f7ee1ca --rounds 2 --out $OUT/ab_second.jsonl > $OUT/ab2.out 2> $OUT/ab2.err
echo rc=$?; tail -4 $OUT/ab2.out
