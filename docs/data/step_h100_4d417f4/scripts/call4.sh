python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl 2>/dev/null
SITE=$PWD/.site
export PYTHONPATH=$SITE:$PWD
timeout 60 python .gpu/sdpa_diag.py 2>&1 | tail -12
source <(sed -n '/^run()/,/^}/p' .gpu/call3.sh)
run cand . --steps 3 --modes second
run base .gpu/base --steps 3 --modes second
