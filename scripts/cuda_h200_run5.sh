#!/bin/bash
# One GPU call (runs 5-8 of results/cuda): ncu of the default CUDA config at H=8/128k, the read
# speed of light per shape (scripts/sol_read.py), with PHASES=1 the split and merge kernels
# timed apart (scripts/time_phases.py), then scripts/cuda_h200_run.sh (smoke, bench,
# GPU tests, sanitizers; the mma/ldmatrix ceilings of run 4 are not re-measured). Run from the
# repo root; the bench arguments pass through; everything lands in $OUT/${RUN_NAME:-run5}.tgz (runs 5-8 of results/cuda).
set -u
R=/tmp/r; mkdir -p $R
. scripts/device_env.sh tree
S=smsp__average_warps_issue_stalled
M=smsp__inst_executed.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
for k in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle not_selected dispatch_stall lg_throttle selected no_instruction branch_resolving; do M=$M,${S}_${k}_per_issue_active.ratio; done
timeout 100 ncu --clock-control none -k regex:verify_split -s 2 -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --metrics $M python3 scripts/profile_split.py 131072 > $R/ncu.txt 2>&1
echo "ncu rc=$?" >> $R/ncu.txt
[ "${SOL:-1}" != 0 ] && { timeout 60 python3 scripts/sol_read.py --out $R > $R/sol_read.log 2>&1; echo "sol rc=$?" >> $R/sol_read.log; }
[ "${PHASES:-0}" != 0 ] && { timeout 120 python3 scripts/time_phases.py --out $R > $R/phases.log 2>&1; echo "phases rc=$?" >> $R/phases.log; }
CEIL_S=0 BENCH_S=${BENCH_S:-230} PYTEST_S=${PYTEST_S:-110} SAN_S=${SAN_S:-35} DIAG_S=0 bash scripts/cuda_h200_run.sh $R "$@" > $R/run.log 2>&1
tar czf $OUT/${RUN_NAME:-run5}.tgz -C /tmp r
grep -E "Duration|inst_executed|hmma|stalled_(wait|short|long|barrier)|Eligible Warps" $R/ncu.txt | sed 's/  */ /g'
tail -6 $R/sol_read.log 2>/dev/null; tail -7 $R/phases.log 2>/dev/null; cat $R/smoke.log; tail -21 $R/bench.log; tail -3 $R/pytest.log; grep -E "rc=|hazard" $R/sanitizer.log
