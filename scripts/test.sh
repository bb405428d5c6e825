#!/usr/bin/env bash
# The test suite, on a fresh machine: installs into .venv (scripts/setup.sh), then pytest.
# Without a GPU: Triton under its interpreter, NVRTC compiles only, GPU tests skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv
. .venv/bin/activate
# every extra: one that did not install would otherwise only turn its tests into skips
python scripts/check_install.py package tune test review
# lint first (seconds): pyproject's [tool.ruff], then the size limits (files <= 600 lines,
# functions <= 80 lines outside the kernels)
ruff check kernels tuner scripts tests
python scripts/check_size.py
# the CUDA kernel compiles without a GPU; a compile error or spill in an arch's default fails CI
for arch in sm_120 sm_90; do kvtune compile-check --arch $arch | tail -1; done
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    # Triton reads TRITON_INTERPRET once, at import: one process cannot run the CPU tests (the
    # interpreter) and the GPU tests (compiled kernels). The CPU suite runs as it does without a
    # GPU (the GPU hidden), then the tests marked gpu on it.
    # exit status 5 (nothing collected: the arguments name only one kind of test) is not a failure
    part() { "$@" || { local rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }
    part env CUDA_VISIBLE_DEVICES="" python -m pytest -q -n 2 --timeout=1800 -m "not gpu" "$@"
    part python -m pytest -q --timeout=1800 -m gpu "$@"
else
    python -m pytest -q -n 2 --timeout=1800 "$@"
fi
