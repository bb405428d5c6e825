#!/usr/bin/env python3
"""Diagnosis (not a test): where a wgmma call's time goes, on the GPU's own clock.

A copy of the wgmma module (never shipped: `nvrtc.source_override`, its own cache names) in
which thread 0 of each split CTA of row block 0 writes %globaltimer at eight points, and thread 0
of each merge block at its entry and exit, into a ring indexed by each CTA's own launch count
(an atomic per CTA slot), so one graph replay of many calls leaves every call's timeline:

  split stages  0 entry, 1 schedule published (block barrier), 2 Q and the first tiles landed
                (barrier (1)), 3 tile loop done, 4 l shared (2), 5 o staged (3), 6 o stored (4),
                7 next segment published (5): the CTA is done
  merge         entry, exit (after its output stores were issued)

Per shape (H 8 unless said, T 9, the wgmma default, inputs rotated over pools: cold L2, as
`time_phases.py`), from the calls of one replay (the first two dropped), medians over calls:
the call's period (split entry to the next call's split entry, = the graph time per call),
the split span (first CTA entry to last CTA done), its CTAs' entry spread, each stage's median
over CTAs and calls and that of the last CTA done, the split -> merge gap (last split CTA done
to first merge block entry), the merge span, and the merge -> next split gap. The graph time per
call of the stamped and the shipped module is timed beside it (what the stamps cost).

    python scripts/timeline_probe.py --out $OUT/timeline
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from cuda.bindings import driver as drv

from sol_read import graph_of, graph_us, replay_us, rotating_calls, write_csv
from time_phases import cold_pools

RING, NS, CTAS, MB = 128, 8, 160, 1024
STAMP_BYTES = 8 * NS + 8  # past the layout's end, rounded up to 8 bytes
STAGES = ["schedule", "q_first_tiles", "tile_loop", "l_shared", "o_staged", "o_stored", "next_segment"]

HEADER = f"""#define KVT_RING {RING}
#define KVT_NS {NS}
#define KVT_CTAS {CTAS}
#define KVT_MB {MB}
extern "C" {{  // definitions with unmangled names (cuModuleGetGlobal)
__device__ unsigned long long kvt_split_stamps[KVT_RING * KVT_NS * KVT_CTAS];
__device__ unsigned long long kvt_merge_stamps[KVT_RING * 2 * KVT_MB];
__device__ unsigned kvt_split_ctr[KVT_CTAS];
__device__ unsigned kvt_merge_ctr[KVT_MB];
}}
static __device__ __forceinline__ unsigned long long kvt_gt() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");
  return t;
}}
// a stage's stamp into the 8-byte-aligned bytes past the layout's dynamic shared memory (the
// launcher asks for STAMP_BYTES more): few registers near the loop's cap, where a global address
// spilled and static shared memory pushed the 1024-aligned dynamic block past 227 KB; the CTA's
// eight go to its launch count's ring slot once, when it has no next segment
#define KVT_SH reinterpret_cast<unsigned long long*>(smem + (Lay::SMEM_BYTES + 7) / 8 * 8)
#define KVT_S(i) do {{ if (threadIdx.x == 0) KVT_SH[i] = kvt_gt(); }} while (0)
#define KVT_FLUSH() do {{ if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y < KVT_CTAS) {{ \\
  const unsigned e = atomicAdd(&kvt_split_ctr[blockIdx.y], 1u) % KVT_RING; \\
  for (int i = 0; i < KVT_NS; ++i) \\
    kvt_split_stamps[(e * KVT_NS + i) * KVT_CTAS + blockIdx.y] = KVT_SH[i]; }} }} while (0)
// a merge block's entry time stays in a register; thread 0 writes both stamps at its exit
#define KVT_M_ENTER() const unsigned long long kvt_t0 = kvt_gt()
#define KVT_M_EXIT() do {{ const unsigned kb = blockIdx.x + gridDim.x * blockIdx.y; \\
  if (threadIdx.x == 0 && kb < KVT_MB) {{ const unsigned e = atomicAdd(&kvt_merge_ctr[kb], 1u) % KVT_RING; \\
    kvt_merge_stamps[(e * 2) * KVT_MB + kb] = kvt_t0; \\
    kvt_merge_stamps[(e * 2 + 1) * KVT_MB + kb] = kvt_gt(); }} }} while (0)
"""

def _after(part: str, anchor: str, text: str) -> tuple[str, str, str]:
    return part, anchor, anchor + text


_LAST = "\n  __syncthreads();  // (5) the next segment published\n  if (work_s[0] < 0) break;\n"
_MERGE_IN = "  const int b = row / a.T, t = row % a.T;\n  pdl_wait();"
#: (part, anchor, its replacement), each anchor once in its part; an anchor of None: prepended
PATCHES = [
    ("verify.cu", None, HEADER),
    _after("verify_wgmma.cu", "  extern __shared__ __align__(1024) unsigned char smem[];\n", "  KVT_S(0);\n"),
    _after("verify_wgmma.cu", "  if (work_s[0] < 0) return;  // no work: the merge never reads this CTA's items\n",
           "  KVT_S(1);\n"),
    _after("verify_wgmma.cu", "  __syncthreads();  // (1) Q, m_s and the first tiles visible to both warpgroups"
           " (and the tail)\n", "  KVT_S(2);\n"),
    _after("verify_wgmma.cu", "  if (t >= 1 && t - 1 < n_tiles) other_tile(t - 1);\n  wait0();\n  keep128(o);\n",
           "  KVT_S(3);\n"),
    _after("verify_wgmma.cu", "  __syncthreads();  // (2)\n", "  KVT_S(4);\n"),
    _after("verify_wgmma.cu", "\n  __syncthreads();  // (3) o staged\n", "  KVT_S(5);\n"),
    _after("verify_wgmma.cu", "\n  __syncthreads();  // (4) o stored: Q's shared memory and the key buffers are "
           "free\n", "  KVT_S(6);\n"),
    # the split CTA's last segment: stamp 7 and the flush
    ("verify_wgmma.cu", _LAST, _LAST.replace("  if (work_s[0] < 0) break;\n", (
        "  KVT_S(7);\n  if (work_s[0] < 0) {\n    KVT_FLUSH();\n    break;\n  }\n"))),
    # the warp merge (verify_wgmma.cu) and the block merge (verify.cu)
    _after("verify_wgmma.cu", "  const int row = blockIdx.x, b = row / a.T, t = row % a.T;\n", "  KVT_M_ENTER();\n"),
    _after("verify_wgmma.cu", "  if (a.lse != nullptr && lane == 0) a.lse[(i64)row * a.lse_stride_m + head] = "
           "s == 0.f ? NEG_INF : m + __logf(s);\n", "  KVT_M_EXIT();\n"),
    ("verify.cu", _MERGE_IN, _MERGE_IN.replace("  pdl_wait();", "  KVT_M_ENTER();\n  pdl_wait();")),
    _after("verify.cu", "    a.lse[(i64)row * a.lse_stride_m + head] = s == 0.f ? NEG_INF : m + __logf(s);\n",
           "  KVT_M_EXIT();\n"),
]
#: (name, H, requests' prefixes)
SHAPES = [("H8 B1 256", 8, [256]), ("H8 B1 4k", 8, [4096]), ("H8 B1 16k", 8, [16384]),
          ("H8 B1 128k", 8, [131072]), ("H8 B8 4k", 8, [4096] * 8), ("H8 B8 16k", 8, [16384] * 8),
          ("H8 B32 4k", 8, [4096] * 32)]


def probe_shapes(ragged: bool) -> list:
    """SHAPES, and bench_serving.py's ragged64 batch with `ragged`."""
    shapes = list(SHAPES)
    if ragged:
        from bench_serving import RAGGED, log_uniform
        n, lo, hi = dict((r[0], r[1:]) for r in RAGGED)["ragged64"]
        shapes.append(("H8 ragged64", 8, log_uniform(n, lo, hi, seed=n)))
    return shapes


def wgmma_calls(H: int, prefixes: list[int], calls_cap: int | None = None):
    """Rotating input pools of `prefixes` (cold L2) and the wgmma default's calls over them
    (`sol_read.rotating_calls`): (problem, params, the calls in graph order)."""
    from kvtune.kernels import get_backend
    from kvtune.kernels.api import describe_problem
    pools = cold_pools(H, prefixes)
    problem = describe_problem(*pools[0].args)
    p = get_backend("wgmma").default_params(problem)
    return problem, p, rotating_calls("wgmma", p, pools, calls_cap)


def patched() -> dict[str, str]:
    from kvtune.kernels.cuda import nvrtc
    texts = {p: nvrtc.SOURCE_PATH.with_name(p).read_text() for p in ("verify.cu", "verify_wgmma.cu")}
    for part, anchor, repl in PATCHES:
        src = texts[part]
        if anchor is None:
            texts[part] = repl + src
            continue
        if src.count(anchor) != 1:
            raise SystemExit(f"anchor {anchor!r} occurs {src.count(anchor)} times in {part}")
        texts[part] = src.replace(anchor, repl)
    return texts


@contextmanager
def stamp_smem():
    """The wgmma launcher asks for STAMP_BYTES more dynamic shared memory inside the block."""
    from kvtune.kernels.cuda import wgmma
    old = wgmma.SMEM_BYTES, wgmma.SMEM_BYTES_TAIL
    wgmma.SMEM_BYTES, wgmma.SMEM_BYTES_TAIL = old[0] + STAMP_BYTES, old[1] + STAMP_BYTES
    try:
        yield
    finally:
        wgmma.SMEM_BYTES, wgmma.SMEM_BYTES_TAIL = old


class Globals:
    """The stamp arrays of the loaded (patched) module."""

    def __init__(self, module):
        from kvtune.kernels.cuda.nvrtc import check_driver
        self.ptr = {}
        for name in ("kvt_split_stamps", "kvt_merge_stamps", "kvt_split_ctr", "kvt_merge_ctr"):
            dptr, size = check_driver(drv.cuModuleGetGlobal(module, name.encode()), f"cuModuleGetGlobal({name})")
            self.ptr[name] = (dptr, size)

    def reset(self) -> None:
        from kvtune.kernels.cuda.nvrtc import check_driver
        for dptr, size in self.ptr.values():
            check_driver(drv.cuMemsetD8(dptr, 0, size), "cuMemsetD8")

    def read(self, name: str) -> np.ndarray:
        from kvtune.kernels.cuda.nvrtc import check_driver
        dptr, size = self.ptr[name]
        host = np.zeros(size // 8, dtype=np.uint64)
        check_driver(drv.cuMemcpyDtoH(host.ctypes.data, dptr, size), "cuMemcpyDtoH")
        return host


def analyse(split: np.ndarray, merge: np.ndarray, calls: int) -> dict:
    """Medians over calls 2 .. calls - 2 of one replay's stamps (ns -> us)."""
    s = split.reshape(RING, NS, CTAS).astype(np.int64)
    m = merge.reshape(RING, 2, MB).astype(np.int64)
    per_call, stage, last_stage = [], {k: [] for k in STAGES}, {k: [] for k in STAGES}
    for k in range(2, min(calls, RING) - 1):
        entry = s[k, 0][s[k, 0] > 0]
        done_mask = s[k, 7] > 0
        if not len(entry) or not done_mask.any():
            continue
        nxt = s[k + 1, 0][s[k + 1, 0] > 0]
        m_in, m_out, p_out = m[k, 0][m[k, 0] > 0], m[k, 1][m[k, 1] > 0], m[k - 1, 1][m[k - 1, 1] > 0]
        if not len(m_in) or not len(m_out) or not len(nxt) or not len(p_out):
            continue
        done = s[k, 7][done_mask]
        per_call.append({
            "period": nxt.min() - entry.min(), "split_span": done.max() - entry.min(),
            "entry_spread": entry.max() - entry.min(), "split_to_merge": m_in.min() - done.max(),
            "merge_span": m_out.max() - m_in.min(), "merge_to_next_split": nxt.min() - m_out.max(),
            "prev_merge_to_split": entry.min() - p_out.max(), "working_ctas": int(done_mask.sum())})
        last = int(np.argmax(np.where(done_mask, s[k, 7], 0)))
        for i, name in enumerate(STAGES, start=1):
            d = (s[k, i] - s[k, i - 1])[done_mask]
            stage[name].extend(d.tolist())
            last_stage[name].append(int(s[k, i, last] - s[k, i - 1, last]))
    if not per_call:
        return {}
    out = {f"{key}_us": round(statistics.median(c[key] for c in per_call) / 1e3, 3) for key in per_call[0]
           if key != "working_ctas"}
    out["working_ctas"] = per_call[0]["working_ctas"]
    out["calls"] = len(per_call)
    for name in STAGES:
        out[f"{name}_med_us"] = round(statistics.median(stage[name]) / 1e3, 3)
        out[f"{name}_last_us"] = round(statistics.median(last_stage[name]) / 1e3, 3)
    flat = np.unique(s[s > 0])
    diffs = np.diff(flat)
    out["timer_step_ns"] = int(diffs[diffs > 0].min()) if len(diffs) else -1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ragged", action="store_true", help="also bench_serving.py's ragged64 batch")
    args = ap.parse_args(argv)
    from kvtune.kernels import get_backend
    from kvtune.kernels.cuda import nvrtc
    from kvtune.kernels.cuda.backend import device_arch
    from kvtune.kernels.cuda.wgmma import compile_wgmma
    be = get_backend("wgmma")
    texts = patched()
    rows = []
    shapes = probe_shapes(args.ragged)
    for name, H, prefixes in shapes:
        problem, p, seq = wgmma_calls(H, prefixes, RING - 8)
        calls = len(seq)
        be._kernels.clear()
        shipped_us = graph_us(seq)
        with nvrtc.source_override(texts["verify.cu"], "verify.cu"), \
                nvrtc.source_override(texts["verify_wgmma.cu"], "verify_wgmma.cu"), stamp_smem():
            be._kernels.clear()
            g = graph_of(seq)   # its eager calls load the stamped module
            ctx = nvrtc._ensure_context(torch.cuda.current_device())
            mod = compile_wgmma(problem.T, device_arch(torch.cuda.current_device()), p.ROWS, p.COPY_LANES)
            glob = Globals(nvrtc._loaded[(int(ctx), mod.name)][0])
            stamped_us = replay_us(g, calls)
            glob.reset()
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            row = {"shape": name, "params": str(p), "shipped_us": round(shipped_us, 2),
                   "stamped_us": round(stamped_us, 2),
                   **analyse(glob.read("kvt_split_stamps"), glob.read("kvt_merge_stamps"), calls)}
            del g
        be._kernels.clear()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del seq
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_csv(Path(args.out) / "timeline.csv", rows)
    cols = ["shipped_us", "stamped_us", "period_us", "prev_merge_to_split_us", "entry_spread_us", "split_span_us",
            "split_to_merge_us", "merge_span_us"] + [f"{s}_med_us" for s in STAGES] + [f"{s}_last_us" for s in STAGES]
    print(f"\n{torch.cuda.get_device_name()}; timer step {rows[0].get('timer_step_ns')} ns; us, medians over calls")
    print(f"{'':<24}" + "".join(f"{r['shape']:>13}" for r in rows))
    for c in cols:
        print(f"{c:<24}" + "".join(f"{r.get(c, float('nan')):>13}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
