#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and installs kvtune with its tuner and test extras.
# The CPU build of torch is installed first: a plain `torch` requirement would pull a
# multi-GB CUDA build on machines without a GPU. A stamp in the environment (the hash of
# pyproject.toml and this checkout's path) skips the install when nothing it depends on changed:
# the package is installed editable, so source changes need no reinstall. The skip also needs
# what the sweep needs (the package and the tune extra) to import: a broken one is installed again.
# Not the test / review extras: a machine that cannot install them would reinstall at every run
# (they are reported below, and scripts/test.sh stops on them).
set -euo pipefail
venv=$(realpath -m "${1:-.venv}")
py=${PYTHON:-python3}
cd "$(dirname "$0")/.."
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
. "$venv/bin/activate"
stamp_file="$venv/.kvtune-install-stamp"
stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd)"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
        && python scripts/check_install.py package tune 2>/dev/null; then
    echo "kvtune: already installed in $venv (pyproject.toml unchanged; delete $stamp_file to reinstall)"
    exit 0
fi
# pip's notes that are not problems: a user-site location warning, and setuptools' banner on
# every editable install (its text between two "!!" lines, then the source line it quotes)
quiet() {
    awk '/^WARNING: Location/ {next}
         /BuildBackendWarning: Editable installation/ {skip = 1; bangs = 0; next}
         skip && /^ *!!/ {if (++bangs == 2) skip = 0; next}
         skip {next}
         /with strategy, WheelFile\(/ {next}
         {print}'
}
python -m pip install -q --upgrade pip 2>&1 | quiet || true
if ! python -c "import torch" 2>/dev/null; then
    if python -c "import sys; sys.exit(0 if sys.platform == 'linux' else 1)" && ! command -v nvidia-smi >/dev/null; then
        # PyPI's Linux torch is the CUDA build (GBs of nvidia-* wheels): the CPU build is the
        # `+cpu` local version, found by a local wheel mirror or on PyTorch's CPU index
        python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
            || python -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
            || echo "kvtune: no CPU build of torch 2.13 found; the plain requirement follows (it may be the CUDA build)" >&2
    fi
fi
pip_ok=1
python -m pip install -q -e ".[test,review]" 2>&1 | quiet || pip_ok=0
# the sweep needs the package and the tune extra: stop, naming each module that does not import
if ! python scripts/check_install.py package tune; then
    echo "kvtune: set-up incomplete in $venv (see above)" >&2
    [ "$pip_ok" = 1 ] || echo "kvtune: pip install -e \".[test,review]\" failed above" >&2
    exit 1
fi
# the test and review extras: said loudly; scripts/test.sh stops on them
python scripts/check_install.py test review \
    || echo "kvtune: the test / review extras are incomplete (above): scripts/test.sh needs them" >&2
[ "$pip_ok" = 1 ] || echo "kvtune: pip reported an error above; the modules the sweep needs import" >&2
python -c "import torch, triton; print(f'kvtune installed: torch {torch.__version__}, triton {triton.__version__}')"
echo "$stamp" > "$stamp_file"
