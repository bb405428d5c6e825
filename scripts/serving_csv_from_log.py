#!/usr/bin/env python3
"""serving.csv from the log of a bench_serving.py run that was cut before it wrote one (it prints
each measured row as a JSON line as it goes; since then it also rewrites the CSV after every case).
The speedup columns are computed by bench_serving's own `_add_speedups`, with the tuned backend of
each batch taken from the YAML the run served by the runtime's bucket policy (`TunedDefaults.lookup`).

    python scripts/serving_csv_from_log.py serving.log serving.csv --defaults kimi-k2-h200.yaml --tp 8
"""
from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402
from sol_read import write_csv  # noqa: E402

from kvtune.kernels.tuned import load_tuned  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("csv")
    ap.add_argument("--defaults", required=True, help="the exported YAML the run served")
    ap.add_argument("--tp", type=int, required=True)
    args = ap.parse_args(argv)
    tuned = load_tuned(args.defaults)
    if not tuned.entries_for(args.tp):
        raise SystemExit(f"--tp {args.tp}: {args.defaults} has no entry for it")

    def plan_for(batch: int):   # the runtime's bucket policy (TunedDefaults.lookup)
        return types.SimpleNamespace(backend=types.SimpleNamespace(name=tuned.lookup(args.tp, batch).backend))

    rows = [json.loads(line) for line in Path(args.log).read_text().splitlines() if line.startswith('{"case"')]
    if not rows:
        raise SystemExit(f"{args.log}: no row lines (JSON objects starting with '{{\"case\"')")
    bench_serving._add_speedups(rows, types.SimpleNamespace(plan_for=plan_for))
    write_csv(Path(args.csv), [{k: r.get(k) for k in bench_serving.CSV_KEYS} for r in rows])
    bench_serving._print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
