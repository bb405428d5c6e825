#!/usr/bin/env bash
# GPU evidence, one step per device-tool call, from the repository root on the GPU machine;
# everything lands under $OUT (logs, CSVs, a tarball of result folders).
#
#   bash scripts/gpu_evidence.sh kernel   # CUDA GPU tests, racecheck on small shapes, the kernel benchmark
#   bash scripts/gpu_evidence.sh sweep    # (carry .whl) kimi-k2-h200 from scratch, export, GPU tests with it,
#                                         # the serving benchmark
#   bash scripts/gpu_evidence.sh serving  # serving GPU tests with the packaged defaults, the serving
#                                         # benchmark at tp 8 and tp 4, the per-bucket dispatch cost
#
# Time limits per part come from the environment (TEST_S, SAN_S, BENCH_S, SWEEP_S, MINS, ...).
# Extra arguments after the step go to the benchmark (kernel) or the sweep (sweep); for the
# sweep, `--then` separates passes run one after another into the same study storage (e.g.
# every batch bucket at tp 8 and 4, then batch 1 at tp 2 and 1).
set -u
OUT=${OUT:?}
step=${1:?say kernel or sweep}; shift
case "$step" in
kernel)
  . scripts/device_env.sh tree
  nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.log 2>&1
  python3 -c "from kvtune.kernels.cuda.nvrtc import kernel_source_hash, nvrtc_version; print('cuda source', kernel_source_hash(), 'nvrtc', nvrtc_version())" >> $OUT/env.log 2>&1
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -x --timeout 120 \
      tests/test_cuda_gpu.py tests/test_contract.py tests/test_nan_and_input_errors.py > $OUT/pytest.log 2>&1
  echo "pytest rc=$?" >> $OUT/pytest.log; tail -n 3 $OUT/pytest.log
  [ "${SAN_S:-60}" -gt 0 ] && MEMCHECK=0 SAN_S=${SAN_S:-60} bash scripts/cuda_sanitize.sh > /dev/null 2>&1
  grep -E "rel err|rc=|ERROR SUMMARY|RACECHECK SUMMARY" $OUT/sanitizer.log 2>/dev/null | head -20
  timeout ${BENCH_S:-330} python3 scripts/bench_kernel.py --out $OUT "$@" > $OUT/bench.log 2>&1
  echo "bench rc=$?" >> $OUT/bench.log; tail -n 16 $OUT/bench.log
  ;;
sweep)
  . scripts/device_env.sh wheels
  res=/tmp/res; mkdir -p $res/logs   # a copy of results/kimi-k2-h200 placed there first is resumed
  kv="python3 -m kvtune.tuner.cli"
  passes=(); cur=""
  for a in "$@"; do if [ "$a" = --then ]; then passes+=("$cur"); cur=""; else cur="$cur $a"; fi; done
  passes+=("$cur")
  for pass in "${passes[@]}"; do
    start=$(date +%s)
    echo "== sweep pass:$pass" >> $res/logs/sweep.log
    timeout ${SWEEP_S:-400} $kv sweep configs/deployments/kimi-k2-h200.yaml --device cuda --out $res \
        --no-progress $pass >> $res/logs/sweep.log 2>&1
    echo "sweep rc=$? wall_s=$(( $(date +%s) - start ))" >> $res/logs/sweep.log
  done
  $kv export kimi-k2-h200 --out $res >> $res/logs/sweep.log 2>&1; echo "export rc=$?" >> $res/logs/sweep.log
  cp $res/kimi-k2-h200/kimi-k2-h200.yaml kernels/defaults/kimi-k2-h200.yaml
  [ "${TEST_S:-150}" -gt 0 ] && timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 \
      tests/test_contract.py tests/test_cuda_gpu.py tests/test_runtime_gpu.py tests/test_packaged_defaults.py \
      tests/test_serving_gpu.py > $res/logs/pytest.log 2>&1
  echo "pytest rc=$?" >> $res/logs/pytest.log
  if [ "${BENCH_S:-150}" -gt 0 ]; then
    timeout ${BENCH_S:-150} python3 scripts/bench_serving.py --defaults $res/kimi-k2-h200/kimi-k2-h200.yaml \
        --out $res/serving > $res/logs/serving.log 2>&1
    echo "bench_serving rc=$?" >> $res/logs/serving.log
  fi
  tar czf $OUT/sweep.tgz -C $res .
  tail -n 25 $res/logs/sweep.log; tail -n 4 $res/logs/pytest.log; tail -n 30 $res/logs/serving.log 2>/dev/null
  ;;
serving)
  . scripts/device_env.sh tree
  nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/env.log 2>&1
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 \
      tests/test_runtime_gpu.py tests/test_packaged_defaults.py tests/test_serving_gpu.py tests/test_batch_buckets.py \
      tests/test_plan_run.py > $OUT/pytest.log 2>&1
  echo "pytest rc=$?" >> $OUT/pytest.log; tail -n 3 $OUT/pytest.log
  # CUDA's default only: the Triton default is 3-9x slower here and its compiles cost minutes
  timeout ${BENCH_S:-240} python3 scripts/bench_serving.py --defaults-of cuda --out $OUT/tp8 > $OUT/serving-tp8.log 2>&1
  echo "bench_serving tp8 rc=$?" >> $OUT/serving-tp8.log
  timeout ${BENCH4_S:-100} python3 scripts/bench_serving.py --defaults-of cuda --tp 4 --batches 1,8,16 --no-ragged \
      --out $OUT/tp4 > $OUT/serving-tp4.log 2>&1
  echo "bench_serving tp4 rc=$?" >> $OUT/serving-tp4.log
  # the tp8 batch-1 bucket's best compile-time config at 4k (trials table) against the exported one
  timeout ${DISPATCH_S:-60} python3 scripts/bench_dispatch.py --out $OUT --exported NSPLIT=132 \
      --alt NSPLIT=33,HEADS_PER_BLOCK=2,STAGES=3 > $OUT/dispatch.log 2>&1
  echo "bench_dispatch rc=$?" >> $OUT/dispatch.log
  tail -n 30 $OUT/serving-tp8.log; tail -n 8 $OUT/serving-tp4.log; tail -n 7 $OUT/dispatch.log
  ;;
*) echo "gpu_evidence.sh: unknown step '$step' (kernel | sweep | serving)" >&2; exit 2 ;;
esac
