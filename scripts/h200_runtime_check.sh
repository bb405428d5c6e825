#!/usr/bin/env bash
# Runtime re-check on one H200 (device tool, repository root): the runtime GPU tests and the
# tuned-runtime benchmark at batch 1 and 4 with the packaged Kimi-K2 defaults.
set -u
OUT=${OUT:?}
. scripts/device_env.sh tree
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 100 tests/test_runtime_gpu.py \
    tests/test_contract.py -k "cuda or runtime or graph" > $OUT/pytest.log 2>&1; echo "pytest rc=$?" >> $OUT/pytest.log
timeout 150 python3 scripts/bench_runtime.py --defaults kernels/defaults/kimi-k2-h200.yaml --tp 8 \
    --batches 1,4 --contexts 4096,16384,65536,131072 --out $OUT/runtime_bench > $OUT/runtime_bench.log 2>&1
echo "bench_runtime rc=$?" >> $OUT/runtime_bench.log
tail -3 $OUT/pytest.log; grep -E "^ +4 " $OUT/runtime_bench.log; tail -2 $OUT/runtime_bench.log
