#!/usr/bin/env bash
# Sweep and export a shipped deployment: the Kimi-K2 H200 one when a CUDA GPU is visible,
# the tiny CPU one (Triton interpreter, CPU timings) otherwise; says which it did.
# Usage: scripts/tune.sh [extra `kvtune sweep` options]   (installs into .venv with
# scripts/setup.sh when kvtune is missing). KVTUNE_DEPLOYMENT overrides the choice; KVTUNE_OUT
# the results root.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v kvtune >/dev/null 2>&1; then   # a fresh machine: install into .venv first
    if [ ! -x .venv/bin/kvtune ]; then bash scripts/setup.sh .venv; fi
    . .venv/bin/activate
fi
# your own sweeps go to runs/ (git-ignored); results/ holds the committed evidence, whose
# studies would otherwise be resumed (and count as done) on your machine
out=${KVTUNE_OUT:-runs}
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    dep=${KVTUNE_DEPLOYMENT:-configs/deployments/kimi-k2-h200.yaml}
    # the shipped sweep's settings (results/kimi-k2-h200/: every tp and batch bucket, CUDA with
    # 8 trials per study in 484 s of one H200, then wgmma, ROWS x NSPLIT, 5 trials per study in
    # about 300 s; the shipped sweep gave tp 1-2 at batch 4-64 10 trials, 405 s in all);
    # --max-minutes stops resumably if it runs long (run the script again to resume). The Triton backend is 3-6x slower there and
    # never served: add `--backend triton` to a pass to sweep it too.
    opts=(--device cuda --backend cuda --trials 8 --rounds 1 --remeasure-top 1 --max-minutes 10)
    wgmma_opts=(--device cuda --backend wgmma --trials 5 --rounds 1 --remeasure-top 1 --max-minutes 6)
    echo "kvtune: CUDA GPU found ($(python -c 'import torch; print(torch.cuda.get_device_name(0))')): sweeping $dep"
else
    dep=${KVTUNE_DEPLOYMENT:-configs/deployments/cpu-tiny.yaml}
    opts=(--device cpu --rounds 1 --remeasure-top 2)
    wgmma_opts=()
    echo "kvtune: no CUDA GPU: sweeping the small CPU deployment $dep (Triton interpreter; CPU timings, not GPU numbers)"
fi
start=$(date +%s)
# --retune-stale: after a kvtune update that changed a kernel, its old trials in $out are set
# aside (trials.forgotten.csv) and it is tuned again rather than resumed as done
kvtune sweep "$dep" --out "$out" --retune-stale "${opts[@]}" "$@"
# the wgmma kernel runs where its backend says it can (H100/H200); a sweep of nothing else fails
if [ -n "${wgmma_opts[*]:-}" ] && python -c "import sys, torch; from kvtune.kernels import get_backend
sys.exit(get_backend('wgmma').supports(torch.device('cuda')) is not None)"; then
    kvtune sweep "$dep" --out "$out" --retune-stale "${wgmma_opts[@]}" "$@"
fi
kvtune export "$dep" --out "$out"
echo "kvtune: done in $(( $(date +%s) - start )) s; results under $out/$(python -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$dep")/"
