#!/usr/bin/env python3
"""The sm_120 proxy benchmark (not a test): configs that fit another arch's limits, run here.

Until an sm_120 card (RTX PRO 6000 Blackwell, RTX 5090) is at hand, the configs that fit its
limits (99 KB of shared memory per block, 100 KB per SM, 1536 threads per SM: `ARCH_LIMITS`)
are timed on this GPU beside this GPU's own default. Every block shape of the arch's search
space (`search_spaces/<arch>/cuda.yaml`) that `reject_reason(..., arch)` passes (NVRTC compile
for that arch, no spills, smem and registers within its limits) is compiled for this GPU and
launched with the split kernel's shared-memory carve-out capped at the arch's per-SM size, so
that no more CTAs share an SM than would fit there. NSPLIT: one wave of this GPU's SMs, and
twice that.

What the proxy keeps: the shared memory per block and per SM, so the block shapes trade the
same things (16-key tiles, heads per CTA against key re-reads). What it cannot keep: the SM
count (132 here, 188 on the PRO 6000), the memory bandwidth (4.8 vs 1.8 TB/s) and sm_120's
own scheduling, so its ranking is a lead for that card and its times are not that card's.

Each config goes through the tuner's Measurer (fp32-oracle gate, then cold-L2 CUDA-graph
replays, median of 15). Writes proxy.csv / proxy.json under --out; prints a table last.

    python scripts/bench_proxy.py --out $OUT                # on a GPU (sm_80 or newer)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sol_read import write_csv  # noqa: E402

SHAPES = [(8, 1, 4096), (8, 1, 16384), (8, 1, 65536), (8, 1, 131072), (8, 8, 65536)]
from kvtune.kernels.cuda.params import CUDA_PARAMS  # noqa: E402

SHAPE_FIELDS = tuple(CUDA_PARAMS.template_names)  # a block shape: every parameter but the launch-time NSPLIT


def fitting_shapes(arch: str, T: int, H: int) -> list[dict]:
    """The block shapes (all params but NSPLIT) of `arch`'s search space that fit `arch`."""
    from kvtune.kernels.cuda.backend import reject_reason
    from kvtune.kernels.cuda.params import CudaParams
    from kvtune.tuner.compile_check import template_configs
    from kvtune.tuner.config import REPO_ROOT
    from kvtune.tuner.space import load_space
    shapes = template_configs(load_space("cuda", space_dir=REPO_ROOT / "search_spaces" / arch))
    return [s for s in shapes if s["HEADS_PER_BLOCK"] <= H and reject_reason(CudaParams(**s), T, arch) is None]


def cap_carveout(backend, keys: set, percent: int) -> None:
    """Wrap `backend._get` so that the split kernels of `keys` (their template values) load
    with the preferred shared-memory carve-out `percent` of this GPU's maximum."""
    from cuda.bindings import driver as drv
    from kvtune.kernels.cuda.nvrtc import check_driver
    orig = backend._get
    done = set()

    def get(params, T, device):
        got = orig(params, T, device)
        key = tuple(getattr(params, f) for f in SHAPE_FIELDS)
        if key in keys and key not in done:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            check_driver(drv.cuFuncSetAttribute(got[0].function, attr, percent), "cuFuncSetAttribute(carveout)")
            done.add(key)
        return got

    backend._get = get


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="sm_120")
    ap.add_argument("--shapes", default="", help="H:batch:prefix,... (default: tp 8 bs 1 at 4k-128k, bs 8 at 64k)")
    ap.add_argument("--T", type=int, default=9)
    args = ap.parse_args(argv)

    from bench_kernel import measure_ceilings
    from kvtune.kernels import get_backend
    from kvtune.kernels.cuda.backend import default_for_arch
    from kvtune.kernels.cuda.params import CudaParams, arch_limits
    from kvtune.tuner.measure import Ceilings, MeasureOptions, Measurer, ProblemSpec

    shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else SHAPES)
    heads = {h for h, _, _ in shapes}
    if len(heads) != 1:
        raise SystemExit("--shapes: one H at a time (the candidates are the block shapes that fit at that H)")
    H = heads.pop()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    lim = arch_limits(args.arch)
    percent = math.ceil(100 * lim.smem_per_sm / props.shared_memory_per_multiprocessor)
    t0 = time.perf_counter()
    cands = fitting_shapes(args.arch, args.T, H)
    arch_default = default_for_arch(args.T, max(1, min(H, 72 // args.T)), args.arch)
    default_shape = {f: getattr(arch_default, f) for f in SHAPE_FIELDS}
    print(f"{len(cands)} block shapes fit {args.arch} at T={args.T}, H={H} ({time.perf_counter() - t0:.0f} s); "
          f"{args.arch} default {arch_default}; carve-out {percent}% of {props.shared_memory_per_multiprocessor} B",
          flush=True)
    cuda = get_backend("cuda")
    cap_carveout(cuda, {tuple(s[f] for f in SHAPE_FIELDS) for s in cands}, percent)
    ceil = measure_ceilings()
    ceilings = Ceilings(read_gbps=ceil["read_gbps"], bf16_tflops=ceil["bf16_tflops"])
    opts = MeasureOptions(timing="graph", reps=15)
    m = Measurer("cuda")
    sms = props.multi_processor_count
    rows = []
    for H, B, prefix in shapes:
        spec = ProblemSpec(heads=H, batch=B, context=prefix, draft_tokens=args.T, tree="random")
        floor = ceilings.floor_us(spec)
        here = cuda.default_params(spec.problem("cuda"))
        runs = [("this GPU's default", here)]
        for s in cands:
            wave = max(1, round(sms / math.ceil(H / s["HEADS_PER_BLOCK"])))
            tag = "default" if s == default_shape else "fits"
            for ns in (wave, 2 * wave):
                runs.append((f"{args.arch} {tag}", CudaParams(**s, NSPLIT=ns)))
        for label, p in runs:
            res = m.measure("cuda", p.__dict__, spec, opts, ceilings)
            rows.append({"label": label, "H": H, "batch": B, "prefix": prefix, "floor_us": round(floor, 2),
                         "median_us": res.median_us, "outcome": res.outcome, "rel_err": res.rel_err,
                         "pct_floor": round(100 * floor / res.median_us, 1) if res.median_us else None,
                         "params": json.dumps(p.__dict__), "reason": res.reason[:200]})
            print(f"H={H} B={B} prefix={prefix} {label:<22} {res.outcome:<7} {res.median_us} us  {p}", flush=True)

    meta = {"device": props.name, "sms": sms, "arch_proxied": args.arch, "carveout_percent": percent,
            "ceilings": ceil, "timing": "graph, cold L2, median of 15", "argv": sys.argv,
            "candidates": cands, "arch_default": arch_default.__dict__}
    from kvtune.kernels.cuda.nvrtc import kernel_source_hash, nvrtc_version
    meta.update(nvrtc=nvrtc_version(), cuda_source_hash=kernel_source_hash())
    write_csv(out_dir / "proxy.csv", rows)
    (out_dir / "proxy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    _print_table(rows, shapes, args.arch)
    return 0


def _print_table(rows: list, shapes, arch: str) -> None:
    def best(of):
        timed = [r for r in of if r["median_us"]]
        return min(timed, key=lambda r: r["median_us"]) if timed else None

    def cell(r):
        return f"{r['median_us']:>9.2f} {r['pct_floor']:>5}" if r else f"{'-':>9} {'-':>5}"

    print(f"\n{'H':>3} {'B':>3} {'prefix':>7} {'floor us':>8} | {'own dflt':>9} {'%fl':>5} | "
          f"{arch + ' dflt':>9} {'%fl':>5} | {'best fit':>9} {'%fl':>5} | best fitting config")
    for H, B, prefix in shapes:
        here = [r for r in rows if (r["H"], r["batch"], r["prefix"]) == (H, B, prefix)]
        own = best([r for r in here if r["label"] == "this GPU's default"])
        dflt = best([r for r in here if r["label"] == f"{arch} default"])
        fit = best([r for r in here if r["label"].startswith(arch)])
        print(f"{H:>3} {B:>3} {prefix:>7} {here[0]['floor_us']:>8.2f} | {cell(own)} | {cell(dflt)} | {cell(fit)} | "
              f"{fit['params'] if fit else '-'}")


if __name__ == "__main__":
    sys.exit(main())
