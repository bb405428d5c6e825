#!/bin/bash
# SASS-level warp stall sampling of the CUDA split kernel (default config, H=8, T=9, bs=1) at the
# given prefixes (default 4096): per-instruction CSV in $OUT/ncu_source.tgz. Run from the repo root.
set -u
R=/tmp/ns; mkdir -p $R
. scripts/device_env.sh tree
for P in ${@:-4096}; do
  timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    -k regex:verify_split -s 2 -c 1 -o $R/src_$P python3 scripts/profile_split.py $P > $R/src_$P.log 2>&1
  timeout 60 ncu -i $R/src_$P.ncu-rep --page source --csv --print-source sass > $R/src_sass_$P.csv 2>>$R/src_$P.log
  timeout 60 ncu -i $R/src_$P.ncu-rep --page details >> $R/src_$P.log 2>&1
  gzip -f $R/src_sass_$P.csv; rm -f $R/src_$P.ncu-rep
done
tar czf $OUT/ncu_source.tgz -C /tmp ns
grep -E "Duration|Elapsed Cycles|SM Frequency" $R/*.log
