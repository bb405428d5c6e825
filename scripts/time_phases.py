#!/usr/bin/env python3
"""Diagnosis (not a test): the CUDA backend's two launches timed apart, H=8, T=9, bs=1.

Graph replay over rotating inputs (cold L2, as the Measurer times; `sol_read.graph_us`), median
of 15, of: both kernels, the split kernel alone, the merge kernel alone (it then merges stale
partials: timing only). The launch of the other kernel is filtered out at `cuLaunchKernel`.

    python scripts/time_phases.py --out $OUT      # on a GPU; or: bash scripts/gpu_evidence.sh limits
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from cuda.bindings import driver as drv

# the same graph timing and CSV as the speed-of-light read (scripts/ is on the path as a script)
from sol_read import graph_us, write_csv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefixes", default="4096,16384,65536,131072")
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args(argv)
    from kvtune.kernels import make_inputs, verify_attention
    from kvtune.kernels.api import describe_problem
    from kvtune.kernels.cuda.backend import CudaBackend
    from kvtune.tuner.measure import ProblemSpec

    be = CudaBackend()
    orig = drv.cuLaunchKernel
    state = {"skip": None}

    def launch(f, *rest):
        if state["skip"] is not None and int(f) == state["skip"]:
            return (drv.CUresult.CUDA_SUCCESS,)
        return orig(f, *rest)

    drv.cuLaunchKernel = launch
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for prefix in [int(p) for p in args.prefixes.split(",")]:
        nbytes = ProblemSpec(heads=args.heads, batch=1, context=prefix, draft_tokens=9).bytes_moved()
        pools = [make_inputs(1, 9, args.heads, prefix, device="cuda", seed=i)
                 for i in range(max(2, min(48, math.ceil(3 * l2 / nbytes))))]
        problem = describe_problem(*pools[0].args)
        p = be.default_params(problem)
        split_k, merge_k = be._get(p, 9, torch.device("cuda"))[:2]
        out = torch.empty(9, args.heads, 512, dtype=torch.bfloat16, device="cuda")
        ws = torch.empty(be.workspace_bytes(problem, p), dtype=torch.uint8, device="cuda")
        reps = max(len(pools), 96 // len(pools) * len(pools))
        row = {"prefix": prefix, "H": args.heads, "params": str(p)}
        for what, skip in (("both", None), ("split", int(merge_k.function)), ("merge", int(split_k.function))):
            state["skip"] = skip
            fns = [lambda x=x, p=p, out=out, ws=ws: verify_attention(*x.args, backend="cuda", params=p, out=out,
                                                                    workspace=ws, check_values_=False)
                   for x in pools]
            row[f"{what}_us"] = round(graph_us([fns[i % len(fns)] for i in range(reps)]), 2)
        state["skip"] = None
        rows.append(row)
        print(row, flush=True)
        del pools
        torch.cuda.empty_cache()
    write_csv(Path(args.out) / "phases.csv", rows)
    print(f"\n{'prefix':>7} {'both us':>8} {'split us':>8} {'merge us':>8}")
    for r in rows:
        print(f"{r['prefix']:>7} {r['both_us']:>8.2f} {r['split_us']:>8.2f} {r['merge_us']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
