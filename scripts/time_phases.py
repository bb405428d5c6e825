#!/usr/bin/env python3
"""Diagnosis (not a test): the CUDA (or wgmma) backend's two launches timed apart, H=8, T=9, bs=1 (or --batch).

Graph replay over rotating inputs (cold L2, as the Measurer times; `sol_read.graph_us`), median
of 15, of: both kernels, the split kernel alone, the merge kernel alone (it then merges stale
partials: timing only). The launch of the other kernel is filtered out at `cuLaunchKernel`
(and `cuLaunchKernelEx`, the merge's launch with programmatic dependent launch).
`--backend wgmma` (wgmma_km: KM_VARIANTS) times the wgmma kernel alike (its default NSPLIT and ROWS unless --params
says; `--merge warp|block` forces one of its two merge kernels, `--batch` times B requests of the
prefix each, `--ragged` bench_serving.py's ragged batches); its variants (WGMMA_VARIANTS: full,
no_tiles, no_q, no_o_store, exit_early, merge_exit (the warp merge returns at once: --merge warp),
no_gather, no_qk_mma and no_pv_mma (the 64-row warpgroups'
wgmma left out, barriers kept), no_copy (their key tiles never copied), no_softmax_wg (their softmax
left out), no_handoff (the warpgroups stop waiting for each other's
publication of a tile), for ROWS 72 the tail warpgroup's: tail_idle, its handshakes only;
tail_no_s_mma, its S^T MMAs left out; tail_no_ldsm, its S^T on register values, not the keys;
tail_no_pv, its O^T MMAs left out; tail_s_wgmma, its S^T on a wgmma chain per tile pair; with
outputs right: tail_early_release, the tail's key buffers handed back a softmax earlier;
tail_chains2 / 3, its S^T in 2 / 3 accumulator chains;
gather_after_publish / gather_if_free, tile t + 2's gather issued after tile t is published
(always / when the tail has not handed its buffer back yet); table_lanes, the split table's bounds
and values loaded a lane each beside kv_indptr; no_q_early, batch 1's instantiation without its Q
copy under the schedule (the copy shipped: results/kernel/wgmma/phases/q-under-schedule/), last_exits, a
CTA returning right after its last segment's o store, table_read, the schedule read from a table
an earlier launch of the same inputs wrote (results/kernel/wgmma/phases/work-table-read/), and
table_content, the same keyed by kv_indptr's values instead of pointers (not yet timed), with the
controls full_again (one comment changed) and pad_merge (dead code in the warp merge); roll_q /
roll_store / roll_scrub, once-per-segment loops kept rolled
(results/kernel/wgmma/phases/variant-order/); uniform_wg, the 64-row warpgroups'
loop compiled once per warpgroup (warp-uniform K descriptors), wgi_plain, the warpgroup index
without the warp reduction that makes it uniform (shipped:
results/kernel/wgmma/phases/fixed-order-decisions-interleaved/); pv_before_s, a warpgroup's S of
tile t issued only after the other's P V of t - 2; and the schedule forced: items,
ranges) patch verify_wgmma.cu at its own anchors (the gather's
lane-mapping variants measured on source 1ec2426d7d93fe07 and the descriptor variants now shipped
(desc_increment, desc_increment_tail, gather_addr) are in git history; eight lanes per row is
now the COPY_LANES parameter).

--rounds N times every variant N times, interleaved, each variant leading one round in turn, and
prints each one's median: in one fixed order the variants timed after the first read up to 1.3 us
slower at batch >= 8 (results/kernel/wgmma/phases/variant-order/), so compare variants with N >=
the number of variants.

--variants also times copies of the source with one stage left out (METHOD.md: place time
inside a kernel by differences), compiled in memory (`nvrtc.source_override`), never shipped;
their outputs are wrong, only their times mean anything:
  full       the source as it is, and `full, hot L2` (one input set replayed: metadata, Q and
             keys stay in L2)
  no_tiles   the split kernel runs no key tile (schedule, Q copy, P zeroing, epilogue only)
  no_q       no Q copy (the tile loop computes on whatever shared memory holds)
  no_o_store the normalised partial o is staged in shared memory but never stored to global
  exit_early every CTA returns right after the schedule (launch + schedule + the merge)
  no_gather  key tiles zero-filled by cp.async (no global reads of K/V): the loop's compute alone
  no_softmax no softmax (P, alpha and the running max and sum untouched)
  no_pv      no O^T = V^T P^T;  no_pv_mma: its ldmatrix loads without its MMAs
  no_stage_barriers  the barriers after QK^T and after the softmax left out (the loop-top one
             stays): what the stages' serialization costs, at most. Not in `all`, name it: with the
             barriers gone, warps race on the staged key slots, and a slot read mid-write can send
             the gather out of bounds (a 16-warp run ended there with an illegal address, which
             ends the process)

    python scripts/time_phases.py --out $OUT      # on a GPU; or: bash scripts/gpu_evidence.sh limits
    python scripts/time_phases.py --out $OUT --prefixes 256,4096,16384 --variants all
    python scripts/time_phases.py --out $OUT --prefixes 65536 --variants full,no_gather,no_softmax,no_pv
    python scripts/time_phases.py --out $OUT --backend wgmma --heads 7 --prefixes 256,131072
    python scripts/time_phases.py --out $OUT --backend wgmma --prefixes 131072 --variants full,tail_idle
    python scripts/time_phases.py --out $OUT --backend wgmma --batch 8 --prefixes 4096 --variants items,ranges+no_q
    python scripts/time_phases.py --out $OUT --backend wgmma --batch 8 --prefixes 4096 --merge warp \
        --variants full,merge_exit
    python scripts/time_phases.py --out $OUT --backend wgmma --heads 64 --prefixes 131072 --params COPY_LANES=8 \
        --variants full,ranges --oracle
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from cuda.bindings import driver as drv

# the same graph timing and CSV as the speed-of-light read (scripts/ is on the path as a script)
from sol_read import graph_us, rotating_calls, write_csv


# the variant tables and their patching (re-exported: scripts and tests import them from here)
from phase_variants import (KM_VARIANTS, OUTPUTS_RIGHT, UNSAFE, VARIANTS,  # noqa: F401
                            WGMMA_VARIANTS, patched_source, variants_of)


def oracle_check(source: str, names: list[str], backend: str, over: dict, tol: float = 1e-2) -> None:
    """Each variant of `names` whose outputs should be right, against the fp32 oracle on three
    small odd batches (T 9 and 1; H 8 and 64; at ROWS 64 and 72 for wgmma, with the --params
    given, NSPLIT and ROWS aside), each called twice (the second call of table_read reads what the
    first wrote); exits on a miss."""
    from kvtune.kernels import get_backend, make_inputs, reference_attention, rel_error, verify_attention
    from kvtune.kernels.cuda import nvrtc
    from kvtune.kernels.cuda.params import WgmmaParams
    _, part = variants_of(backend)
    be = get_backend(backend)
    for variant in [v for v in names if set(v.split("+")) <= OUTPUTS_RIGHT]:
        with nvrtc.source_override(patched_source(source, variant, backend), part):
            be._kernels.clear()
            for B, T, H, prefix in [(1, 9, 8, [4000]), (3, 9, 8, [97, 1, 700]), (2, 1, 64, [1000, 33])]:
                x = make_inputs(B, T, H, prefix, device="cuda", seed=B + T)
                ref, _ = reference_attention(*x.args)
                rest = {k: v for k, v in over.items() if k not in ("NSPLIT", "ROWS")}
                for params in ([WgmmaParams(NSPLIT=5, ROWS=r, **rest) for r in (64, 72)] if backend == "wgmma"
                               else [None]):
                    # twice: a variant may keep state from one launch to the next (table_read)
                    for call in (1, 2):
                        err = rel_error(verify_attention(*x.args, backend=backend, params=params), ref)
                        print(f"oracle: {variant} B {B} T {T} H {H} {prefix} {params or 'default'} call {call}: "
                              f"rel err {err:.2e}", flush=True)
                        if not err <= tol:
                            raise SystemExit(f"--oracle: variant {variant} is wrong (rel err {err:.2e} > {tol})")
        be._kernels.clear()


def cold_pools(heads: int, prefix, batch: int = 1) -> list:
    """Input sets (T 9, `batch` requests of `prefix` keys each, or one request per entry of a
    list `prefix`) to rotate through so that each replay reads its keys, indices and Q from HBM:
    together about 3x the L2 (2 to 48 sets)."""
    from kvtune.kernels import make_inputs
    from kvtune.tuner.measure import ProblemSpec
    prefixes = prefix if isinstance(prefix, list) else [prefix] * batch
    nbytes = sum(ProblemSpec(heads=heads, batch=1, context=n, draft_tokens=9).bytes_moved() for n in prefixes)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return [make_inputs(len(prefixes), 9, heads, prefixes, device="cuda", seed=i, device_values=True)
            for i in range(max(2, min(48, math.ceil(3 * l2 / nbytes))))]


def lpt_order(prefixes: list[int], nsplit: int, T: int = 9, bn: int = 32) -> list[int]:
    """`prefixes` sorted by the size of their items in verify.cu's items schedule at `nsplit`
    (find_item: each request cut into ceil(L / chunk) equal pieces of whole tiles), largest first:
    the order in which the GPU's block scheduler, filling SMs as they free, would run the
    longest-processing-time-first list schedule."""
    lens = [p + T for p in prefixes]
    cap = max(nsplit, len(lens))
    tiles = max(math.ceil(sum(lens) / cap / bn), 1)
    while sum(max(math.ceil(n / (tiles * bn)), 1) for n in lens) > cap:
        tiles += 1

    def piece(n: int) -> int:
        parts = max(math.ceil(n / (tiles * bn)), 1)
        return max(math.ceil(math.ceil(n / parts) / bn), 1)
    return [p for _, p in sorted(((-piece(n), p) for n, p in zip(lens, prefixes)), key=lambda t: t[0])]


class Phases:
    """Times one prefix's launches, with the merge or the split launch filtered out."""

    def __init__(self, heads: int, backend: str = "cuda"):
        from kvtune.kernels import get_backend
        self.heads, self.name, self.be = heads, backend, get_backend(backend)
        self.skip = None
        orig, orig_ex = drv.cuLaunchKernel, drv.cuLaunchKernelEx

        def launch(f, *rest):
            if self.skip is not None and int(f) == self.skip:
                return (drv.CUresult.CUDA_SUCCESS,)
            return orig(f, *rest)

        def launch_ex(cfg, f, *rest):
            if self.skip is not None and int(f) == self.skip:
                return (drv.CUresult.CUDA_SUCCESS,)
            return orig_ex(cfg, f, *rest)

        drv.cuLaunchKernel, drv.cuLaunchKernelEx = launch, launch_ex

    def kernels(self, p, B: int):
        if self.name == "cuda":
            return self.be._get(p, 9, torch.device("cuda"))[:2]
        k = (self.be._get(9, p.ROWS, torch.device("cuda"), p.COPY_LANES) if self.name == "wgmma"
             else self.be._get(9, torch.device("cuda"), p.DV_SPLIT, p.SPLIT_ALIGN))
        return k.split_for(B), k.merge_for(p.NSPLIT, B, 9, self.heads)[0]

    def time(self, pools, over: dict) -> dict:
        from kvtune.kernels.api import describe_problem
        problem = describe_problem(*pools[0].args)
        p = replace(self.be.default_params(problem), **over)
        split_k, merge_k = self.kernels(p, problem.B)
        calls = rotating_calls(self.name, p, pools)
        row = {"params": str(p)}
        for what, skip in (("both", None), ("split", int(merge_k.function)), ("merge", int(split_k.function))):
            self.skip = skip
            row[f"{what}_us"] = round(graph_us(calls), 2)
        self.skip = None
        return row


def round_order(names: list[str], rnd: int) -> list[str]:
    """The variants in round `rnd`: each leads one round in turn. A variant timed later in a
    process reads slower (results/kernel/wgmma/phases/variant-order/), so one fixed order favours
    the first."""
    k = rnd % len(names)
    return names[k:] + names[:k]


def print_summary(rows: list[dict]) -> None:
    """Per (prefix, B, variant) the median over its rounds of each time, in first-seen order."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["prefix"], r["B"], r["variant"]), []).append(r)
    print(f"\n{'prefix':>9} {'B':>3} {'variant':<28} {'rounds':>6} {'both us':>8} {'split us':>8} {'merge us':>8}")
    for (prefix, B, variant), rs in groups.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("both_us", "split_us", "merge_us")}
        print(f"{prefix:>9} {B:>3} {variant:<28} {len(rs):>6} {med['both_us']:>8.2f} {med['split_us']:>8.2f} "
              f"{med['merge_us']:>8.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefixes", default="4096,16384,65536,131072")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1, help="requests per call, each with the prefix's keys")
    ap.add_argument("--ragged", default="", help="in place of --prefixes: bench_serving.py's ragged batches by name "
                    "(ragged16, ragged64)")
    ap.add_argument("--order", choices=("given", "lpt"), default="given",
                    help="with --ragged: the requests as generated, or sorted largest item first (lpt) for the "
                         "items schedule at the run's NSPLIT (what a host-side permutation of the batch buys)")
    ap.add_argument("--merge", choices=("auto", "warp", "block"), default="auto",
                    help="wgmma: the merge kernel (auto: wgmma.uses_warp_merge's choice)")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "wgmma", "wgmma_km"])
    ap.add_argument("--params", default="", help="NAME=VALUE,... over the backend's default (e.g. NUM_WARPS=4)")
    ap.add_argument("--variants", default="", help="'all', or a comma-separated list of the variants above to time")
    ap.add_argument("--source", default="", help="a file timed in place of the backend's source part (e.g. the "
                    "shipped verify_wgmma.cu from git history against the tree's), patched by --variants alike")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, interleaved, each "
                    "variant leading one round in turn; the summary gives each one's median")
    ap.add_argument("--oracle", action="store_true", help="first check the variants whose outputs should be right "
                    "(OUTPUTS_RIGHT) against the fp32 oracle on small batches")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds: at least 1, got {args.rounds}")
    from kvtune.kernels.cuda import nvrtc
    from kvtune.kernels.params import declaration

    known = declaration(args.backend).params
    over = {k: int(v) for k, v in (kv.split("=") for kv in args.params.split(",") if kv)}
    if set(over) - set(known):
        raise SystemExit(f"--params: unknown {sorted(set(over) - set(known))}; known: {sorted(known)}")
    table, part = variants_of(args.backend)
    names = [v.strip() for v in args.variants.split(",")] if args.variants else ["full"]
    names = [v for v in table if v not in UNSAFE] if names == ["all"] else names
    unknown = {c for v in names for c in v.split("+")} - set(table)
    if unknown:
        raise SystemExit(f"--variants: unknown for {args.backend} {sorted(unknown)}; known: all, {', '.join(table)} "
                         "(a+b: both)")
    if args.merge != "auto":
        from kvtune.kernels.cuda import wgmma
        wgmma.WARP_MERGE_MAX_SPLITS = 10**6 if args.merge == "warp" else 0
    source = Path(args.source or nvrtc.SOURCE_PATH.with_name(part)).read_text()
    if args.oracle:
        oracle_check(source, names, args.backend, over)
    ph = Phases(args.heads, args.backend)
    rows = []
    cases = [(int(p), int(p)) for p in args.prefixes.split(",")]
    if args.ragged:
        from bench_serving import RAGGED, log_uniform
        known = {name: (n, lo, hi) for name, n, lo, hi in RAGGED}
        if set(args.ragged.split(",")) - set(known):
            raise SystemExit(f"--ragged: unknown {args.ragged}; known: {sorted(known)}")
        cases = [(name, log_uniform(*known[name], seed=known[name][0])) for name in args.ragged.split(",")]
        if args.order == "lpt":
            nsplit = over.get("NSPLIT", 132)
            cases = [(f"{name} lpt", lpt_order(keys, nsplit)) for name, keys in cases]
    for prefix, keys in cases:
        pools = cold_pools(args.heads, keys, args.batch)
        n_req = len(keys) if isinstance(keys, list) else args.batch
        for rnd in range(args.rounds):
            for variant in round_order(names, rnd):
                hot = variant == "full" and args.variants and rnd == 0
                runs = [(variant, pools)] + ([("full, hot L2", pools[:1])] if hot else [])
                with nvrtc.source_override(patched_source(source, variant, args.backend), part):
                    ph.be._kernels.clear()
                    for name, use in runs:
                        row = {"prefix": prefix, "B": n_req, "H": args.heads,
                               "source": Path(args.source).name or "tree", "merge": args.merge, "variant": name,
                               "round": rnd, **ph.time(use, over)}
                        rows.append(row)
                        print(row, flush=True)
                ph.be._kernels.clear()
        del pools
        torch.cuda.empty_cache()
    write_csv(Path(args.out) / "phases.csv", rows)
    print_summary(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
