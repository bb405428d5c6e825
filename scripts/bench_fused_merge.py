"""The wgmma kernel's two ways to merge, timed in one call (a benchmark, not a test): the split
kernel's merge tree (`fused`: no merge kernel) against a merge kernel after the split kernel
(`separate`: wgmma.uses_warp_merge's), per batch shape, interleaved (separate, fused, separate,
fused), each first checked against the fp32 oracle on fresh inputs.

    python3 scripts/bench_fused_merge.py --out DIR [--cases 1:4096,32:4096,...] [--ragged ragged64,ragged16]
        [--heads 8] [--params NSPLIT=132,ROWS=72,COPY_LANES=8]

Times: split + merge per call, CUDA-graph replay, cold L2 (time_phases.cold_pools: rotating input
sets, together about 3x the L2), median of 15, us. Floor: the kimi-k2-h200 device profile's
(bench_serving.floor_us). Writes DIR/fused-merge.csv and prints a table last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sol_read import graph_us, write_csv  # noqa: E402

CASES = "1:4096,1:16384,4:16384,8:4096,8:16384,16:4096,16:16384,32:4096,32:16384,64:4096,64:16384"
MODES = ("separate", "fused")
#: what the fused merge costs, taken apart (timing only: the outputs are wrong, no oracle check):
#: no_merge keeps every arrival and climb but merges nothing; no_climb writes the partials and stops
VARIANTS = {
    "full": [],
    "no_merge": [("      fuse_merge<T, RB, NTH, FT>(a, smem, b, mb * RB, slot0, stride, c, up == 1);\n", "")],
    "no_climb": [("if (a.fused && f_count > 1) fuse_climb<T, RB, 128, 256>", "if (false) fuse_climb<T, RB, 128, 256>")],
    # right outputs: the merge's accumulation one unit at a time (a third of its code)
    "one_unit": [("    constexpr int U = 3;\n", "    constexpr int U = 1;\n")],
}


def oracle_check(B: int, prefix, heads: int, p) -> dict:
    """Both modes against the fp32 oracle on fresh inputs of the case's shape (ragged: its lengths)."""
    from kvtune.kernels import make_inputs, reference_attention, rel_error, verify_attention
    x = make_inputs(B, 9, heads, prefix, tree="random", device="cuda", seed=B, device_values=True)
    ref, _ = reference_attention(*x.args)
    errs = {}
    for mode in MODES:
        os.environ["KVTUNE_WGMMA_MERGE"] = mode
        errs[mode] = rel_error(verify_attention(*x.args, backend="wgmma", params=p), ref)
        if not errs[mode] <= 1e-2:
            raise SystemExit(f"{mode}: B {B} {prefix}: rel err {errs[mode]:.2e} against the oracle")
    return errs


def time_case(pools, p, reps: int) -> dict[str, list[float]]:
    from kvtune.kernels import verify_attention
    from kvtune.kernels.api import describe_problem
    from kvtune.kernels.cuda.wgmma import WgmmaBackend
    problem = describe_problem(*pools[0].args)
    out = torch.empty(problem.B * 9, problem.H, 512, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(WgmmaBackend().workspace_bytes(problem, p), dtype=torch.uint8, device="cuda")
    n = max(len(pools), 96 // len(pools) * len(pools))
    fns = [lambda x=x: verify_attention(*x.args, backend="wgmma", params=p, out=out, workspace=ws,
                                        check_values_=False) for x in pools]
    got: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(reps):
        for mode in MODES:
            os.environ["KVTUNE_WGMMA_MERGE"] = mode
            got[mode].append(graph_us([fns[i % len(fns)] for i in range(n)]))
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=CASES, help="BATCH:PREFIX,... (every request of the batch holds PREFIX keys)")
    ap.add_argument("--ragged", default="ragged64,ragged16", help="bench_serving.py's ragged batches by name, or ''")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--params", default="NSPLIT=132,ROWS=72,COPY_LANES=8", help="WgmmaParams fields NAME=VALUE,...")
    ap.add_argument("--reps", type=int, default=2, help="interleaved rounds of both modes")
    ap.add_argument("--hot", action="store_true", help="one input set (hot L2, code in L2) instead of cold pools")
    ap.add_argument("--variant", default="full", choices=sorted(VARIANTS),
                    help="the fused merge taken apart (ROWS 72: the tail warpgroup climbs)")
    args = ap.parse_args(argv)
    from bench_serving import RAGGED, floor_us, log_uniform
    from time_phases import cold_pools

    from kvtune.kernels.cuda.params import WgmmaParams
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.measure import Ceilings, ProblemSpec
    over = {k: int(v) for k, v in (kv.split("=") for kv in args.params.split(",") if kv)}
    dep = load_deployment(Path(__file__).resolve().parent.parent / "configs/deployments/kimi-k2-h200.yaml")
    ceil = Ceilings(dep.device.read_gbps, dep.device.bf16_tflops)
    cases = [(int(b), int(n)) for b, n in (c.split(":") for c in args.cases.split(",") if c)]
    known = {name: (n, lo, hi) for name, n, lo, hi in RAGGED}
    named = [(name, log_uniform(*known[name], seed=known[name][0])) for name in args.ragged.split(",") if name]
    from kvtune.kernels.cuda import nvrtc
    src = nvrtc.SOURCE_PATH.with_name("verify_wgmma.cu").read_text()
    for anchor, repl in VARIANTS[args.variant]:
        if src.count(anchor) != 1:
            raise SystemExit(f"--variant {args.variant}: anchor {anchor!r} occurs {src.count(anchor)} times")
        src = src.replace(anchor, repl)
    with nvrtc.source_override(src, "verify_wgmma.cu"):
        rows = _run(args, cases, named, over, ceil, ProblemSpec, floor_us, cold_pools, WgmmaParams)
    name = "fused-merge.csv" if args.variant == "full" else f"fused-merge-{args.variant}.csv"
    name = name.replace(".csv", "-hot.csv") if args.hot else name
    write_csv(Path(args.out) / name, rows)
    print(f"\n{'case':>12} {'items/req':>9} {'floor':>7} {'separate':>9} {'fused':>9} {'f/s':>6} "
          f"{'% floor s':>9} {'% floor f':>9} auto")
    for r in rows:
        print(f"{r['case']:>12} {r['items_per_request']:>9} {r['floor_us']:>7.2f} {r['separate_us']:>9.2f} "
              f"{r['fused_us']:>9.2f} {r['fused_over_separate']:>6.3f} {100 * r['floor_us'] / r['separate_us']:>9.1f} "
              f"{100 * r['floor_us'] / r['fused_us']:>9.1f} {r['auto']}")
    return 0


def _run(args, cases, named, over, ceil, ProblemSpec, floor_us, cold_pools, WgmmaParams) -> list[dict]:
    rows = []
    for label, B, prefix in [(f"{b} x {n}", b, n) for b, n in cases] + [(nm, len(ks), ks) for nm, ks in named]:
        p = replace(WgmmaParams(NSPLIT=132, ROWS=72), **over)
        right = args.variant in ("full", "one_unit")
        errs = oracle_check(B, prefix, args.heads, p) if right else {m: float("nan") for m in MODES}
        pools = cold_pools(args.heads, prefix, B)[:1 if args.hot else None]
        got = time_case(pools, p, args.reps)
        prefixes = prefix if isinstance(prefix, list) else [prefix] * B
        floor = floor_us(ceil, ProblemSpec(heads=args.heads, batch=B, context=max(prefixes), draft_tokens=9), prefixes)
        row = {"case": label, "B": B, "variant": args.variant + (", hot L2" if args.hot else ""), "params": str(p),
               "floor_us": round(floor, 2),
               "items_per_request": -(-max(p.NSPLIT, B) // B), "auto": "fused" if _auto(p, B) else "separate"}
        for mode in MODES:
            row[f"{mode}_us"] = round(statistics.median(got[mode]), 2)
            row[f"{mode}_runs"] = " ".join(f"{t:.2f}" for t in got[mode])
            row[f"{mode}_err"] = f"{errs[mode]:.2e}"
        row["fused_over_separate"] = round(row["fused_us"] / row["separate_us"], 3)
        rows.append(row)
        print(row, flush=True)
        del pools
        torch.cuda.empty_cache()
    return rows


def _auto(p, B: int) -> bool:
    os.environ["KVTUNE_WGMMA_MERGE"] = "auto"
    from kvtune.kernels.cuda.wgmma import uses_fused_merge
    return uses_fused_merge(p.NSPLIT, B)


if __name__ == "__main__":
    sys.exit(main())
