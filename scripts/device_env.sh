# Sourced by the device-tool scripts, from the repository root on the device machine:
# `kvtune` importable from this tree without installing it (a package of two links),
# unbuffered output, a compile cache on the machine's /tmp (unless the caller chose one), and,
# with the argument `wheels`, the carried .whl (optuna and its dependencies) in /tmp/site.
# The argument is required (`tree` or `wheels`): without one, `.` would pass the caller's own.
case "${1:-}" in tree|wheels) ;; *) echo "device_env.sh: say 'tree' or 'wheels', got '${1:-}'" >&2; return 2 2>/dev/null || exit 2 ;; esac
mkdir -p /tmp/shim/kvtune
ln -sfn "$PWD/kernels" /tmp/shim/kvtune/kernels
ln -sfn "$PWD/tuner" /tmp/shim/kvtune/tuner
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1 KVTUNE_CACHE_DIR=${KVTUNE_CACHE_DIR:-/tmp/kvtune-cache}
if [ "${1:-}" = wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/shim:/tmp/site
fi
