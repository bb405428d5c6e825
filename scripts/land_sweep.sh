#!/usr/bin/env bash
# Land a deployment's sweep that `gpu_evidence.sh sweep` packed on a GPU (its $OUT/sweep.tgz) into
# the committed evidence and the packaged defaults, on a CPU:
#
#   bash scripts/land_sweep.sh /path/to/sweep.tgz kimi-k2-h200
#
# - results/<dep>/: trials.csv, studies.db, runs.jsonl and the exported YAML from the archive,
#   its logs/ (the archive's logs are the committed ones with this call's appended, since the
#   sweep resumed from them); trials.forgotten.csv stays out (the rows it holds are in git history);
# - no exported YAML newer than the trials (the call's export did not run or was cut): exported
#   here, without serving checks (logs/export-no-check.log), as the README of the folder must say;
# - kernels/defaults/<dep>.yaml: that YAML, once every backend it serves was measured on this
#   checkout's kernel source (else it stops, naming both hashes);
# - results/<dep>/report/: `kvtune report`;
# - for kimi-k2-h200, results/serving/dispatch/context-alternatives.csv (the review's table).
# It commits nothing: read `git diff --stat`, update results/<dep>/README.md, then commit.
set -euo pipefail
tgz=${1:?the sweep.tgz a gpu_evidence.sh sweep call returned}
dep=${2:?the deployment, e.g. kimi-k2-h200}
[ -f "$tgz" ] || { echo "land_sweep.sh: $tgz: no such file" >&2; exit 2; }
[ -f "configs/deployments/$dep.yaml" ] || { echo "land_sweep.sh: $dep: no configs/deployments/$dep.yaml" >&2; exit 2; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar xzf "$tgz" -C "$tmp"
src=$tmp/$dep
for f in trials.csv studies.db runs.jsonl; do
  [ -f "$src/$f" ] || { echo "land_sweep.sh: $tgz holds no $dep/$f" >&2; exit 2; }
done
dst=results/$dep
mkdir -p "$dst/logs"
cp "$src/trials.csv" "$src/studies.db" "$src/runs.jsonl" "$dst/"
cp "$tmp"/logs/*.log "$dst/logs/"
if [ -f "$src/$dep.yaml" ] && [ "$src/$dep.yaml" -nt "$src/trials.csv" ] && tail -1 "$src/$dep.yaml" | grep -q "^# end of kvtune tuned defaults"; then
  cp "$src/$dep.yaml" "$dst/"
  echo "== the call's export (with its serving checks): $dst/$dep.yaml"
else
  echo "== no whole export newer than the trials in $tgz: exporting here, without serving checks"
  kvtune export "$dep" --out results > "$dst/logs/export-no-check.log" 2>&1 || {
    echo "land_sweep.sh: export failed, see $dst/logs/export-no-check.log" >&2; exit 1; }
fi
git show "HEAD:kernels/defaults/$dep.yaml" > "$tmp/before.yaml" 2>/dev/null || cp "$dst/$dep.yaml" "$tmp/before.yaml"
rc=0
python - "$dst/$dep.yaml" <<'PYEOF' || rc=$?
import sys
from kvtune.kernels import get_backend
from kvtune.kernels.tuned import SchemaError, load_tuned
try:
    tuned = load_tuned(sys.argv[1])
except (SchemaError, ValueError) as e:
    print(f"land_sweep.sh: {e}", file=sys.stderr)
    sys.exit(3)
hashes = {n: (tuned.provenance["kernel_hash"].get(n), get_backend(n).kernel_hash()) for n in {e.backend for e in tuned.entries}}
stale = {n: h for n, h in hashes.items() if h[0] != h[1]}
for n, (was, now) in stale.items():
    print(f"{sys.argv[1]}: {n} measured on source {was}, this checkout's is {now}", file=sys.stderr)
sys.exit(1 if stale else 0)
PYEOF
case $rc in
  0) ;;
  1) echo "land_sweep.sh: $dst/$dep.yaml was not tuned on this checkout's kernels; not packaged" >&2; exit 1;;
  *) echo "land_sweep.sh: $dst/$dep.yaml does not load; not packaged" >&2; exit 1;;
esac
cp "$dst/$dep.yaml" "kernels/defaults/$dep.yaml"
kvtune report "$dst" --out "$dst/report" > /dev/null
if [ "$dep" = kimi-k2-h200 ]; then
  python -c "from kvtune.tuner.review import load_results, dispatch_table; dispatch_table(load_results('$dst')).to_csv('results/serving/dispatch/context-alternatives.csv', index=False, float_format='%.2f')"
fi
echo "== landed $dep: $(git diff --stat -- "$dst" kernels/defaults | tail -1)"
echo "== the buckets whose serving config moved (scripts/diff_defaults.py, the packaged file before -> now):"
python scripts/diff_defaults.py "$tmp/before.yaml" "kernels/defaults/$dep.yaml"
