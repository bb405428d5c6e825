#!/usr/bin/env bash
# The NVRTC compile tests (no GPU) under another NVRTC than the one installed, e.g. the GPU
# machines' 13.0 while CI has the newest: pip downloads that nvidia-cuda-nvrtc wheel into a cache
# folder and the tests run with its libnvrtc preloaded (one compile cache per version, so no CUBIN
# of the installed NVRTC is read). pyproject allows nvidia-cuda-nvrtc >= 13.0, so each of those
# must compile every default without spills.
#
#   bash scripts/compile_tests_nvrtc.sh 13.0 [pytest options]     # after scripts/setup.sh
set -euo pipefail
ver=${1:?"NVRTC version (major.minor), e.g. 13.0"}
shift
cd "$(dirname "$0")/.."
. .venv/bin/activate
major=${ver%%.*}
root=${XDG_CACHE_HOME:-$HOME/.cache}/kvtune/nvrtc-$ver
lib=$root/nvidia/cu$major/lib   # the layout of the nvidia-cuda-nvrtc wheels from 13.0 (pyproject's floor)
if [ ! -e "$lib/libnvrtc.so.$major" ]; then
    rm -rf "$root/wheel"; mkdir -p "$root/wheel"
    python -m pip download -q --no-deps -d "$root/wheel" "nvidia-cuda-nvrtc==$ver.*" 2> >(grep -v "WARNING: Location" >&2)
    wheels=("$root"/wheel/nvidia_cuda_nvrtc-*.whl)
    python -m zipfile -e "${wheels[0]}" "$root"
fi
export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LD_PRELOAD="$lib/libnvrtc.so.$major"
export KVTUNE_CACHE_DIR="$root/compile-cache"
got=$(python -c "from kvtune.kernels.cuda.nvrtc import nvrtc_version; print(nvrtc_version())")
[ "$got" = "$ver" ] || { echo "compile_tests_nvrtc.sh: asked for NVRTC $ver, loaded $got" >&2; exit 1; }
echo "NVRTC $got ($lib)"
python -m pytest -q -p no:cacheprovider -m "not gpu" "$@" tests/test_cuda_compile.py tests/test_cuda_smem_mirror.py \
    tests/test_param_declaration.py tests/test_wgmma_compile.py tests/test_wgmma_km_compile.py \
    tests/test_diagnostic_scripts.py
for arch in sm_120 sm_90; do kvtune compile-check --arch $arch | tail -1; done
