#!/usr/bin/env python3
"""Diagnosis (not a test, not shipped): what combining a request's split partials on chip would
save at batch 1 (sm_90: thread-block clusters and distributed shared memory).

At H 8 x T 9 (72 query rows), batch 1 x 4k, the wgmma kernel's 132 splits write 132 x 72 x 512
bf16 partials (9.7 MB, twice the 4.7 MB of keys) and a second kernel merges them. Issue 12 names a
cluster reduction as a way to cut that: the C CTAs of a cluster (C consecutive splits of one
request) combine their partials through each other's shared memory, so only NSPLIT / C partials
reach global memory and the merge reads C times fewer.

This probe isolates that epilogue from the tile loop. Each of NSPLIT CTAs (256 threads, one per SM
through `--smem` bytes of dynamic shared memory, as the split kernel) holds a synthetic partial of
72 rows (o normalised, bf16; its max m and sum l, fp32) drawn from a hash of (split, row, column),
stages it in its shared memory, then:

- C = 1: stores it to global memory (the shipped kernel's staged store);
- C > 1 (`__cluster_dims__(C)`): after a cluster barrier, CTA rank q combines rows
  [q * 72 / C, (q + 1) * 72 / C) of the C partials, read through `ld.shared::cluster`, and stores
  them as one partial; a second barrier keeps every CTA's shared memory alive until read.

A merge kernel (a warp per row, as the shipped warp merge) then combines the NSPLIT / C partials
into the output. Each configuration is checked against torch's merge of the same synthetic
partials, then timed as CUDA-graph replays (median): the split epilogue alone, the merge alone,
and both, beside an empty launch of each grid and the epilogue's own draw of its synthetic
partial (subtracted: `epilogue_us`). Each cluster size's row says whether its grid fits the GPU in
one wave (`cuOccupancyMaxActiveClusters`: at one CTA per SM a cluster needs C SMs of one GPC, and
not every SM can take part at C = 8). What the numbers bound: the part of the fixed cost
a cluster reduction can take off (the merge's reads, the partials' stores), not the tile loop.

    python scripts/cluster_merge_probe.py --out $OUT      # on an sm_90 GPU
    python scripts/cluster_merge_probe.py --compile-only  # any machine with NVRTC: ptxas per C
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROWS, DV = 72, 512

KERNEL = r"""
typedef unsigned int u32; typedef unsigned short u16;
#define ROWS 72
#define DV 512

__device__ __forceinline__ float uhash(u32 x) {   // [0, 1): the torch reference draws the same
  x *= 2654435761u;
  return (float)(x >> 8) * (1.0f / 16777216.0f);
}
__device__ __forceinline__ float syn_m(int c, int r) { return 4.f * uhash((u32)(c * ROWS + r)); }
__device__ __forceinline__ float syn_l(int c, int r) { return 1.f + 10.f * uhash((u32)(c * ROWS + r) + 7777777u); }
__device__ __forceinline__ float syn_o(int c, int r, int d) { return uhash((u32)((c * ROWS + r) * DV + d)) - 0.5f; }

__device__ __forceinline__ u16 bf16_of(float f) {   // round to nearest even (finite inputs)
  u32 u = __float_as_uint(f);
  return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float f32_of(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u32 mapa(u32 addr, u32 rank) {
  u32 r; asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank)); return r;
}
__device__ __forceinline__ uint4 ld_cluster_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
  float v; asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory"); return v;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ u32 cluster_rank() {
  u32 r; asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r)); return r;
}

// grid NSPLIT (a multiple of CL), 256 threads, dynamic shared memory >= ROWS * DV * 2 + (2 + 2 + CL) * ROWS * 4.
// part_o [NSPLIT / CL][ROWS][DV] bf16 (o / l), part_lse [NSPLIT / CL][ROWS] fp32 (m + ln l).
// empty: 1 exits at once; 2 draws and stages the partial, then exits (what the timings subtract).
extern "C" __global__ void
#if CL > 1
__cluster_dims__(CL, 1, 1)
#endif
__launch_bounds__(256, 1) epilogue(u16* part_o, float* part_lse, int empty) {
  if (empty == 1) return;
  extern __shared__ __align__(16) unsigned char smem[];
  u16* os = (u16*)smem;                              // [ROWS][DV] bf16
  float* ms = (float*)(smem + ROWS * DV * 2);        // [ROWS]
  float* ls = ms + ROWS;                             // [ROWS]
  const int c = blockIdx.x, tid = threadIdx.x, chunk = tid & 63, r0 = tid >> 6;
  for (int r = r0; r < ROWS; r += 4) {               // this CTA's partial, staged as the kernel stages o
    u32 w[4];
    for (int i = 0; i < 4; ++i)
      w[i] = (u32)bf16_of(syn_o(c, r, chunk * 8 + 2 * i)) | ((u32)bf16_of(syn_o(c, r, chunk * 8 + 2 * i + 1)) << 16);
    *reinterpret_cast<uint4*>(os + r * DV + chunk * 8) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  if (tid < ROWS) { ms[tid] = syn_m(c, tid); ls[tid] = syn_l(c, tid); }
  if (empty == 2) {   // a read the compiler cannot drop: bf16 0xFFFF is a NaN never drawn
    __syncthreads();
    if (os[tid * 8] == 0xFFFFu) part_lse[0] = 0.f;
    return;
  }
#if CL == 1
  __syncthreads();
  for (int r = r0; r < ROWS; r += 4)
    *reinterpret_cast<uint4*>(part_o + ((long long)c * ROWS + r) * DV + chunk * 8) =
        *reinterpret_cast<const uint4*>(os + r * DV + chunk * 8);
  if (tid < ROWS) part_lse[c * ROWS + tid] = ms[tid] + __logf(ls[tid]);
#else
  float* wts = ls + ROWS;                            // [ROWS][CL]: each partial's weight in the cluster's sum
  float* stat = wts + ROWS * CL;                     // [ROWS][2]: the cluster's max and sum
  cluster_sync();                                    // every partial of the cluster staged
  const u32 q = cluster_rank();
  const int R = ROWS / CL, out = c / CL;
  if (tid < R) {                                     // this rank's rows: the weights, read once per row
    const int r = (int)q * R + tid;
    float m[CL], mx = -1e30f, sum = 0.f;
    for (int j = 0; j < CL; ++j) { m[j] = ld_cluster_f32(mapa(smem_u32(ms + r), j)); mx = fmaxf(mx, m[j]); }
    for (int j = 0; j < CL; ++j) {
      const float w = ld_cluster_f32(mapa(smem_u32(ls + r), j)) * __expf(m[j] - mx);
      wts[r * CL + j] = w;
      sum += w;
    }
    stat[2 * r] = mx;
    stat[2 * r + 1] = sum;
  }
  __syncthreads();
  for (int r = (int)q * R + r0; r < ((int)q + 1) * R; r += 4) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < CL; ++j) {
      const uint4 v = ld_cluster_v4(mapa(smem_u32(os + r * DV + chunk * 8), j));
      const u32 vw[4] = {v.x, v.y, v.z, v.w};
      const float wj = wts[r * CL + j];
      for (int i = 0; i < 4; ++i) {
        acc[2 * i] += wj * f32_of((u16)(vw[i] & 0xFFFFu));
        acc[2 * i + 1] += wj * f32_of((u16)(vw[i] >> 16));
      }
    }
    const float inv = 1.f / stat[2 * r + 1];
    u32 w[4];
    for (int i = 0; i < 4; ++i) w[i] = (u32)bf16_of(acc[2 * i] * inv) | ((u32)bf16_of(acc[2 * i + 1] * inv) << 16);
    *reinterpret_cast<uint4*>(part_o + ((long long)out * ROWS + r) * DV + chunk * 8) =
        make_uint4(w[0], w[1], w[2], w[3]);
    if (chunk == 0) part_lse[out * ROWS + r] = stat[2 * r] + __logf(stat[2 * r + 1]);
  }
  // no CTA leaves while another reads its shared memory. Relaxed: every remote load's value is
  // used above, so it is complete; a release here would also drain this CTA's global stores.
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
#endif
}

// a warp per row (grid ROWS / 8 blocks of 256 threads); out [ROWS][DV] bf16
extern "C" __global__ void __launch_bounds__(256) merge(const u16* part_o, const float* part_lse, u16* out,
                                                        int nsplit, int empty) {
  if (empty) return;
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= ROWS) return;
  float mx = -1e30f;
  for (int k = lane; k < nsplit; k += 32) mx = fmaxf(mx, part_lse[k * ROWS + row]);
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float s = 0.f;
  for (int k = lane; k < nsplit; k += 32) s += __expf(part_lse[k * ROWS + row] - mx);
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  float acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = 0.f;
  for (int k = 0; k < nsplit; ++k) {
    const float w = __expf(part_lse[k * ROWS + row] - mx);
    const uint4* p = reinterpret_cast<const uint4*>(part_o + ((long long)k * ROWS + row) * DV + lane * 16);
    const uint4 a = p[0], b = p[1];
    const u32 vw[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    for (int i = 0; i < 8; ++i) {
      acc[2 * i] += w * f32_of((u16)(vw[i] & 0xFFFFu));
      acc[2 * i + 1] += w * f32_of((u16)(vw[i] >> 16));
    }
  }
  const float inv = 1.f / s;
  u32 w[8];
  for (int i = 0; i < 8; ++i) w[i] = (u32)bf16_of(acc[2 * i] * inv) | ((u32)bf16_of(acc[2 * i + 1] * inv) << 16);
  uint4* o = reinterpret_cast<uint4*>(out + row * DV + lane * 16);
  o[0] = make_uint4(w[0], w[1], w[2], w[3]);
  o[1] = make_uint4(w[4], w[5], w[6], w[7]);
}
"""

#: (NSPLIT, cluster sizes): 132 splits (the shipped batch-1 grid) by its divisors, 128 for C = 8
CONFIGS = ((132, (1, 2, 3, 4, 6)), (128, (1, 8)), (66, (1, 2)))


def source(cl: int) -> str:
    return f"#define CL {cl}\n" + KERNEL


def synthetic(nsplit: int, device: str = "cuda"):
    """The kernel's synthetic partials in float64: m, l [nsplit][ROWS] and o [nsplit][ROWS][DV]
    (normalised, rounded to bf16 as stored)."""
    import torch

    def uhash(x):
        return (((x * 2654435761) & 0xFFFFFFFF) >> 8).double() / 16777216.0

    c = torch.arange(nsplit, device=device, dtype=torch.int64)[:, None]
    r = torch.arange(ROWS, device=device, dtype=torch.int64)[None, :]
    m = 4.0 * uhash(c * ROWS + r)
    ell = 1.0 + 10.0 * uhash(c * ROWS + r + 7777777)
    d = torch.arange(DV, device=device, dtype=torch.int64)
    o = (uhash(((c * ROWS + r)[..., None]) * DV + d) - 0.5).to(torch.bfloat16).double()
    return m, ell, o


def merge_partials(m, ell, o):
    """(m, l, o) of the partials combined over their first dimension (the log-sum-exp merge)."""
    mx = m.max(0).values
    w = ell * (m - mx).exp()
    return mx, w.sum(0), (w[..., None] * o).sum(0) / w.sum(0)[..., None]


def reference(nsplit: int, device: str = "cuda"):
    """The merged output of the synthetic partials, fp32 [ROWS][DV]."""
    return merge_partials(*synthetic(nsplit, device))[2].float()


def graph_us(fn, reps: int) -> float:
    """Median us of one replay of a CUDA graph capturing fn(), CUDA events around each replay.
    Not `sol_read.graph_us`: at a few us per replay the host's enqueue of the replay would be
    timed too, so the GPU is kept busy while it happens (as `probe_harness.median_us` does)."""
    import torch
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)   # the GPU busy while the host enqueues: its cost is not timed
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)[len(ts) // 2]


def max_active_clusters(kernel, grid: int, cl: int, smem: int) -> int | None:
    """How many clusters of `cl` CTAs of `kernel` (launched on `grid` CTAs) the GPU holds at once
    (the driver's occupancy query; None where it fails): a grid of more clusters runs in more
    than one wave."""
    drv = kernel.drv
    try:
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = kernel.threads, 1, 1
        cfg.sharedMemBytes = smem
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cl, 1, 1
        cfg.attrs, cfg.numAttrs = [attr], 1
        err, n = drv.cuOccupancyMaxActiveClusters(kernel.fn, cfg)
        return int(n) if err == drv.CUresult.CUDA_SUCCESS else None
    except Exception as e:  # noqa: BLE001 -- informative only: the row says it is unknown
        print(f"max active clusters of {cl}: {type(e).__name__}: {e}", flush=True)
        return None


def measure(nsplit: int, cl: int, kernels, ref, reps: int, smem: int) -> dict:
    """One configuration: checked against `ref`, timed when right, checked again after timing."""
    import torch
    ep, mg = kernels
    n_out = nsplit // cl
    # NaN first: a row a kernel fails to write fails the check, not a previous configuration's row
    part_o = torch.full((n_out, ROWS, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    part_lse = torch.full((n_out, ROWS), float("nan"), dtype=torch.float32, device="cuda")
    out = torch.full((ROWS, DV), float("nan"), dtype=torch.bfloat16, device="cuda")

    def split(empty=0):
        ep.launch(nsplit, part_o, part_lse, empty)

    def merge(empty=0):
        mg.launch(ROWS // 8, part_o, part_lse, out, n_out, empty)

    def rel_err():
        split()
        merge()
        torch.cuda.synchronize()
        return ((out.float() - ref).norm() / ref.norm()).item()

    err = rel_err()
    most = max_active_clusters(ep, nsplit, cl, smem)
    row = {"nsplit": nsplit, "cluster": cl, "partials_written": n_out,
           "partial_mb": round(n_out * ROWS * DV * 2 / 1e6, 2), "max_active_clusters": most,
           "one_wave": None if most is None else n_out <= most, "rel_err": err}
    if err < 1e-2:
        row.update(split_us=graph_us(split, reps), merge_us=graph_us(merge, reps),
                   both_us=graph_us(lambda: (split(), merge()), reps),
                   empty_split_us=graph_us(lambda: split(1), reps),
                   drawn_split_us=graph_us(lambda: split(2), reps),   # the synthetic partial drawn and staged
                   empty_both_us=graph_us(lambda: (split(1), merge(1)), reps))
        row["epilogue_us"] = row["split_us"] - row["drawn_split_us"]
        row["rel_err_after"] = rel_err()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="folder for cluster_merge_probe.json")
    ap.add_argument("--smem", type=int, default=220 * 1024,
                    help="dynamic shared memory per CTA (default 220 KB: one CTA per SM, as the split kernel)")
    ap.add_argument("--reps", type=int, default=200, help="graph replays timed per measurement")
    ap.add_argument("--compile-only", action="store_true", help="compile each cluster size for sm_90a and stop")
    a = ap.parse_args(argv)
    sizes = sorted({cl for _, cls in CONFIGS for cl in cls})
    if a.compile_only:
        from probe_harness import compile_kernel
        for cl in sizes:
            print(f"== CL {cl}")
            compile_kernel(source(cl), f"cluster_merge_{cl}.cu")
        return 0
    if not a.out:
        ap.error("--out is required unless --compile-only")
    from kvtune.kernels.cuda.params import arch_limits
    need, most = ROWS * DV * 2 + (2 + 2 + max(sizes)) * ROWS * 4, arch_limits("sm_90").smem_per_block
    if not need <= a.smem <= most:
        ap.error(f"--smem: {a.smem} bytes; the epilogue needs {need} to {most} (sm_90's most per block)")
    import torch
    from probe_harness import Kernel
    res = {"device": torch.cuda.get_device_name(0), "smem": a.smem, "rows": []}
    merge = Kernel(source(1), "cluster_merge_1.cu", "merge", 0)   # the same at every cluster size
    kernels = {cl: (Kernel(source(cl), f"cluster_merge_{cl}.cu", "epilogue", a.smem), merge) for cl in sizes}
    for nsplit, cls in CONFIGS:
        ref = reference(nsplit)
        for cl in cls:
            res["rows"].append(measure(nsplit, cl, kernels[cl], ref, a.reps, a.smem))
            print(json.dumps(res["rows"][-1]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "cluster_merge_probe.json").write_text(json.dumps(res, indent=1))
    print(f"\nsplit epilogue + merge at 72 rows x {DV}, graph replay, median us ({res['device']}):")
    print(f"{'NSPLIT':>6} {'C':>2} {'waves':>5} {'partials MB':>11} {'split':>7} {'epilogue':>8} {'merge':>7} "
          f"{'both':>7} {'empty both':>10} {'rel err':>8}")
    for r in res["rows"]:
        waves = "?" if r["one_wave"] is None else "1" if r["one_wave"] else ">1"
        if "both_us" in r:
            print(f"{r['nsplit']:>6} {r['cluster']:>2} {waves:>5} {r['partial_mb']:>11} {r['split_us']:>7.2f} "
                  f"{r['epilogue_us']:>8.2f} {r['merge_us']:>7.2f} {r['both_us']:>7.2f} {r['empty_both_us']:>10.2f} "
                  f"{max(r['rel_err'], r['rel_err_after']):>8.1e}")
        else:
            print(f"{r['nsplit']:>6} {r['cluster']:>2} {waves:>5}  wrong (rel err {r['rel_err']:.2e}): not timed")
    return 0 if all(max(r["rel_err"], r.get("rel_err_after", 0)) < 1e-2 for r in res["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
