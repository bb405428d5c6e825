#!/bin/bash
# ncu per-kernel breakdown of the CUDA backend's default config at H=8 (split + merge durations at
# 4k / 16k / 128k), and SASS-level stall sampling of the split kernel at 128k. Run from the repo
# root; lands in $OUT/ncu_breakdown.tgz.
set -u
R=/tmp/nb; mkdir -p $R
. scripts/device_env.sh tree
M=gpu__time_duration.sum,sm__cycles_elapsed.avg,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
for P in 4096 16384 131072; do
  timeout 60 ncu --clock-control none -k regex:verify_ -s 4 -c 2 --metrics $M python3 scripts/profile_split.py $P > $R/dur_$P.txt 2>&1
done
timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats -k regex:verify_split -s 2 -c 1 \
  -o $R/src python3 scripts/profile_split.py 131072 > $R/src.log 2>&1
timeout 60 ncu -i $R/src.ncu-rep --page source --csv --print-source sass > $R/src_sass.csv 2>$R/src_sass.err
gzip -f $R/src_sass.csv; rm -f $R/src.ncu-rep
tar czf $OUT/ncu_breakdown.tgz -C /tmp nb
for P in 4096 16384 131072; do echo "== $P"; grep -E "verify_|duration|cycles_elapsed|inst_exec|dram__bytes|lts__t_bytes" $R/dur_$P.txt | sed 's/  */ /g' | cut -c1-110; done
tail -3 $R/src.log; head -c 600 $R/src_sass.err; ls -la $R
