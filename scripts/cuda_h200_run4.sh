#!/bin/bash
# One GPU call (run 4 of results/cuda): ncu of the default CUDA config at H=8/128k, then
# scripts/cuda_h200_run.sh (smoke, ceilings, bench, GPU tests, sanitizers). Run from the repo root;
# the bench arguments pass through; everything lands in $OUT/run4.tgz.
set -u
R=/tmp/r; mkdir -p $R
. scripts/device_env.sh tree
S=smsp__average_warps_issue_stalled
M=smsp__inst_executed.sum,sm__cycles_elapsed.avg
for k in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle not_selected dispatch_stall lg_throttle selected no_instruction branch_resolving; do M=$M,${S}_${k}_per_issue_active.ratio; done
timeout 100 ncu --clock-control none -k regex:verify_split -s 2 -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --metrics $M python3 scripts/profile_split.py 131072 > $R/ncu.txt 2>&1
echo "ncu rc=$?" >> $R/ncu.txt
BENCH_S=${BENCH_S:-230} PYTEST_S=${PYTEST_S:-110} SAN_S=${SAN_S:-35} DIAG_S=0 bash scripts/cuda_h200_run.sh $R "$@" > $R/run.log 2>&1
tar czf $OUT/run4.tgz -C /tmp r
grep -E "Duration|inst_executed|stalled|Issue Slots|Eligible Warps" $R/ncu.txt | sed 's/  */ /g'
cat $R/smoke.log; tail -21 $R/bench.log; tail -3 $R/pytest.log; grep -E "rc=|hazard" $R/sanitizer.log
