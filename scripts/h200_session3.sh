#!/usr/bin/env bash
# H200 session 3 (device tool, repository root; carry .whl): the Kimi-K2 H200 sweep from
# scratch with the current kernels (fresh studies: the kernel hashes changed), export, and
# the tuned runtime against SGLang-style Triton. Everything lands in $OUT/session3.tgz.
set -u
OUT=${OUT:?}
. scripts/device_env.sh wheels
res=/tmp/res; mkdir -p $res/logs
kv="python3 -m kvtune.tuner.cli"
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton, optuna; print(torch.__version__, triton.__version__, optuna.__version__)"; } > $res/logs/env.log 2>&1
start=$(date +%s)
timeout ${SWEEP_S:-450} $kv sweep configs/deployments/kimi-k2-h200.yaml --device cuda --out $res --trials ${TRIALS:-14} \
    --rounds 2 --remeasure-top 2 --max-minutes ${MINS:-6.5} --no-progress > $res/logs/sweep.log 2>&1
echo "sweep rc=$? wall_s=$(( $(date +%s) - start ))" >> $res/logs/sweep.log
$kv export kimi-k2-h200 --out $res >> $res/logs/sweep.log 2>&1; echo "export rc=$?" >> $res/logs/sweep.log
timeout ${BENCH_S:-70} python3 scripts/bench_runtime.py --defaults $res/kimi-k2-h200/kimi-k2-h200.yaml --tp 8 \
    --batches 1,4 --contexts 4096,16384,65536,131072 --out $res/runtime_bench > $res/logs/runtime_bench.log 2>&1
echo "bench_runtime rc=$?" >> $res/logs/runtime_bench.log
tar czf $OUT/session3.tgz -C $res .
tail -n 45 $res/logs/sweep.log; tail -n 14 $res/logs/runtime_bench.log
