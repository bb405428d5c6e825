"""`kvtune compile-check`: compile CUDA configs for an arch with NVRTC, no GPU needed.

Prints, per config of a search space (or a built-in spread), the registers, spills, stack
and shared memory ptxas reports, and whether the config fits the arch's limits. Exits
non-zero when the arch's default config fails to compile or spills.
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor

from kvtune.kernels.shapes import MAX_DRAFT_TOKENS

from .options import int_in, positive_int

# used without --space: every VEC, tile sizes, warp counts, head groups and pipeline depths
BUILTIN_SPREAD = [
    dict(VEC=8, BLOCK_N=32, NUM_WARPS=16, HEADS_PER_BLOCK=8, STAGES=2),
    dict(VEC=8, BLOCK_N=32, NUM_WARPS=16, HEADS_PER_BLOCK=8, STAGES=3),
    dict(VEC=8, BLOCK_N=16, NUM_WARPS=16, HEADS_PER_BLOCK=8, STAGES=4),
    dict(VEC=8, BLOCK_N=64, NUM_WARPS=16, HEADS_PER_BLOCK=4, STAGES=2),
    dict(VEC=8, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=4, STAGES=2),
    dict(VEC=4, BLOCK_N=16, NUM_WARPS=8, HEADS_PER_BLOCK=2, STAGES=3),
    dict(VEC=2, BLOCK_N=32, NUM_WARPS=16, HEADS_PER_BLOCK=1, STAGES=2),
    dict(VEC=8, BLOCK_N=16, NUM_WARPS=8, HEADS_PER_BLOCK=2, STAGES=2),
    dict(VEC=8, BLOCK_N=16, NUM_WARPS=16, HEADS_PER_BLOCK=4, STAGES=2),
]


def template_configs(space) -> list[dict]:
    """The distinct template-value combinations of a CUDA search space (`space.load_space` or
    `read_space`), in grid order: launch-time values (NSPLIT) and constraints do not change
    what is compiled."""
    from kvtune.kernels.cuda.params import CUDA_PARAMS
    if space.backend != "cuda":
        raise ValueError(f"{space.source}: backend is {space.backend!r}, compile-check needs a cuda space")
    out: dict[tuple, dict] = {}
    for g in space.grid():
        cfg = {n: g[n] for n in CUDA_PARAMS.template_names}
        out.setdefault(tuple(cfg.values()), cfg)
    return list(out.values())


def check_one(cfg: dict, T: int, heads: int, arch: str) -> dict:
    """Compile one config; returns its resource report and the verdict of `reject_reason`,
    the judgement the sweep prunes by (never raises)."""
    from kvtune.kernels.cuda.backend import (CudaParams, KernelGeometry, check_static, compile_params,
                                             reject_reason, split_expr)
    from kvtune.kernels.cuda.nvrtc import NvrtcError
    row = dict(cfg, registers=None, spills=None, stack=None, smem=None, fits=False, reason="")
    try:
        p = CudaParams(**cfg)
        check_static(p, T)
    except ValueError as e:
        row["reason"] = f"invalid: {e}"
        return row
    if p.HEADS_PER_BLOCK > heads:
        row["reason"] = f"HEADS_PER_BLOCK > heads ({heads})"
        return row
    row["smem"] = KernelGeometry.of(p, T).smem_bytes
    try:
        mod = compile_params(p, T, arch)
    except NvrtcError as e:
        row["reason"] = "compile error: " + " ".join(str(e).split())[:300]
        row["compile_error"] = True
        return row
    why = reject_reason(p, T, arch)          # the module above comes from the cache
    row["fits"] = why is None
    row["reason"] = why or ""
    if split_expr(p, T) in mod.unreported:   # its zeros are not ptxas's: shown as "-", not as 0
        row["reason"] = (row["reason"] + "; " if why else "") + "no ptxas report: registers and spills unknown"
        return row
    res = mod.resources[split_expr(p, T)]
    row.update(registers=res.registers, spills=res.spills, stack=res.stack)
    return row


def _run(args) -> int:
    from kvtune.kernels.cuda.backend import ARCH_LIMITS, default_for_arch
    from kvtune.kernels.cuda.params import CUDA_PARAMS
    from kvtune.kernels.cuda.nvrtc import kernel_source_hash, nvrtc_version
    if args.arch not in ARCH_LIMITS:
        raise ValueError(f"--arch: {args.arch!r} has no limits table; known: {sorted(ARCH_LIMITS)}")
    T, H = args.T, args.heads
    default = default_for_arch(T, max(1, min(H, 72 // T)), args.arch)
    default_cfg = {f: getattr(default, f) for f in CUDA_PARAMS.template_names}
    if args.space:
        from .space import read_space
        configs = template_configs(read_space(args.space, "cuda"))
    else:
        configs = [dict(c) for c in BUILTIN_SPREAD]
    configs = [default_cfg] + [c for c in configs if {**default_cfg, **c} != default_cfg]
    lim = ARCH_LIMITS[args.arch]
    print(f"compile-check {args.arch} (smem/block {lim.smem_per_block} B, {lim.threads_per_sm} threads/SM, "
          f"{lim.regs_per_sm} regs/SM), T={T}, heads={H}, NVRTC {nvrtc_version()}, source {kernel_source_hash()}")
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            rows = list(ex.map(check_one, configs, [T] * len(configs), [H] * len(configs),
                               [args.arch] * len(configs)))
    else:
        rows = [check_one(c, T, H, args.arch) for c in configs]
    hdr = (f"{'VEC':>3} {'BN':>3} {'W':>2} {'HPB':>3} {'ST':>2} {'C':>1} {'regs':>4} {'spill':>5} {'stack':>5} "
           f"{'smem':>7} fits  note")
    print(hdr)
    for i, r in enumerate(rows):
        fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
        tag = "  (default)" if i == 0 else ""
        print(f"{r['VEC']:>3} {r['BLOCK_N']:>3} {r['NUM_WARPS']:>2} {r['HEADS_PER_BLOCK']:>3} {r['STAGES']:>2} "
              f"{r.get('CTAS_PER_SM', 1):>1} "
              f"{fmt(r['registers']):>4} {fmt(r['spills']):>5} {fmt(r['stack']):>5} {fmt(r['smem']):>7} "
              f"{'yes' if r['fits'] else 'no ':<4} {r['reason']}{tag}")
    n_fit = sum(r["fits"] for r in rows)
    n_err = sum(bool(r.get("compile_error")) for r in rows)
    print(f"{len(rows)} configs: {n_fit} fit {args.arch}, {n_err} compile errors")
    d = rows[0]
    if d.get("compile_error") or not d["fits"]:
        print(f"default config does not build cleanly for {args.arch}: {d['reason']}", file=sys.stderr)
        if not n_fit and not d.get("compile_error"):
            from kvtune.kernels.cuda.backend import fit_hint
            from kvtune.kernels.cuda.params import arch_limits
            hint = fit_hint(args.T, arch_limits(args.arch).smem_per_block, args.arch, f"on {args.arch}")
            print(f"  {hint}", file=sys.stderr)
        return 1
    if d["registers"] is None:   # built, but NVRTC printed no ptxas report: no spill check was possible
        print(f"default config built for {args.arch}, but NVRTC printed no ptxas report for it: its registers and "
              "spills are unknown, so a clean build cannot be confirmed", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("compile-check", help="compile CUDA configs with NVRTC for an arch (no GPU needed)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", required=True, help="target, e.g. sm_80, sm_86, sm_89, sm_90, sm_120")
    p.add_argument("--space", default=None, help="a CUDA search-space YAML file, e.g. search_spaces/sm_120/cuda.yaml "
                   "(default: a built-in spread of configs)")
    p.add_argument("--T", type=int_in("--T", 1, MAX_DRAFT_TOKENS, "draft tokens"), default=9,
                   help="draft tokens per request (a template value)")
    p.add_argument("--heads", type=positive_int("--heads"), default=8,
                   help="query heads per rank (bounds HEADS_PER_BLOCK)")
    p.add_argument("--jobs", type=positive_int("--jobs"), default=1, help="parallel compiler processes")
    p.set_defaults(func=_run)
