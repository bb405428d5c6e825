#!/usr/bin/env python3
"""Join trials tables of one deployment (e.g. a sweep of one more backend into a copy of the
shipped folder, committed as its new rows only) into one table an export can read: the union of
their columns, in the order of the table that has the most (a backend adds its parameter
columns), rows in the order given.

    python scripts/merge_trials.py results/kimi-k2-h200/trials.csv \
        results/serving/dispatch-chain/export/trials-wgmma_km.csv --out /tmp/res/kimi-k2-h200/trials.csv
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def merge(paths: list[Path], out: Path) -> int:
    tables = []
    for p in paths:
        with open(p, newline="") as f:
            rows = list(csv.reader(f))
        if not rows:
            sys.exit(f"{p}: empty (no header)")
        tables.append((p, rows[0], rows[1:]))
    header = max((h for _, h, _ in tables), key=len)
    for p, h, _ in tables:
        missing = [c for c in h if c not in header]
        if missing:
            sys.exit(f"{p}: columns {missing} are in no wider table's header; merge tables of one deployment")
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for p, h, rows in tables:
            for r in rows:
                if len(r) != len(h):
                    sys.exit(f"{p}: a row of {len(r)} fields under a header of {len(h)} (a torn table?)")
                d = dict(zip(h, r))
                w.writerow([d.get(c, "") for c in header])
                n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tables", nargs="+", type=Path, help="trials.csv files, in order")
    ap.add_argument("--out", type=Path, required=True, help="the joined table to write")
    a = ap.parse_args()
    print(f"wrote {a.out}: {merge(a.tables, a.out)} rows")


if __name__ == "__main__":
    main()
