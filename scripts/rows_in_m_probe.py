#!/usr/bin/env python3
"""Diagnosis (not a test, not shipped): the ping-pong tile loop with query rows in M (sm_90a).

`pingpong_probe.py` measured a two-warpgroup ping-pong loop at 0.917 us per 32 keys per SM with
keys in M (S^T = K Q^T), under the 1.16-1.20 us of HBM time of those keys; but its 64-key tiles
(72 KB) do not fit twice beside Q in 227 KB, so a kernel that streams key tiles cannot use it. This
probe measures the orientation that fits (FlashMLA's): query rows in M, keys in N, 32-key tiles
(36 KB, so three stages and Q fit), before the kernel is written:

- S = Q K^T: 36 wgmma m64n32k16 (64 query rows, both operands in shared memory);
- the softmax on S in registers: each warp owns 16 whole rows, so a row's max is two quad
  shuffles (no shared memory); lazy as in `pingpong_probe.py` (a row's max moves only past a
  slack of 8 in log2; `bar.red.or` tells the warpgroup when O must be rescaled);
- O = P V: P stays in registers as the A operand (wgmma m64n256k16, A from registers, V read
  transposed from the key rows) for the warpgroup that made it, and goes to shared memory (4 KB
  per tile) for the other warpgroup's 256 value columns; ping-pong as in `pingpong_probe.py`
  (warpgroup w takes tiles w, w + 2, ...; the other's last tile's PV runs behind the own QK^T).

Rows 65-72 of a 72-row CTA (H 8 x T 9) are not in this probe: the kernel would run them on a
third warpgroup (mma.sync). In two shared-memory layouts, the core-matrix one without swizzle
(`wgmma_probe.py`'s) and the 128-byte swizzle that a cp.async gather fills without bank conflicts
(its V descriptor's two byte offsets tried both ways, the first that matches kept), it checks a
few tiles with a moving max against torch, then times the loop per 32 keys per SM, one CTA per
SM, every operand already in shared memory.

    python scripts/rows_in_m_probe.py --out $OUT      # on an sm_90 GPU
"""
from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch
from probe_harness import Kernel, compile_kernel
from probe_harness import time_modes as harness_time_modes
from pingpong_probe import SYNC_FNS
from wgmma_probe import HELPERS


def _wgmma_ss(n: int) -> str:
    """S = A B with both operands in shared memory (K-major), m64 n`n` k16, n / 2 accumulators."""
    k = n // 2
    regs = ", ".join(f"%{i}" for i in range(k))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(k))
    return f"""
__device__ __forceinline__ void wgmma_ss_n{n}(float (&d)[{k}], u64 da, u64 db, int acc) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 2}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "
               "{{{regs}}}, %{k}, %{k + 1}, p, 1, 1, 0, 0;\\n}}\\n"
               : {outs}
               : "l"(da), "l"(db), "r"(acc));
}}"""


def _wgmma_pv(n: int) -> str:
    """O += P V, m64 n`n` k16: P from registers (rs) or shared memory (ss), V transposed (MN-major)."""
    k = n // 2
    regs = ", ".join(f"%{i}" for i in range(k))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(k))
    return f"""
__device__ __forceinline__ void wgmma_rs_n{n}(float (&d)[{k}], const u32 (&a)[4], u64 db) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 5}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "
               "{{{regs}}}, {{%{k}, %{k + 1}, %{k + 2}, %{k + 3}}}, %{k + 4}, p, 1, 1, 1;\\n}}\\n"
               : {outs}
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}}
__device__ __forceinline__ void wgmma_ssv_n{n}(float (&d)[{k}], u64 da, u64 db) {{
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 2}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 "
               "{{{regs}}}, %{k}, %{k + 1}, p, 1, 1, 0, 1;\\n}}\\n"
               : {outs}
               : "l"(da), "l"(db), "r"(1));
}}"""


#: device functions shared with stream_probe.py (barriers, the swizzled layout, P packing, rescale)
DEVICE_FNS = SYNC_FNS + r"""
#define PBUF 4096   // one tile's P: 64 rows x 32 keys bf16, K-major core matrices (8 row blocks of 512 B)
__device__ __forceinline__ u64 desc_sw(u32 addr, u32 lbo, u32 sbo) {  // 128-byte swizzle, 1024-aligned atoms
  return desc(addr, lbo, sbo) | ((u64)1 << 62);
}
// byte offset of 16-byte chunk c (columns 8c..8c+7) of row r in a [rows][576] tile, 128-byte swizzle
__device__ __forceinline__ u32 sw_off(int r, int c, int rows) {
  return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) * 16);
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) { return (u32)bf16_bits(lo) | ((u32)bf16_bits(hi) << 16); }
__device__ __forceinline__ void keep128(float (&o)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(o[i]) :: "memory");
}
__device__ __forceinline__ void keep16(float (&s)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+f"(s[i]) :: "memory");
}
// accumulator element i of m64nN: row 16 warp + lane / 4 + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 (lane % 4) + (i & 1)
__device__ __forceinline__ void rescale(float (&o)[128], float (&l)[2], float a0, float a1) {
  l[0] *= a0;
  l[1] *= a1;
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] *= ((i >> 1) & 1) ? a1 : a0;
}
// The softmax of one tile, lazy max: this thread's rows r0 = 16 warp + lane / 4 and r1 = r0 + 8
// (t4 = lane % 4). S (s) is scaled to log2 units plus `bias`; a row's max moves only past SLACK,
// and when some row's moves (one bar.red.or over the warpgroup, barrier `bar`) the maxima go to
// m_s and the rescale factors to alpha_t, and this warpgroup's O and l are rescaled once its MMAs
// in flight are done. P leaves as the A fragments of the own PV (a: a0 row g / k 2t, a1 row g+8,
// a2 / a3 k 2t+8, per k16 step) and in shared memory at pt for the other warpgroup (K-major core
// matrices: row r, keys 8j + 2 t4 .. +1 in one 4-byte store). Returns whether a max moved.
__device__ __forceinline__ int softmax_tile(float (&s)[16], float scale, float bias, float* m_s, float* alpha_t,
    unsigned char* pt, int bar, int r0, int r1, int t4, float (&o)[128], float (&l)[2], u32 (&a)[2][4]) {
  float m0 = m_s[r0], m1 = m_s[r1], mx0 = -__int_as_float(0x7f800000), mx1 = mx0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    s[i] = s[i] * scale + bias;
    if ((i >> 1) & 1) mx1 = fmaxf(mx1, s[i]); else mx0 = fmaxf(mx0, s[i]);
  }
  const int grew = bar_or(bar, (mx0 > m0 + SLACK) | (mx1 > m1 + SLACK));
  if (grew) {  // each warp owns its 16 rows: the row max is a quad reduction
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float n0 = mx0 > m0 + SLACK ? mx0 : m0, n1 = mx1 > m1 + SLACK ? mx1 : m1;
    const float a0 = n0 == m0 ? 1.f : ex2(m0 - n0), a1 = n1 == m1 ? 1.f : ex2(m1 - n1);
    if (t4 == 0) {
      m_s[r0] = n0;
      m_s[r1] = n1;
      alpha_t[r0] = a0;
      alpha_t[r1] = a1;
    }
    m0 = n0;
    m1 = n1;
    wg_wait0();  // own O: the other tile's PV may still be accumulating into it
    keep128(o);
    rescale(o, l, a0, a1);
  }
  float p[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    p[i] = ex2(s[i] - (((i >> 1) & 1) ? m1 : m0));
    l[(i >> 1) & 1] += p[i];
  }
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    a[kk][0] = pack_bf16(p[8 * kk + 0], p[8 * kk + 1]);
    a[kk][1] = pack_bf16(p[8 * kk + 2], p[8 * kk + 3]);
    a[kk][2] = pack_bf16(p[8 * kk + 4], p[8 * kk + 5]);
    a[kk][3] = pack_bf16(p[8 * kk + 6], p[8 * kk + 7]);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    *(u32*)(pt + (r0 >> 3) * 512 + j * 128 + (r0 & 7) * 16 + 4 * t4) = pack_bf16(p[4 * j], p[4 * j + 1]);
    *(u32*)(pt + (r1 >> 3) * 512 + j * 128 + (r1 & 7) * 16 + 4 * t4) = pack_bf16(p[4 * j + 2], p[4 * j + 3]);
  }
  return grew;
}
"""

KERNEL = DEVICE_FNS + r"""
// mode bit 0: write O, l and the max (verify); bit 1: tile t's scores + 3 t (the max grows);
// bit 2: no softmax (P as it is); bit 3: no PV
// sw: 0 the core-matrix layout without swizzle (as wgmma_probe.py), 1 the 128-byte swizzle that a
// cp.async gather can fill without bank conflicts (Q and K as in the WGMMA experiment of commit
// 2a1a48e: 9 panels of 64 columns, row r's 16-byte chunk j at (j ^ r % 8) * 16); lbo_v / sbo_v: the
// byte offsets of V's descriptor (MN-major), tried both ways by the check
extern "C" __global__ void __launch_bounds__(256, 1) rows_in_m(const u16* q, const u16* kv, float* o_out,
    float* l_out, float* m_out, int iters, int mode, float scale, int sw, u32 lbo_v, u32 sbo_v) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* Qs = smem;                       // 8 row blocks (64 query rows)
  unsigned char* Ks = smem + 8 * ROWBLK;          // 4 row blocks (32 keys)
  unsigned char* Ps = smem + 12 * ROWBLK;         // [4 tiles][PBUF] P for the other warpgroup
  float* m_s = (float*)(Ps + 4 * PBUF);           // [64] running max (log2 units)
  float* alpha_s = m_s + 64;                      // [4 tiles][64] rescale factors of the tile's max move
  int* grew_s = (int*)(alpha_s + 4 * 64);         // [4 tiles]: the tile moved some row's max
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3, r0 = 16 * warp + g, r1 = r0 + 8;
  for (int i = tid; i < 64 * 72; i += 256) {
    const int r = i / 72, c = i % 72;
    *(uint4*)(Qs + (sw ? sw_off(r, c, 64) : (r >> 3) * ROWBLK + c * 128 + (r & 7) * 16)) = ((const uint4*)q)[i];
  }
  for (int i = tid; i < 32 * 72; i += 256) {
    const int r = i / 72, c = i % 72;
    *(uint4*)(Ks + (sw ? sw_off(r, c, 32) : (r >> 3) * ROWBLK + c * 128 + (r & 7) * 16)) = ((const uint4*)kv)[i];
  }
  for (int i = tid; i < 4 * PBUF / 16; i += 256) ((uint4*)Ps)[i] = make_uint4(0u, 0u, 0u, 0u);
  for (int i = tid; i < 64; i += 256) m_s[i] = -__int_as_float(0x7f800000);
  async_fence();
  __syncthreads();
  const u32 qs = smem_u32(Qs), ks = smem_u32(Ks), ps = smem_u32(Ps);
  float o[128], l[2] = {0.f, 0.f}, s[16];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  // V for this warpgroup's 256 value columns, keys 16 kk .. 16 kk + 15: MN-major, read transposed
  auto v_desc = [&](int kk) {
    return sw ? desc_sw(ks + (4 * wg) * 32 * 128 + (2 * kk) * 1024, lbo_v, sbo_v)
              : desc(ks + (2 * kk) * ROWBLK + (256 * wg / 8) * 128, lbo_v, sbo_v);
  };
  // k16 step kk of Q (64 rows) and K (32 keys): panel kk / 4, +32 bytes per step inside it
  auto q_desc = [&](int kk) { return sw ? desc_sw(qs + (kk >> 2) * 64 * 128 + (kk & 3) * 32, 16, 1024)
                                        : desc(qs + kk * 256, 128, 9216); };
  auto k_desc = [&](int kk) { return sw ? desc_sw(ks + (kk >> 2) * 32 * 128 + (kk & 3) * 32, 16, 1024)
                                        : desc(ks + kk * 256, 128, 9216); };
  auto pv_smem = [&](int tile) {  // the other warpgroup's P, from shared memory
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) wgmma_ssv_n256(o, desc(ps + (tile % 4) * PBUF + kk * 256, 128, 512), v_desc(kk));
    wg_commit();
  };
  auto other_tile = [&](int tile) {  // its P, max and factors are published: rescale, then its PV
    bar_sync(3 + tile % 4, 256);
    if (mode & 8) return false;
    if (grew_s[tile % 4]) {
      wg_wait0();
      keep128(o);
      rescale(o, l, alpha_s[(tile % 4) * 64 + r0], alpha_s[(tile % 4) * 64 + r1]);
    }
    pv_smem(tile);
    return true;
  };
  int t = wg;
  for (; t < iters; t += 2) {
    // S = Q K^T of tile t, all 576 columns
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 36; ++kk) wgmma_ss_n32(s, q_desc(kk), k_desc(kk), kk);
    wg_commit();
    if (t >= 1 && other_tile(t - 1)) {
      wg_wait1();  // S of tile t done; the other tile's PV runs on under the softmax
    } else {
      wg_wait0();
    }
    keep16(s);
    u32 a[2][4];
    int grew = 0;
    if (!(mode & 4)) {
      grew = softmax_tile(s, scale, (mode & 2) ? 3.f * t : 0.f, m_s, alpha_s + (t % 4) * 64, Ps + (t % 4) * PBUF,
                          1 + wg, r0, r1, t4, o, l, a);
    } else {
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[kk][e] = 0x3f803f80u;  // P = 1
    }
    if (wt == 0) grew_s[t % 4] = grew;
    async_fence();                 // P written by the generic proxy, read by the other warpgroup's wgmma
    bar_arrive(3 + t % 4, 256);    // tile t's P, max and factors to the other warpgroup
    if (!(mode & 8)) {             // own PV, P straight from registers
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) wgmma_rs_n256(o, a[kk], v_desc(kk));
      wg_commit();
    }
  }
  if (t - 1 < iters) other_tile(t - 1);  // the other warpgroup's last tile, after this one's last
  wg_wait0();
  keep128(o);
  __syncthreads();
  if (mode & 1) {
#pragma unroll
    for (int i = 0; i < 128; ++i)
      o_out[(((i >> 1) & 1) ? r1 : r0) * 512 + 256 * wg + 8 * (i >> 2) + 2 * t4 + (i & 1)] = o[i];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = l[h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (t4 == 0) atomicAdd(&l_out[h ? r1 : r0], v);
    }
    for (int r = tid; r < 64; r += 256) m_out[r] = m_s[r];
  } else {
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc += o[i];
    if (acc == 1234.5f) o_out[tid] = acc;  // never true: keeps the MMAs alive
  }
}
"""

SMEM = 12 * 9216 + 4 * 4096 + (64 + 4 * 64) * 4 + 4 * 4


def source() -> str:
    return HELPERS + _wgmma_ss(32) + _wgmma_pv(256) + KERNEL


def compile_probe(arch: str = "sm_90a") -> tuple[bytes, str]:
    return compile_kernel(source(), "rows_in_m_probe.cu", arch)


class Probe(Kernel):
    def __init__(self):
        super().__init__(source(), "rows_in_m_probe.cu", "rows_in_m", SMEM)

    def launch(self, grid, q, kv, o, lsum, m, iters, mode, scale, sw=0, lbo_v=9216, sbo_v=128):
        super().launch(grid, q, kv, o, lsum, m, iters, mode, float(scale), sw, ctypes.c_uint(lbo_v),
                       ctypes.c_uint(sbo_v))


#: V's descriptor byte offsets (LBO, SBO) to try per layout: which one strides the value columns
#: (N) and which the keys (K) of an MN-major operand; the no-swizzle pair is wgmma_probe.py's
#: measured reading for V^T.
V_READINGS = {0: [(9216, 128), (128, 9216)], 1: [(4096, 1024), (1024, 4096)]}


def check(pr: Probe, iters: int, sw: int, reading) -> dict:
    """`iters` tiles of the same 32 keys, tile t's scores raised by 3 t (so the max moves, in both
    warpgroups), against torch in fp32: O / l per query row, and l at the kernel's own max."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(64, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(32, 576, device="cuda", generator=g).bfloat16()
    scale = 576 ** -0.5 * 1.4426950408889634 * 4   # sharp rows: the max matters
    o = torch.full((64, 512), float("nan"), device="cuda")
    lsum = torch.zeros(64, device="cuda")
    m = torch.full((64,), float("nan"), device="cuda")
    pr.launch(1, q, kv, o, lsum, m, iters, 3, scale, sw, *reading)
    torch.cuda.synchronize()
    s = (q.float() @ kv.float().t()) * scale                  # [64 rows, 32 keys], log2 units
    ts = torch.arange(iters, device="cuda", dtype=torch.float32) * 3
    logits = s.unsqueeze(0) + ts.view(-1, 1, 1)                # [tiles, rows, keys]
    w = torch.exp2(logits - m.view(1, -1, 1))                  # at the kernel's final max
    l_ref = w.sum((0, 2))
    o_ref = torch.einsum("trk,kd->rd", w, kv[:, :512].float())
    o_err = ((o / lsum[:, None] - o_ref / l_ref[:, None]).norm() / (o_ref / l_ref[:, None]).norm()).item()
    l_err = ((lsum - l_ref).abs() / l_ref).max().item()
    lag = (m - logits.amax((0, 2))).abs().max().item()
    row = {"sw": sw, "lbo_v": reading[0], "sbo_v": reading[1], "iters": iters, "o_err": o_err, "l_err": l_err,
           "max_final_minus_true": lag}
    print(row, flush=True)
    return row


def passed(row: dict) -> bool:
    return row["o_err"] < 1e-2 and row["l_err"] < 1e-2   # NaN fails both


def time_modes(pr: Probe, sw: int, reading, iters: int = 1024) -> list[dict]:
    q = torch.randn(64, 576, device="cuda").bfloat16()
    kv = torch.randn(32, 576, device="cuda").bfloat16()
    o = torch.empty(64, 512, device="cuda")
    lsum = torch.zeros(64, device="cuda")
    m = torch.empty(64, device="cuda")
    modes = (("ping-pong: QK^T + softmax + PV", 0), ("no softmax", 4), ("no PV", 8), ("QK^T only", 12))
    rows = harness_time_modes(lambda sms, mode: pr.launch(sms, q, kv, o, lsum, m, iters, mode, 0.06, sw, *reading),
                              modes, lambda mode: 2 * 64 * 32 * (576 + (0 if mode & 8 else 512)), iters, 32)
    return [{"sw": sw, **r} for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    pr = Probe()
    res = {"device": torch.cuda.get_device_name(0), "checks": [], "timings": []}
    for sw in (0, 1):   # each layout: the first reading of V's descriptor that matches, then all checks
        for reading in V_READINGS[sw]:
            first = check(pr, 2, sw, reading)
            res["checks"].append(first)
            if passed(first):
                rows = [check(pr, n, sw, reading) for n in (1, 7, 12)]
                res["checks"] += rows
                if all(passed(r) for r in rows):
                    res["timings"] += time_modes(pr, sw, reading)
                break
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "rows_in_m_probe.json").write_text(json.dumps(res, indent=1))
    if not res["timings"]:
        print("no layout matched torch: nothing timed")
        return 1
    print(f"\nping-pong wgmma loop, query rows in M, 64 rows, 32-key tiles in shared memory, one CTA per SM "
          f"({res['device']}):")
    for r in res["timings"]:
        layout = "128-byte swizzle" if r["sw"] else "no swizzle"
        print(f"  {layout:<16} {r['what']:<32} {r['us_per_32_keys']:.3f} us per 32-key tile per SM, "
              f"{r['tflops_all_sms']:.0f} TFLOP/s")
    return 0 if len({r["sw"] for r in res["timings"]}) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
