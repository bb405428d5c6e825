#!/usr/bin/env python3
"""Serving as engines run it (a benchmark, not a test): batches, ragged batches, 61-layer steps.

With the shipped defaults (or --defaults), at tp 8 by default:
  * per batch B in {1, 2, 4, 8, 16, 32, 64} x prefix {4k, 16k, 64k} (a B whose launch needs
    more workspace than the deployment's budget is skipped, with a row saying so), and two
    ragged batches (16 requests, prefixes log-uniform 1k..128k; 64 requests, 1k..8k), one
    layer's kernel time of:
      tuned          VerifyAttention.plan + run: the entry of B's batch bucket (or the
                     largest), NSPLIT per request on the device
      tuned-direct   the launch `tuned` runs, as one verify_attention call with the NSPLIT its
                     split table gives the batch (`VerifyAttention.direct_config`; cuda, wgmma,
                     wgmma_km):
                     tuned - tuned-direct is what the runtime path adds, measured on the same pools
      tuned-b1       the same runtime with the file's batch-1 entries only: batch > 1 runs
                     the batch-1 config with NSPLIT rescaled (what kvtune shipped before buckets)
      default-<be>   each available backend's untuned default parameters
    against the floor max(bytes / read_bw, flops / mma_rate) of the deployment's device
    profile (`Ceilings.floor_us`; a ragged batch sums its requests' bytes and flops);
  * per shape, one decode step of --layers (61) layers, each layer its own KV pool:
      step:runtime   VerifyAttention.plan once + a run per layer
      step:adapter   SGLangVerifyAdapter.plan once (one pack launch) + a run per layer
      step:per-call  the adapter's extend_attention_fwd per layer (packs every layer: today)
    and the cost per layer above the kernel itself ((step - layers x tuned) / layers).
Every variant is checked against the fp32 oracle first. Timing is the tuner's (graph replay,
cold L2): `Measurer._timing_pools` (KV pools together >= 4x L2, rotated) and
`Measurer._time_cuda` per layer; `sol_read.graph_us` (one step captured, replayed) per step.

    python scripts/bench_serving.py --out runs/serving      # the H200, < 3 min (committed: results/serving/)
    python scripts/bench_serving.py --smoke --out /tmp/smoke               # CPU, Triton interpreter

Writes serving.csv (and serving.json with the command and the runtime) under --out; prints a
table last. --smoke: tiny shapes, 2 layers, allow_mismatch, and without a GPU the runtime on the
fp32 oracle (KVTUNE_VERIFY=reference, unless set) and no timing: it proves the script runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")       # before triton is first imported
    # the runtime on the fp32 oracle keeps the smoke run short on a CPU (the interpreter takes
    # seconds per launch at 8 heads); Triton still runs the adapter's packing and its default
    os.environ.setdefault("KVTUNE_VERIFY", "reference")

from kvtune.kernels import (
    VerifyInputs,
    get_backend,
    make_inputs,
    reference_attention,
    rel_error,
    verify_attention,
)
from kvtune.kernels.backends import call_workspace_bytes
from kvtune.kernels.runtime import VerifyAttention, load_defaults
from kvtune.kernels.sglang import SGLangVerifyAdapter, sglang_verify_args
from kvtune.tuner.config import load_deployment
from kvtune.tuner.measure import Ceilings, MeasureOptions, Measurer, ProblemSpec
from sol_read import graph_us, write_csv

TOL = 2e-2
BATCHES = [1, 2, 4, 8, 16, 32, 64]
PREFIXES = [4096, 16384, 65536]
RAGGED = [("ragged16", 16, 1024, 131072), ("ragged64", 64, 1024, 8192)]
SMOKE = dict(batches=[2], prefixes=[40], ragged=[("ragged2", 2, 8, 100)], layers=2)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def log_uniform(n: int, lo: int, hi: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [int(math.exp(r.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]


def floor_us(ceil: Ceilings, base: ProblemSpec, prefixes: list[int]) -> float:
    """The floor of a batch (`Ceilings.floor_us`; a ragged one sums its requests' bytes and flops)."""
    return ceil.floor_us(dataclasses.replace(base, batch=len(prefixes), context=max(prefixes),
                                             prefixes=tuple(prefixes)))


class Case:
    """One batch: fresh inputs for the oracle check, and cold-L2 timing pools built by the
    tuner's Measurer (regions of one KV tensor, each request's slots a permutation in it)."""

    def __init__(self, m: Measurer, spec: ProblemSpec, prefixes: list[int], opts: MeasureOptions, seed: int):
        self.spec, self.prefixes = spec, prefixes
        dev = m.device
        self.check = make_inputs(len(prefixes), spec.draft_tokens, spec.heads, prefixes, tree=spec.tree,
                                 kv_lora_rank=spec.kv_lora_rank, rope_dim=spec.rope_dim, device=dev,
                                 sm_scale=spec.sm_scale, seed=seed)
        m._key = None                                  # the Measurer's own inputs are not ours
        m._check, m._gen = self.check, torch.Generator(device=dev).manual_seed(seed + 7919)
        self.pools = m._timing_pools(spec, opts)
        # layers of a step share the metadata and read their own KV: views of the pools' regions
        # with pool 0's (region-local) indices
        p0 = self.pools[0]
        n = len(self.pools)
        if n > 1:
            region = p0.kv_cache.shape[0] // n
            self.layer_kv = [p0.kv_cache[i * region:(i + 1) * region] for i in range(n)]
        else:
            self.layer_kv = [p0.kv_cache]
        self.step_inp = p0


def check_and_time(m: Measurer, case: Case, opts: MeasureOptions, make_launch, timed: bool) -> dict:
    """make_launch(inp) -> a zero-argument callable running one layer on `inp`, returning o."""
    out = make_launch(case.check)()
    err = rel_error(out, reference_attention(*case.check.args, kv_lora_rank=case.spec.kv_lora_rank)[0])
    if not err < TOL:
        return {"outcome": "wrong", "rel_err": err}
    if not timed:
        return {"outcome": "ok", "rel_err": err}
    launches = [make_launch(p) for p in case.pools]
    times, n = m._time_cuda(lambda launch: launch(), launches, opts, "graph")
    times.sort()
    return {"outcome": "ok", "rel_err": err, "median_us": statistics.median(times), "p10_us": times[len(times) // 10],
            "p90_us": times[(9 * len(times)) // 10], "launches": n, "pools": len(case.pools)}


def step_variants(va: VerifyAttention, ad: SGLangVerifyAdapter, case: Case, layers: int) -> dict:
    """name -> (step callable, [per-layer outputs]) for one decode step of `layers` layers."""
    inp, kvs, T, Dv = case.step_inp, case.layer_kv, va.T, va.Dv
    rows = inp.q.shape[0]
    outs = [torch.empty(rows, va.H, Dv, dtype=torch.bfloat16, device=va.device) for _ in range(layers)]
    a = sglang_verify_args(VerifyInputs(q=inp.q, kv_cache=kvs[0], kv_indptr=inp.kv_indptr, kv_indices=inp.kv_indices,
                                        tree_mask=inp.tree_mask, sm_scale=inp.sm_scale, prefix_lens=inp.prefix_lens,
                                        parents=inp.parents, kv_lora_rank=inp.kv_lora_rank))
    loc = a.pop("out_cache_loc")
    meta = (a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"])

    def runtime_step():
        va.plan(inp.kv_indptr, inp.kv_indices, inp.tree_mask)
        for i in range(layers):
            va.run(inp.q, kvs[i % len(kvs)], outs[i])

    def adapter_step():
        ad.plan(*meta, out_cache_loc=loc, max_len_extend=T)
        for i in range(layers):
            kb = kvs[i % len(kvs)].unsqueeze(1)
            ad.run(inp.q, kb, outs[i], v_buffer=kb[..., :Dv], sm_scale=inp.sm_scale)

    def per_call_step():
        for i in range(layers):
            kb = kvs[i % len(kvs)].unsqueeze(1)
            ad.extend_attention_fwd(**dict(a, k_buffer=kb, v_buffer=kb[..., :Dv], o_extend=outs[i]),
                                    out_cache_loc=loc)

    return {"step:runtime": runtime_step, "step:adapter": adapter_step, "step:per-call": per_call_step}, outs


def check_step(case: Case, outs, sm_scale: float, Dv: int) -> float:
    """Worst relative error over the step's layers against the oracle (each its own pool)."""
    inp = case.step_inp
    worst = 0.0
    for i, o in enumerate(outs[:len(case.layer_kv)]):
        ref = reference_attention(inp.q, case.layer_kv[i], inp.kv_indptr, inp.kv_indices, inp.tree_mask, sm_scale,
                                  kv_lora_rank=Dv)[0]
        worst = max(worst, rel_error(o, ref))
    return worst


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--defaults", help="exported YAML (file or folder); default: the packaged one of --deployment")
    ap.add_argument("--deployment", default="kimi-k2-h200", help="deployment (budget, device ceilings, lookup)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--batches", type=_ints, default=BATCHES)
    ap.add_argument("--prefixes", type=_ints, default=PREFIXES)
    ap.add_argument("--no-ragged", action="store_true", help="skip the two ragged batches")
    ap.add_argument("--layers", type=int, default=61, help="layers per decode step (DeepSeek-V3 / Kimi-K2: 61)")
    ap.add_argument("--budget-mb", type=float, help="workspace budget (default: the deployment's)")
    ap.add_argument("--defaults-of", default="cuda,triton",
                    help="backends whose untuned default is a variant (comma-separated; '' for none)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--nsplit", type=_ints, default=[],
                    help="also time the CUDA default at these NSPLIT values (e.g. 132,264: ragged batches)")
    ap.add_argument("--allow-mismatch", action="store_true", help="use a YAML tuned elsewhere (logged)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any machine (CPU: Triton interpreter)")
    ap.add_argument("--out", required=True)
    return ap


def _default_backends(names: str, dev) -> dict:
    """`default-<name>` -> backend, for each named backend that can run on `dev`."""
    out = {}
    for name in [b for b in names.split(",") if b.strip()]:
        try:
            be = get_backend(name)
        except ImportError:
            continue
        if be.supports(dev) is None:
            out[f"default-{name}"] = be
    return out


def _kernel_variants(va, va_b1, defaults: dict, B: int, out, nsplits: list[int] = (), keys: int | None = None) -> dict:
    """variant name -> (make(inputs) -> launch, config text) for one layer's kernel; `nsplits`:
    the CUDA default again at each of these NSPLIT (`default-cuda-nsplitN`); `keys`: the batch's
    keys in all (the config text is then what runs for them, NSPLIT included)."""
    def runtime_launch(rt):
        def launch_on(inp):
            step = rt.plan(inp.kv_indptr, inp.kv_indices, inp.tree_mask, check_values=False)
            return lambda: rt.run(inp.q, inp.kv_cache, out, plan=step)
        return launch_on
    def config_text(rt):
        # what runs for `keys`: the config serving them, NSPLIT its split table's value (the
        # grid's NSPLIT, the plan's largest, is not what a 4k batch launches)
        if keys is not None:
            try:
                be, params = rt.direct_config(B, keys)
                return f"{be.name} {params}"
            except ValueError:
                pass   # NSPLIT per request (Triton): the grid's parameters
        return f"{rt.plan_for(B).backend.name} {rt.params_for(B)}"
    variants = {"tuned": (runtime_launch(va), config_text(va))}
    if va_b1 is not None:
        variants["tuned-b1"] = (runtime_launch(va_b1), config_text(va_b1))
    problem = va.problem(B)
    runs = [(vname, be, be.default_params(problem)) for vname, be in defaults.items()]
    if keys is not None and va.device.type == "cuda":
        try:   # what `tuned` launches, as one verify_attention call: the runtime's own cost, same pools
            runs.insert(0, ("tuned-direct", *va.direct_config(B, keys)))
        except ValueError:
            pass   # a backend that picks NSPLIT per request (Triton): no one call runs it
    runs += [(f"default-cuda-nsplit{n}", be, dataclasses.replace(be.default_params(problem), NSPLIT=n))
             for vname, be in defaults.items() if be.name == "cuda" for n in nsplits]
    for vname, be, params in runs:
        ws = torch.empty(max(1, be.workspace_bytes(problem, params)), dtype=torch.uint8, device=out.device)

        def make(inp, be=be, params=params, ws=ws):
            return lambda: verify_attention(*inp.args, backend=be, params=params, out=out, workspace=ws,
                                            kv_lora_rank=va.Dv, check_values_=False)
        variants[vname] = (make, f"{be.name} {params}")
    return variants


def _failed(e: Exception) -> dict:
    # a failing variant is a row of the table, not a crash
    return {"outcome": "failed", "reason": f"{type(e).__name__}: {e}"[:300]}


def _time_kernels(m, case, opts, variants: dict, common: dict, timed: bool, rows: list) -> dict:
    """Check and time each variant on `case`; one row each (appended to `rows`, printed)."""
    res = {}
    for vname, (make, config) in variants.items():
        t0 = time.perf_counter()
        try:
            r = check_and_time(m, case, opts, make, timed=timed)
        except Exception as e:  # noqa: BLE001
            r = _failed(e)
        res[vname] = r
        med = r.get("median_us")
        rows.append({**common, "variant": vname, **r, "config": config,
                     "pct_floor": round(100 * common["floor_us"] / med, 1) if med else None,
                     "wall_s": round(time.perf_counter() - t0, 2)})
        print(json.dumps(rows[-1], default=str), flush=True)
    return res


def _time_steps(va, ad, case, layers: int, reps: int, kernel_us, common: dict, timed: bool, rows: list) -> None:
    """One decode step of `layers` layers per step variant, checked against the oracle; one
    row each with the cost per layer above the kernel (`kernel_us`)."""
    steps, outs = step_variants(va, ad, case, layers)
    for sname, fn in steps.items():
        t0 = time.perf_counter()
        try:
            for o in outs:
                o.fill_(float("nan"))
            if timed:
                us = graph_us([fn], reps=reps)
            else:
                fn()
                us = None
            err = check_step(case, outs, va.sm_scale, va.Dv)
            r = {"outcome": "ok" if err < TOL else "wrong", "rel_err": err, "median_us": us}
            if us is not None:
                r["per_layer_us"] = us / layers
                if kernel_us:
                    r["overhead_per_layer_us"] = us / layers - kernel_us
        except Exception as e:  # noqa: BLE001
            r = _failed(e)
        rows.append({**common, "variant": sname, "layers": layers, **r,
                     "wall_s": round(time.perf_counter() - t0, 2)})
        print(json.dumps(rows[-1], default=str), flush=True)


def _add_speedups(rows: list, va) -> None:
    """x_vs_default (the tuned backend's untuned default) and x_vs_b1 (tuned-b1) per kernel row."""
    by = {(r["case"], r["variant"]): r.get("median_us") for r in rows}
    for r in rows:
        med = r.get("median_us")
        if not med or r["variant"].startswith("step:"):
            continue
        be = va.plan_for(r["B"]).backend.name
        for key, other in (("x_vs_default", f"default-{be}"), ("x_vs_b1", "tuned-b1")):
            o = by.get((r["case"], other))
            r[key] = round(o / med, 3) if o else None


def _print_table(rows: list) -> None:
    def f(x, spec=".2f"):
        return format(x, spec) if isinstance(x, (int, float)) and x is not None else ""
    print(f"\n{'case':<12} {'variant':<15} {'us':>9} {'floor':>8} {'%floor':>6} {'x def':>6} {'x b1':>6} "
          f"{'us/layer':>8} {'+us/layer':>9}")
    for r in rows:
        med = f(r.get("median_us")) or r.get("outcome", "")
        print(f"{r['case']:<12} {r['variant']:<15} {med:>9} {f(r.get('floor_us')):>8} "
              f"{f(r.get('pct_floor'), '.1f'):>6} {f(r.get('x_vs_default')):>6} {f(r.get('x_vs_b1')):>6} "
              f"{f(r.get('per_layer_us')):>8} {f(r.get('overhead_per_layer_us')):>9}")


CSV_KEYS = ["case", "B", "prefix", "keys", "variant", "outcome", "median_us", "p10_us", "p90_us", "floor_us",
            "pct_floor", "x_vs_default", "x_vs_b1", "layers", "per_layer_us", "overhead_per_layer_us", "rel_err",
            "launches", "pools", "config", "reason", "wall_s"]


def _run_case(m, spec, prefixes, opts, ci, va, va_b1, ad, defaults, args, common, cuda, rows) -> None:
    B = spec.batch
    case = Case(m, spec, prefixes, opts, seed=ci)
    out = torch.empty(B * va.T, va.H, va.Dv, dtype=torch.bfloat16, device=va.device)
    variants = _kernel_variants(va, va_b1, defaults, B, out, args.nsplit, common["keys"])
    res = _time_kernels(m, case, opts, variants, common, cuda, rows)
    _time_steps(va, ad, case, args.layers, args.reps, res["tuned"].get("median_us"), common, cuda, rows)
    del case
    if cuda:
        torch.cuda.empty_cache()


def _write(out_dir: Path, rows: list, va, meta: dict) -> dict:
    _add_speedups(rows, va)
    write_csv(out_dir / "serving.csv", [{k: r.get(k) for k in CSV_KEYS} for r in rows])
    (out_dir / "serving.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return meta


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda and not args.smoke:
        print("bench_serving: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    ragged = [] if args.no_ragged else RAGGED
    if args.smoke:
        args.batches, args.prefixes, args.layers = SMOKE["batches"], SMOKE["prefixes"], SMOKE["layers"]
        ragged = [] if args.no_ragged else SMOKE["ragged"]
    dep = load_deployment(args.deployment)
    ceil = Ceilings(dep.device.read_gbps, dep.device.bf16_tflops)
    budget = int(args.budget_mb * 2**20) if args.budget_mb else dep.workspace_budget_bytes
    allow = args.allow_mismatch or args.smoke
    tuned = load_defaults(args.defaults, deployment=args.deployment, device=dev, allow_mismatch=allow)
    if tuned is None:
        print("bench_serving: no tuned defaults found (pass --defaults)", file=sys.stderr)
        return 2
    max_b = max(args.batches + [n for _, n, _, _ in ragged])
    max_c = max(args.prefixes + [hi for _, _, _, hi in ragged])
    kw = dict(tp=args.tp, max_batch=max_b, max_context=max_c, device=dev, allow_mismatch=allow)
    va = VerifyAttention.from_defaults(tuned, **kw)
    ad = SGLangVerifyAdapter(va)
    b1 = [e for e in tuned.entries if e.max_batch == 1]
    va_b1 = VerifyAttention.from_defaults(dataclasses.replace(tuned, entries=tuple(b1)), **kw) if b1 else None
    print(f"runtime: {va.describe()}", flush=True)
    m = Measurer(str(dev))
    opts = MeasureOptions(timing="graph", reps=args.reps, workspace_budget_bytes=budget)
    base = ProblemSpec(heads=va.H, batch=1, context=1, draft_tokens=va.T, tree="random", kv_lora_rank=va.Dv,
                       rope_dim=va.Dk - va.Dv, sm_scale=va.sm_scale)
    cases = [(f"B{b}xP{p}", b, [p] * b) for b in args.batches for p in args.prefixes]
    cases += [(name, n, log_uniform(n, lo, hi, seed=n)) for name, n, lo, hi in ragged]
    defaults = _default_backends(args.defaults_of, dev)
    rows = []
    for ci, (label, B, prefixes) in enumerate(cases):
        spec = dataclasses.replace(base, batch=B, context=max(prefixes))
        common = {"case": label, "B": B, "prefix": prefixes[0] if len(set(prefixes)) == 1 else "ragged",
                  "keys": sum(prefixes) + B * va.T, "floor_us": round(floor_us(ceil, base, prefixes), 3)}
        plan = va.plan_for(B)
        need = call_workspace_bytes(va.problem(B), [(c, be) for c, _, be in plan.launches((va.params_for(B), None))])
        if need > budget:
            rows.append({**common, "variant": "tuned", "outcome": "skipped",
                         "reason": f"workspace {need / 2**20:.0f} MiB > budget {budget / 2**20:.0f} MiB"})
            print(json.dumps(rows[-1]), flush=True)
        else:
            _run_case(m, spec, prefixes, opts, ci, va, va_b1, ad, defaults, args, common, cuda, rows)
        # after every case: a run cut short (a time limit, a fault) keeps the cases it finished
        meta = _write(Path(args.out), rows, va, {
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "device": torch.cuda.get_device_name(dev)
            if cuda else str(dev), "defaults": tuned.source, "budget_bytes": budget,
            "ceilings": dataclasses.asdict(ceil), "runtime": {k: v for k, v in va.describe().items() if k != "plans"},
            "wall_s": round(time.perf_counter() - t_start, 1), "cases_done": ci + 1, "cases": len(cases)})
    _print_table(rows)
    out_dir = Path(args.out)
    print(f"wrote {out_dir / 'serving.csv'} and {out_dir / 'serving.json'} in {meta['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
