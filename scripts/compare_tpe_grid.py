#!/usr/bin/env python
"""TPE against an exhaustive grid: best correct latency per (backend, tp, bs, ctx).

    S="--tp 8 --ctx 4096 65536 --space-dir results/tpe-vs-grid/spaces --trials 12 --rounds 0"
    kvtune sweep configs/deployments/kimi-k2-h200.yaml $S --out runs/tpe
    kvtune sweep configs/deployments/kimi-k2-h200.yaml $S --grid --out runs/grid
    python scripts/compare_tpe_grid.py runs/tpe/kimi-k2-h200/trials.csv runs/grid/kimi-k2-h200/trials.csv

(`bash scripts/gpu_evidence.sh tpe-vs-grid` runs all three on a GPU machine; results/tpe-vs-grid/
holds the committed comparisons; the reduced spaces keep the grid small: CUDA 24 configs plus the
default's values, Triton 48). Prints one row per study: the best search-phase median of each, the gap in percent (TPE
over grid; <= 3 is the goal) and how many configs each measured. One seed is one draw;
`scripts/replay_sampler.py` replays the search over many seeds against the grid's table.
"""
from __future__ import annotations

import argparse
import sys

from kvtune.tuner.table import read_trials

KEYS = ["backend", "tp", "bs", "ctx"]


def best(path: str):
    df = read_trials(path)
    s = df[(df["phase"] == "search") & (df["outcome"] == "ok")]
    g = s.groupby(KEYS)["median_us"]
    return g.min().rename("best_us"), g.size().rename("ok_configs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tpe_csv")
    ap.add_argument("grid_csv")
    ap.add_argument("--tolerance-pct", type=float, default=3.0)
    a = ap.parse_args(argv)
    import pandas as pd
    tb, tn = best(a.tpe_csv)
    gb, gn = best(a.grid_csv)
    df = pd.concat([tb.rename("tpe_us"), tn.rename("tpe_n"), gb.rename("grid_us"), gn.rename("grid_n")],
                   axis=1).dropna(subset=["tpe_us", "grid_us"]).reset_index()
    if df.empty:
        print("no (backend, tp, bs, ctx) measured correct in both tables", file=sys.stderr)
        return 1
    df["gap_pct"] = 100 * (df["tpe_us"] / df["grid_us"] - 1)
    df["within"] = df["gap_pct"] <= a.tolerance_pct
    print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(f"{int(df['within'].sum())}/{len(df)} studies within {a.tolerance_pct:g}% of the grid's best")
    return 0


if __name__ == "__main__":
    sys.exit(main())
