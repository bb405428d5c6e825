#!/usr/bin/env bash
# one device call: resume the kimi-k2-h200 sweep's ragged phase, export, serving bench, GPU tests
set -u
end=$((SECONDS + ${CAP_S:-480}))
left() { echo $(( end - SECONDS > 5 ? end - SECONDS : 5 )); }
. scripts/device_env.sh wheels
res=/tmp/res; mkdir -p $res/logs; cp -r results/kimi-k2-h200 $res/; rm -rf $res/kimi-k2-h200/report
kv="python3 -m kvtune.tuner.cli"; dep=configs/deployments/kimi-k2-h200.yaml
run_pass() { local t0=$SECONDS; echo "== sweep pass: $*" >> $res/logs/sweep.log
  timeout $(left) $kv sweep $dep --device cuda --out $res --no-progress "$@" >> $res/logs/sweep.log 2>&1
  echo "sweep rc=$? wall_s=$((SECONDS - t0))" >> $res/logs/sweep.log; }
run_pass --tp 4 --bs 4 16 64 --backend cuda --trials 6 --rounds 1 --remeasure-top 1 --max-minutes 2.0
run_pass --tp 8 --bs 4 16 64 --backend cuda --trials 8 --rounds 1 --remeasure-top 1 --max-minutes 1.0
t0=$SECONDS; timeout $(left) $kv export kimi-k2-h200 --out $res >> $res/logs/sweep.log 2>&1
echo "export rc=$? wall_s=$((SECONDS - t0))" >> $res/logs/sweep.log
tar czf $OUT/res.tgz -C $res .
for tp in 4 8; do timeout $(( $(left) / 2 )) python3 scripts/bench_serving.py --defaults $res/kimi-k2-h200/kimi-k2-h200.yaml \
  --tp $tp --batches 16,64 --prefixes 4096,16384 --defaults-of cuda --reps 10 --out $OUT/serving-tp$tp > $OUT/serving-tp$tp.log 2>&1
  echo "bench tp$tp rc=$?" >> $OUT/serving-tp$tp.log; done
cp $res/kimi-k2-h200/kimi-k2-h200.yaml kernels/defaults/kimi-k2-h200.yaml
timeout $(left) python3 -m pytest -q -p no:cacheprovider -o addopts="" -rs --timeout 60 tests/test_packaged_defaults.py \
  tests/test_serving_gpu.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?" >> $OUT/pytest.log
grep -E "== sweep|rc=" $res/logs/sweep.log; tail -3 $OUT/pytest.log; grep -E "ragged|rc=" $OUT/serving-tp*.log | head -20
