#!/usr/bin/env python3
"""Diagnosis (not a test, not shipped): a two-warpgroup ping-pong verify tile loop on wgmma (sm_90a).

`wgmma_probe.py` measured the pieces of a wgmma tile loop with every operand in shared memory:
QK^T 0.43 and PV 0.43 us per 32 keys per SM, but 2.29 us for the loop as written (QK^T split
over both warpgroups and summed through shared memory, a full row max through shared memory
every tile, every stage behind a CTA barrier), against 1.16 us of HBM time per 32 keys. This
probe measures the loop a rewrite of the CUDA kernel would use, with the same operands (72
query rows, one 64-key tile of 576 columns in shared memory, no gather), before it is written:

- **Ping-pong**: warpgroup w computes S^T = K Q^T (36 wgmma m64n72k16, all 576 columns) and the
  softmax of tiles t = w, w + 2, ...; both warpgroups run O^T += V^T P^T for every tile on their
  own 256 value columns. While one warpgroup runs its softmax, the other's MMAs keep the tensor
  cores busy: PV of the other's last tile is issued right behind the own QK^T and runs under
  the softmax.
- **Lazy max**: a row's running max moves only when a score exceeds it by more than 8 (log2
  units); the test is one `bar.red.or` over the warpgroup; only then do the 4 warps exchange their
  column maxima through shared memory and the O^T columns (both warpgroups') get rescaled.
- P^T goes through four shared-memory buffers (tile t % 4) so that no tile's P is rewritten while
  a PV may still read it; each tile's P, its max and its rescale factors are published to the
  other warpgroup by one named barrier (`bar.arrive` / `bar.sync`, 256 threads).

It first runs a few tiles whose scores grow by 3 per tile (each warpgroup takes the rescale path)
and checks O / l against torch, then times the loop (no growth: the steady state), the loop
without its softmax, and without its PV, per 32 keys per SM, with one CTA per SM.

    python scripts/pingpong_probe.py --out $OUT      # on an sm_90 GPU
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from probe_harness import Kernel, compile_kernel
from probe_harness import time_modes as harness_time_modes
from wgmma_probe import HELPERS, _wgmma_fn

#: the warpgroup barriers, the lazy max's slack and exp2, shared with rows_in_m_probe.py
SYNC_FNS = r"""
#define SLACK 8.f
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ int bar_or(int id, int pred) {  // warpgroup-wide OR (128 threads)
  int r;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.s32 p, %2, 0;\nbar.red.or.pred q, %1, 128, p;\nselp.s32 %0, 1, 0, q;\n}\n"
               : "=r"(r) : "r"(id), "r"(pred) : "memory");
  return r;
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
"""

KERNEL = SYNC_FNS + r"""__device__ __forceinline__ void keep4(float (&o)[4][36]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) keep(o[m]);
}
// O^T columns (query rows n = 8j + 2(lane%4) + (e&1)) times alpha[n]; l likewise
__device__ __forceinline__ void rescale(float (&o)[4][36], float (&l)[18], const float* alpha, int lane) {
#pragma unroll
  for (int j = 0; j < 9; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float a = alpha[8 * j + 2 * (lane & 3) + e];
      l[2 * j + e] *= a;
#pragma unroll
      for (int m = 0; m < 4; ++m) { o[m][4 * j + e] *= a; o[m][4 * j + 2 + e] *= a; }
    }
}

// mode bit 0: write O^T, l and the max (verify); bit 1: tile t's scores + 3 t (the max grows);
// bit 2: no softmax (P left as it is); bit 3: no PV
extern "C" __global__ void __launch_bounds__(256, 1) pingpong(const u16* q, const u16* kv, float* o_out, float* l_out,
    float* m_out, int iters, int mode, float scale) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* Qs = smem;                       // 9 row blocks (72 query rows)
  unsigned char* Ks = smem + 9 * ROWBLK;          // 8 row blocks (64 keys)
  unsigned char* Ps = smem + 17 * ROWBLK;         // [4 tiles][9 row blocks x 8 key chunks] P^T
  float* m_s = (float*)(Ps + 4 * 9 * 1024);       // [72] running max (log2 units)
  float* alpha_s = m_s + 72;                      // [4 tiles][72] rescale factors of the tile's max move
  float* red = alpha_s + 4 * 72;                  // [2 warpgroups][4 warps][72] column maxima
  int* grew_s = (int*)(red + 2 * 4 * 72);         // [4 tiles]: the tile moved some row's max
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  for (int t = tid; t < 72 * 72; t += 256) {
    const int r = t / 72, c = t % 72;
    *(uint4*)(Qs + (r >> 3) * ROWBLK + c * 128 + (r & 7) * 16) = ((const uint4*)q)[t];
  }
  for (int t = tid; t < 64 * 72; t += 256) {
    const int r = t / 72, c = t % 72;
    *(uint4*)(Ks + (r >> 3) * ROWBLK + c * 128 + (r & 7) * 16) = ((const uint4*)kv)[t];
  }
  for (int t = tid; t < 4 * 9 * 1024 / 16; t += 256) ((uint4*)Ps)[t] = make_uint4(0u, 0u, 0u, 0u);
  for (int t = tid; t < 72; t += 256) m_s[t] = -__int_as_float(0x7f800000);
  async_fence();
  __syncthreads();
  const u32 qs = smem_u32(Qs), ks = smem_u32(Ks), ps = smem_u32(Ps);
  float o[4][36], l[18], s[36];
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int i = 0; i < 36; ++i) o[m][i] = 0.f;
#pragma unroll
  for (int i = 0; i < 18; ++i) l[i] = 0.f;
  auto pv = [&](int tile) {  // O^T += V^T P^T on this warpgroup's 256 value columns
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int m = 0; m < 4; ++m)
        wgmma_n72_t1(o[m], desc(ks + (2 * kk) * ROWBLK + ((256 * wg + 64 * m) / 8) * 128, 9216, 128),
                     desc(ps + (tile % 4) * 9216 + kk * 2 * 128, 128, 1024), 1);
    wg_commit();
  };
  int t = wg;
  for (; t < iters; t += 2) {
    // S^T = K Q^T of tile t, all 576 columns
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 36; ++kk)
      wgmma_n72_t0(s, desc(ks + kk * 256, 128, 9216), desc(qs + kk * 256, 128, 9216), kk);
    wg_commit();
    if (t >= 1) {  // the other warpgroup's tile t-1: its P, max and rescale factors are published
      bar_sync(3 + (t - 1) % 4, 256);
      if (!(mode & 8)) {
        if (grew_s[(t - 1) % 4]) {
          wg_wait0();
          keep4(o);
          rescale(o, l, alpha_s + ((t - 1) % 4) * 72, lane);
        }
        pv(t - 1);
        wg_wait1();  // QK^T of tile t done; PV of t-1 runs on under the softmax
      } else {
        wg_wait0();  // no PV issued: the last group is QK^T's
      }
    } else {
      wg_wait0();
    }
    keep(s);
    int grew = 0;
    if (!(mode & 4)) {
      const float bias = (mode & 2) ? 3.f * t : 0.f;
      float mr[18];
      int need = 0;
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) mr[2 * j + e] = m_s[8 * j + 2 * (lane & 3) + e];
#pragma unroll
      for (int i = 0; i < 36; ++i) {
        s[i] = s[i] * scale + bias;
        need |= s[i] > mr[2 * (i >> 2) + (i & 1)] + SLACK;
      }
      grew = bar_or(1 + wg, need);
      if (grew) {  // the 4 warps' column maxima through shared memory; rows that grew take their tile max
        float* rw = red + wg * 4 * 72;
#pragma unroll
        for (int j = 0; j < 9; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = fmaxf(s[4 * j + e], s[4 * j + 2 + e]);
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
            v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
            if (lane < 4) rw[warp * 72 + 8 * j + 2 * lane + e] = v;
          }
        bar_sync(1 + wg, 128);
        float alpha[18];
#pragma unroll
        for (int j = 0; j < 9; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int n = 8 * j + 2 * (lane & 3) + e;
            const float mx = fmaxf(fmaxf(rw[n], rw[72 + n]), fmaxf(rw[144 + n], rw[216 + n]));
            const float old = mr[2 * j + e];
            const float now = mx > old + SLACK ? mx : old;
            alpha[2 * j + e] = now == old ? 1.f : ex2(old - now);
            mr[2 * j + e] = now;
            if (warp == 0 && lane < 4) {
              m_s[n] = now;
              alpha_s[(t % 4) * 72 + n] = alpha[2 * j + e];
            }
          }
        // own O^T: the PV of tile t-1 may still be accumulating into it
        wg_wait0();
        keep4(o);
#pragma unroll
        for (int j = 0; j < 9; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float a = alpha[2 * j + e];
            l[2 * j + e] *= a;
#pragma unroll
            for (int m = 0; m < 4; ++m) { o[m][4 * j + e] *= a; o[m][4 * j + 2 + e] *= a; }
          }
      }
      unsigned char* pt = Ps + (t % 4) * 9216;
#pragma unroll
      for (int i = 0; i < 36; ++i) {
        const int j = i >> 2, e = i & 3;
        const int n = 8 * j + 2 * (lane & 3) + (e & 1), m = 16 * warp + (lane >> 2) + 8 * (e >> 1);
        const float p = ex2(s[i] - mr[2 * j + (e & 1)]);
        l[2 * j + (e & 1)] += p;
        *(u16*)(pt + (n >> 3) * 1024 + (m >> 3) * 128 + (n & 7) * 16 + (m & 7) * 2) = bf16_bits(p);
      }
    }
    if (wt == 0) grew_s[t % 4] = grew;
    async_fence();                 // P^T written by the generic proxy, read by wgmma
    bar_arrive(3 + t % 4, 256);    // tile t's P, max and factors to the other warpgroup
    bar_sync(1 + wg, 128);         // all of this warpgroup's P^T is written
    if (!(mode & 8)) pv(t);
  }
  if (t - 1 < iters) {  // the other warpgroup's last tile, after this one's last
    bar_sync(3 + (t - 1) % 4, 256);
    if (!(mode & 8)) {
      if (grew_s[(t - 1) % 4]) {
        wg_wait0();
        keep4(o);
        rescale(o, l, alpha_s + ((t - 1) % 4) * 72, lane);
      }
      pv(t - 1);
    }
  }
  wg_wait0();
  keep4(o);
  __syncthreads();
  if (mode & 1) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          o_out[(256 * wg + 64 * m + 16 * warp + (lane >> 2) + 8 * (e >> 1)) * 72 + 8 * j + 2 * (lane & 3) + (e & 1)] =
              o[m][4 * j + e];
    // l: this thread's keys of its 18 rows, summed over the 8 key lanes, the 4 warps and both warpgroups
#pragma unroll
    for (int i = 0; i < 18; ++i) {
      float v = l[i];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) atomicAdd(&l_out[8 * (i >> 1) + 2 * lane + (i & 1)], v);
    }
    for (int r = tid; r < 72; r += 256) m_out[r] = m_s[r];
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

SMEM = 17 * 9216 + 4 * 9216 + (72 + 4 * 72 + 2 * 4 * 72) * 4 + 4 * 4


def source() -> str:
    return HELPERS + _wgmma_fn(0) + _wgmma_fn(1) + KERNEL


def compile_probe(arch: str = "sm_90a") -> bytes:
    return compile_kernel(source(), "pingpong_probe.cu", arch)[0]


class Probe(Kernel):
    def __init__(self):
        super().__init__(source(), "pingpong_probe.cu", "pingpong", SMEM)

    def launch(self, grid, q, kv, o, lsum, m, iters, mode, scale):
        super().launch(grid, q, kv, o, lsum, m, iters, mode, float(scale))


def check(pr: Probe, iters: int) -> dict:
    """`iters` tiles of the same keys, tile t's scores raised by 3 t (so the max moves, in both
    warpgroups), against torch in fp32: O / l per query row, and l against the kernel's own max."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(72, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(64, 576, device="cuda", generator=g).bfloat16()
    scale = 576 ** -0.5 * 1.4426950408889634 * 4   # sharp rows: the max matters
    o = torch.full((512, 72), float("nan"), device="cuda")
    lsum = torch.zeros(72, device="cuda")
    m = torch.full((72,), float("nan"), device="cuda")
    pr.launch(1, q, kv, o, lsum, m, iters, 3, scale)
    torch.cuda.synchronize()
    s = (kv.float() @ q.float().t()) * scale                  # [64 keys, 72 rows], log2 units
    ts = torch.arange(iters, device="cuda", dtype=torch.float32) * 3
    logits = s.unsqueeze(0) + ts.view(-1, 1, 1)                # [tiles, keys, rows]
    w = torch.exp2(logits - m.view(1, 1, -1))                  # at the kernel's final max
    l_ref = w.sum((0, 1))
    o_ref = torch.einsum("kd,tkr->dr", kv[:, :512].float(), w)
    o_err = ((o / lsum - o_ref / l_ref).norm() / (o_ref / l_ref).norm()).item()
    l_err = ((lsum - l_ref).abs() / l_ref).max().item()
    lag = (m - logits.amax((0, 1))).abs().max().item()
    row = {"iters": iters, "o_err": o_err, "l_err": l_err, "max_final_minus_true": lag}
    print(row, flush=True)
    return row


def time_modes(pr: Probe, iters: int = 512) -> list[dict]:
    q = torch.randn(72, 576, device="cuda").bfloat16()
    kv = torch.randn(64, 576, device="cuda").bfloat16()
    o = torch.empty(512, 72, device="cuda")
    lsum = torch.zeros(72, device="cuda")
    m = torch.empty(72, device="cuda")
    modes = (("ping-pong: QK^T + softmax + PV", 0), ("no softmax", 4), ("no PV", 8), ("QK^T only", 12))
    return harness_time_modes(lambda sms, mode: pr.launch(sms, q, kv, o, lsum, m, iters, mode, 0.06), modes,
                              lambda mode: 2 * 72 * 64 * (576 + (0 if mode & 8 else 512)), iters, 64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    pr = Probe()
    checks = [check(pr, n) for n in (1, 2, 7, 12)]
    ok = all(c["o_err"] < 1e-2 and c["l_err"] < 1e-2 for c in checks)
    res = {"device": torch.cuda.get_device_name(0), "checks": checks, "timings": time_modes(pr) if ok else []}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "pingpong_probe.json").write_text(json.dumps(res, indent=1))
    if not ok:
        print("the ping-pong loop does not match torch: nothing timed")
        return 1
    print(f"\nping-pong wgmma tile loop, operands in shared memory, 72 query rows, one CTA per SM ({res['device']}):")
    for r in res["timings"]:
        print(f"  {r['what']:<32} {r['us_per_64_keys']:.3f} us per 64-key tile per SM "
              f"({r['us_per_32_keys']:.3f} per 32 keys), {r['tflops_all_sms']:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
