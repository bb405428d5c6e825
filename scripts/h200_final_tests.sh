#!/usr/bin/env bash
# Final GPU tests on the H200 (device tool, repository root): every backend against the oracle,
# the CUDA backend, and the serving runtime with the shipped packaged defaults
# (kernels/defaults/kimi-k2-h200.yaml). Log in $OUT/pytest.log.
set -u
OUT=${OUT:?}
. scripts/device_env.sh tree
python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 tests/test_contract.py tests/test_cuda_gpu.py \
    tests/test_runtime_gpu.py tests/test_packaged_defaults.py > $OUT/pytest.log 2>&1
echo "pytest rc=$?" >> $OUT/pytest.log
tail -n 4 $OUT/pytest.log
