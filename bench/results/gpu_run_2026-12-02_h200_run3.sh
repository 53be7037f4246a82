C=$PWD/.carry/gpufhe
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $C/whl/*.whl || exit 1
mkdir -p /tmp/src && tar -xf $C/src.tar -C /tmp/src && cd /tmp/src || exit 1
export PYTHONPATH=/tmp/src:/tmp/site PYTHONUNBUFFERED=1
echo "src $(cat COMMIT)"; date -u
timeout 200 python3 bench/gpu_packed.py --weights $C/packed --repeat 3 --skip-seal --out $OUT/packed.json 2>&1 | tee $OUT/packed.log | grep -v "^ \|^{$\|^}$"
echo "t+$(( $(date +%s) - T0 ))s"
timeout 100 python3 -m pytest -q -c /dev/null -p no:cacheprovider tests/fhe/test_gpu_backend_packed.py 2>&1 | tail -2
echo "t+$(( $(date +%s) - T0 ))s"; date -u
