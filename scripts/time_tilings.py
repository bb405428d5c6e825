#!/usr/bin/env python3
"""Diagnosis (not a test): the CUDA kernel's QK^T warp tilings timed against each other.

The launcher picks the tiling of S^T = K Q^T (`backend.qk_tiling`: QMT key m16 tiles per warp,
QRG row groups, QKS slices of the 576-wide reduction) by least shared-memory traffic per key.
time_phases.py places most of the tile loop's time in QK^T (about 1.7 of 2.7 us per 32-key
tile at H 8, T 9), running at about a third of the MMA rate that PV reaches, so this times
every tiling the kernel accepts (`backend.qk_tilings`) that compiles without spills, each first checked
against the fp32 oracle (a ragged batch), then H=8, T=9, bs 1 through graph replay over
rotating inputs (cold L2), split + merge, median of 15 (`sol_read.graph_us`).

    python scripts/time_tilings.py --out $OUT --prefixes 16384,131072 --warps 8,16
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from sol_read import graph_us, rotating_calls, write_csv
from time_phases import cold_pools


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefixes", default="16384,131072")
    ap.add_argument("--warps", default="8,16")
    args = ap.parse_args(argv)
    from kvtune.kernels import get_backend, make_inputs, reference_attention, rel_error, verify_attention
    from kvtune.kernels.api import describe_problem
    from kvtune.kernels.cuda import backend as bk

    be = get_backend("cuda")
    heuristic = bk.qk_tiling
    rows = []
    chk = make_inputs(3, 9, 8, [700, 5, 2000], tree="random", device="cuda", seed=7)
    ref, _ = reference_attention(*chk.args)
    for prefix in [int(v) for v in args.prefixes.split(",")]:
        pools = cold_pools(8, prefix)
        base = be.default_params(describe_problem(*pools[0].args))
        for nw in [int(v) for v in args.warps.split(",")]:
            p = replace(base, NUM_WARPS=nw)
            chosen = heuristic(p, 9)
            for t in bk.qk_tilings(p, 9):
                bk.qk_tiling = lambda _p, _T, t=t: t
                be._kernels.clear()
                row = {"prefix": prefix, "NUM_WARPS": nw, "QMT": t[0], "QRG": t[1], "QKS": t[2],
                       "heuristic": t == chosen, "registers": None, "spills": None, "rel_err": None, "us": None}
                res = bk.compile_params(p, 9, "sm_90").resources[bk.split_expr(p, 9)]
                row.update(registers=res.registers, spills=res.spills)
                if res.spills:
                    rows.append(row)
                    continue
                err = rel_error(verify_attention(*chk.args, backend="cuda", params=p), ref)
                row["rel_err"] = round(err, 5)
                if not err < 1e-2:
                    rows.append(row)
                    continue
                row["us"] = round(graph_us(rotating_calls("cuda", p, pools)), 2)
                rows.append(row)
                print(row, flush=True)
            bk.qk_tiling = heuristic
        del pools
        torch.cuda.empty_cache()
    write_csv(Path(args.out) / "tilings.csv", rows)
    print(f"\n{'prefix':>7} {'warps':>5} {'QMT,QRG,QKS':>11} {'regs':>4} {'us':>8}")
    for r in rows:
        if r["us"] is not None:
            mark = "  <- the launcher's pick" if r["heuristic"] else ""
            print(f"{r['prefix']:>7} {r['NUM_WARPS']:>5} {r['QMT']:>3},{r['QRG']},{r['QKS']:<5} {r['registers']:>4} "
                  f"{r['us']:>8.2f}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
