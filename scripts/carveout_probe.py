#!/usr/bin/env python3
"""Diagnosis (not a test): does the SM's shared-memory carve-out change between the split kernel
and its merge cost time, and does pinning every kernel of a call to one carve-out take it off?

The split kernel holds 226 KB of shared memory per SM, the block merge 45 KB, the warp merge
none, so with no preference the driver may configure an SM for more L1 when it runs a merge, and back for the
next split. A reconfiguration needs the SM drained. This times the wgmma backend's default
(split + merge, `verify_attention`, T 9, graph replay over rotating inputs: cold L2 as
`time_phases.py` times, median of 15) with CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
set per variant on the module's kernels, the variants interleaved over `--rounds` rounds:

  default       the driver's choice (-1: what kvtune ships)
  merge_shared  both merge kernels prefer the maximum shared memory (100), as the split needs
  all_shared    the split kernel too
  merge_l1      both merges prefer the maximum L1 (0): the other way, as a control

    python scripts/carveout_probe.py --out $OUT/carveout
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from cuda.bindings import driver as drv

from sol_read import graph_us, write_csv
from timeline_probe import probe_shapes, wgmma_calls

VARIANTS = {"default": (-1, -1), "merge_shared": (-1, 100), "all_shared": (100, 100), "merge_l1": (-1, 0)}


def set_carveout(loaded, split: int, merge: int) -> None:
    from kvtune.kernels.cuda.nvrtc import check_driver
    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    for k, v in ((loaded.split, split), (loaded.split_b1, split), (loaded.merge, merge), (loaded.merge_warp, merge)):
        check_driver(drv.cuFuncSetAttribute(k.function, attr, v), "cuFuncSetAttribute(carveout)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ragged", action="store_true", help="also bench_serving.py's ragged64 batch")
    args = ap.parse_args(argv)
    from kvtune.kernels import get_backend
    from kvtune.kernels.cuda.nvrtc import check_driver
    be = get_backend("wgmma")
    shapes = probe_shapes(args.ragged)
    rows = []
    for name, H, prefixes in shapes:
        problem, p, seq = wgmma_calls(H, prefixes)
        loaded = be._get(problem.T, p.ROWS, torch.device("cuda"), p.COPY_LANES)
        times = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v, (cs, cm) in VARIANTS.items():
                set_carveout(loaded, cs, cm)
                times[v].append(graph_us(seq))
        set_carveout(loaded, -1, -1)
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        static = {k: check_driver(drv.cuFuncGetAttribute(attr, getattr(loaded, k).function), "cuFuncGetAttribute")
                  for k in ("split", "split_b1", "merge", "merge_warp")}
        base = statistics.median(times["default"])
        for v, ts in times.items():
            med = statistics.median(ts)
            rows.append({"shape": name, "params": str(p), "variant": v, "us": round(med, 2),
                         "vs_default": round(med / base, 4), "runs_us": " ".join(f"{t:.2f}" for t in ts),
                         "static_smem": " ".join(f"{k}={s}" for k, s in static.items())})
            print(rows[-1], flush=True)
        del seq
        torch.cuda.empty_cache()
    write_csv(Path(args.out) / "carveout.csv", rows)
    print(f"\n{torch.cuda.get_device_name()}\n{'shape':<13} " + " ".join(f"{v:>13}" for v in VARIANTS))
    for name, *_ in shapes:
        r = {x["variant"]: x for x in rows if x["shape"] == name}
        print(f"{name:<13} " + " ".join(f"{r[v]['us']:>7.2f} {r[v]['vs_default']:>5.3f}" for v in VARIANTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
