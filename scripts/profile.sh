#!/usr/bin/env bash
# Profile the CUDA kernel with Nsight Compute (device tool, repository root; ncu on the machine).
# Per prefix (default 4096 and 131072), H = 8 (or $H), T = 9, bs = 1, the default config of backend
# $BACKEND (cuda, default, wgmma or wgmma_km) with the overrides in PARAMS (e.g. PARAMS="HEADS_PER_BLOCK=4,NSPLIT=264"),
# driven by scripts/profile_split.py ($WGMMA_SOURCE: another verify_wgmma.cu to profile, e.g. from git history):
#
#   $OUT/ncu_<prefix>.txt      split and merge durations, cycles, instructions, DRAM and L2 bytes; the
#                              split kernel's SpeedOfLight, warp state, scheduler and stall reasons
#   $OUT/sass_<prefix>.csv.gz  per-instruction warp stall samples of the split kernel (SourceCounters)
#
#   bash scripts/profile.sh [PREFIX ...]
set -u
OUT=${OUT:?}
. scripts/device_env.sh tree
S=smsp__average_warps_issue_stalled
M=smsp__inst_executed.sum,sm__cycles_elapsed.avg,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
for k in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle not_selected dispatch_stall \
         lg_throttle selected no_instruction branch_resolving; do M=$M,${S}_${k}_per_issue_active.ratio; done
D=gpu__time_duration.sum,sm__cycles_elapsed.avg,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
run="python3 scripts/profile_split.py"
# the split kernel's name: verify_split_kernel (cuda), verify_wgmma_kernel (wgmma), verify_km_kernel (wgmma_km)
K=verify_split; [ "${BACKEND:-cuda}" = wgmma ] && K=verify_wgmma; [ "${BACKEND:-cuda}" = wgmma_km ] && K=verify_km
for P in ${@:-4096 131072}; do
  f=$OUT/ncu_$P.txt
  # the driver launches split + merge three times; the third pair is measured (warm caches, compiled)
  timeout ${NCU_S:-90} ncu --clock-control none -k regex:verify_ -s 4 -c 2 --metrics $D $run $P "${PARAMS:-}" > $f 2>&1
  echo "durations rc=$?" >> $f
  timeout ${NCU_S:-120} ncu --clock-control none -k regex:$K -s 2 -c 1 --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section SourceCounters --metrics $M \
      -o /tmp/prof_$P -f $run $P "${PARAMS:-}" >> $f 2>&1
  echo "profile rc=$?" >> $f
  ncu -i /tmp/prof_$P.ncu-rep --page details >> $f 2>&1
  ncu -i /tmp/prof_$P.ncu-rep --page source --csv --print-source sass 2>>$f | gzip > $OUT/sass_$P.csv.gz
  rm -f /tmp/prof_$P.ncu-rep
  echo "== $P"; grep -E "verify_|Duration|gpu__time_duration|inst_executed|hmma|stalled_(wait|short|long|barrier)|Eligible Warps|dram__bytes" $f \
      | sed 's/  */ /g' | cut -c1-110
done
