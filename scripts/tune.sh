#!/usr/bin/env bash
# Sweep and export a Kimi-K2 deployment for the CUDA GPU it finds: the shipped one that names
# that GPU (kimi-k2-h200, kimi-k2-h100, kimi-k2-rtx-pro-6000), else one written for it under
# $KVTUNE_OUT/configs from its measured ceilings (`kvtune calibrate --deployment-for kimi-k2`);
# the tiny CPU one (Triton interpreter, CPU timings) without a GPU; says which it did.
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
    # a sweep refuses a GPU its deployment's device profile does not name (H100 and H200 share
    # sm_90: only the name tells their timings apart)
    dep=${KVTUNE_DEPLOYMENT:-$(kvtune calibrate --deployment-for kimi-k2 --out-dir "$out/configs")}
    # the shipped sweeps' settings (results/kimi-k2-h200/, results/kimi-k2-h100/: every tp and
    # batch bucket in 9.4 min of one H200, 12.2 of one H100). Where the wgmma kernel runs
    # (H100/H200) it serves every entry: the CUDA kernel is searched no further than its default
    # config (the fallback, and the export's CUDA-default column; the ragged phase still times a
    # few NSPLIT values at batch buckets > 1), and wgmma gets 8 trials per study over NSPLIT x
    # ROWS x COPY_LANES. On other GPUs the CUDA kernel is the one tuned, 8 trials per study.
    # --max-minutes stops resumably if a pass runs long (run the script again to resume). The
    # Triton backend is 3-6x slower and never served: add `--backend triton` to a pass to sweep it.
    wgmma=0
    python -c "import sys, torch; from kvtune.kernels import get_backend
sys.exit(get_backend('wgmma').supports(torch.device('cuda')) is not None)" 2>/dev/null && wgmma=1
    if [ "$wgmma" = 1 ]; then
        opts=(--device cuda --backend cuda --trials 1 --rounds 1 --remeasure-top 1 --max-minutes 4)
        wgmma_opts=(--device cuda --backend wgmma --trials 8 --rounds 1 --remeasure-top 1 --max-minutes 12)
    else
        opts=(--device cuda --backend cuda --trials 8 --rounds 1 --remeasure-top 1 --max-minutes 12)
        wgmma_opts=()
    fi
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
if [ -n "${wgmma_opts[*]:-}" ]; then
    kvtune sweep "$dep" --out "$out" --retune-stale "${wgmma_opts[@]}" "$@"
fi
kvtune export "$dep" --out "$out"
# KVTUNE_DEPLOYMENT may be a name or a file, as kvtune takes it: its loader names the folder
name=$(python -c "import sys; from kvtune.tuner.config import load_deployment; print(load_deployment(sys.argv[1]).name)" "$dep")
echo "kvtune: done in $(( $(date +%s) - start )) s; results under ${out%/}/$name/"
