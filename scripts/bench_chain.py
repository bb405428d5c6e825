#!/usr/bin/env python3
"""What the idle launch of a per-context dispatch across wgmma and wgmma_km costs, chained and
not (a benchmark, not a test).

A dispatch launches every config of an entry on every call; the one whose split table holds
the batch's bucket computes, the others exit at once. Not chained (KVTUNE_DISPATCH_CHAIN=0),
each launch is a split kernel and its merge, so an idle config adds two kernels to the call.
Chained (`kernels.cuda.backend.launch_dispatch`), wgmma_km's split kernel follows the other one
with programmatic serialization and one merge runs after both. Per shape (H 8 unless told, T 9,
CUDA-graph replay, cold L2, median of 15, `tuner.measure.Measurer` as the export's checks time
them, every call gated against the fp32 oracle):

  wgmma / wgmma_km          the config alone
  wgmma+idle km             wgmma serves, wgmma_km idle beside it ({chain, nochain})
  km+idle wgmma             wgmma_km serves, wgmma idle beside it ({chain, nochain})

    python scripts/bench_chain.py --out $OUT/chain --shapes 1:4096,16:4096,16:65536
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sol_read import parse_kv, write_csv  # noqa: E402

from kvtune.kernels import get_backend  # noqa: E402
from kvtune.tuner.config import load_deployment  # noqa: E402
from kvtune.tuner.measure import Ceilings, MeasureOptions, Measurer, ProblemSpec  # noqa: E402

BIG = 10**9   # bucket bounds far above every request


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--shapes", default="1:4096,1:65536,16:4096,16:65536,64:4096",
                    help="batch:prefix,... (equal requests)")
    ap.add_argument("--wgmma", default="", help="wgmma overrides NAME=V,... (default: its default)")
    ap.add_argument("--km", default="", help="wgmma_km overrides NAME=V,... (default: its default)")
    ap.add_argument("--deployment", default="configs/deployments/kimi-k2-h200.yaml", help="for the floor")
    args = ap.parse_args()
    dev = load_deployment(args.deployment).device
    ceil = Ceilings(dev.read_gbps, dev.bf16_tflops)
    m = Measurer("cuda")
    rows = []
    for shape in args.shapes.split(","):
        B, prefix = (int(v) for v in shape.split(":"))
        spec = ProblemSpec(heads=args.heads, batch=B, context=prefix, draft_tokens=9)
        pb = spec.problem("cuda")
        w = {**vars(get_backend("wgmma").default_params(pb)), **parse_kv(args.wgmma)}
        k = {**vars(get_backend("wgmma_km").default_params(pb)), **parse_kv(args.km)}
        cases = [("wgmma", "-", "wgmma", w, None, None),
                 ("wgmma_km", "-", "wgmma_km", k, None, None)]
        for chain in ("1", "0"):
            # two buckets: every request falls in the first; a table needs one bucket it serves
            serve = lambda n: [[BIG // 2, BIG], [n, 1]]  # noqa: E731
            idle = lambda n: [[BIG // 2, BIG], [0, n]]  # noqa: E731
            cases += [("wgmma+idle km", chain, "wgmma", w, serve(w["NSPLIT"]),
                       [[k, idle(k["NSPLIT"]), "wgmma_km"]]),
                      ("km+idle wgmma", chain, "wgmma", w, idle(w["NSPLIT"]),
                       [[k, serve(k["NSPLIT"]), "wgmma_km"]])]
        for label, chain, be, params, table, dispatch in cases:
            os.environ["KVTUNE_DISPATCH_CHAIN"] = chain if chain != "-" else "1"
            opts = MeasureOptions(timing="graph", split_table=table, dispatch=dispatch)
            r = m.measure(be, params, spec, opts, ceil)
            row = {"B": B, "prefix": prefix, "H": args.heads, "case": label, "chain": chain,
                   "outcome": r.outcome, "median_us": r.median_us, "p10_us": r.p10_us, "p90_us": r.p90_us,
                   "floor_us": round(r.floor_us, 3) if r.floor_us else None,
                   "pct_floor": round(r.pct_floor, 1) if r.pct_floor else None, "reason": r.reason,
                   "wgmma": json.dumps(w), "wgmma_km": json.dumps(k)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_csv(Path(args.out) / "chain.csv", rows)
    # the idle launch's cost: dispatch minus the serving config alone
    alone = {(r["B"], r["prefix"], r["case"]): r["median_us"] for r in rows if r["chain"] == "-"}
    print(f"\n{'B':>3} {'prefix':>7} {'serves':>8} {'alone':>8} {'+idle chained':>14} {'+idle 2 kernels':>16}")
    for (B, prefix, case), us in alone.items():
        name = "wgmma+idle km" if case == "wgmma" else "km+idle wgmma"
        got = {r["chain"]: r["median_us"] for r in rows if (r["B"], r["prefix"], r["case"]) == (B, prefix, name)}
        if us and got.get("1") and got.get("0"):
            print(f"{B:>3} {prefix:>7} {case:>8} {us:>8.2f} {got['1']:>8.2f} ({got['1'] - us:+.2f}) "
                  f"{got['0']:>8.2f} ({got['0'] - us:+.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
