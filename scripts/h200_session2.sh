#!/usr/bin/env bash
# H200 session 2 (device tool, repository root): resume the Kimi-K2 sweep with a larger trial
# budget (the committed studies in results/ travel with the tree), export, then TPE against
# an exhaustive grid at tp 8 on the reduced spaces of results/tpe-vs-grid/spaces.
set -u
OUT=${OUT:?}
. scripts/device_env.sh wheels
kv="python3 -m kvtune.tuner.cli"
start=$(date +%s)
timeout 330 $kv sweep configs/deployments/kimi-k2-h200.yaml --device cuda --out results --trials ${TRIALS:-14} \
    --rounds 2 --remeasure-top 2 --max-minutes ${MINS:-4.5} --no-progress > $OUT/sweep.log 2>&1
echo "sweep rc=$? wall_s=$(( $(date +%s) - start ))" >> $OUT/sweep.log
$kv export kimi-k2-h200 --out results >> $OUT/sweep.log 2>&1; echo "export rc=$?" >> $OUT/sweep.log
g=results/tpe-vs-grid
for mode in tpe grid; do
  flag=""; [ $mode = grid ] && flag=--grid
  timeout 100 $kv sweep configs/deployments/kimi-k2-h200.yaml --device cuda --tp 8 --ctx 4096 65536 \
      --space-dir $g/spaces --out $g/$mode --trials 12 --rounds 0 --no-progress $flag > $OUT/$mode.log 2>&1
  echo "$mode rc=$?" >> $OUT/$mode.log
done
python3 scripts/compare_tpe_grid.py $g/tpe/kimi-k2-h200/trials.csv $g/grid/kimi-k2-h200/trials.csv > $OUT/compare.log 2>&1
tar czf $OUT/session2.tgz results/kimi-k2-h200 $g
cat $OUT/compare.log; tail -22 $OUT/sweep.log
