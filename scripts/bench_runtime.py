"""Tuned serving runtime vs SGLang-style fixed defaults, at the same shapes (GPU).

For each (batch, context) every variant is first checked against the fp32 oracle on fresh
inputs, then timed with the tuner's measurement method (`kvtune.tuner.measure`): launches
rotate over several KV pools whose total is several times the L2 (cold L2), many launches
are captured in one CUDA graph, and the median (p10, p90) over replays is reported in us
per launch. Variants:

  tuned           VerifyAttention.from_defaults(YAML): the exported config, NSPLIT chosen
                  per request on the device from the split table (what serving runs)
  tuned+adapter   the same behind the SGLang-layout adapter (mask packing + index merge)
  triton-nsplit8  the Triton kernel with its default tile and a fixed NSPLIT=8 (SGLang's
                  Triton backend default num_kv_splits)
  default-<be>    each available backend's untuned default parameters

Usage (the YAML from `kvtune export`, or found by deployment name via KVTUNE_CONFIG_DIR):
  python scripts/bench_runtime.py --defaults results/<dep>/<dep>.yaml --tp 8 \
      --batches 1,4,16 --contexts 1024,8192,32768,131072 --out results/runtime_bench
Prints a table last; writes results.csv and results.json under --out.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from kvtune.kernels import get_backend, reference_attention, rel_error, verify_attention
from kvtune.kernels.runtime import load_defaults
from kvtune.kernels.sglang import SGLangVerifyAdapter, sglang_verify_args
from kvtune.tuner.measure import MeasureOptions, Measurer, ProblemSpec

TOL = 2e-2


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def time_variant(m: Measurer, spec: ProblemSpec, opts: MeasureOptions, make_launch) -> dict:
    """Check one variant against the oracle, then time it (graph replay, cold L2).

    make_launch(inp) -> a zero-argument callable that runs the variant on those inputs and
    returns its output. The pools and the timing loop are the tuner's (`Measurer`)."""
    m._inputs_for(spec, opts)
    m._refresh_check()
    chk = m._check
    out = make_launch(chk)()
    err = rel_error(out, reference_attention(*chk.args, kv_lora_rank=spec.kv_lora_rank)[0])
    if not err < TOL:
        return {"outcome": "wrong", "rel_err": err}
    launches = [make_launch(p) for p in m._pools]      # one callable per KV pool, rotated
    times, n = m._time_cuda(lambda launch: launch(), launches, opts, "graph")
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * (len(times) - 1) + 0.5))]  # noqa: E731
    return {"outcome": "ok", "rel_err": err, "median_us": q(0.5), "p10_us": q(0.1), "p90_us": q(0.9),
            "launches": n, "pools": len(m._pools)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--defaults", help="exported YAML (file or folder); default: search by --deployment")
    ap.add_argument("--deployment", help="deployment name for the lookup (KVTUNE_CONFIG_DIR, packaged)")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--batches", type=_ints, default=[1, 4, 16])
    ap.add_argument("--contexts", type=_ints, default=[1024, 8192, 32768, 131072])
    ap.add_argument("--tree", default="random", choices=["chain", "random"])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--allow-mismatch", action="store_true", help="use a YAML tuned elsewhere (logged)")
    ap.add_argument("--no-adapter", action="store_true", help="skip the SGLang-adapter variant")
    ap.add_argument("--out", default="results/runtime_bench")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_runtime: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    tuned = load_defaults(args.defaults, deployment=args.deployment, device=dev, allow_mismatch=args.allow_mismatch)
    if tuned is None:
        print("bench_runtime: no tuned defaults found (pass --defaults)", file=sys.stderr)
        return 2
    max_b, max_c = max(args.batches), max(args.contexts)
    # check_values=False: as before plan/run, the per-call path reads no values (no host sync
    # in the eager passes that size the timed graphs)
    ad = SGLangVerifyAdapter.from_defaults(tuned, tp=args.tp, max_batch=max_b, max_context=max_c, device=dev,
                                           allow_mismatch=args.allow_mismatch, check_values=False)
    va = ad.verify
    print(f"tuned runtime: {va.describe()}  (adapter buffers {ad.allocated_bytes / 2**20:.1f} MiB in all)")
    m = Measurer(str(dev))
    opts = MeasureOptions(timing="graph", reps=args.reps, workspace_budget_bytes=1 << 62)
    rows = []
    for B in args.batches:
        for C in args.contexts:
            spec = ProblemSpec(heads=va.H, batch=B, context=C, draft_tokens=va.T, tree=args.tree,
                               kv_lora_rank=va.Dv, rope_dim=va.Dk - va.Dv, sm_scale=va.sm_scale)
            problem = spec.problem(dev)
            out = torch.empty(B * va.T, va.H, va.Dv, dtype=torch.bfloat16, device=dev)
            variants = {"tuned": lambda inp: (lambda: va(*inp.args[:5], out=out))}
            if not args.no_adapter:
                def adapter_launch(inp):
                    a = sglang_verify_args(inp)
                    return lambda: ad(**a)
                variants["tuned+adapter"] = adapter_launch
            fixed = {}
            tb = get_backend("triton")
            fixed["triton-nsplit8"] = (tb, dataclasses.replace(tb.default_params(problem), NSPLIT=8))
            for name in ("triton", "cuda"):
                try:
                    be = get_backend(name)
                except ImportError:
                    continue
                if be.supports(dev) is None:
                    fixed[f"default-{name}"] = (be, be.default_params(problem))
            for name, (be, params) in fixed.items():
                ws = torch.empty(max(1, be.workspace_bytes(problem, params)), dtype=torch.uint8, device=dev)

                def fixed_launch(inp, be=be, params=params, ws=ws):
                    return lambda: verify_attention(*inp.args, backend=be, params=params, out=out, workspace=ws,
                                                    kv_lora_rank=va.Dv, check_values_=False)
                variants[name] = fixed_launch
            plan = va.plan_for(B)
            for name, make in variants.items():
                t0 = time.perf_counter()
                try:
                    r = time_variant(m, spec, opts, make)
                except Exception as e:  # noqa: BLE001 - a failing variant is a row, not a crash
                    r = {"outcome": "failed", "reason": f"{type(e).__name__}: {e}"[:300]}
                row = {"batch": B, "context": C, "variant": name, **r, "wall_s": round(time.perf_counter() - t0, 1)}
                if name.startswith("tuned"):
                    row["config"] = f"{plan.backend.name} {va.params_for(B)} nsplit={va.nsplit_for(B, C)}"
                else:
                    row["config"] = f"{fixed[name][0].name} {fixed[name][1]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    # speed-up of the tuned runtime over the SGLang-style fixed NSPLIT=8
    base = {(r["batch"], r["context"]): r.get("median_us") for r in rows if r["variant"] == "triton-nsplit8"}
    for r in rows:
        b = base.get((r["batch"], r["context"]))
        r["speedup_vs_nsplit8"] = round(b / r["median_us"], 3) if b and r.get("median_us") else None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = ["batch", "context", "variant", "outcome", "median_us", "p10_us", "p90_us", "speedup_vs_nsplit8",
            "rel_err", "launches", "pools", "config", "reason", "wall_s"]
    with open(out_dir / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    meta = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(dev), "defaults": tuned.source,
            "runtime": {k: v for k, v in va.describe().items() if k != "plans"},
            "plans": [{**p, "params": str(p["params"])} for p in va.describe()["plans"]]}
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(f"\n{'B':>3} {'context':>8} {'variant':<16} {'median us':>10} {'p10':>8} {'p90':>8} {'x vs nsplit8':>12}")
    for r in rows:
        med = f"{r['median_us']:.2f}" if r.get("median_us") else r["outcome"]
        p10 = f"{r['p10_us']:.2f}" if r.get("p10_us") else ""
        p90 = f"{r['p90_us']:.2f}" if r.get("p90_us") else ""
        sp = f"{r['speedup_vs_nsplit8']:.2f}" if r.get("speedup_vs_nsplit8") else ""
        print(f"{r['batch']:>3} {r['context']:>8} {r['variant']:<16} {med:>10} {p10:>8} {p90:>8} {sp:>12}")
    print(f"wrote {out_dir / 'results.csv'} and {out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
