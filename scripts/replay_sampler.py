#!/usr/bin/env python
"""Replay the sweep's search against an exhaustive grid's measured latencies, over many seeds.

    python scripts/replay_sampler.py results/tpe-vs-grid/before/grid/kimi-k2-h200/trials.csv \\
        --space-dir results/tpe-vs-grid/spaces --tp 8 --ctx 4096 65536 --seeds 50 --trials 12 24 \\
        --out results/tpe-vs-grid/replay/after

Runs the real sweep (`tuner/replay.py`: sampler, baseline, warm starts, grid policy,
cross-bucket phase) with each measurement looked up in the grid's trials table, once per
seed and budget, and prints per study the gap of the best config found over the grid's
best: mean, median, p90, worst, and the fraction of seeds within --tolerance-pct.
`--strategy KEY=VALUE ...` overrides fields of `tuner.strategy.SearchStrategy` (to compare
candidates). This replays GPU-measured latencies; it measures nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields, replace
from pathlib import Path

from kvtune.tuner.replay import replay, summarize
from kvtune.tuner.strategy import DEFAULT, SearchStrategy
from kvtune.tuner.sweep import SweepOptions


def parse_strategy(items) -> SearchStrategy:
    types = {f.name: f.type for f in fields(SearchStrategy)}
    kw = {}
    for it in items or ():
        k, _, v = it.partition("=")
        if k not in types:
            raise SystemExit(f"--strategy: unknown field {k!r}; known: {sorted(types)}")
        kw[k] = json.loads(v) if v not in ("None", "none") else None
    return replace(DEFAULT, **kw)


def _run(job):
    dep, grid, space_dir, seeds, trials, opts = job
    with contextlib.redirect_stderr(io.StringIO()):
        return replay(dep, grid, space_dir, seeds, trials, opts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("grid_csv", help="trials.csv of an exhaustive grid sweep (kvtune sweep --grid)")
    ap.add_argument("--deployment", default="configs/deployments/kimi-k2-h200.yaml")
    ap.add_argument("--space-dir", required=True, help="the search spaces the grid swept")
    ap.add_argument("--tp", type=int, nargs="+")
    ap.add_argument("--ctx", type=int, nargs="+")
    ap.add_argument("--backend", nargs="+")
    ap.add_argument("--seeds", type=int, default=50, help="seeds 0 .. N-1")
    ap.add_argument("--trials", type=int, nargs="+", help="budgets per study (default: the deployment's)")
    ap.add_argument("--strategy", nargs="*", metavar="KEY=VALUE", help="SearchStrategy fields to override")
    ap.add_argument("--tolerance-pct", type=float, default=3.0)
    ap.add_argument("--jobs", type=int, default=2, help="processes")
    ap.add_argument("--out", help="folder for per_seed.csv and summary.csv")
    a = ap.parse_args(argv)
    import pandas as pd
    strategy = parse_strategy(a.strategy)
    opts = SweepOptions(tps=a.tp, ctxs=a.ctx, backends=a.backend, strategy=strategy)
    budgets = a.trials or [None]
    chunks = [list(range(a.seeds))[i::a.jobs] for i in range(a.jobs)]
    jobs = [(a.deployment, a.grid_csv, a.space_dir, c, t, opts) for t in budgets for c in chunks if c]
    with ProcessPoolExecutor(max_workers=a.jobs) as ex:
        df = pd.concat(list(ex.map(_run, jobs)), ignore_index=True)
    df = df.sort_values(["trials", "backend", "tp", "bs", "ctx", "seed"]).reset_index(drop=True)
    s = summarize(df, a.tolerance_pct)
    print(f"strategy: {strategy}")
    print(s.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        df.to_csv(out / "per_seed.csv", index=False, float_format="%.6g")
        s.to_csv(out / "summary.csv", index=False, float_format="%.4g")
        print(f"written: {out / 'per_seed.csv'}, {out / 'summary.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
