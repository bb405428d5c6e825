#!/usr/bin/env python3
"""What a per-context-bucket choice of compile-time config costs inside one CUDA graph (a
benchmark, not a test).

One graph serves every context of a (tp, batch bucket) because the context is only known on the
device. Serving a second compile-time config for some context buckets therefore means launching
both configs' kernels on every replay, each exiting at once unless the device-side context falls
in its buckets. This measures, per prefix (bs 1, T 9, H 8 unless told), CUDA-graph replay over
rotating inputs (cold L2, median of 15 replays of >= 40 calls):

  exported           the exported config (NSPLIT of the bucket) alone
  alt                the alternative config alone (the bucket's best in the trials table)
  exported+skip      the exported config after one early-exit launch with the alternative
                     config's split grid and one with its merge grid (what the dispatch adds
                     where the exported config serves)
  alt+skip           the alternative config after the same two early exits of the exported one

An early-exit launch reads a device int (the bucket) and returns: it is the cheapest thing a
dispatch can launch, so `(exported+skip) - exported` is the least a dispatch costs per call.
The runtime's dispatch (`kernels/plans.py`) launches the real kernels instead, whose idle launch
exits after reading the batch's key count and the split table: its cost at the shapes served is
measured by `scripts/bench_serving.py` (`results/serving/dispatch/tp4-batch64/`: about 9 us at
tp 4 batch 64, where the idle grids take more than one wave).

    python scripts/bench_dispatch.py --out $OUT \
        --exported NSPLIT=132,HEADS_PER_BLOCK=8,STAGES=2 --alt NSPLIT=33,HEADS_PER_BLOCK=2,STAGES=3
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sol_read  # noqa: E402
from sol_read import parse_kv, write_csv  # noqa: E402

from kvtune.kernels import get_backend, make_inputs, reference_attention, rel_error, verify_attention  # noqa: E402
from kvtune.kernels.cuda.backend import launch_shapes  # noqa: E402
from kvtune.kernels.api import describe_problem  # noqa: E402


@triton.jit
def _early_exit(sel, out, mine):
    s = tl.load(sel)
    if s == mine:  # never true here: every CTA exits after one load, as a dispatch's would
        tl.store(out + tl.program_id(0), s)


def skip_launches(p, T: int, H: int, B: int, sel, sink):
    """The two early-exit launches that stand in for config `p`'s split and merge kernels."""
    (split_grid, split_block), (merge_grid, merge_block) = launch_shapes(p, B, T, H)
    split_ctas, merge_ctas = math.prod(split_grid), math.prod(merge_grid)
    warps_split, warps_merge = max(1, split_block[0] // 32), max(1, merge_block[0] // 32)

    def run():
        _early_exit[(split_ctas,)](sel, sink, 1, num_warps=warps_split)
        _early_exit[(merge_ctas,)](sel, sink, 1, num_warps=warps_merge)
    return run


def graph_us(fns_per_call: list, reps: int = 15) -> float:
    """Median per-call time of one graph holding every call of `fns_per_call` (each a list of
    launches run in order), replayed `reps` times."""
    def in_order(fns):
        def call():
            for f in fns:
                f()
        return call
    return sol_read.graph_us([in_order(fns) for fns in fns_per_call], reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefixes", default="4096,16384,65536,131072")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--exported", default="", help="CUDA params overriding the default, K=V,...")
    ap.add_argument("--alt", required=True, help="the alternative CUDA params, K=V,...")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    be = get_backend("cuda")
    T, H, B = 9, args.heads, args.batch
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    sel = torch.zeros(1, dtype=torch.int32, device=dev)
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    rows = []
    for prefix in [int(x) for x in args.prefixes.split(",")]:
        probe = make_inputs(B, T, H, prefix, device=dev, seed=0)
        problem = describe_problem(*probe.args)
        base = be.default_params(problem)
        cfg = {}
        for name, spec in (("exported", args.exported), ("alt", args.alt)):
            cfg[name] = dataclasses.replace(base, **parse_kv(spec)) if spec else base
        n_pools = max(2, math.ceil(4 * l2 / (probe.kv_cache.numel() * 2)))
        pools = [make_inputs(B, T, H, prefix, device=dev, seed=1 + i) for i in range(n_pools)]
        out = torch.empty(B * T, H, 512, dtype=torch.bfloat16, device=dev)
        ws = torch.empty(max(be.workspace_bytes(problem, p) for p in cfg.values()), dtype=torch.uint8, device=dev)

        def call(p, inp):
            return lambda: verify_attention(*inp.args, backend=be, params=p, out=out, workspace=ws,
                                            check_values_=False)
        for name, p in cfg.items():  # correctness first
            call(p, probe)()
            err = rel_error(out, reference_attention(*probe.args)[0])
            assert err < 2e-2, f"{name} {p}: rel err {err}"
        n = max(len(pools), 40 // len(pools) * len(pools))
        row = {"prefix": prefix, "B": B, "H": H}
        for name, p in cfg.items():
            other = cfg["alt" if name == "exported" else "exported"]
            sk = skip_launches(other, T, H, B, sel, sink)
            row[f"{name}_us"] = round(graph_us([[call(p, pools[i % len(pools)])] for i in range(n)]), 2)
            row[f"{name}+skip_us"] = round(graph_us([[sk, call(p, pools[i % len(pools)])] for i in range(n)]), 2)
        row["skip_cost_us"] = round(((row["exported+skip_us"] - row["exported_us"])
                                     + (row["alt+skip_us"] - row["alt_us"])) / 2, 2)
        row["exported"], row["alt"] = str(cfg["exported"]), str(cfg["alt"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_csv(Path(args.out) / "dispatch.csv", rows)
    print(f"\n{'prefix':>7} {'exported':>9} {'alt':>8} {'exp+skip':>9} {'alt+skip':>9} {'skip cost':>9}")
    for r in rows:
        print(f"{r['prefix']:>7} {r['exported_us']:>9} {r['alt_us']:>8} {r['exported+skip_us']:>9} "
              f"{r['alt+skip_us']:>9} {r['skip_cost_us']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
