#!/usr/bin/env python3
"""Diagnosis (not a test, not shipped): the rows-in-M ping-pong loop fed by a cp.async gather (sm_90a).

`rows_in_m_probe.py` times the tile loop a rewrite of the CUDA kernel would use with its operands
already in shared memory. This probe feeds it the way the kernel must: one request's keys split
over NSPLIT CTAs (one per SM), each CTA gathering its 32-key tiles from a large KV pool through
an index list (cp.async, 16-byte chunks, into the 128-byte-swizzled layout), four key buffers,
while its two warpgroups run the ping-pong loop on 64 query rows:

- warpgroup w owns tiles w, w + 2, ...: it gathers them (tile t + 2 is issued while tile t is
  computed; the slots of t + 4 are loaded one tile ahead so no copy waits on an index load),
  runs their QK^T and softmax, and PV on its 256 value columns; the other warpgroup runs PV of
  the same tile on its own columns from the P it publishes (4 KB per tile);
- before publishing a tile, each warpgroup waits for its own MMAs, so that the publication also
  says that the previous tile's P buffer and key buffer are no longer read.

Left out (the kernel has them): the 8 query rows past 64 (H 8 x T 9 = 72), the tree mask and the
draft keys, ragged splits (here every split holds whole tiles), the merge (done in torch by the
check). Each CTA writes its partial o (bf16, normalised), l and max, as the shipped kernel does.
It checks a small case against torch, then times the launch at about 128k keys over a pool
several times the L2 (cold), against the floor of the bytes it must read.

    python scripts/stream_probe.py --out $OUT      # on an sm_90 GPU
"""
from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch
from probe_harness import Kernel, compile_kernel, median_us
from rows_in_m_probe import DEVICE_FNS, _wgmma_pv, _wgmma_ss
from wgmma_probe import HELPERS

KERNEL = r"""
#define NBUF 4            // key buffers: tiles t-1 (the other's PV), t, t+1 (the other's), t+2 (loading)
#define KBUF (32 * 1152)  // one 32-key tile of 576 columns, 128-byte swizzle
#define NPB 2             // P buffers (the publication of tile t+1 frees tile t-1's)
__device__ __forceinline__ void cp16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// grid NSPLIT, 256 threads. Split c holds keys [c * chunk, (c + 1) * chunk) of the request (chunk a
// multiple of 32). q [64][576] bf16; pool [slots][576] bf16; idx [L] int32; part_o [NSPLIT][64][512]
// bf16 (o / l); part_l, part_m [NSPLIT][64] fp32 (l at the split's max m, log2 units).
extern "C" __global__ void __launch_bounds__(256, 1) stream(const u16* q, const u16* pool, const int* idx,
    u16* part_o, float* part_l, float* part_m, int chunk, float scale, u32 lbo_v, u32 sbo_v) {
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* Qs = smem;                        // 64 rows, 128-byte swizzle
  unsigned char* Ks = smem + 64 * 1152;            // [NBUF][KBUF]
  unsigned char* Ps = Ks + NBUF * KBUF;            // [NPB][PBUF]
  float* m_s = (float*)(Ps + NPB * PBUF);          // [64]
  float* alpha_s = m_s + 64;                       // [NPB][64]
  float* l_s = alpha_s + NPB * 64;                 // [2 warpgroups][64]
  int* grew_s = (int*)(l_s + 2 * 64);              // [NPB]
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3, r0 = 16 * warp + g, r1 = r0 + 8;
  const int lo = blockIdx.x * chunk, n_tiles = chunk / 32;
  const u32 qs = smem_u32(Qs), ks = smem_u32(Ks), ps = smem_u32(Ps);
  // this thread's share of a tile copy: key row wt / 4, chunks wt % 4 + 4 k (18 of the row's 72)
  const int crow = wt >> 2, csub = wt & 3;
  auto issue_tile = [&](int t, int slot) {
    const u16* src = pool + (long long)slot * 576;
    const u32 dst = ks + (t % NBUF) * KBUF;
#pragma unroll
    for (int k = 0; k < 18; ++k) {
      const int c = csub + 4 * k;
      cp16(dst + sw_off(crow, c, 32), src + c * 8);
    }
    cp_commit();
  };
  auto slot_of = [&](int t) { return t < n_tiles ? idx[lo + 32 * t + crow] : 0; };
  // prologue: Q, this warpgroup's first tile, and the slots of its second
  for (int i = tid; i < 64 * 72; i += 256)
    cp16(qs + sw_off(i / 72, i % 72, 64), q + (i / 72) * 576 + (i % 72) * 8);
  cp_commit();
  if (wg < n_tiles) issue_tile(wg, slot_of(wg));
  int slot_next = slot_of(wg + 2);
  for (int i = tid; i < 64; i += 256) m_s[i] = -__int_as_float(0x7f800000);
  cp_wait_all();    // Q and this warpgroup's first tile
  async_fence();
  __syncthreads();  // Q, m_s and the first tiles visible to both warpgroups
  float o[128], l[2] = {0.f, 0.f}, s[16];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  auto v_desc = [&](int t, int kk) {  // this warpgroup's 256 value columns (panels 4 wg ..), keys 16 kk ..
    return desc_sw(ks + (t % NBUF) * KBUF + (4 * wg) * 4096 + (2 * kk) * 1024, lbo_v, sbo_v);
  };
  auto other_tile = [&](int tile) {  // published: its P, max and factors; then its PV on this warpgroup's columns
    bar_sync(3 + tile % NPB, 256);
    if (grew_s[tile % NPB]) {
      wg_wait0();
      keep128(o);
      rescale(o, l, alpha_s[(tile % NPB) * 64 + r0], alpha_s[(tile % NPB) * 64 + r1]);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      wgmma_ssv_n256(o, desc(ps + (tile % NPB) * PBUF + kk * 256, 128, 512), v_desc(tile, kk));
    wg_commit();
  };
  int t = wg;
  for (; t < n_tiles; t += 2) {
    // tile t's keys (and, the first time, Q) have landed: this thread's copies, then the warpgroup's
    cp_wait_all();
    async_fence();
    bar_sync(1 + wg, 128);
    wg_fence();
    const u32 kb = ks + (t % NBUF) * KBUF;
#pragma unroll
    for (int kk = 0; kk < 36; ++kk)
      wgmma_ss_n32(s, desc_sw(qs + (kk >> 2) * 64 * 128 + (kk & 3) * 32, 16, 1024),
                   desc_sw(kb + (kk >> 2) * 32 * 128 + (kk & 3) * 32, 16, 1024), kk);
    wg_commit();
    if (t >= 1) {
      other_tile(t - 1);
      wg_wait1();  // S of tile t done; the other tile's PV runs on under the softmax
    } else {
      wg_wait0();
    }
    keep16(s);
    u32 a[2][4];
    const int grew = softmax_tile(s, scale, 0.f, m_s, alpha_s + (t % NPB) * 64, Ps + (t % NPB) * PBUF, 1 + wg, r0,
                                  r1, t4, o, l, a);
    if (wt == 0) grew_s[t % NPB] = grew;
    // every MMA this warpgroup issued is done: the other's PV of t-1 (its P buffer and key buffer
    // are free once the other warpgroup says the same of its own) and this one's PV of t-2
    wg_wait0();
    keep128(o);
    // tile t+2 into the buffer of t-2: its last readers were this warpgroup's PV of t-2 (done) and
    // the other's (done before it published t-1, which this warpgroup waited for)
    if (t + 2 < n_tiles) issue_tile(t + 2, slot_next);
    slot_next = slot_of(t + 4);
    async_fence();
    bar_arrive(3 + t % NPB, 256);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) wgmma_rs_n256(o, a[kk], v_desc(t, kk));
    wg_commit();
  }
  if (t - 1 < n_tiles) other_tile(t - 1);  // the other warpgroup's last tile
  wg_wait0();
  keep128(o);
  // l of both warpgroups (each summed its own tiles' keys, both rescaled by every move)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v = l[h];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (t4 == 0) l_s[wg * 64 + (h ? r1 : r0)] = v;
  }
  __syncthreads();
  const float l0 = l_s[r0] + l_s[64 + r0], l1 = l_s[r1] + l_s[64 + r1];
  const float i0 = l0 == 0.f ? 0.f : 1.f / l0, i1 = l1 == 0.f ? 0.f : 1.f / l1;
  u16* po = part_o + (long long)blockIdx.x * 64 * 512;
#pragma unroll
  for (int i = 0; i < 128; i += 2) {
    const int row = ((i >> 1) & 1) ? r1 : r0;
    const float inv = ((i >> 1) & 1) ? i1 : i0;
    *(u32*)(po + row * 512 + 256 * wg + 8 * (i >> 2) + 2 * t4) = pack_bf16(o[i] * inv, o[i + 1] * inv);
  }
  if (wg == 0 && t4 == 0) {
    part_l[blockIdx.x * 64 + r0] = l0;
    part_l[blockIdx.x * 64 + r1] = l1;
    part_m[blockIdx.x * 64 + r0] = m_s[r0];
    part_m[blockIdx.x * 64 + r1] = m_s[r1];
  }
}
"""

SMEM = 64 * 1152 + 4 * 32 * 1152 + 2 * 4096 + (64 + 2 * 64 + 2 * 64) * 4 + 2 * 4


def source() -> str:
    return HELPERS + _wgmma_ss(32) + _wgmma_pv(256) + DEVICE_FNS + KERNEL


def compile_probe(arch: str = "sm_90a") -> tuple[bytes, str]:
    return compile_kernel(source(), "stream_probe.cu", arch)


class Probe(Kernel):
    def __init__(self):
        super().__init__(source(), "stream_probe.cu", "stream", SMEM)

    def launch(self, nsplit, q, pool, idx, part_o, part_l, part_m, chunk, scale, lbo_v, sbo_v):
        super().launch(nsplit, q, pool, idx, part_o, part_l, part_m, chunk, float(scale), ctypes.c_uint(lbo_v),
                       ctypes.c_uint(sbo_v))


def merged(part_o, part_l, part_m):
    """Each row's attention output from the splits' partials ([S, 64, 512] o / l, l and m in log2)."""
    m = part_m.max(0).values
    w = part_l * torch.exp2(part_m - m)                     # [S, 64]
    return (part_o.float() * w[..., None]).sum(0) / w.sum(0)[:, None]


def check(pr: Probe, reading, nsplit: int = 3, chunk: int = 160) -> dict:
    """nsplit splits of chunk keys (5 tiles each: both warpgroups, odd tile counts) gathered from a
    shuffled pool, against torch in fp32."""
    g = torch.Generator(device="cuda").manual_seed(1)
    L = nsplit * chunk
    q = torch.randn(64, 576, device="cuda", generator=g).bfloat16()
    pool = torch.randn(4 * L, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randperm(4 * L, device="cuda", generator=g)[:L].int()
    scale = 576 ** -0.5 * 1.4426950408889634 * 4
    part_o = torch.full((nsplit, 64, 512), float("nan"), device="cuda").bfloat16()
    part_l = torch.full((nsplit, 64), float("nan"), device="cuda")
    part_m = torch.full((nsplit, 64), float("nan"), device="cuda")
    pr.launch(nsplit, q, pool, idx, part_o, part_l, part_m, chunk, scale, *reading)
    torch.cuda.synchronize()
    k = pool[idx.long()].float()
    ref = torch.softmax((q.float() @ k.t()) * scale * 0.6931471805599453, dim=-1) @ k[:, :512]
    out = merged(part_o, part_l, part_m)
    err = ((out - ref).norm() / ref.norm()).item()
    row = {"lbo_v": reading[0], "sbo_v": reading[1], "nsplit": nsplit, "chunk": chunk, "rel_err": err}
    print(row, flush=True)
    return row


def time_launch(pr: Probe, reading, nsplit: int, tiles: int) -> dict:
    """nsplit splits of `tiles` 32-key tiles each from a pool about 8x the L2 (a fresh index list per
    launch, from 4): us per launch, and the floor of its bytes at the read bandwidth measured here."""
    L = nsplit * tiles * 32
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    slots = max(4 * L, 8 * l2 // 1152)
    pool = torch.randn(slots, 576, device="cuda").bfloat16()
    idxs = [torch.randperm(slots, device="cuda")[:L].int() for _ in range(4)]
    q = torch.randn(64, 576, device="cuda").bfloat16()
    part_o = torch.empty(nsplit, 64, 512, device="cuda").bfloat16()
    part_l = torch.empty(nsplit, 64, device="cuda")
    part_m = torch.empty(nsplit, 64, device="cuda")
    calls = iter(range(10 ** 9))
    us = median_us(lambda: pr.launch(nsplit, q, pool, idxs[next(calls) % 4], part_o, part_l, part_m, tiles * 32,
                                     0.06, *reading), reps=12)
    big = torch.ones(1 << 28, device="cuda")                           # 1 GiB of fp32
    read_us = median_us(lambda: big.sum(), reps=6)                      # read bandwidth of plain bytes
    bw = big.numel() * 4 / (read_us * 1e-6)
    floor_us = L * 1152 / bw * 1e6
    return {"nsplit": nsplit, "tiles_per_split": tiles, "keys": L, "us": us, "read_gbps": bw / 1e9,
            "floor_us": floor_us, "pct_floor": 100 * floor_us / us, "us_per_tile": us / tiles}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    pr = Probe()
    res = {"device": torch.cuda.get_device_name(0), "checks": [], "timings": []}
    reading = None
    for r in ((4096, 1024), (1024, 4096)):   # V's descriptor offsets (MN-major, 128-byte swizzle)
        row = check(pr, r)
        res["checks"].append(row)
        if row["rel_err"] < 1e-2:
            reading = r
            break
    if reading is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for tiles in (1, 2, 4, 8, 16, 31):   # about 4k to 128k keys over one wave of CTAs
            res["timings"].append(time_launch(pr, reading, sms, tiles))
            print(res["timings"][-1], flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "stream_probe.json").write_text(json.dumps(res, indent=1))
    if reading is None:
        print("no reading of V's descriptor matched torch: nothing timed")
        return 1
    print(f"\nrows-in-M ping-pong fed by a cp.async gather, 64 query rows, one CTA per SM ({res['device']}):")
    for r in res["timings"]:
        print(f"  {r['keys']:>7} keys: {r['us']:8.2f} us ({r['us_per_tile']:.3f} per 32-key tile per SM), "
              f"floor {r['floor_us']:.2f} us at {r['read_gbps']:.0f} GB/s: {r['pct_floor']:.0f}% of it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
