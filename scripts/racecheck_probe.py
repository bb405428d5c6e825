#!/usr/bin/env python3
"""Diagnosis (not a test): does compute-sanitizer racecheck flag race-free code built from the
wgmma kernel's synchronisation constructs? Run under the tool:

    compute-sanitizer --tool racecheck --racecheck-report hazard python3 scripts/racecheck_probe.py

Every probe kernel ends with the exchange racecheck flags in `verify_wgmma_kernel` (the final l
exchange: a thread writes a word of shared memory, `__syncthreads()`, a thread of the other
warpgroup reads it; `results/kernel/wgmma/racecheck/`). Each kernel adds one construct of that
kernel before it, in a form that is race-free by construction (every shared word is written by
one thread and read only after a barrier the writer arrived at before): named barriers at 128
and 256 threads (their id an immediate, or in a register as in the tile loop), the ping-pong's
flag handoff on `bar.sync` with a `bar.red.or` vote, the tile loop's barrier protocol as the
kernel runs it (MMAs and copies aside), a `bar.arrive` / `bar.sync` handoff,
`bar.red.or`, an mbarrier handoff, `cp.async`, `wgmma` reading shared memory, `setmaxnreg` at
384 threads, and 227 KB of dynamic shared memory. A hazard reported on a kernel here is the
tool's, not a race; each kernel's output is also checked (the exchange must return the other
warpgroup's value).
"""
from __future__ import annotations

import sys

import torch

from probe_harness import Kernel

SRC = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ int bar_or(int id, int pred) {
  int r;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.s32 p, %2, 0;\nbar.red.or.pred q, %1, 128, p;\nselp.s32 %0, 1, 0, q;\n}\n"
               : "=r"(r) : "r"(id), "r"(pred) : "memory");
  return r;
}
extern __shared__ __align__(1024) unsigned char smem[];

// The exchange racecheck flags in verify_wgmma_kernel: word `t` written by thread t, read by
// thread t ^ 128 (the other warpgroup) after __syncthreads(), at byte offset `off`.
__device__ __forceinline__ float exchange(int off, float v) {
  float* s = reinterpret_cast<float*>(smem + off);
  const int t = threadIdx.x;
  s[t] = v;
  __syncthreads();
  const float r = s[t ^ 128];
  __syncthreads();
  return r;
}
#define OUT(v) out[blockIdx.x * blockDim.x + threadIdx.x] = (v)

extern "C" __global__ void k_plain(float* out, int off) { OUT(exchange(off, threadIdx.x)); }

// named barriers of one warpgroup (128) and of both (256), in a loop as the tile loop takes them
extern "C" __global__ void k_named(float* out, int off) {
  const int wg = threadIdx.x >> 7;
  for (int i = 0; i < 4; ++i) {
    bar_sync(1 + wg, 128);
    bar_sync(3 + (i & 1), 256);
  }
  OUT(exchange(off, threadIdx.x));
}

// the same, the barrier's id in a register (the tile loop's `bar.sync 3 + (t & 1)`: ptxas keeps
// the id in a register there), `rounds` from the launch
extern "C" __global__ void k_named_reg(float* out, int off, int rounds) {
  const int wg = threadIdx.x >> 7;
#pragma unroll 1
  for (int i = 0; i < rounds; ++i) {
    bar_sync(1 + wg, 128);
    bar_sync(3 + (i & 1), 256);
  }
  OUT(exchange(off, threadIdx.x));
}

// the ping-pong's handoff as the kernel runs it with `--publish sync`: the publishing warpgroup's
// thread 0 writes its tile's flag (two slots by tile parity), both warpgroups take the tile's
// barrier (id in a register), the other warpgroup reads the flag; a warpgroup vote on its own
// barrier (bar.red) and a warpgroup barrier (bar.sync) on the same id per tile
extern "C" __global__ void k_pingpong(float* out, int off, int rounds) {
  volatile int* flag = reinterpret_cast<volatile int*>(smem + 4096);
  const int t = threadIdx.x, wg = t >> 7;
  int got = 0;
#pragma unroll 1
  for (int i = 0; i < rounds; ++i) {
    bar_sync(1 + wg, 128);
    const int any = bar_or(1 + wg, (t & 127) == (i & 127));
    if (wg == (i & 1)) {
      if ((t & 127) == 0) flag[i & 1] = i + any;
      bar_sync(3 + (i & 1), 256);
    } else {
      bar_sync(3 + (i & 1), 256);
      got += flag[i & 1];
    }
  }
  __syncthreads();
  OUT(exchange(off, threadIdx.x) + 0.f * got);
}

// the tile loop's barrier protocol itself, MMAs and copies aside: warpgroup w owns tiles w, w + 2,
// ... of `rounds`; per tile its own barrier (bar.sync 1 + w, 128), the other warpgroup's
// publication of tile t - 1 (bar.sync 3 + ((t - 1) & 1), 256) and the read of what that tile
// wrote (its flag, the shared row maxima), a vote (bar.red.or on 1 + w), then its own writes (the
// flag of tile t, the maxima both warpgroups share) and its publication (bar.sync 3 + (t & 1));
// after the loop the other's last tile, then the l exchange. Every write precedes the barrier its
// readers wait on, and the next write of the same word follows a publication its reader made
// after reading: race-free, as the kernel's `--publish sync` copy (scripts/racecheck_wgmma.py)
extern "C" __global__ void k_tile_protocol(float* out, int off, int rounds) {
  volatile int* flag = reinterpret_cast<volatile int*>(smem + 4096);
  volatile float* m = reinterpret_cast<volatile float*>(smem + 4352);  // 64 rows, both warpgroups
  const int t0 = threadIdx.x, w = t0 >> 7, wt = t0 & 127;
  float got = 0.f;
  int t = w;
#pragma unroll 1
  for (; t < rounds; t += 2) {
    bar_sync(1 + w, 128);
    if (t >= 1) {  // the other warpgroup's tile t - 1
      bar_sync(3 + ((t - 1) & 1), 256);
      got += flag[(t - 1) & 1];
    }
    const float mx = m[wt & 63];
    const int grew = bar_or(1 + w, (wt & 7) == (t & 7));
    if (wt < 64) m[wt] = mx + grew;
    if (wt == 0) flag[t & 1] = t;
    bar_sync(3 + (t & 1), 256);  // publish tile t
  }
  if (t >= 1 && t - 1 < rounds) {
    bar_sync(3 + ((t - 1) & 1), 256);
    got += flag[(t - 1) & 1];
  }
  OUT(exchange(off, threadIdx.x) + 0.f * got);
}

// the ping-pong's publication: one warpgroup writes and arrives, the other waits and reads
extern "C" __global__ void k_arrive(float* out, int off) {
  volatile float* flag = reinterpret_cast<volatile float*>(smem + 4096);
  const int t = threadIdx.x, wg = t >> 7;
  float got = 0.f;
  for (int i = 0; i < 4; ++i) {
    const int pub = i & 1;  // the publishing warpgroup of round i
    if (wg == pub) {
      if ((t & 127) == 0) flag[i] = 1.f + i;
      bar_arrive(3 + pub, 256);
    } else {
      bar_sync(3 + pub, 256);
      got += flag[i];
    }
  }
  __syncthreads();
  OUT(exchange(off, threadIdx.x) + 0.f * got);
}

// the lazy max's vote: bar.red.or over each warpgroup
extern "C" __global__ void k_bar_red(float* out, int off) {
  const int wg = threadIdx.x >> 7;
  int any = 0;
  for (int i = 0; i < 4; ++i) any += bar_or(1 + wg, threadIdx.x == 5 + i);
  OUT(exchange(off, threadIdx.x) + 0.f * any);
}

// the tail's key-buffer handoff: one thread writes, arrives on an mbarrier (count 1), others wait
extern "C" __global__ void k_mbarrier(float* out, int off) {
  const u32 mb = smem_u32(smem + 8192);
  volatile float* x = reinterpret_cast<volatile float*>(smem + 8200);
  if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(mb) : "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    *x = 7.f;
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(mb) : "memory");
  }
  u32 done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(mb), "r"(0) : "memory");
  } while (!done);
  const float got = *x;
  __syncthreads();
  OUT(exchange(off, threadIdx.x) + 0.f * got);
}

// cp.async into shared memory, waited for and published by a barrier
extern "C" __global__ void k_cp_async(float* out, int off, const float* src) {
  const int t = threadIdx.x;
  const u32 dst = smem_u32(smem + 12288 + 16 * t);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src + 4 * t) : "memory");
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();
  const float got = reinterpret_cast<const float*>(smem + 12288)[4 * (t ^ 128)];
  __syncthreads();
  OUT(exchange(off, got));
}

// wgmma m64n32k16 reading A (64 x 16) and B (32 x 16) from shared memory, no swizzle
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32);
}
extern "C" __global__ void k_wgmma(float* out, int off) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int t = threadIdx.x, wg = t >> 7;
  unsigned short* ab = reinterpret_cast<unsigned short*>(smem + 20480);  // A: 2048 B, B: 1024 B per warpgroup
  for (int i = t; i < 2 * 1536; i += blockDim.x) ab[i] = 0x3f80;  // bf16 1.0
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const u32 a = smem_u32(smem + 20480 + wg * 3072), b = a + 2048;
  float d[16];
  for (int i = 0; i < 16; ++i) d[i] = 0.f;
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(desc(a, 128, 256)), "l"(desc(b, 128, 256)), "r"(0));
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) sum += d[i];
  __syncthreads();
  OUT(exchange(off, threadIdx.x) + 0.f * sum);
#endif
}

// 384 threads: the two 64-row warpgroups take registers from the tail's (setmaxnreg), then the
// same exchange across all three (t ^ 128 for the first two, the tail with warpgroup 0)
extern "C" __global__ void __launch_bounds__(384, 1) k_setmaxnreg(float* out, int off) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int t = threadIdx.x;
  if (t >= 256) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 136;\n");
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 184;\n");
  }
  float* s = reinterpret_cast<float*>(smem + off);
  s[t] = t;
  __syncthreads();
  const float r = s[t < 256 ? t ^ 128 : t - 256];
  __syncthreads();
  OUT(r);
#endif
}
"""

#: (kernel, threads per block)
PROBES = [("k_plain", 256), ("k_named", 256), ("k_named_reg", 256), ("k_pingpong", 256), ("k_tile_protocol", 256),
          ("k_arrive", 256),
          ("k_bar_red", 256), ("k_mbarrier", 256), ("k_cp_async", 256), ("k_wgmma", 256), ("k_setmaxnreg", 384)]


#: kernels that take a round count (8 tiles' handoffs)
ROUNDS = {"k_named_reg", "k_pingpong", "k_tile_protocol"}


def expected(fn: str, threads: int, src: torch.Tensor | None) -> torch.Tensor:
    """What probe `fn`'s exchange returns to each of its `threads` (on `src`'s device; `src`: the
    cp.async probe's global input)."""
    t = torch.arange(threads, device=src.device if src is not None else "cpu")
    if fn == "k_setmaxnreg":
        return torch.where(t < 256, t ^ 128, t - 256).float()
    if fn == "k_cp_async":  # thread t's exchange carries src[4 (t ^ 128)]; its partner's comes back
        return src[4 * t].float()
    return (t ^ 128).float()


def main() -> int:
    src = torch.randn(4 * 256, device="cuda")
    bad = 0
    # the exchange where the ROWS 64 kernel's l exchange sits (dynamic offset 0x38300; racecheck
    # names 0x38700, the shared window's first 1 KB being reserved), in the most dynamic shared
    # memory a block may have (the kernel takes 225-226 KB), and at offset 0 of 32 KB
    for smem, off in ((227 * 1024, 0x38300), (32 * 1024, 0)):
        for fn, threads in PROBES:
            k = Kernel(SRC, "racecheck_probe.cu", fn, smem, threads)
            out = torch.full((2 * threads,), -1.0, device="cuda")
            args = (out, off, src) if fn == "k_cp_async" else (out, off, 8) if fn in ROUNDS else (out, off)
            k.launch(2, *args)
            torch.cuda.synchronize()
            ok = torch.equal(out.view(2, threads)[1], expected(fn, threads, src))
            bad += not ok
            print(f"probe {fn} threads {threads} smem {smem} off {off:#x}: output {'right' if ok else 'WRONG'}",
                  flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
