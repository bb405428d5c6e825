#!/usr/bin/env bash
# Land a deployment's sweep that `gpu_evidence.sh sweep` packed on a GPU (its $OUT/sweep.tgz) into
# the committed evidence and the packaged defaults, on a CPU:
#
#   bash scripts/land_sweep.sh /path/to/sweep.tgz kimi-k2-h200
#
# - results/<dep>/: trials.csv, studies.db, runs.jsonl and the exported YAML from the archive,
#   its logs/ (the archive's logs are the committed ones with this call's appended, since the
#   sweep resumed from them); trials.forgotten.csv stays out (the rows it holds are in git history),
#   and the archive's other folders are named, not landed;
# - no exported YAML newer than the trials (the call's export did not run or was cut): exported
#   here, without serving checks (logs/export-no-check.log), as the README of the folder must say;
# - kernels/defaults/<dep>.yaml: that YAML. Every backend it serves (per-bucket ones too) must have
#   been measured on this checkout's kernel source and the file must load, else nothing lands at
#   all (checked in the unpacked copy first) and the error names the backend and both hashes;
# - results/<dep>/report/: `kvtune report`;
# - for kimi-k2-h200, results/serving/dispatch/context-alternatives.csv (the review's table).
# It commits nothing: read its output (the sweep's and export's own warnings, the moved buckets) and
# `git diff --stat`, update results/<dep>/README.md, then commit. Run it from the repository root,
# with this checkout's kvtune importable (the hashes are computed from it).
set -euo pipefail
tgz=${1:?the sweep.tgz a gpu_evidence.sh sweep call returned}
dep=${2:?the deployment, e.g. kimi-k2-h200}
[ -d configs/deployments ] && [ -d kernels/defaults ] || {
  echo "land_sweep.sh: run it from the repository root (no configs/deployments or kernels/defaults in $PWD)" >&2; exit 2; }
[ -f "$tgz" ] || { echo "land_sweep.sh: $tgz: no such file" >&2; exit 2; }
[ -f "configs/deployments/$dep.yaml" ] || { echo "land_sweep.sh: $dep: no configs/deployments/$dep.yaml" >&2; exit 2; }
# the hashes are the importable kvtune's sources: they must be this checkout's
here=$(python -c "import os, kvtune.kernels as k; print(os.path.dirname(os.path.realpath(k.__file__)))")
if [ -f kernels/__init__.py ] && [ "$(cd kernels && pwd -P)" != "$here" ]; then
  echo "land_sweep.sh: kvtune is imported from $here, not from this checkout ($PWD/kernels): its kernel hashes would be another checkout's" >&2
  exit 2
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tar xzf "$tgz" -C "$tmp"
src=$tmp/$dep
for f in trials.csv studies.db runs.jsonl; do
  [ -f "$src/$f" ] || { echo "land_sweep.sh: $tgz holds no $dep/$f" >&2; exit 2; }
done
# everything is checked in the unpacked copy first: a refused archive changes nothing here
call_export=0
if [ -f "$src/$dep.yaml" ] && [ "$src/$dep.yaml" -nt "$src/trials.csv" ] && tail -1 "$src/$dep.yaml" | grep -q "^# end of kvtune tuned defaults"; then
  call_export=1
  echo "== the call's export (with its serving checks)"
else
  echo "== no whole export newer than the trials in $tgz: exporting here, without serving checks"
  mkdir -p "$tmp/logs"
  kvtune export "$dep" --out "$tmp" > "$tmp/logs/export-no-check.log" 2>&1 || {
    cp "$tmp/logs/export-no-check.log" "$tmp.export.log"
    echo "land_sweep.sh: the export failed, its log: $tmp.export.log" >&2; exit 1; }
fi
rc=0
python - "$src/$dep.yaml" <<'PYEOF' || rc=$?
import sys
from kvtune.kernels.lookup import kernel_hash_mismatches
from kvtune.kernels.tuned import SchemaError, load_tuned
try:
    tuned = load_tuned(sys.argv[1])
except (SchemaError, ValueError) as e:
    print(f"land_sweep.sh: {e}", file=sys.stderr)
    sys.exit(3)
stale = kernel_hash_mismatches(tuned)   # the runtime's own check of the backends the file serves
for line in stale:
    print(line, file=sys.stderr)
sys.exit(1 if stale else 0)
PYEOF
case $rc in
  0) ;;
  1) echo "land_sweep.sh: $tgz: its $dep.yaml was not tuned on this checkout's kernels; nothing landed" >&2; exit 1;;
  *) echo "land_sweep.sh: $tgz: its $dep.yaml does not load; nothing landed" >&2; exit 1;;
esac
dst=results/$dep
mkdir -p "$dst/logs"
[ "$call_export" = 1 ] && rm -f "$dst/logs/export-no-check.log"   # a CPU export of an earlier landing
cp "$src/trials.csv" "$src/studies.db" "$src/runs.jsonl" "$src/$dep.yaml" "$dst/"
[ -d "$tmp/logs" ] && cp -r "$tmp/logs/." "$dst/logs/"
if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  git show "HEAD:kernels/defaults/$dep.yaml" > "$tmp/before.yaml" 2>/dev/null || cp "$dst/$dep.yaml" "$tmp/before.yaml"
else
  cp "kernels/defaults/$dep.yaml" "$tmp/before.yaml" 2>/dev/null || cp "$dst/$dep.yaml" "$tmp/before.yaml"
fi
cp "$dst/$dep.yaml" "kernels/defaults/$dep.yaml"
kvtune report "$dst" --out "$dst/report" > /dev/null
if [ "$dep" = kimi-k2-h200 ]; then
  python -c "from kvtune.tuner.review import load_results, dispatch_table; dispatch_table(load_results('$dst')).to_csv('results/serving/dispatch/context-alternatives.csv', index=False, float_format='%.2f')"
fi
echo "== landed $dep into $dst and kernels/defaults/$dep.yaml"
others=$(cd "$tmp" && ls -A | grep -vx -e "$dep" -e logs || true)
[ -z "$others" ] || echo "== not landed (the archive's other folders; commit them where they belong): $others"
# what the sweep and the export said about themselves: a pass stopped early, a study unfinished
grep -hE "rc=|^warning" "$tmp/logs/sweep.log" "$tmp/logs/export-no-check.log" 2>/dev/null | tail -n 12 | sed 's/^/   /' || true
echo "== the buckets whose serving config moved (scripts/diff_defaults.py, the packaged file before -> now):"
python scripts/diff_defaults.py "$tmp/before.yaml" "kernels/defaults/$dep.yaml"
