#!/usr/bin/env bash
# The test suite, on a fresh machine: installs into .venv (scripts/setup.sh), then pytest.
# Without a GPU: Triton under its interpreter, NVRTC compiles only, GPU tests skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh .venv
. .venv/bin/activate
# lint first (seconds): pyproject's [tool.ruff], then the size limits (files <= 600 lines,
# functions <= 80 lines outside the kernels)
ruff check kernels tuner scripts tests
python scripts/check_size.py
# the CUDA kernel compiles without a GPU; a compile error or spill in an arch's default fails CI
for arch in sm_120 sm_90; do kvtune compile-check --arch $arch | tail -1; done
python -m pytest -q -n 2 --timeout=1800 "$@"
