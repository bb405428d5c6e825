#!/usr/bin/env bash
# GPU evidence, one step per device-tool call, from the repository root on the GPU machine;
# everything lands under $OUT (logs, CSVs, a tarball of result folders). results/README.md says
# which step made which committed folder.
#
#   bash scripts/gpu_evidence.sh kernel       # CUDA GPU tests, racecheck on small shapes, the kernel benchmark
#   bash scripts/gpu_evidence.sh sweep        # (carry .whl) kimi-k2-h200 (DEP=<deployment name>: another) from
#                                             # scratch, export, GPU tests with it, the serving benchmark
#                                             # (CALIBRATE=<device profile name>: measure this GPU's ceilings
#                                             # into configs/devices/<name>.yaml first; PRE_S=N: precompile;
#                                             # RESUME=1: resume the committed results/<deployment>;
#                                             # DEP=a,b: the first whose device profile names this GPU,
#                                             # in $OUT/deployment.txt: for a call that may get either;
#                                             # FORGET="--backend B --tp N ...": kvtune forget those first;
#                                             # COMPARE_S=N: serve the changed entries, before and after;
#                                             # BEFORE=<file>: "before" is that file, not the committed one)
#   bash scripts/gpu_evidence.sh serving      # serving GPU tests with the packaged defaults, the serving
#                                             # benchmark at tp 8 and tp 4, the per-bucket dispatch cost
#                                             # (RAGGED_REPEATS=N: tp 8's ragged batches N more times)
#   bash scripts/gpu_evidence.sh dispatch     # (carry .whl) the dispatch across backends: its GPU tests, the
#                                             # export of kimi-k2-h200 from its trials, the serving benchmark
#   bash scripts/gpu_evidence.sh tests        # every test marked gpu (carry .whl for the tuner's)
#   bash scripts/gpu_evidence.sh sanitize     # compute-sanitizer racecheck (and memcheck unless MEMCHECK=0) of
#                                             # the cuda and wgmma kernels on small odd shapes
#   bash scripts/gpu_evidence.sh limits       # what bounds the kernel: mma.sync/ldmatrix ceilings, the read
#                                             # speed of light per shape, split and merge timed apart,
#                                             # the wgmma tile-loop probes (sm_90)
#   bash scripts/gpu_evidence.sh phases       # the fixed cost placed: split and merge apart, and source
#                                             # variants with one stage left out, at 256-64k (or the
#                                             # time_phases.py arguments given)
#   bash scripts/gpu_evidence.sh cluster-merge  # the split partials combined through DSMEM in clusters of
#                                             # C CTAs, against the staged store (sm_90; the probe only)
#   bash scripts/gpu_evidence.sh proxy        # the sm_120 proxy: every config that fits sm_120, timed here
#                                             # with sm_120's shared memory per SM, beside this GPU's default
#   bash scripts/gpu_evidence.sh tpe-vs-grid  # (carry .whl) the search against an exhaustive grid at tp 8
#   bash scripts/gpu_evidence.sh workers      # (carry .whl, two GPUs) the same sweep with --workers 2 and 1
#
# Time limits per part come from the environment (TEST_S, SAN_S, BENCH_S, SWEEP_S, EXPORT_S, ...);
# a part given 0 seconds is left out (`part`: `timeout 0` would mean no limit); the sweep step
# keeps them all inside DEADLINE_S and packs its folder into $OUT after each part.
# Extra arguments after the step go to the benchmark (kernel) or the sweep (sweep); for the
# sweep, `--then` separates passes run one after another into the same study storage (e.g.
# every batch bucket at tp 8 and 4, then batch 1 at tp 2 and 1).
set -u
OUT=${OUT:?}
step=${1:?say kernel, sweep, serving, dispatch, tests, sanitize, limits, phases, cluster-merge, proxy, tpe-vs-grid or workers}; shift
kv="python3 -m kvtune.tuner.cli"
dep_name=${DEP:-kimi-k2-h200}   # the sweep step's deployment; the others are kimi-k2-h200's
dep=configs/deployments/$dep_name.yaml
h200=configs/deployments/kimi-k2-h200.yaml

# part SECONDS COMMAND...: COMMAND under `timeout SECONDS`; at 0 seconds a line saying it was
# skipped instead (on the part's own output, so its log says so) and status 0
part() {
  local s=$1; shift
  [[ $s =~ ^[0-9]+$ ]] || { echo "gpu_evidence.sh: part: seconds must be a whole number, got '$s'" >&2; return 2; }
  if [ "$s" -eq 0 ]; then echo "skipped (given 0 s): $*"; return 0; fi
  timeout "$s" "$@"
}

# compute-sanitizer racecheck (and memcheck unless MEMCHECK=0) of the CUDA kernel on small odd
# shapes, with and without a split table -> $OUT/sanitizer.log
sanitize() {
  cat > /tmp/san.py <<'PYEOF'
import torch
from kvtune.kernels import SplitTable, make_inputs, reference_attention, rel_error, verify_attention
for (B, T, H, prefix, tree) in [(1, 9, 8, [54], "chain"), (3, 1, 8, [97, 1, 7], "chain"),
                                (2, 16, 16, [300, 5], "random"), (1, 2, 64, [1000], "random")]:
    x = make_inputs(B, T, H, prefix, tree=tree, device="cuda", seed=B * 100 + T)
    ref, _ = reference_attention(*x.args)
    for be in ("cuda", "wgmma") if torch.cuda.get_device_capability() == (9, 0) else ("cuda",):
        o = verify_attention(*x.args, backend=be)
        st = SplitTable.build([64, 512], [1, 4], "cuda")
        o2 = verify_attention(*x.args, backend=be, split_table=st)
        torch.cuda.synchronize()
        print(be, B, T, H, prefix, tree, "rel err", round(rel_error(o, ref), 5), round(rel_error(o2, ref), 5),
              flush=True)
PYEOF
  { python3 /tmp/san.py; echo "plain rc=$?"
    part ${SAN_S:-150} compute-sanitizer --tool racecheck --racecheck-report hazard python3 /tmp/san.py 2>&1 \
        | grep -v "Host Frame" | tail -25
    echo "racecheck rc=${PIPESTATUS[0]}"
    if [ "${MEMCHECK:-1}" = 1 ]; then
      part ${SAN_S:-150} compute-sanitizer --tool memcheck python3 /tmp/san.py 2>&1 | grep -v "Host Frame" | tail -25
      echo "memcheck rc=${PIPESTATUS[0]}"
    fi
    python3 -c "from kvtune.kernels.cuda.nvrtc import kernel_source_hash; print('cuda source', kernel_source_hash())"
  } > $OUT/sanitizer.log 2>&1
}

env_log() {
  nvidia-smi --query-gpu=index,name,driver_version --format=csv > $OUT/env.log 2>&1
  python3 -c "from kvtune.kernels.cuda.nvrtc import kernel_source_hash, nvrtc_version; print('cuda source', kernel_source_hash(), 'nvrtc', nvrtc_version())" >> $OUT/env.log 2>&1
}

case "$step" in
kernel)
  . scripts/device_env.sh tree
  env_log
  part ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs -x --timeout 120 \
      tests/test_cuda_gpu.py tests/test_wgmma_gpu.py tests/test_contract.py tests/test_nan_and_input_errors.py \
      > $OUT/pytest.log 2>&1
  echo "pytest rc=$?" >> $OUT/pytest.log; tail -n 3 $OUT/pytest.log
  [ "${SAN_S:-60}" -gt 0 ] && MEMCHECK=0 SAN_S=${SAN_S:-60} sanitize
  grep -E "rel err|rc=|ERROR SUMMARY|RACECHECK SUMMARY" $OUT/sanitizer.log 2>/dev/null | head -20
  part ${BENCH_S:-330} python3 scripts/bench_kernel.py --out $OUT "$@" > $OUT/bench.log 2>&1
  echo "bench rc=$?" >> $OUT/bench.log; tail -n 16 $OUT/bench.log
  ;;
sweep)
  # Everything inside one deadline (DEADLINE_S, default 560 s: under the device tool's 600-s
  # call limit), and the result folder packed into $OUT after every part: a call stopped early
  # still returns every finished pass (the sweep resumes from it).
  end=$(( SECONDS + ${DEADLINE_S:-560} ))
  cap() { local left=$(( end - SECONDS )); [ "$left" -lt "$1" ] && echo $(( left > 5 ? left : 5 )) || echo "$1"; }
  . scripts/device_env.sh wheels
  if [[ $dep_name == *,* ]]; then  # DEP=a,b,...: the first whose device profile names this GPU
    dep_name=$(python3 - "$dep_name" <<'PYEOF'
import sys
import torch
from kvtune.tuner.config import load_deployment
gpu = torch.cuda.get_device_name(0)
names = sys.argv[1].split(",")
for n in names:
    if load_deployment(n).device.device_name == gpu:
        print(n)
        sys.exit(0)
sys.exit(f"gpu_evidence.sh: DEP={sys.argv[1]}: no deployment's device profile names this GPU ({gpu})")
PYEOF
) || exit 2
    dep=configs/deployments/$dep_name.yaml
  fi
  echo "$dep_name" > $OUT/deployment.txt
  res=/tmp/res; mkdir -p $res/logs   # a copy of results/$dep_name placed there first is resumed
  if [ "${RESUME:-0}" = 1 ]; then  # RESUME=1: that copy made here, from the committed sweep
    mkdir -p $res/$dep_name
    cp results/$dep_name/trials.csv results/$dep_name/studies.db results/$dep_name/runs.jsonl $res/$dep_name/
    # a re-tune cut before its end, committed with the rows it set aside: the resumed studies still
    # measure each bucket's prior (tuner/priors.py) first
    [ -f results/$dep_name/trials.forgotten.csv ] && cp results/$dep_name/trials.forgotten.csv $res/$dep_name/
    cp results/$dep_name/logs/*.log $res/logs/ 2>/dev/null
    echo "== resumed from results/$dep_name ($(git log -1 --format=%h -- results/$dep_name/trials.csv 2>/dev/null))" \
        >> $res/logs/sweep.log
  fi
  if [ -n "${FORGET:-}" ]; then  # FORGET="--backend B [--tp ..] [--bs ..] [--ctx ..]": those buckets tuned afresh
    echo "== forget $FORGET" >> $res/logs/sweep.log
    $kv forget $dep_name --out $res $FORGET >> $res/logs/sweep.log 2>&1
  fi
  pack() { tar czf $OUT/sweep.tgz.part -C $res . && mv $OUT/sweep.tgz.part $OUT/sweep.tgz; }  # a kill mid-pack keeps the last whole one
  nvidia-smi --query-gpu=name,driver_version --format=csv >> $res/logs/env.log 2>&1
  if [ -n "${CALIBRATE:-}" ]; then  # this GPU's ceilings, the floors' denominators, before any trial
    timeout $(cap 120) $kv calibrate --name $CALIBRATE --path configs/devices/$CALIBRATE.yaml >> $res/logs/calibrate.log 2>&1
    echo "calibrate rc=$?" >> $res/logs/calibrate.log; cp configs/devices/$CALIBRATE.yaml $res/logs/
  fi
  [ "${PRE_S:-0}" -gt 0 ] && { timeout $(cap $PRE_S) python3 scripts/precompile.py --arch sm_90 --T 9 --jobs 16 \
      > $res/logs/precompile.log 2>&1; echo "precompile rc=$?" >> $res/logs/precompile.log; }
  passes=(); cur=""
  for a in "$@"; do if [ "$a" = --then ]; then passes+=("$cur"); cur=""; else cur="$cur $a"; fi; done
  passes+=("$cur")
  for pass in "${passes[@]}"; do
    start=$(date +%s)
    echo "== sweep pass:$pass" >> $res/logs/sweep.log
    timeout $(cap ${SWEEP_S:-400}) $kv sweep $dep --device cuda --out $res --no-progress $pass >> $res/logs/sweep.log 2>&1
    echo "sweep rc=$? wall_s=$(( $(date +%s) - start ))" >> $res/logs/sweep.log
    pack
  done
  if [ "${EXPORT_S:-200}" -gt 0 ]; then  # EXPORT_S=0: passes only (the sweep goes on in a later call)
    start=$(date +%s)
    timeout $(cap ${EXPORT_S:-200}) $kv export $dep_name --out $res >> $res/logs/sweep.log 2>&1
    echo "export rc=$? wall_s=$(( $(date +%s) - start ))" >> $res/logs/sweep.log; pack
    cp $res/$dep_name/$dep_name.yaml kernels/defaults/$dep_name.yaml
  fi
  # COMPARE_S=N: each (tp, batch bucket) whose buckets the export changed, served by the committed
  # file (before) and the new one (after), N seconds each, contexts up to 16k (2 layers a step)
  if [ "${COMPARE_S:-0}" -gt 0 ] && [ -f $res/$dep_name/$dep_name.yaml ]; then
    # BEFORE=<file>: the "before" side is that file (e.g. an earlier commit's export) instead
    old=${BEFORE:-results/$dep_name/$dep_name.yaml} new=$res/$dep_name/$dep_name.yaml; mkdir -p $res/compare
    python3 scripts/diff_defaults.py $old $new > $res/compare/diff.md 2>&1
    python3 scripts/diff_defaults.py $old $new --changed > $res/compare/changed.txt 2>&1
    while read -r tp bs ctxs; do
      pre=$(echo $ctxs | tr , '\n' | awk '$1 <= 16384' | paste -sd,)
      [ -n "$pre" ] || continue
      rag=$([ "$bs" -ge 16 ] || echo --no-ragged)
      for side in before after; do
        f=$([ $side = before ] && echo $old || echo $new)
        timeout $(cap $COMPARE_S) python3 scripts/bench_serving.py --defaults $f --deployment $dep_name --tp $tp \
            --batches $bs --prefixes $pre $rag --layers 2 --defaults-of "" --out $res/compare/tp$tp-b$bs-$side \
            > $res/compare/tp$tp-b$bs-$side.log 2>&1
        echo "bench_serving rc=$?" >> $res/compare/tp$tp-b$bs-$side.log
      done
      pack
    done < <(sort -k1,1nr $res/compare/changed.txt)   # tp 8 and 4 first
  fi
  if [ "${TEST_S:-150}" -gt 0 ]; then
    # the packaged-defaults test compares the packaged file with results/<deployment>: this
    # checkout's copy takes the new export and its trials, so the test checks the new file
    [ -f $res/$dep_name/$dep_name.yaml ] && cp $res/$dep_name/$dep_name.yaml $res/$dep_name/trials.csv results/$dep_name/
    timeout $(cap ${TEST_S:-150}) python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 \
        tests/test_packaged_defaults.py tests/test_runtime_gpu.py tests/test_contract.py tests/test_cuda_gpu.py \
        tests/test_serving_gpu.py > $res/logs/pytest.log 2>&1
    echo "pytest rc=$?" >> $res/logs/pytest.log
  fi
  if [ "${BENCH_S:-150}" -gt 0 ]; then
    timeout $(cap ${BENCH_S:-150}) python3 scripts/bench_serving.py --defaults $res/$dep_name/$dep_name.yaml --deployment $dep_name \
        --out $res/serving > $res/logs/serving.log 2>&1
    echo "bench_serving rc=$?" >> $res/logs/serving.log
  fi
  pack
  tail -n 25 $res/logs/sweep.log; tail -n 4 $res/logs/pytest.log 2>/dev/null; tail -n 30 $res/logs/serving.log 2>/dev/null
  cat $res/compare/diff.md 2>/dev/null | cut -c1-200; grep -h "\"variant\": \"tuned\"" $res/compare/*.log 2>/dev/null | cut -c1-160
  ;;
sanitize)
  . scripts/device_env.sh tree
  sanitize; grep -E "rel err|rc=|ERROR SUMMARY|RACECHECK SUMMARY" $OUT/sanitizer.log | head -20
  ;;
serving)
  # every output under one folder, packed into $OUT/serving.tgz after each part (the device tool
  # returns 8 files; a part cut by its limit keeps the parts before it)
  . scripts/device_env.sh tree
  o=/tmp/serving-evidence; rm -rf $o; mkdir -p $o
  pack() { tar czf $OUT/serving.tgz -C $o .; }
  nvidia-smi --query-gpu=name,driver_version --format=csv > $o/env.log 2>&1
  part ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 \
      tests/test_runtime_gpu.py tests/test_packaged_defaults.py tests/test_serving_gpu.py tests/test_batch_buckets.py \
      tests/test_plan_run.py > $o/pytest.log 2>&1
  echo "pytest rc=$?" >> $o/pytest.log; tail -n 3 $o/pytest.log; pack
  # CUDA's default only: the Triton default is 3-9x slower here and its compiles cost minutes
  part ${BENCH_S:-240} python3 scripts/bench_serving.py --defaults-of cuda --out $o/tp8 > $o/serving-tp8.log 2>&1
  echo "bench_serving tp8 rc=$?" >> $o/serving-tp8.log; pack
  # RAGGED_REPEATS=N: the ragged batches and batch 64 x 4k N more times at tp 8, without the
  # backends' defaults (tuned, tuned-b1, tuned-direct and 2-layer steps): the run-to-run spread of
  # the numbers nearest a goal
  for i in $(seq 1 ${RAGGED_REPEATS:-0}); do
    part ${REPEAT_S:-60} python3 scripts/bench_serving.py --defaults-of "" --tp 8 --batches 64 --prefixes 4096 \
        --layers 2 --out $o/tp8-repeat$i > $o/serving-tp8-repeat$i.log 2>&1
    echo "bench_serving tp8 repeat $i rc=$?" >> $o/serving-tp8-repeat$i.log; pack
  done
  part ${BENCH4_S:-100} python3 scripts/bench_serving.py --defaults-of cuda --tp 4 --batches 1,8,16 --no-ragged \
      --out $o/tp4 > $o/serving-tp4.log 2>&1
  echo "bench_serving tp4 rc=$?" >> $o/serving-tp4.log; pack
  # the tp8 batch-1 bucket's best compile-time config at 4k (trials table) against the exported one
  part ${DISPATCH_S:-60} python3 scripts/bench_dispatch.py --out $o --exported NSPLIT=132 \
      --alt NSPLIT=33,HEADS_PER_BLOCK=2,STAGES=3 > $o/dispatch.log 2>&1
  echo "bench_dispatch rc=$?" >> $o/dispatch.log; pack
  cp $o/pytest.log $o/serving-tp8.log $OUT/
  tail -n 30 $o/serving-tp8.log; tail -n 8 $o/serving-tp4.log 2>/dev/null; tail -n 7 $o/dispatch.log 2>/dev/null
  grep -h -E "^ragged|^B64xP4096" $o/serving-tp8-repeat*.log 2>/dev/null | grep -E "tuned"
  ;;
dispatch)
  # the per-context dispatch across backends: its GPU tests and the wgmma_km cases of the shared
  # ones, then kimi-k2-h200 exported from its trials and the wgmma_km sweep's (every backend's;
  # the export takes the table's backends) with the serving checks it lacks measured here, and
  # the serving benchmark of that export -> $OUT/export.tgz, $OUT/serving
  . scripts/device_env.sh wheels
  env_log
  part ${PRE_S:-150} python3 scripts/precompile.py --arch sm_90 --T 1,2,5,9,16 --jobs 16 > $OUT/precompile.log 2>&1
  tail -n 2 $OUT/precompile.log
  part ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 150 \
      tests/test_dispatch_gpu.py > $OUT/pytest.log 2>&1
  part ${TEST2_S:-150} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 120 -k wgmma_km \
      tests/test_cuda_gpu.py tests/test_contract.py >> $OUT/pytest.log 2>&1
  echo "pytest rc=$?" >> $OUT/pytest.log; grep -E "passed|failed|rc=" $OUT/pytest.log
  r=/tmp/res; rm -rf $r; mkdir -p $r; cp -r results/kimi-k2-h200 $r/
  # the shipped sweep's rows and the wgmma_km sweep's on its current source (with that export's
  # recorded checks: results/serving/dispatch-chain/export/), one table
  python3 scripts/merge_trials.py results/kimi-k2-h200/trials.csv results/serving/dispatch-chain/export/trials-wgmma_km.csv \
      --out $r/kimi-k2-h200/trials.csv
  part ${EXPORT_S:-200} $kv export $h200 --out $r > $OUT/export.log 2>&1
  echo "export rc=$?" >> $OUT/export.log
  tar czf $OUT/export.tgz -C $r kimi-k2-h200
  part ${BENCH_S:-150} python3 scripts/bench_serving.py --defaults $r/kimi-k2-h200/kimi-k2-h200.yaml \
      --defaults-of cuda --tp 8 --batches 1,8,16,64 --prefixes 4096,65536 --layers 8 --out $OUT/serving \
      > $OUT/serving.log 2>&1
  echo "bench_serving rc=$?" >> $OUT/serving.log
  grep -E "note:|rc=" $OUT/export.log | tail -n 12; tail -n 22 $OUT/serving.log 2>/dev/null
  ;;
tests)
  if ls .whl/*.whl >/dev/null 2>&1; then . scripts/device_env.sh wheels; else . scripts/device_env.sh tree; fi
  env_log
  part ${TEST_S:-500} python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 200 -m gpu tests \
      > $OUT/pytest.log 2>&1
  echo "pytest rc=$?" >> $OUT/pytest.log; tail -n 12 $OUT/pytest.log
  ;;
limits)
  . scripts/device_env.sh tree
  env_log
  # every output under one folder, packed into $OUT/limits.tgz: the device tool returns 8 files
  o=/tmp/limits; mkdir -p $o
  part ${CEIL_S:-60} python3 scripts/mma_ceiling.py --out $o > $o/ceilings.log 2>&1
  echo "ceilings rc=$?" >> $o/ceilings.log
  part ${SOL_S:-60} python3 scripts/sol_read.py --out $o > $o/sol_read.log 2>&1
  echo "sol rc=$?" >> $o/sol_read.log
  part ${PHASES_S:-120} python3 scripts/time_phases.py --out $o > $o/phases.log 2>&1
  echo "phases rc=$?" >> $o/phases.log
  for probe in wgmma_probe pingpong_probe rows_in_m_probe stream_probe; do
    part ${PROBE_S:-90} python3 scripts/$probe.py --out $o > $o/$probe.log 2>&1
    echo "$probe rc=$?" >> $o/$probe.log
  done
  tar czf $OUT/limits.tgz -C $o .
  tail -n 8 $o/ceilings.log; tail -n 6 $o/sol_read.log; tail -n 6 $o/phases.log; tail -n 12 $o/wgmma_probe.log
  tail -n 7 $o/pingpong_probe.log; tail -n 9 $o/rows_in_m_probe.log; tail -n 6 $o/stream_probe.log
  ;;
phases)
  . scripts/device_env.sh tree
  args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--prefixes 256,4096,16384,65536 --variants all)
  part ${PHASES_S:-200} python3 scripts/time_phases.py --out $OUT "${args[@]}" > $OUT/phases.log 2>&1
  echo "phases rc=$?" >> $OUT/phases.log; tail -n 28 $OUT/phases.log
  ;;
cluster-merge)
  # issue 12's on-chip combine of a request's split partials (thread-block clusters, DSMEM), the
  # epilogue alone against the staged store (sm_90) -> results/kernel/wgmma/cluster-merge-probe/
  . scripts/device_env.sh tree
  env_log
  part ${PROBE_S:-240} python3 scripts/cluster_merge_probe.py --out $OUT "$@" > $OUT/cluster_merge_probe.log 2>&1
  echo "cluster_merge_probe rc=$?" >> $OUT/cluster_merge_probe.log; tail -n 20 $OUT/cluster_merge_probe.log
  ;;
proxy)
  . scripts/device_env.sh tree
  part ${PROXY_S:-300} python3 scripts/bench_proxy.py --out $OUT "$@" > $OUT/proxy.log 2>&1
  echo "proxy rc=$?" >> $OUT/proxy.log; tail -n 9 $OUT/proxy.log
  ;;
tpe-vs-grid)
  . scripts/device_env.sh wheels
  # a comparison of searches, never exported: on an H100 too (--other-device)
  S="--tp 8 --ctx 4096 65536 --space-dir results/tpe-vs-grid/spaces --trials 12 --rounds 0 --no-progress --other-device"
  start=$(date +%s)
  part ${GRID_S:-200} $kv sweep $h200 $S --grid --out $OUT/grid > $OUT/grid.log 2>&1
  echo "grid rc=$? wall_s=$(( $(date +%s) - start ))" >> $OUT/grid.log; start=$(date +%s)
  part ${TPE_S:-120} $kv sweep $h200 $S --out $OUT/tpe > $OUT/tpe.log 2>&1
  echo "tpe rc=$? wall_s=$(( $(date +%s) - start ))" >> $OUT/tpe.log
  python3 scripts/compare_tpe_grid.py $OUT/tpe/kimi-k2-h200/trials.csv $OUT/grid/kimi-k2-h200/trials.csv \
      > $OUT/compare.log 2>&1
  cat $OUT/compare.log; tail -n 1 $OUT/grid.log $OUT/tpe.log
  ;;
workers)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  . scripts/device_env.sh wheels
  env_log
  sweep=($h200 --other-device --device cuda --tp 4 8 --ctx 16384 131072 --trials ${TRIALS:-8} --rounds 1 --remeasure-top 2 --no-progress)
  for w in 2 1; do   # each with cold compile caches
    export TRITON_CACHE_DIR=/tmp/triton-cache-w$w KVTUNE_CACHE_DIR=/tmp/kvtune-cache-w$w
    start=$(date +%s.%N)
    part ${SWEEP_S:-200} $kv sweep "${sweep[@]}" --workers $w --out $OUT/workers$w > $OUT/workers$w.log 2>&1
    rc=$?; end=$(date +%s.%N)
    echo "workers=$w rc=$rc wall_s=$(python3 -c "print(round($end - $start, 1))")" | tee -a $OUT/wall.log
    $kv export kimi-k2-h200 --out $OUT/workers$w >> $OUT/workers$w.log 2>&1
  done
  ;;
*) echo "gpu_evidence.sh: unknown step '$step' (kernel | sweep | serving | dispatch | tests | sanitize | limits | phases | cluster-merge | proxy | tpe-vs-grid | workers)" >&2; exit 2 ;;
esac
