#!/usr/bin/env python3
"""Benchmark (not a test): CUDA vs Triton vs the floor for MLA verify attention.

Shapes: T=9, bs=1, H in {8, 16, 32, 64}, prefix in {4k, 16k, 64k, 128k} (override with
--heads / --prefixes). Every number goes through the tuner's measurement helper
(`kvtune.tuner.measure.Measurer`): static pruning, a correctness gate against the fp32 oracle
on fresh inputs with poisoned outputs, then cold-L2 timing (KV pools rotated, their total
several times the L2) of CUDA-graph replays with CUDA events; median and p10/p90 spread.

The floor is max(bytes / read_bw, flops / mma_rate), with both ceilings measured here: a
read-only torch.sum over a few GB of bf16, and an 8192^3 bf16 matmul.

Rows: each backend's default config; `--nsplits` adds the CUDA default with other NSPLIT
values; `--extra` adds other CUDA template configs ("VEC=8,BLOCK_N=64,HEADS_PER_BLOCK=4"; without
an explicit NSPLIT they get the default's rule, about one CTA per SM).
Writes bench.csv and bench.json under --out and prints a short table last.

    python scripts/bench_verify.py --out results/cuda/h200
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch


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


def parse_kv(text: str) -> dict:
    out = {}
    for part in text.split(","):
        k, v = part.split("=")
        out[k.strip()] = int(v)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for bench.csv / bench.json")
    ap.add_argument("--heads", default="8,16,32,64")
    ap.add_argument("--prefixes", default="4096,16384,65536,131072")
    ap.add_argument("--T", type=int, default=9)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--nsplits", default="", help="extra NSPLIT values for the CUDA default config, e.g. 16,32,64")
    ap.add_argument("--extra", action="append", default=[], help="extra CUDA config overrides (k=v,k=v)")
    ap.add_argument("--extra-heads", default="8", help="heads at which --extra configs run")
    ap.add_argument("--timing", default="graph", choices=["graph", "eager"])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)

    from kvtune.kernels import get_backend
    from kvtune.tuner.measure import Ceilings, MeasureOptions, Measurer, ProblemSpec

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    ceil = measure_ceilings()
    print(f"device {props.name}, {props.multi_processor_count} SMs; read {ceil['read_gbps']:.0f} GB/s, "
          f"bf16 mma {ceil['bf16_tflops']:.0f} TFLOP/s", flush=True)
    ceilings = Ceilings(read_gbps=ceil["read_gbps"], bf16_tflops=ceil["bf16_tflops"])
    opts = MeasureOptions(timing=args.timing, reps=args.reps)
    m = Measurer("cuda")
    heads = [int(h) for h in args.heads.split(",")]
    prefixes = [int(p) for p in args.prefixes.split(",")]
    nsplits = [int(n) for n in args.nsplits.split(",") if n]
    extra_heads = {int(h) for h in args.extra_heads.split(",") if h}
    rows = []
    for H in heads:
        for prefix in prefixes:
            spec = ProblemSpec(heads=H, batch=args.batch, context=prefix, draft_tokens=args.T)
            runs = [(b, "default", None) for b in args.backends.split(",")]
            if "cuda" in args.backends:
                base = get_backend("cuda").default_params(spec.problem("cuda")).__dict__
                for ns in nsplits:
                    if ns != base["NSPLIT"]:
                        runs.append(("cuda", f"NSPLIT={ns}", {**base, "NSPLIT": ns}))
                if H in extra_heads:
                    for ex in args.extra:
                        over = parse_kv(ex)
                        cfg = {**base, **over}
                        if "NSPLIT" not in over:  # the default's rule: about one CTA per SM
                            ctas = args.batch * -(-H // cfg["HEADS_PER_BLOCK"])
                            cfg["NSPLIT"] = max(1, min(256, round(props.multi_processor_count / ctas)))
                        runs.append(("cuda", ex, cfg))
            for backend, label, params in runs:
                t0 = time.perf_counter()
                res = m.measure(backend, params, spec, opts, ceilings)
                used = params if params is not None else get_backend(backend).default_params(
                    spec.problem("cuda")).__dict__
                row = {"backend": backend, "config": label, "H": H, "T": args.T, "batch": args.batch,
                       "prefix": prefix, **{k: v for k, v in res.to_dict().items() if k != "extra"},
                       "params": json.dumps(used)}
                rows.append(row)
                pct = f"{res.pct_floor:.1f}%" if res.pct_floor else "-"
                med = f"{res.median_us:.2f}" if res.median_us else "-"
                print(f"H={H:<3} prefix={prefix:<7} {backend:<7} {label:<40} {res.outcome:<7} {med:>9} us "
                      f"{pct:>7} err={res.rel_err if res.rel_err is None else f'{res.rel_err:.2e}'} "
                      f"{res.reason[:160]} ({time.perf_counter() - t0:.1f}s)", flush=True)

    meta = {"device": props.name, "sms": props.multi_processor_count, "ceilings": ceil, "torch": torch.__version__,
            "timing": args.timing, "argv": sys.argv}
    try:
        import triton
        meta["triton"] = triton.__version__
        from kvtune.kernels.cuda.nvrtc import kernel_source_hash, nvrtc_version
        meta["nvrtc"] = nvrtc_version()
        meta["cuda_source_hash"] = kernel_source_hash()
    except Exception as e:  # noqa: BLE001 - provenance is best effort
        meta["provenance_error"] = str(e)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(out_dir / "bench.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    # -- short table: default configs, CUDA vs Triton vs floor, and the best CUDA row seen
    print(f"\n{'H':>3} {'prefix':>7} {'floor us':>9} {'cuda us':>9} {'%floor':>7} {'triton us':>9} {'%floor':>7} "
          f"{'speedup':>7} {'best cuda us':>12} {'%floor':>7} best config")
    for H in heads:
        for prefix in prefixes:
            sel = [r for r in rows if r["H"] == H and r["prefix"] == prefix]
            cu = next((r for r in sel if r["backend"] == "cuda" and r["config"] == "default"), None)
            tr = next((r for r in sel if r["backend"] == "triton" and r["config"] == "default"), None)
            ok = [r for r in sel if r["backend"] == "cuda" and r["outcome"] == "ok"]
            best = min(ok, key=lambda r: r["median_us"]) if ok else None

            def f(r, k, fmt):
                return fmt.format(r[k]) if r and r.get(k) is not None and r["outcome"] == "ok" else \
                    (r["outcome"] if r else "-")
            fl = next((r["floor_us"] for r in sel if r.get("floor_us")), None)
            sp = (tr["median_us"] / cu["median_us"]) if cu and tr and cu["outcome"] == tr["outcome"] == "ok" else None
            print(f"{H:>3} {prefix:>7} {fl if fl is None else f'{fl:.2f}':>9} {f(cu, 'median_us', '{:.2f}'):>9} "
                  f"{f(cu, 'pct_floor', '{:.1f}'):>7} {f(tr, 'median_us', '{:.2f}'):>9} {f(tr, 'pct_floor', '{:.1f}'):>7} "
                  f"{'-' if sp is None else f'{sp:.2f}x':>7} {f(best, 'median_us', '{:.2f}'):>12} "
                  f"{f(best, 'pct_floor', '{:.1f}'):>7} {best['config'] if best else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
