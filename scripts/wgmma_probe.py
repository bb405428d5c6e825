#!/usr/bin/env python3
"""Diagnosis (not a test, not shipped): what the verify tile loop would cost with wgmma (sm_90a).

The CUDA kernel's tile loop runs on mma.sync and ldmatrix (one source for sm_80..sm_120) and
spends about 2.7 us per 32-key tile per SM (results/kernel/README.md), bound by about 11 KB
of shared-memory traffic per key. This probe measures the same tile's arithmetic as Hopper's
warpgroup MMA would do it, with every operand already in shared memory (no HBM, no gather):
the speed of light of a wgmma tile loop, against which a rewrite can be judged before it is
written.

One CTA per SM, two warpgroups, 72 query rows (H 8 x T 9), one 64-key tile of 576 columns:
- S^T = K Q^T: 36 k16 steps of wgmma m64n72k16 (keys in M, query rows in N: 72 rows pad to
  72, not 128), split 18/18 across the warpgroups and summed through shared memory;
- softmax: max over the 64 keys per query row (shuffles, then 4 warps through shared memory),
  P = exp2(S * scale - max) in bf16, written to shared memory as P^T;
- O^T = V^T P^T: each warpgroup owns 256 of the 512 value columns, 4 x 4 wgmma m64n72k16 with
  V^T read transposed (imm-trans-a) from the same key rows.
Operands use the no-swizzle core-matrix layout: element (row r, column c) of a [rows][576]
bf16 operand at (r / 8) * 9216 + (c / 8) * 128 + (r % 8) * 16 + (c % 8) * 2 bytes.

It first checks one iteration against torch (S, then O from the kernel's own P) for each
reading of the descriptors' two byte offsets (which one strides K and which M/N), then times
the reading that passed: the full tile, QK^T only and PV only, per tile per SM.

    python scripts/wgmma_probe.py --out $OUT      # on an sm_90 GPU
"""
from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch
from probe_harness import Kernel, compile_kernel
from probe_harness import time_modes as harness_time_modes


def _wgmma_fn(trans_a: int) -> str:
    regs = ", ".join(f"%{i}" for i in range(36))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(36))
    return f"""
__device__ __forceinline__ void wgmma_n72_t{trans_a}(float (&d)[36], u64 da, u64 db, int acc) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %38, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 "
               "{{{regs}}}, %36, %37, p, 1, 1, {trans_a}, 0;\\n}}\\n"
               : {outs}
               : "l"(da), "l"(db), "r"(acc));
}}"""


#: PTX helpers shared with pingpong_probe.py: the no-swizzle descriptor, the warpgroup fences, bf16.
HELPERS = r"""
typedef unsigned int u32; typedef unsigned short u16; typedef unsigned long long u64;
#define ROWBLK 9216   // bytes per 8-row block of a [rows][576] operand: 72 core matrices of 128 B

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {  // no swizzle, base offset 0
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void async_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void keep(float (&d)[36]) {
#pragma unroll
  for (int i = 0; i < 36; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
__device__ __forceinline__ u16 bf16_bits(float x) {
  u32 u = __float_as_uint(x); u += 0x7fffu + ((u >> 16) & 1u); return (u16)(u >> 16);
}
"""

SRC = HELPERS + r"""
// s[4j + e]: key 16 warp + lane/4 (+8 for e >= 2), query row 8j + 2(lane%4) + (e & 1)
__device__ __forceinline__ void dump_s(const float (&s)[36], float* s_out, int warp, int lane) {
#pragma unroll
  for (int j = 0; j < 9; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s_out[(16 * warp + (lane >> 2) + 8 * (e >> 1)) * 72 + 8 * j + 2 * (lane & 3) + (e & 1)] = s[4 * j + e];
}
// P = exp2(S * scale - max over the 64 keys) for query-row blocks J0..J1-1, as P^T in bf16;
// the max crosses the warpgroup's 4 warps through `red` and named barrier `bar`
template <int J0, int J1>
__device__ __forceinline__ void softmax_rows(const float (&s)[36], float* red, unsigned char* Ps, u16* p_out,
                                             bool dump, int warp, int lane, float scale, int bar) {
  float mx[18];
#pragma unroll
  for (int j = J0; j < J1; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
      mx[2 * j + e] = v;
    }
  if (lane < 4)
#pragma unroll
    for (int j = J0; j < J1; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) red[warp * 72 + 8 * j + 2 * lane + e] = mx[2 * j + e];
  asm volatile("bar.sync %0, 128;\n" :: "r"(bar) : "memory");
#pragma unroll
  for (int j = J0; j < J1; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = 8 * j + 2 * (lane & 3) + (e & 1), m = 16 * warp + (lane >> 2) + 8 * (e >> 1);
      const float rm = fmaxf(fmaxf(red[n], red[72 + n]), fmaxf(red[144 + n], red[216 + n])) * scale;
      const u16 pb = bf16_bits(exp2f(s[4 * j + e] * scale - rm));
      *(u16*)(Ps + (n >> 3) * 1024 + (m >> 3) * 128 + (n & 7) * 16 + (m & 7) * 2) = pb;
      if (dump) p_out[m * 72 + n] = pb;
    }
}
WGMMA_FNS

// mode bit 0: verify (one iteration, write S, P, O); bit 1: skip QK^T; bit 2: skip PV; bit 3: skip softmax;
// bit 4: the softmax split over both warpgroups
extern "C" __global__ void __launch_bounds__(256, 1) probe(const u16* q, const u16* kv, float* s_out, u16* p_out,
    float* o_out, int iters, int mode, u32 lbo_k, u32 sbo_k, u32 lbo_v, u32 sbo_v, float scale) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* Qs = smem;                       // 9 row blocks
  unsigned char* Ks = smem + 9 * ROWBLK;          // 8 row blocks (64 keys)
  float* Ss = (float*)(smem + 17 * ROWBLK);       // [2][128 threads][36] partial S^T
  float* red = Ss + 2 * 128 * 36;                 // [4 warps][72] per-warp column max
  unsigned char* Ps = (unsigned char*)(red + 4 * 72);  // P^T: 9 row blocks (query rows) x 8 key chunks
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  for (int t = tid; t < 72 * 72; t += 256) {
    const int r = t / 72, c = t % 72;
    *(uint4*)(Qs + (r >> 3) * ROWBLK + c * 128 + (r & 7) * 16) = ((const uint4*)q)[t];
  }
  for (int t = tid; t < 64 * 72; t += 256) {
    const int r = t / 72, c = t % 72;
    *(uint4*)(Ks + (r >> 3) * ROWBLK + c * 128 + (r & 7) * 16) = ((const uint4*)kv)[t];
  }
  async_fence();
  __syncthreads();
  const u32 qs = smem_u32(Qs), ks = smem_u32(Ks), ps = smem_u32(Ps);
  float o[4][36];
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int i = 0; i < 36; ++i) o[m][i] = 0.f;
  float s[36];
  for (int it = 0; it < iters; ++it) {
    if (!(mode & 2)) {
      // S^T = K Q^T over this warpgroup's 18 k16 steps
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 18; ++kk) {
        const u32 off = (18 * wg + kk) * 2 * 128;
        wgmma_n72_t0(s, desc(ks + off, lbo_k, sbo_k), desc(qs + off, lbo_k, sbo_k), kk);
      }
      wg_commit();
      wg_wait0();
      keep(s);
      if (mode & 8) continue;  // QK^T alone: no exchange, no softmax
      const bool dump = (mode & 1) && it == 0;
      if (mode & 16) {  // both warpgroups: exchange partials conflict-free, then each does its row blocks
#pragma unroll
        for (int i = 0; i < 36; ++i) Ss[(wg * 36 + i) * 128 + wt] = s[i];
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 36; ++i) s[i] += Ss[((1 - wg) * 36 + i) * 128 + wt];
        if (dump && wg == 0) dump_s(s, s_out, warp, lane);
        if (wg == 0) softmax_rows<0, 5>(s, red, Ps, p_out, dump, warp, lane, scale, 1);
        else softmax_rows<5, 9>(s, red, Ps, p_out, dump, warp, lane, scale, 2);
      } else {  // the first version: one warpgroup sums the partials and does every row
#pragma unroll
        for (int i = 0; i < 36; ++i) Ss[(wg * 128 + wt) * 36 + i] = s[i];
        __syncthreads();
        if (wg == 0) {
#pragma unroll
          for (int i = 0; i < 36; ++i) s[i] += Ss[(128 + wt) * 36 + i];
          if (dump) dump_s(s, s_out, warp, lane);
          softmax_rows<0, 9>(s, red, Ps, p_out, dump, warp, lane, scale, 1);
        }
      }
      async_fence();
      __syncthreads();
    }
    if (!(mode & 4)) {
      // O^T += V^T P^T: this warpgroup's 256 value columns, 4 k16 steps of keys
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const u32 a = ks + (2 * kk) * ROWBLK + ((256 * wg + 64 * m) / 8) * 128;
          wgmma_n72_t1(o[m], desc(a, lbo_v, sbo_v), desc(ps + kk * 2 * 128, 128, 1024), 1);
        }
      wg_commit();
      wg_wait0();
#pragma unroll
      for (int m = 0; m < 4; ++m) keep(o[m]);
      __syncthreads();  // the next iteration rewrites S and P
    }
  }
  if (mode & 1) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          o_out[(256 * wg + 64 * m + 16 * warp + (lane >> 2) + 8 * (e >> 1)) * 72 + 8 * j + 2 * (lane & 3) + (e & 1)] =
              o[m][4 * j + e];
  } else {
    float acc = 0.f;
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int i = 0; i < 36; ++i) acc += o[m][i];
    if (acc == 1234.5f) o_out[tid] = acc;  // never true: keeps the MMAs alive
  }
}
"""

# the layout needs 17 * 9216 + 2 * 128 * 36 * 4 + 4 * 72 * 4 + 9 * 1024 bytes; the launch takes the
# whole 227 KB so that a wrong reading of the byte offsets reads garbage, not past the allocation
SMEM = 227 * 1024


def source() -> str:
    return SRC.replace("WGMMA_FNS", _wgmma_fn(0) + _wgmma_fn(1))


def compile_probe(arch: str = "sm_90a") -> bytes:
    return compile_kernel(source(), "wgmma_probe.cu", arch)[0]


class Probe(Kernel):
    def __init__(self):
        super().__init__(source(), "wgmma_probe.cu", "probe", SMEM)

    def launch(self, grid, q, kv, s, p, o, iters, mode, lbo_k, sbo_k, lbo_v, sbo_v, scale):
        super().launch(grid, q, kv, s, p, o, iters, mode, *[ctypes.c_uint(v) for v in (lbo_k, sbo_k, lbo_v, sbo_v)],
                       float(scale))


def check(pr: Probe, readings, mode: int = 1) -> list[dict]:
    """One iteration per reading of the byte offsets, against torch (mode 1, or 17 for the split
    softmax); one row per reading with its errors."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(72, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(64, 576, device="cuda", generator=g).bfloat16()
    scale = 576 ** -0.5 * 1.4426950408889634
    s_ref = kv.float() @ q.float().t()                          # [64 keys, 72 rows]
    out = []
    for lbo_k, sbo_k, lbo_v, sbo_v in readings:
        s = torch.full((64, 72), float("nan"), device="cuda")
        p = torch.zeros(64, 72, dtype=torch.bfloat16, device="cuda")
        o = torch.full((512, 72), float("nan"), device="cuda")
        pr.launch(1, q, kv, s, p, o, 1, mode, lbo_k, sbo_k, lbo_v, sbo_v, scale)
        torch.cuda.synchronize()
        s_err = ((s - s_ref).norm() / s_ref.norm()).item()
        p_ref = torch.exp2(s * scale - (s * scale).amax(0, keepdim=True))
        p_err = ((p.float() - p_ref).norm() / p_ref.norm()).item()
        o_ref = kv[:, :512].float().t() @ p.float()                # V^T P^T from the kernel's own P
        o_err = ((o - o_ref).norm() / o_ref.norm()).item()
        row = {"mode": mode, "lbo_k": lbo_k, "sbo_k": sbo_k, "lbo_v": lbo_v, "sbo_v": sbo_v,
               "s_err": s_err, "p_err": p_err, "o_err": o_err}
        print(row, flush=True)
        out.append(row)
    return out


def time_modes(pr: Probe, reading, iters: int = 512) -> list[dict]:
    q = torch.randn(72, 576, device="cuda").bfloat16()
    kv = torch.randn(64, 576, device="cuda").bfloat16()
    s = torch.empty(64, 72, device="cuda")
    p = torch.empty(64, 72, dtype=torch.bfloat16, device="cuda")
    o = torch.empty(512, 72, device="cuda")
    modes = (("QK^T + softmax + PV", 0), ("QK^T + softmax only", 4), ("QK^T only", 12), ("PV only", 2),
             ("QK^T + split softmax + PV", 16), ("QK^T + split softmax", 20))
    return harness_time_modes(lambda sms, mode: pr.launch(sms, q, kv, s, p, o, iters, mode, *reading, 0.06), modes,
                              lambda mode: 2 * 72 * 64 * ((0 if mode & 2 else 576) + (0 if mode & 4 else 512)),
                              iters, 64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    pr = Probe()
    # (LBO, SBO) of K/Q (K-major) and of V^T (MN-major): which offset strides which dimension
    readings = [(128, 9216, 128, 9216), (128, 9216, 9216, 128), (9216, 128, 128, 9216), (9216, 128, 9216, 128)]
    checked = check(pr, readings)
    good = [r for r in checked if r["s_err"] < 1e-2 and r["p_err"] < 1e-2 and r["o_err"] < 1e-2]
    res = {"device": torch.cuda.get_device_name(0), "checks": checked, "timings": []}
    if good:
        g = good[0]
        reading = (g["lbo_k"], g["sbo_k"], g["lbo_v"], g["sbo_v"])
        split = check(pr, [reading], mode=17)[0]
        res["checks"].append(split)
        if not (split["s_err"] < 1e-2 and split["p_err"] < 1e-2 and split["o_err"] < 1e-2):
            print("the split softmax does not match torch: nothing timed")
            good = []
        else:
            res["timings"] = time_modes(pr, reading)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "wgmma_probe.json").write_text(json.dumps(res, indent=1))
    if not good:
        print("no reading of the descriptors (or the split softmax) matched torch: nothing timed")
        return 1
    print(f"\nwgmma tile loop, operands in shared memory, 72 query rows, one CTA per SM ({res['device']}):")
    for r in res["timings"]:
        print(f"  {r['what']:<22} {r['us_per_64_keys']:.3f} us per 64-key tile per SM "
              f"({r['us_per_32_keys']:.3f} per 32 keys), {r['tflops_all_sms']:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
