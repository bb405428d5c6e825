#!/usr/bin/env bash
# 2x H200 session (device tool, kind nvidia-h200-x2, repository root): the same Kimi-K2 sweep
# with --workers 2 and with one worker (each with cold compile caches), then the runtime
# benchmark at batch 1 and 4 and the runtime GPU tests. Results: $OUT/session.tgz and logs.
set -u
OUT=${OUT:?}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. scripts/device_env.sh wheels
kv="python3 -m kvtune.tuner.cli"
nvidia-smi --query-gpu=index,name,driver_version --format=csv > $OUT/env.log 2>&1
res=/tmp/res; mkdir -p $res
sweep=(configs/deployments/kimi-k2-h200.yaml --device cuda --tp 4 8 --ctx 16384 131072 --trials ${TRIALS:-8}
       --rounds 1 --remeasure-top 2 --no-progress)
for w in 2 1; do
  export TRITON_CACHE_DIR=/tmp/triton-cache-w$w KVTUNE_CACHE_DIR=/tmp/kvtune-cache-w$w
  start=$(date +%s.%N)
  timeout 200 $kv sweep "${sweep[@]}" --workers $w --out $res/workers$w > $OUT/workers$w.log 2>&1
  rc=$?; end=$(date +%s.%N)
  echo "workers=$w rc=$rc wall_s=$(python3 -c "print(round($end - $start, 1))")" | tee -a $OUT/wall.log
  $kv export kimi-k2-h200 --out $res/workers$w >> $OUT/workers$w.log 2>&1
done
unset TRITON_CACHE_DIR
export KVTUNE_CACHE_DIR=/tmp/kvtune-cache-w1
timeout 90 python3 scripts/bench_runtime.py --defaults kernels/defaults/kimi-k2-h200.yaml --tp 8 \
    --batches 1,4 --contexts 4096,16384,65536,131072 --out $res/runtime_bench > $OUT/runtime_bench.log 2>&1
echo "bench_runtime rc=$?" >> $OUT/runtime_bench.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 100 tests/test_runtime_gpu.py \
    tests/test_packaged_defaults.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?" >> $OUT/pytest.log
tar czf $OUT/session.tgz -C $res .
cat $OUT/wall.log; tail -3 $OUT/pytest.log; tail -12 $OUT/runtime_bench.log
