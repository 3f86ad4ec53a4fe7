set -u
. .device/lib.sh
echo "== tests"; timeout 120 python -m pytest -q -o addopts="" -p no:cacheprovider tests/flashbob/test_cudnn_passes.py 2>&1 | tail -4
echo "== step16k"; timeout 300 python .device/step16k.py 2>&1 | grep -v Warning | tail -12
