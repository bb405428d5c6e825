#!/usr/bin/env python3
"""Speed of light per shape (a benchmark, not a test): how fast can one kernel read exactly the
bytes a verify launch must move, timed the way the Measurer times the kernels?

For each prefix (bs=1, T=9, H=8) the byte count is `ProblemSpec.bytes_moved()`; a torch.sum
over that many contiguous bf16 bytes is captured into a CUDA graph over rotating buffers (cold
L2: the buffers together are several times the L2), replayed, median of 15. Also the replay
time of a graph of 1-element kernels (the per-launch floor inside a graph). The floor of the
tables (bytes / 4189 GB/s, the bandwidth of a 4 GB read) ignores the ramp-up a short read pays;
this says how much of that floor any single kernel can reach at each size.

    python scripts/sol_read.py --out $OUT         # on a GPU; or: bash scripts/gpu_evidence.sh limits
"""
from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from pathlib import Path

import torch


def graph_of(fns):
    """`fns` (called in turn) captured into one CUDA graph, after one eager call of each (compiles,
    loads, allocations), and replayed once."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    return g


def replay_us(g, calls: int, reps=15) -> float:
    """Median per-call time of `reps` replays of graph `g`, which holds `calls` calls."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(ts)


def graph_us(fns, reps=15) -> float:
    """Median per-call time of `fns` (called in turn) captured into one graph and replayed."""
    return replay_us(graph_of(fns), len(fns), reps)


def rotating_calls(backend: str, params, pools: list, cap: int | None = None) -> list:
    """`verify_attention` calls of `backend` with `params` over `pools` in turn, for one CUDA
    graph (`graph_us`): a whole number of rotations, about 96 calls (at least one per pool; at
    most `cap`), sharing one output and workspace; outputs unchecked (timing only)."""
    from kvtune.kernels import get_backend, verify_attention
    from kvtune.kernels.api import describe_problem
    problem = describe_problem(*pools[0].args)
    out = torch.empty(problem.B * problem.T, problem.H, problem.Dv, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(get_backend(backend).workspace_bytes(problem, params), dtype=torch.uint8, device="cuda")
    fns = [lambda x=x: verify_attention(*x.args, backend=backend, params=params, out=out, workspace=ws,
                                        check_values_=False) for x in pools]
    calls = max(len(fns), 96 // len(fns) * len(fns))
    return [fns[i % len(fns)] for i in range(min(calls, cap or calls))]


def write_csv(path: Path, rows: list[dict]) -> None:
    """`rows` (dicts with the same keys) as a CSV file, its folder created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def parse_kv(text: str) -> dict:
    """"NAME=VALUE,NAME=VALUE" -> {NAME: int(VALUE)} (config overrides on the command line)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise SystemExit(f"override {part!r}: expected NAME=VALUE")
        try:
            out[k.strip()] = int(v)
        except ValueError:
            raise SystemExit(f"override {part!r}: {v.strip()!r} is not an integer") from None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefixes", default="4096,16384,65536,131072")
    ap.add_argument("--read-gbps", type=float, default=4189.0, help="the floor's bandwidth (4 GB torch.sum)")
    args = ap.parse_args(argv)
    from kvtune.tuner.measure import ProblemSpec

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    tiny = torch.zeros(1, device="cuda")
    launch_us = graph_us([lambda: tiny.add_(1.0)] * 64)
    print(f"graph of 1-element kernels: {launch_us:.2f} us per kernel", flush=True)
    for prefix in [int(p) for p in args.prefixes.split(",")]:
        nbytes = ProblemSpec(heads=8, batch=1, context=prefix, draft_tokens=9).bytes_moved()
        n_buf = max(2, math.ceil(4 * l2 / nbytes))
        bufs = [torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda") for _ in range(n_buf)]
        reps = max(n_buf, 64 // n_buf * n_buf)
        us = graph_us([(lambda b=b: b.sum(dtype=torch.float32)) for b in bufs] * (reps // n_buf))
        floor = nbytes / (args.read_gbps * 1e3)
        row = {"prefix": prefix, "bytes": nbytes, "buffers": n_buf, "sum_us": round(us, 2),
               "gbps": round(nbytes / (us * 1e3), 1), "floor_us": round(floor, 2),
               "pct_floor": round(100 * floor / us, 1), "launch_us": round(launch_us, 2)}
        rows.append(row)
        print(row, flush=True)
        del bufs
        torch.cuda.empty_cache()
    write_csv(Path(args.out) / "sol_read.csv", rows)
    print(f"\n{'prefix':>7} {'MB':>7} {'sum us':>8} {'GB/s':>6} {'floor us':>8} {'% floor':>7}")
    for r in rows:
        print(f"{r['prefix']:>7} {r['bytes'] / 1e6:>7.1f} {r['sum_us']:>8.2f} {r['gbps']:>6.0f} {r['floor_us']:>8.2f} "
              f"{r['pct_floor']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
