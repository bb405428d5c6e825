#!/usr/bin/env bash
# H200 session 4 (device tool, repository root; carry .whl): TPE against an exhaustive grid at
# tp 8 on the reduced spaces with the current kernels and search strategy, then the GPU tests
# (every backend against the oracle, the CUDA backend, the serving runtime with the packaged
# defaults). Everything lands in $OUT/session4.tgz.
set -u
OUT=${OUT:?}
. scripts/device_env.sh wheels
res=/tmp/res; mkdir -p $res/logs
kv="python3 -m kvtune.tuner.cli"
S="--tp 8 --ctx 4096 65536 --space-dir results/tpe-vs-grid/spaces --trials 12 --rounds 0 --no-progress"
start=$(date +%s)
timeout ${GRID_S:-200} $kv sweep configs/deployments/kimi-k2-h200.yaml $S --grid --out $res/grid2 > $res/logs/grid.log 2>&1
echo "grid rc=$? wall_s=$(( $(date +%s) - start ))" >> $res/logs/grid.log; start=$(date +%s)
timeout ${TPE_S:-120} $kv sweep configs/deployments/kimi-k2-h200.yaml $S --out $res/tpe2 > $res/logs/tpe.log 2>&1
echo "tpe rc=$? wall_s=$(( $(date +%s) - start ))" >> $res/logs/tpe.log
python3 scripts/compare_tpe_grid.py $res/tpe2/kimi-k2-h200/trials.csv $res/grid2/kimi-k2-h200/trials.csv > $res/logs/compare.log 2>&1
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 tests/test_contract.py \
    tests/test_cuda_gpu.py tests/test_runtime_gpu.py tests/test_packaged_defaults.py > $res/logs/pytest.log 2>&1
echo "pytest rc=$?" >> $res/logs/pytest.log
tar czf $OUT/session4.tgz -C $res .
cat $res/logs/compare.log; tail -n 3 $res/logs/grid.log $res/logs/tpe.log $res/logs/pytest.log
