#!/usr/bin/env bash
# H200 session 6 (device tool, repository root; carry .whl): after a CUDA kernel change, the
# Kimi-K2 H200 sweep from scratch, export, the exported YAML installed as the packaged default
# (in the device's copy of the tree), the final GPU tests against it, and the tuned runtime
# against SGLang-style Triton. Everything lands in $OUT/session6.tgz. A sweep stopped by its time
# limit resumes when run again on the same results directory (RES=results: the committed one).
set -u
OUT=${OUT:?}
. scripts/device_env.sh wheels
res=${RES:-/tmp/res}; mkdir -p $res/logs  # RES=results resumes the committed sweep (results/kimi-k2-h200)
kv="python3 -m kvtune.tuner.cli"
{ nvidia-smi --query-gpu=name,driver_version --format=csv
  python3 -c "import torch, triton, optuna; print(torch.__version__, triton.__version__, optuna.__version__)"
  python3 -c "from kvtune.kernels.cuda.nvrtc import kernel_source_hash; print('cuda source', kernel_source_hash())"; } > $res/logs/env.log 2>&1
start=$(date +%s)
timeout ${SWEEP_S:-400} $kv sweep configs/deployments/kimi-k2-h200.yaml --device cuda --out $res --trials ${TRIALS:-14} \
    --rounds 2 --remeasure-top 2 --max-minutes ${MINS:-6} --no-progress > $res/logs/sweep.log 2>&1
echo "sweep rc=$? wall_s=$(( $(date +%s) - start ))" >> $res/logs/sweep.log
$kv export kimi-k2-h200 --out $res >> $res/logs/sweep.log 2>&1; echo "export rc=$?" >> $res/logs/sweep.log
cp $res/kimi-k2-h200/kimi-k2-h200.yaml kernels/defaults/kimi-k2-h200.yaml
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 tests/test_contract.py \
    tests/test_cuda_gpu.py tests/test_runtime_gpu.py tests/test_packaged_defaults.py > $res/logs/pytest.log 2>&1
echo "pytest rc=$?" >> $res/logs/pytest.log
timeout ${BENCH_S:-70} python3 scripts/bench_runtime.py --defaults $res/kimi-k2-h200/kimi-k2-h200.yaml --tp 8 \
    --batches 1,4 --contexts 4096,16384,65536,131072 --out $res/runtime_bench > $res/logs/runtime_bench.log 2>&1
echo "bench_runtime rc=$?" >> $res/logs/runtime_bench.log
tar czf $OUT/session6.tgz -C $res kimi-k2-h200 logs runtime_bench
tail -n 30 $res/logs/sweep.log; tail -n 4 $res/logs/pytest.log; tail -n 14 $res/logs/runtime_bench.log
