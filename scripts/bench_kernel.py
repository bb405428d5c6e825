#!/usr/bin/env python3
"""Kernel benchmark (not a test): CUDA vs Triton vs the floor vs a gather-read speed of light.

Per shape (H heads, B requests of `prefix` keys + T=9 drafts each): the CUDA backend's default,
the Triton backend's default, the wgmma and wgmma_km backends' defaults where the GPU has wgmma
(and other NSPLIT values of wgmma: --wgmma-nsplit; other configs: --wgmma "ROWS=64", whose NSPLIT,
unless given, is one wave of its row blocks; --km "DV_SPLIT=128,NSPLIT=66"), optional other CUDA
configs (--extra), each through the tuner's
measurement helper (`kvtune.tuner.measure.Measurer`: static pruning, a correctness gate against
the fp32 oracle on fresh inputs with poisoned outputs, then cold-L2 CUDA-graph replays timed
with CUDA events, median of 15), and:

- floor = max(bytes / read_bw, flops / mma_rate), both ceilings measured here (a 4 GB
  torch.sum, an 8192^3 bf16 matmul);
- SOL = the best of a few launches of `_gather_read`, a Triton kernel that reads exactly the
  key rows of the shape through an index list (random slots of a pool, rotated so the L2 is
  cold, as the Measurer does) and reduces them to one number per program: what any verify
  kernel, which must read those bytes, could reach at that size.

`--tuned kimi-k2-h200` (a deployment name or a YAML path) also times, per shape, the config the
tuned defaults serve there (the batch bucket's entry at H heads per rank, the context bucket's
NSPLIT: what the sweep measured as `latency_us`).

Writes bench.csv / bench.json under --out and prints a short table last.

    python scripts/bench_kernel.py --out $OUT
    python scripts/bench_kernel.py --out $OUT --extra "HEADS_PER_BLOCK=4,BLOCK_N=16,CTAS_PER_SM=2"
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sol_read import graph_us, parse_kv, write_csv  # noqa: E402

# (H, batch, prefix): the kernel issue's shapes
SHAPES = [(8, 1, 256), (8, 1, 4096), (8, 1, 16384), (8, 1, 65536), (8, 1, 131072),
          (8, 8, 4096), (8, 8, 16384), (8, 8, 65536), (8, 32, 4096), (8, 32, 16384),
          (64, 1, 65536), (64, 1, 131072)]



def measure_ceilings(read_gb: float = 4.0, reps: int = 10) -> dict:
    """Read bandwidth (torch.sum over `read_gb` GB of bf16) and bf16 MMA rate (8192^3 matmul)."""
    n = int(read_gb * 1e9 / 2)
    x = torch.randn(n // 1024, 1024, device="cuda").to(torch.bfloat16)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 2):
        s.record()
        x.sum(dtype=torch.float32)
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e) * 1e-3)
    read_gbps = x.numel() * 2 / statistics.median(times) / 1e9
    del x
    a = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    times = []
    for i in range(reps + 3):
        s.record()
        a @ b
        e.record()
        e.synchronize()
        if i >= 3:
            times.append(s.elapsed_time(e) * 1e-3)
    tflops = 2 * 8192 ** 3 / statistics.median(times) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"read_gbps": read_gbps, "bf16_tflops": tflops}

@triton.jit
def _gather_read(kv, idx, out, n_keys, stride, ROWS: tl.constexpr):
    """Sum of the key rows idx[pid*ROWS ...] (grid-stride), 576 bf16 columns each."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([ROWS, 64], dtype=tl.float32)
    c = tl.arange(0, 64)
    for start in tl.range(pid * ROWS, n_keys, nprog * ROWS, num_stages=3):
        r = start + tl.arange(0, ROWS)
        m = r < n_keys
        s = tl.load(idx + r, mask=m, other=0).to(tl.int64)
        base = kv + s[:, None] * stride + c[None, :]
        for j in tl.static_range(9):  # 9 x 64 = 576 columns
            acc += tl.load(base + j * 64, mask=m[:, None], other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(acc))


def sol_us(n_keys: int, l2_bytes: int, sms: int) -> tuple[float, str]:
    """Best time of the gather read of `n_keys` random rows (cold L2), and its launch shape."""
    row_bytes = 576 * 2
    n_pools = max(2, math.ceil(4 * l2_bytes / (n_keys * row_bytes)))
    slots = n_pools * n_keys
    kv = torch.randn(slots, 576, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(slots, device="cuda", dtype=torch.int64).to(torch.int32)
    idx = [perm[i * n_keys:(i + 1) * n_keys].contiguous() for i in range(n_pools)]
    best = (float("inf"), "")
    for rows in (8, 16):
        for ctas_per_sm in (2, 4):
            grid = max(1, min(sms * ctas_per_sm, triton.cdiv(n_keys, rows)))
            out = torch.empty(grid, device="cuda", dtype=torch.float32)
            reps = max(n_pools, 32 // n_pools * n_pools)
            fns = [(lambda i=i, kv=kv, out=out, rows=rows, grid=grid:
                    _gather_read[(grid,)](kv, i, out, n_keys, kv.stride(0), ROWS=rows, num_warps=4))
                   for i in idx] * (reps // n_pools)
            us = graph_us(fns)
            if us < best[0]:
                best = (us, f"{grid} programs x {rows} rows")
    del kv, perm, idx
    torch.cuda.empty_cache()
    return best


def _print_table(rows: list, shapes) -> None:
    print(f"\n{'H':>3} {'B':>3} {'prefix':>7} {'floor':>7} {'SOL':>7} {'SOL%fl':>6} {'cuda':>8} {'%floor':>6} "
          f"{'%SOL':>5} {'triton':>8} {'cu/tr':>6} {'wgmma':>8} {'%floor':>6} {'%SOL':>5} {'km':>8} {'%floor':>6} "
          f"{'%SOL':>5} {'best':>9} {'%floor':>6} best config")
    for H, B, prefix in shapes:
        sel = [r for r in rows if (r["H"], r["batch"], r["prefix"]) == (H, B, prefix)]
        cu = next(r for r in sel if r["backend"] == "cuda" and r["config"] == "default")
        tr = next((r for r in sel if r["backend"] == "triton"), None)
        wg = next((r for r in sel if r["backend"] == "wgmma" and r["config"] == "default"), None)
        km = next((r for r in sel if r["backend"] == "wgmma_km" and r["config"] == "default"), None)
        ok = [r for r in sel if r["backend"] in ("cuda", "wgmma", "wgmma_km") and r["outcome"] == "ok"]
        best = min(ok, key=lambda r: r["median_us"]) if ok else None

        def us(r):
            return f"{r['median_us']:.2f}" if r and r["outcome"] == "ok" else (r["outcome"] if r else "-")
        fl = cu["floor_us"] or 0.0
        sp = (f"{tr['median_us'] / cu['median_us']:.2f}x" if tr and cu["outcome"] == tr["outcome"] == "ok" else "-")
        print(f"{H:>3} {B:>3} {prefix:>7} {fl:>7.2f} {cu['sol_us']:>7.2f} {cu['pct_floor_sol']:>6.1f} {us(cu):>8} "
              f"{cu['pct_floor'] or 0:>6.1f} {cu['pct_sol'] or 0:>5.1f} {us(tr):>8} {sp:>6} {us(wg):>8} "
              f"{(wg or {}).get('pct_floor') or 0:>6.1f} {(wg or {}).get('pct_sol') or 0:>5.1f} {us(km):>8} "
              f"{(km or {}).get('pct_floor') or 0:>6.1f} {(km or {}).get('pct_sol') or 0:>5.1f} {us(best):>9} "
              f"{(best or {}).get('pct_floor') or 0:>6.1f} {best['backend'] + ' ' + best['config'] if best else '-'}")


def tuned_run(tuned, H: int, batch: int, prefix: int) -> tuple[str, str, dict] | None:
    """(backend, label, params) of the config a tuned-defaults file serves at H heads per rank,
    `batch` requests of `prefix` keys: the entry of the first batch bucket >= batch (the runtime's
    policy, `TunedDefaults.lookup`) with the context bucket's NSPLIT (and, under a per-context
    dispatch, its own backend and compile-time params: `TunedEntry.served_by`), or None where no
    entry has H heads per rank."""
    tps = sorted({e.tp for e in tuned.entries if e.heads_per_rank == H})
    if not tps:
        return None
    e = tuned.lookup(tps[0], batch)
    b = e.bucket_for(prefix)
    backend, params = e.served_by(b)
    return backend, f"exported (tp {e.tp}, batch bucket {e.max_batch})", {**params, "NSPLIT": b.NSPLIT}


def _runs(args, spec, H: int, sms: int) -> list[tuple[str, str, dict | None]]:
    """(backend, label, params) to time at one shape: each backend's default and the asked-for others."""
    from kvtune.kernels import get_backend
    from kvtune.kernels.cuda.wgmma import one_wave
    base = get_backend("cuda").default_params(spec.problem("cuda")).__dict__
    runs = [("cuda", "default", base)]
    if not args.no_triton:
        runs.append(("triton", "default", None))
    if args.pdl_ab:
        runs.append(("cuda", "default, PDL on", base))
    wgmma = get_backend("wgmma")
    if wgmma.supports(torch.device("cuda")) is None:
        wdef = wgmma.default_params(spec.problem("cuda")).__dict__
        runs.append(("wgmma", "default", wdef))
        for n in (int(v) for v in args.wgmma_nsplit.split(",") if v):
            runs.append(("wgmma", f"NSPLIT={n}", {**wdef, "NSPLIT": n}))
        for ex in args.wgmma:
            over = parse_kv(ex)
            p = {**wdef, **over}
            if "NSPLIT" not in over:
                p["NSPLIT"] = one_wave(H, args.T, p["ROWS"], sms)
            runs.append(("wgmma", ex, p))
        km = get_backend("wgmma_km")
        kdef = km.default_params(spec.problem("cuda")).__dict__
        runs.append(("wgmma_km", "default", kdef))
        for ex in args.km:
            runs.append(("wgmma_km", ex, {**kdef, **parse_kv(ex)}))
    if args.tuned is not None:
        run = tuned_run(args.tuned, H, spec.batch, spec.context)
        if run is not None and (run[0] not in ("wgmma", "wgmma_km") or wgmma.supports(torch.device("cuda")) is None):
            runs.append(run)
    if H == 8:
        for ex in args.extra:
            runs.append(("cuda", ex, {**base, **parse_kv(ex)}))
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="", help="H:batch:prefix,... (default: the issue's shapes)")
    ap.add_argument("--T", type=int, default=9)
    ap.add_argument("--extra", action="append", default=[], help="other CUDA configs (k=v,k=v), at H=8")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--wgmma-nsplit", default="",
                    help="other NSPLIT values of the wgmma backend (comma-separated) beside its default, where it runs")
    ap.add_argument("--wgmma", action="append", default=[],
                    help="other wgmma configs (k=v,k=v); NSPLIT, unless given, is one wave of ROWS-row blocks")
    ap.add_argument("--km", action="append", default=[],
                    help="other wgmma_km configs (k=v,k=v) beside its default, where it runs")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="also time the CUDA default with KVTUNE_CUDA_PDL=1 (PDL launch of the merge)")
    ap.add_argument("--tuned", default=None, metavar="YAML_OR_DEPLOYMENT",
                    help="also time the config this tuned-defaults file (or packaged deployment name) serves at "
                         "each shape: its batch bucket's entry, the context bucket's NSPLIT")
    args = ap.parse_args(argv)
    if args.tuned is not None:
        from kvtune.kernels.lookup import load_defaults
        name = args.tuned
        args.tuned = load_defaults(name) if Path(name).is_file() else load_defaults(deployment=name)
        if args.tuned is None:
            ap.error(f"--tuned {name}: no tuned-defaults file of that name or path")

    from kvtune.kernels import get_backend
    from kvtune.tuner.measure import Ceilings, MeasureOptions, Measurer, ProblemSpec

    shapes = ([tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else SHAPES)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    ceil = measure_ceilings()
    print(f"device {props.name}, {props.multi_processor_count} SMs; read {ceil['read_gbps']:.0f} GB/s, "
          f"bf16 mma {ceil['bf16_tflops']:.0f} TFLOP/s", flush=True)
    ceilings = Ceilings(read_gbps=ceil["read_gbps"], bf16_tflops=ceil["bf16_tflops"])
    opts = MeasureOptions(timing="graph", reps=15)
    m = Measurer("cuda")
    cuda = get_backend("cuda")
    rows = []
    for H, B, prefix in shapes:
        spec = ProblemSpec(heads=H, batch=B, context=prefix, draft_tokens=args.T, tree="random")
        sol, sol_shape = sol_us(spec.keys, props.L2_cache_size, props.multi_processor_count)
        floor = ceilings.floor_us(spec)
        runs = _runs(args, spec, H, props.multi_processor_count)
        for backend, label, params in runs:
            t0 = time.perf_counter()
            if "PDL on" in label:
                os.environ["KVTUNE_CUDA_PDL"] = "1"
                cuda._kernels.clear()
            res = m.measure(backend, params, spec, opts, ceilings)
            if "PDL on" in label:
                os.environ.pop("KVTUNE_CUDA_PDL")
                cuda._kernels.clear()
            used = params if params is not None else get_backend(backend).default_params(spec.problem("cuda")).__dict__
            row = {"backend": backend, "config": label, "H": H, "T": args.T, "batch": B, "prefix": prefix,
                   "sol_us": round(sol, 2), "sol_launch": sol_shape, "pct_floor_sol": round(100 * floor / sol, 1),
                   **{k: v for k, v in res.to_dict().items() if k != "extra"},
                   "pct_sol": round(100 * sol / res.median_us, 1) if res.median_us else None,
                   "params": json.dumps(used)}
            rows.append(row)
            med = f"{res.median_us:.2f}" if res.median_us else "-"
            print(f"H={H:<3} B={B:<3} prefix={prefix:<7} {backend:<7} {label:<45} {res.outcome:<7} {med:>9} us "
                  f"floor {floor:.2f} sol {sol:.2f} err={res.rel_err} {res.reason[:120]} "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)

    meta = {"device": props.name, "sms": props.multi_processor_count, "ceilings": ceil, "torch": torch.__version__,
            "triton": triton.__version__, "timing": "graph, cold L2, median of 15", "argv": sys.argv}
    from kvtune.kernels.cuda.nvrtc import kernel_source_hash, nvrtc_version
    meta.update(nvrtc=nvrtc_version(), cuda_source_hash=kernel_source_hash(),
                wgmma_source_hash=get_backend("wgmma").kernel_hash(),
                wgmma_km_source_hash=get_backend("wgmma_km").kernel_hash())
    write_csv(out_dir / "bench.csv", rows)  # every row has the same keys
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    _print_table(rows, shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
