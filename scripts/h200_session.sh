#!/usr/bin/env bash
# One H200 session (run through the device tool from the repository root): the Kimi-K2 H200
# sweep + export, the tuned runtime against fixed defaults, then the GPU tests. Everything
# lands in $OUT/session.tgz (results tree) and $OUT/*.log.
# Usage: bash scripts/h200_session.sh [SWEEP_MINUTES]
set -u
OUT=${OUT:?}
mins=${1:-5}
. scripts/device_env.sh wheels
res=/tmp/res; mkdir -p $res
kv="python3 -m kvtune.tuner.cli"
{ nvidia-smi --query-gpu=name,driver_version --format=csv; python3 -c "import torch, triton, optuna; print(torch.__version__, triton.__version__, optuna.__version__)"; } > $OUT/env.log 2>&1
start=$(date +%s)
timeout $(( mins * 60 + 60 )) $kv sweep configs/deployments/kimi-k2-h200.yaml --device cuda --out $res \
    --trials ${TRIALS:-6} --rounds 2 --remeasure-top 2 --max-minutes $mins --no-progress > $OUT/sweep.log 2>&1
echo "sweep rc=$? wall_s=$(( $(date +%s) - start ))" >> $OUT/sweep.log
$kv export kimi-k2-h200 --out $res >> $OUT/sweep.log 2>&1; echo "export rc=$?" >> $OUT/sweep.log
timeout 90 python3 scripts/bench_runtime.py --defaults $res/kimi-k2-h200/kimi-k2-h200.yaml --tp 8 \
    --batches 1,4 --contexts 4096,16384,65536,131072 --out $res/runtime_bench > $OUT/runtime_bench.log 2>&1
echo "bench_runtime rc=$?" >> $OUT/runtime_bench.log
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 \
    tests/test_contract.py tests/test_cuda_gpu.py tests/test_runtime_gpu.py > $OUT/pytest.log 2>&1
echo "pytest rc=$?" >> $OUT/pytest.log
tar czf $OUT/session.tgz -C $res .
tail -5 $OUT/pytest.log; tail -30 $OUT/sweep.log
