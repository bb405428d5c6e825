// MLA verify attention with the keys in wgmma's M dimension (sm_90a only: H100 / H200). Compiled
// appended to verify.cu and verify_wgmma.cu: it takes verify.cu's SplitArgs and items schedule and
// writes the same partials, which verify.cu's block merge or verify_wgmma.cu's warp merge combine;
// it uses verify_wgmma.cu's wgmma, barrier and mbarrier helpers.
//
// One CTA: 72 query rows (rows r = head * T + t of one request; H*T rows take ceil(H*T / 72) row
// blocks, blockIdx.x) against one work item's keys (blockIdx.y), in 64-key tiles:
//   S^T  = K Q^T     36 wgmma m64n72k16 (64 keys in M, the 72 query rows in N: no padding rows)
//   softmax over M   a lazy max: one bar.red.or per tile; the column maxima meet only when a
//                    score passes its row's max by more than RESCALE_SLACK
//   O^T += V^T P^T   per 64 value columns 4 wgmma m64n72k16, V^T read transposed from the same key
//                    rows, P^T through shared memory
// The probe of this loop with its operands in shared memory ran 0.91 us per 32 keys per SM, under
// the 1.16 us of HBM time of the keys (results/kernel/pingpong-probe/); the 32-key rows-in-M loop
// of verify_wgmma.cu runs about 1.9 with its tail warpgroup. What kept it out was shared memory: Q
// (81 KB) and two whole 64-key tiles (144 KB) leave no room for P^T. Here the tile's last 64
// columns (K's rope part, read by S^T alone) have one slot of their own, refilled as soon as S^T is
// done, so two tiles of the first 512 columns, the rope slot, P^T and Q fit 227 KB.
//
// Three or four warpgroups, each with one role (setmaxnreg gives the registers to the math):
//   0, the producer: gathers tile t's rows through the index list by cp.async into buffer t % 2
//      and the rope slot; completion lands on mbarriers (cp.async.mbarrier.arrive.noinc).
//   1, S: S^T, the softmax, P^T, and PV for value columns [0, 64 CA) (CA = DV_SPLIT / 64).
//   2 (and 3 where CA = 0), PV: PV for value columns [64 CA, 512) (CA = 0: 0-255 and 256-511).
// With CA = 0 the S warpgroup's path per tile is S^T and the softmax alone, and the PV of tile t
// runs on the tensor cores under S^T of tile t + 1.
// Q and the key tiles use the 128-byte swizzle, panel-major: element (row r, column c) of an operand
// of R rows at (c / 64) * (R * 128) + r * 128 + (((c / 8) % 8) ^ (r % 8)) * 16 + (c % 8) * 2 bytes, so
// 64 columns of a 64-key tile are one 8 KB panel, and the gather's 8 lanes per key row copy a whole
// 128-byte line of it into 8 different bank groups. (Without the swizzle a row's 8 chunks sit 128
// bytes apart: 8 lanes per row conflict 8-way, and 8 rows per 8 lanes read 8 lines per quarter
// warp; the latter measured 2x the L2 sectors and 7x the shared-memory wavefronts of the copies,
// Nsight Compute, H 8 batch 1 x 128k.) P^T is unswizzled: 8 query rows x 8 keys per core matrix.

namespace kvtune {
namespace km {

constexpr int N = 72;                        // query rows per CTA (wgmma N)
constexpr int BN = 64;                       // keys per tile (wgmma M)
constexpr int PANEL = BN * 128;              // 8192 B: 64 columns of a key tile
constexpr int QPANEL = N * 128;              // 9216 B: 64 columns of Q
constexpr int NOPE = DV / 64;                // 8 panels: V, which is K's first 512 columns
constexpr int KBUF = NOPE * PANEL;           // 65536 B per key buffer
constexpr int K_OFF = (DK / 64) * QPANEL;    // 82944: after Q's 9 panels
constexpr int R_OFF = K_OFF + 2 * KBUF;      // the rope slot (columns 512-575 of the tile in S^T)
constexpr int P_OFF = R_OFF + PANEL;         // P^T [72 rows][64 keys]
constexpr int M_OFF = P_OFF + N * BN * 2;    // float [72]: running max, log2 units (the S warpgroup's)
constexpr int ALPHA_OFF = M_OFF + N * 4;     // float [72]: the tile's rescale factors, for the PV warpgroup
constexpr int MX_OFF = ALPHA_OFF + N * 4;    // int [72]: the tile's column maxima as ordered ints
constexpr int FLAG_OFF = MX_OFF + N * 4;     // int [4]: the tile moved some row's max
constexpr int WORK_OFF = FLAG_OFF + 16;      // int [4]: the item (b, lo, hi, item)
constexpr int BAR_OFF = WORK_OFF + 16;       // u64 mbarrier [3]: key buffer 0, 1 and the rope slot landed
constexpr int SMEM_BYTES = BAR_OFF + 3 * 8;
static_assert(BAR_OFF % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(K_OFF % 1024 == 0 && R_OFF % 1024 == 0 && QPANEL % 1024 == 0, "128-byte swizzle atoms are 1024-byte aligned");
static_assert(SMEM_BYTES <= 227 * 1024, "over sm_90's shared memory per block");
constexpr int OPITCH = DV * 2 + 16;          // bytes per staged o row: +16 spreads a store's rows over the banks
static_assert(N * OPITCH <= 2 * KBUF, "the staged o fits in the two key buffers");

// named barriers (0 is __syncthreads, never used after the roles split)
constexpr int B_CONS = 1;   // the consumers: every warpgroup but the producer
constexpr int B_S = 2;      // the S warpgroup (128)
constexpr int B_EMPTY = 3;  // 3 + buffer: a key buffer read by every PV (the producer syncs, PV warpgroups arrive)
constexpr int B_ROPE = 5;   // the rope slot read by S^T (256: the producer syncs, S arrives)
constexpr int B_READY = 6;  // P^T and the factors written (S arrives, the PV-only warpgroups sync)
constexpr int B_FREE = 7;   // P^T read by the PV-only warpgroups (they arrive, S syncs)

// The warpgroups and registers of a DV_SPLIT (CA = DV_SPLIT / 64). Registers per thread after the
// split (setmaxnreg) fit the launch's: 128 x (PRODUCER + S + PV x PVS) <= THREADS x (65536 /
// THREADS). The S warpgroup holds CA x 36 O^T accumulators, S^T (36) and l (18) and needs about 64
// more; a PV one its value chunks x 36 and about 30 more.
constexpr int REGS_PRODUCER = 40;
template <int CA>
struct Roles {
  // 256 columns in the S warpgroup (CA 4) leave the PV one 168 registers for 144 accumulators:
  // ptxas spills 1.3 KB there, so the S warpgroup takes at most 192, or none (CA 0: two PV ones)
  static_assert(CA == 0 || CA == 2 || CA == 3, "DV_SPLIT: 0, 128 or 192 value columns in the S warpgroup");
  static constexpr int PVS = CA == 0 ? 2 : 1;            // PV-only warpgroups
  static constexpr int THREADS = 128 * (2 + PVS);
  static constexpr int CONS = THREADS - 128;             // consumer threads
  static constexpr int PV_CHUNKS = (8 - CA) / PVS;       // value chunks per PV-only warpgroup
  static constexpr int S = CA == 0 ? 112 : CA == 3 ? 232 : 208;
  static constexpr int PV = CA == 0 ? 176 : CA == 3 ? 224 : 248;
  static constexpr int EMPTY = 128 * (1 + PVS + (CA > 0));   // B_EMPTY: the producer and every PV
  static constexpr int READY = 128 * (1 + PVS);              // B_READY and B_FREE
  static_assert(REGS_PRODUCER + S + PV * PVS <= THREADS / 128 * (65536 / THREADS / 8 * 8), "over the launch's registers");
};

// wgmma m64n72k16, bf16 in, fp32 out, both operands in shared memory; TA = 1 reads A transposed
// (MN-major: V^T from key rows)
template <int TA>
__device__ __forceinline__ void mma_n72(float (&d)[36], u64 da, u64 db, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35}, %36, %37, p, 1, 1, %39, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                 "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                 "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                 "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
               : "l"(da), "l"(db), "r"(acc), "n"(TA));
}
__device__ __forceinline__ void keep36(float (&d)[36]) {
#pragma unroll
  for (int i = 0; i < 36; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int M>
__device__ __forceinline__ void keep_o(float (&o)[M][36]) {
#pragma unroll
  for (int m = 0; m < M; ++m) keep36(o[m]);
}
// Descriptors: K and Q (K-major, 128-byte swizzle) step 32 B per k16 step inside a panel and
// 1024 B between 8-row atoms; V^T (MN-major, swizzled) 1024 B between 8-key atoms (its K), 64 value
// columns being one panel (its M); P^T (K-major, no swizzle) 128 B between the two 8-key core
// matrices of a k16 step and 1024 B between 8-row blocks. Each MMA's descriptor is a base plus a
// compile-time offset (wg::desc_add); the base is made opaque in every tile (`fresh`), or the
// compiler hoists the loop-invariant ones (Q's 36, P^T's 4) out of the loop as 64-bit registers and
// spills them.
__device__ __forceinline__ u64 kmajor_sw(u32 addr) { return wg::desc_sw(addr, 16, 1024); }
__device__ __forceinline__ u64 vt(u32 addr) { return wg::desc_sw(addr, PANEL, 1024); }
__device__ __forceinline__ u64 kmajor(u32 addr) { return wg::desc(addr, 128, 1024); }
// byte offset of 16-byte chunk c (< 8) of row r in a swizzled panel
__device__ __forceinline__ u32 swz(int r, int c) { return r * 128 + ((c ^ (r & 7)) * 16); }
__device__ __forceinline__ u64 fresh(u64 d) {
  asm volatile("" : "+l"(d));
  return d;
}

__device__ __forceinline__ void mbar_init(u32 addr, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
// the mbarrier counts this thread's arrival once all its earlier cp.async have landed
__device__ __forceinline__ void cp_async_arrive(u32 addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}
// floats ordered as ints, for atomicMax (fmaxf's order on non-NaN values)
__device__ __forceinline__ int ordered(float f) {
  const int i = __float_as_int(f);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float unordered(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Accumulator element 4 j + e of m64n72 (this thread): M row 16 warp + lane / 4 + 8 (e >> 1), N
// column 8 j + 2 (lane % 4) + (e & 1). In S^T the M row is a key and the column a query row; in O^T
// the M row is a value column.

// O^T columns times alpha[column] (both warpgroups, on a moved max)
template <int M>
__device__ __forceinline__ void rescale_cols(float (&o)[M][36], const float* alpha, int t4) {
#pragma unroll
  for (int j = 0; j < 9; ++j) {
    const float2 a = *reinterpret_cast<const float2*>(alpha + 8 * j + 2 * t4);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      o[m][4 * j] *= a.x;
      o[m][4 * j + 1] *= a.y;
      o[m][4 * j + 2] *= a.x;
      o[m][4 * j + 3] *= a.y;
    }
  }
}

// O^T += V^T P^T for value chunks C0 .. C0 + M - 1 (64 columns each) of key buffer kb
template <int C0, int M>
__device__ __forceinline__ void pv(float (&o)[M][36], u32 kb, u32 ps) {
  const u64 dv = fresh(vt(kb + C0 * PANEL)), dp = fresh(kmajor(ps));
  wg::fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int m = 0; m < M; ++m)
      mma_n72<1>(o[m], wg::desc_add(dv, m * PANEL + kk * 2048), wg::desc_add(dp, kk * 256), 1);
  wg::commit();
}

// A NaN in a draft key's V must not reach the rows that may not see that key (their p is 0, and
// 0 * NaN = NaN): zero the NaN values of V in rows k_lo .. k_hi-1 of key buffer kbuf, after S^T
// read them (a row that sees the key has a NaN score already) and before any PV.
__device__ __forceinline__ void scrub_nan_v(unsigned char* kbuf, int k_lo, int k_hi, int wt) {
  for (int c = wt; c < (k_hi - k_lo) * (DV / 8); c += 128) {
    const int k = k_lo + c / (DV / 8), ch = c % (DV / 8);
    uint4* piece = reinterpret_cast<uint4*>(kbuf + (ch >> 3) * PANEL + swz(k, ch & 7));
    const uint4 v = *piece;
    u32 w[4] = {v.x, v.y, v.z, v.w};
    bool nan = false;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const u32 sh = 16 * (e & 1);
      if (((w[e >> 1] >> sh) & 0x7fffu) > 0x7f80u) {
        w[e >> 1] &= ~(0xffffu << sh);
        nan = true;
      }
    }
    if (nan) *piece = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Q rows rb .. rb + 71 of request b (row r: head r / T, draft token r % T), zero past H * T, into
// Q's panels; by the CONS consumer threads (ct), under the producer's first tiles.
template <int T, int CONS>
__device__ __forceinline__ void load_q(const SplitArgs& a, unsigned char* smem, int b, int rb, int HT, int ct) {
  const u32 qs = smem_u32(smem);
  if (a.q_vec16) {  // 8 lanes per row: a 128-byte line of one panel per quarter warp
    const int cc = ct & 7;
    for (int r = ct >> 3; r < N; r += CONS / 8) {
      const int rg = rb + r;
      const bool ok = rg < HT;
      const u16* src = ok ? a.q + (i64)(b * T + rg % T) * a.q_stride_m + (i64)(rg / T) * a.q_stride_h + cc * 8 : a.q;
#pragma unroll
      for (int p = 0; p < DK / 64; ++p) cp_async<16>(qs + p * QPANEL + swz(r, cc), src + (ok ? 64 * p : 0), ok ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    for (int i = ct; i < N * DK; i += CONS) {
      const int r = i / DK, col = i % DK, rg = rb + r;
      *reinterpret_cast<u16*>(smem + (col >> 6) * QPANEL + swz(r, (col >> 3) & 7) + (col & 7) * 2) =
          rg < HT ? a.q[(i64)(b * T + rg % T) * a.q_stride_m + (i64)(rg / T) * a.q_stride_h + col] : (u16)0;
    }
  }
  wg::async_fence();
  wg::bar_sync(B_CONS, CONS);
}

// The producer: tile t's 64 rows (this thread rows tid / 8 + 16 i, 16-byte chunk tid % 8 of each
// 64-column panel: 8 lanes copy a row's 128-byte line) into key buffer t % 2 once both PVs of tile
// t - 2 are done, then its rope columns into the slot once S^T of tile t - 1 is done.
template <int EMPTY>
__device__ __forceinline__ void produce(const SplitArgs& a, unsigned char* smem, int kv_start, int lo, int hi,
                                        int n_tiles) {
  const int rr = (threadIdx.x & 127) >> 3, cc = threadIdx.x & 7;
  const u32 ks = smem_u32(smem + K_OFF), rs = smem_u32(smem + R_OFF), bars = smem_u32(smem + BAR_OFF);
  const u32 sx = swz(0, cc ^ (rr & 7));  // the chunk's place in the row: the rows rr + 16 i share it
  // a slot is read as the low 32-bit word of an int64 index (as verify.cu does), one tile ahead
  const int idx_shift = a.indices_64 ? 1 : 0;
  const int* idx32 = reinterpret_cast<const int*>(a.indices) + ((i64)kv_start << idx_shift);
  auto slot_of = [&](int t, int i) -> u32 {  // ~0u: past the split (the row is zero-filled)
    const int n = lo + BN * t + rr + 16 * i;
    return (t >= n_tiles || n >= hi) ? ~0u : (u32)idx32[(i64)n << idx_shift];
  };
  u32 cur[4], nxt[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) cur[i] = slot_of(0, i);
  for (int t = 0; t < n_tiles; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) nxt[i] = slot_of(t + 1, i);
    if (t >= 2) wg::bar_sync(B_EMPTY + (t & 1), EMPTY);
    const u32 kb = ks + (t & 1) * KBUF + sx;
    const u16* src[4];
    int bytes[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ok = cur[i] != ~0u;
      src[i] = ok ? a.kv + (i64)cur[i] * a.kv_stride + cc * 8 : a.kv;
      bytes[i] = ok ? 16 : 0;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int p = 0; p < NOPE; ++p) cp_async<16>(kb + p * PANEL + (rr + 16 * i) * 128, src[i] + 64 * p, bytes[i]);
    cp_async_arrive(bars + 8 * (t & 1));
    if (t >= 1) wg::bar_sync(B_ROPE, 256);
#pragma unroll
    for (int i = 0; i < 4; ++i) cp_async<16>(rs + sx + (rr + 16 * i) * 128, src[i] + DV, bytes[i]);
    cp_async_arrive(bars + 16);
#pragma unroll
    for (int i = 0; i < 4; ++i) cur[i] = nxt[i];
  }
}

// l per query row (the S warpgroup's l over its keys), o normalised into bf16 rows in the key
// buffers, then stored as the item's partial rows; lse written by the S warpgroup (WITH_L). M = 0:
// no value chunks (o is a placeholder).
template <int T, int CONS, int C0, int M, bool WITH_L>
__device__ __forceinline__ void epilogue(const SplitArgs& a, unsigned char* smem, float (&o)[M > 0 ? M : 1][36],
                                         const float (&l)[18], int rb, int HT, int item, int ct) {
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int wt = ct & 127, warp = wt >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
  float* red = reinterpret_cast<float*>(smem + R_OFF);  // [4 warps][72]: the rope slot is free now
  wg::bar_sync(B_CONS, CONS);                          // every warpgroup's MMAs are done
  if constexpr (WITH_L) {
#pragma unroll
    for (int i = 0; i < 18; ++i) {
      float v = l[i];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (g == 0) red[warp * N + 8 * (i >> 1) + 2 * t4 + (i & 1)] = v;
    }
  }
  wg::bar_sync(B_CONS, CONS);
  const float* m_s = reinterpret_cast<const float*>(smem + M_OFF);
  float inv[18];
#pragma unroll
  for (int i = 0; i < 18; ++i) {
    const int c = 8 * (i >> 1) + 2 * t4 + (i & 1);
    const float lc = red[c] + red[N + c] + red[2 * N + c] + red[3 * N + c];
    inv[i] = lc == 0.f ? 0.f : 1.f / lc;  // NaN stays NaN
  }
  // one lse store per row by thread wt, not 18 unrolled per-row stores by warp 0: each carried its
  // own rg % T, rg / T and 64-bit address math, 15 KB of code run once per CTA, and at 4k a CTA's
  // once-run code is fetched cold (instruction fetch: 43% of the stall samples before)
  if (WITH_L && wt < N && rb + wt < HT) {
    const int c = wt, rg = rb + c;
    const float lc = red[c] + red[N + c] + red[2 * N + c] + red[3 * N + c];
    a.part_lse[((i64)item * T + rg % T) * a.H + rg / T] = lc == 0.f ? NEG_INF : (m_s[c] + __log2f(lc)) * LN2;
  }
  unsigned char* st = smem + K_OFF;
#pragma unroll
  for (int m = 0; m < M; ++m)  // (none for M = 0)
#pragma unroll
    for (int i = 0; i < 36; ++i) {
      const int dv = 64 * (C0 + m) + 16 * warp + g + 8 * ((i >> 1) & 1), c = 8 * (i >> 2) + 2 * t4 + (i & 1);
      *reinterpret_cast<u16*>(st + c * OPITCH + dv * 2) = bf16_bits(o[m][i] * inv[2 * (i >> 2) + (i & 1)]);
    }
  wg::bar_sync(B_CONS, CONS);
  for (int i = ct; i < N * (DV / 8); i += CONS) {
    const int c = i / (DV / 8), k = i % (DV / 8), rg = rb + c;
    if (rg < HT)
      *reinterpret_cast<uint4*>(a.part_o + (((i64)item * T + rg % T) * a.H + rg / T) * DV + 8 * k) =
          *reinterpret_cast<const uint4*>(st + c * OPITCH + 16 * k);
  }
}

// The S warpgroup: S^T of every tile, the softmax, P^T, and O^T for value chunks 0 .. CA - 1.
template <int T, int CA>
__device__ __forceinline__ void s_role(const SplitArgs& a, unsigned char* smem, int b, int lo, int hi, int P,
                                       int n_tiles, int rb, int HT, int item) {
  using namespace km;
  using R = Roles<CA>;
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int tid = threadIdx.x, wt = tid & 127, warp = wt >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const u32 ks = smem_u32(smem + K_OFF), qs = smem_u32(smem), rs = smem_u32(smem + R_OFF);
  const u32 ps = smem_u32(smem + P_OFF), bars = smem_u32(smem + BAR_OFF);
  float* m_s = reinterpret_cast<float*>(smem + M_OFF);
  int* mx_s = reinterpret_cast<int*>(smem + MX_OFF);
  float* alpha_s = reinterpret_cast<float*>(smem + ALPHA_OFF);
  int* flag_s = reinterpret_cast<int*>(smem + FLAG_OFF);
  load_q<T, R::CONS>(a, smem, b, rb, HT, tid - 128);
  float o[CA > 0 ? CA : 1][36], l[18];
#pragma unroll
  for (int m = 0; m < CA; ++m)
#pragma unroll
    for (int i = 0; i < 36; ++i) o[m][i] = 0.f;
#pragma unroll
  for (int i = 0; i < 18; ++i) l[i] = 0.f;
  // The tree mask as visibility bits of this thread's two keys (eh) in the split's (at most two)
  // tiles with draft keys, bit 2 j + e1 for query row 8 j + 2 t4 + e1; past hi invisible too.
  // Packed before the loop: 18 mask words per thread held in it would spill.
  const int td0 = (max(lo, P) - lo) / BN;  // the first tile holding a draft key (if hi > P)
  u32 vis[2][2] = {{0u, 0u}, {0u, 0u}};
  if (hi > P) {
    const i64* tmask = a.tree_mask + (i64)b * T;
#pragma unroll 1  // run once per CTA: rolled, less code to fetch (vis is indexed by x and eh only)
    for (int q = 0; q < 18; ++q) {
      const int rg = rb + 8 * (q >> 1) + 2 * t4 + (q & 1);
      const u64 bits = rg < HT ? (u64)tmask[rg % T] : 0ull;
#pragma unroll
      for (int x = 0; x < 2; ++x)
#pragma unroll
        for (int eh = 0; eh < 2; ++eh) {
          const int n = lo + BN * (td0 + x) + 16 * warp + g + 8 * eh, d = n - P;
          const bool ok = (n < hi) & ((d < 0) | (bool)((bits >> (d & 63)) & 1ull));
          vis[x][eh] |= (u32)ok << q;
        }
    }
  }
  for (int t = 0; t < n_tiles; ++t) {
    const u32 kb = ks + (t & 1) * KBUF;
    float s[36];
    // -- S^T = K Q^T: the first 512 columns from the key buffer, the last 64 from the rope slot
    const u64 dk = fresh(kmajor_sw(kb)), dq = fresh(kmajor_sw(qs)), dr = fresh(kmajor_sw(rs));
    // both waits before the first MMA: a wait loop inside the accumulator chain makes ptxas
    // serialize every wgmma (C7514); the producer issues both parts at about the same time
    wg::mbar_wait(bars + 8 * (t & 1), (t >> 1) & 1);
    wg::mbar_wait(bars + 16, t & 1);
    wg::async_fence();
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < 32; ++kk)
      mma_n72<0>(s, wg::desc_add(dk, (kk >> 2) * PANEL + (kk & 3) * 32),
                 wg::desc_add(dq, (kk >> 2) * QPANEL + (kk & 3) * 32), kk);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      mma_n72<0>(s, wg::desc_add(dr, kk * 32), wg::desc_add(dq, NOPE * QPANEL + kk * 32), 1);
    wg::commit();
    wg::wait0();
    keep36(s);
    if (t + 1 < n_tiles) wg::bar_arrive(B_ROPE, 256);  // the rope slot may take tile t + 1's
    const int k0 = lo + BN * t;
    {  // draft keys in this tile: NaNs out of their V (uniform over the warpgroup)
      const int d_lo = max(k0, P), d_hi = min(k0 + BN, hi);
      if (d_lo < d_hi) scrub_nan_v(smem + K_OFF + (t & 1) * KBUF, d_lo - k0, d_hi - k0, wt);
    }
    // -- scale to log2 units; -inf for keys past the split and draft keys the row may not see
    if (k0 + BN <= min(hi, P)) {
#pragma unroll
      for (int i = 0; i < 36; ++i) s[i] *= a.qk_scale;
    } else {  // a partial tile, or one of the two with draft keys (uniform)
      const int x = t - td0;
      const bool drafts = hi > P && (x == 0 || x == 1);
      const u32 v0 = x == 0 ? vis[0][0] : vis[1][0], v1 = x == 0 ? vis[0][1] : vis[1][1];
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1)
#pragma unroll
          for (int eh = 0; eh < 2; ++eh) {
            const int i = 4 * j + 2 * eh + e1, n = k0 + 16 * warp + g + 8 * eh;
            const bool ok = drafts ? (bool)(((eh ? v1 : v0) >> (2 * j + e1)) & 1u) : n < hi;
            s[i] = ok ? s[i] * a.qk_scale : NEG_INF;
          }
    }
    // -- lazy max: does any score pass its row's max by more than the slack?
    int need = 0;
#pragma unroll
    for (int j = 0; j < 9; ++j) {
      const float2 m = *reinterpret_cast<const float2*>(m_s + 8 * j + 2 * t4);
      need |= (s[4 * j] > m.x + RESCALE_SLACK) | (s[4 * j + 2] > m.x + RESCALE_SLACK) |
              (s[4 * j + 1] > m.y + RESCALE_SLACK) | (s[4 * j + 3] > m.y + RESCALE_SLACK);
    }
    const int grew = wg::bar_or(B_S, need);  // false while a row's scores are all -inf
    if (grew) {
      // the tile's column maxima: this thread's 2 keys, the 8 lanes of a column, the 4 warps
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          float v = fmaxf(s[4 * j + e1], s[4 * j + 2 + e1]);
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
          if (g == 0) atomicMax(mx_s + 8 * j + 2 * t4 + e1, ordered(v));
        }
      wg::bar_sync(B_S, 128);
      // the P^T buffer's last reader is done before its factors are rewritten
      if (t > 0) wg::bar_sync(B_FREE, R::READY);
#pragma unroll
      for (int j = 0; j < 9; ++j)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int c = 8 * j + 2 * t4 + e1;
          const float old = m_s[c], mx = unordered(mx_s[c]);
          const float now = mx > old + RESCALE_SLACK ? mx : old;
          const float alpha = now == old ? 1.f : fast_exp2(old - now);
          l[2 * j + e1] *= alpha;
#pragma unroll
          for (int m = 0; m < CA; ++m) {  // (none for CA = 0)
            o[m][4 * j + e1] *= alpha;
            o[m][4 * j + 2 + e1] *= alpha;
          }
          if (warp == 0 && g == 0) alpha_s[c] = alpha;
        }
      wg::bar_sync(B_S, 128);  // every thread has read the old maxima and mx_s
      if (wt < N) {
        const float now = unordered(mx_s[wt]);
        if (now > m_s[wt] + RESCALE_SLACK) m_s[wt] = now;
        mx_s[wt] = ordered(NEG_INF);
      }
      wg::bar_sync(B_S, 128);  // the new maxima
    } else if (t > 0) {
      wg::bar_sync(B_FREE, R::READY);
    }
    // -- P = exp2(s - max) in bf16, as P^T [72 rows][64 keys]; l per row over this thread's keys
    unsigned char* pt = smem + P_OFF;
#pragma unroll
    for (int j = 0; j < 9; ++j) {
      const float2 m = *reinterpret_cast<const float2*>(m_s + 8 * j + 2 * t4);
      const float z0 = m.x == NEG_INF ? 0.f : m.x, z1 = m.y == NEG_INF ? 0.f : m.y;  // masked keys: ex2(-inf) = 0
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = fast_exp2(s[4 * j + e] - ((e & 1) ? z1 : z0));
        l[2 * j + (e & 1)] += p;
        const int n = 8 * j + 2 * t4 + (e & 1), k = 16 * warp + g + 8 * (e >> 1);
        *reinterpret_cast<u16*>(pt + (n >> 3) * 1024 + (k >> 3) * 128 + (n & 7) * 16 + (k & 7) * 2) = bf16_bits(p);
      }
    }
    if (wt == 0) flag_s[0] = grew;
    wg::async_fence();  // P^T and the scrubbed V: generic stores, read by wgmma
    wg::bar_arrive(B_READY, R::READY);
    if constexpr (CA > 0) {
      wg::bar_sync(B_S, 128);  // all of this warpgroup's P^T is written
      // -- O^T += V^T P^T on value chunks 0 .. CA - 1
      pv<0, CA>(o, kb, ps);
      wg::wait0();
      keep_o(o);
      if (t + 2 < n_tiles) wg::bar_arrive(B_EMPTY + (t & 1), R::EMPTY);
    }
  }
  epilogue<T, R::CONS, 0, CA, true>(a, smem, o, l, rb, HT, item, tid - 128);
}

// A PV warpgroup: O^T for value chunks C0 .. C0 + M - 1 of every tile, once the S warpgroup has
// written its P^T and factors.
template <int T, int CA, int C0, int M>
__device__ __forceinline__ void pv_role(const SplitArgs& a, unsigned char* smem, int b, int n_tiles, int rb, int HT,
                                        int item) {
  using namespace km;
  using R = Roles<CA>;
  const int tid = threadIdx.x, t4 = tid & 3;
  const u32 ks = smem_u32(smem + K_OFF), ps = smem_u32(smem + P_OFF), bars = smem_u32(smem + BAR_OFF);
  load_q<T, R::CONS>(a, smem, b, rb, HT, tid - 128);
  float o[M][36];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int i = 0; i < 36; ++i) o[m][i] = 0.f;
  const float* alpha_s = reinterpret_cast<const float*>(smem + ALPHA_OFF);
  const int* flag_s = reinterpret_cast<const int*>(smem + FLAG_OFF);
  for (int t = 0; t < n_tiles; ++t) {
    const u32 kb = ks + (t & 1) * KBUF;
    wg::bar_sync(B_READY, R::READY);
    wg::mbar_wait(bars + 8 * (t & 1), (t >> 1) & 1);  // (landed already: the S warpgroup waited)
    if (flag_s[0]) rescale_cols(o, alpha_s, t4);
    pv<C0, M>(o, kb, ps);
    wg::wait0();
    keep_o(o);
    if (t + 1 < n_tiles) wg::bar_arrive(B_FREE, R::READY);
    if (t + 2 < n_tiles) wg::bar_arrive(B_EMPTY + (t & 1), R::EMPTY);
  }
  const float none[18] = {};
  epilogue<T, R::CONS, C0, M, false>(a, smem, o, none, rb, HT, item, tid - 128);
}
}  // namespace km

// grid (ceil(H * T / 72), NSPLIT + B): x the row block, y the work item (verify.cu's items, pieces
// in multiples of ALIGN keys); block km::Roles<CA>::THREADS (three or four warpgroups); dynamic
// smem km::SMEM_BYTES. CA: value chunks (64 columns) of O^T in the S warpgroup (DV_SPLIT / 64).
//
// chained_meta: null, or this launch follows another split launch of the same per-context
// dispatch (launched with programmatic serialization, so it may start while that one runs) and
// one merge after both reads one meta table. Then an idle launch writes nothing at all; an
// active one records the items in chained_meta ([B][2], its own) at its start and copies them to
// a.meta only once the grid before it is complete (griddepcontrol.wait), after that grid's idle
// marks; and every CTA waits for that grid before it exits, so the merge launched after this
// grid reads both grids' writes. One merge instead of one per launch, and the idle grid's
// launch overlaps the active one's (results/serving/dispatch-chain/).
template <int T, int CA, int ALIGN>
__global__ void __launch_bounds__(km::Roles<CA>::THREADS, 1) verify_km_kernel(const SplitArgs a,
                                                                              int* const chained_meta) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace km;
  const float NEG_INF = -__int_as_float(0x7f800000);
  static_assert(T >= 1 && T <= 64, "T in [1, 64]: the tree mask is one int64 per row");
  static_assert(ALIGN == 32 || ALIGN == 64, "SPLIT_ALIGN: 32 or 64 keys");
  using R = Roles<CA>;
  extern __shared__ __align__(1024) unsigned char smem[];
  {  // the launcher sizes dynamic smem from a Python mirror
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
    if (dyn < (u32)SMEM_BYTES || (smem_u32(smem) & 1023u)) __trap();  // swizzle atoms: 1024-byte aligned
  }
  int* work_s = reinterpret_cast<int*>(smem + WORK_OFF);
  float* m_s = reinterpret_cast<float*>(smem + M_OFF);
  int* mx_s = reinterpret_cast<int*>(smem + MX_OFF);
  const int tid = threadIdx.x, wgi = tid >> 7;
  const int HT = a.H * T, rb = blockIdx.x * N;
  pdl_launch_dependents();  // the merge waits for this whole grid before it reads anything
  const bool cta0 = blockIdx.y == 0 && blockIdx.x == 0;
  if (tid < 32) {
    Work w;
    if (chained_meta == nullptr) {
      w = find_work<ALIGN>(a, blockIdx.y, cta0);
    } else {  // an idle chained launch marks nothing: the meta is the other launch's
      SplitArgs own = a;
      own.meta = chained_meta;
      w = find_work<ALIGN>(own, blockIdx.y, cta0 && !batch_idle(a));
    }
    if (tid == 0) {
      work_s[0] = w.b;
      if (w.b >= 0) {
        const int L = a.indptr[w.b + 1] - a.indptr[w.b];
        work_s[1] = w.split * w.chunk;
        work_s[2] = min(w.split * w.chunk + w.chunk, L);
      }
      work_s[3] = blockIdx.y;
    }
  } else if (tid == 32) {
    for (int i = 0; i < 3; ++i) mbar_init(smem_u32(smem + BAR_OFF + 8 * i), 128);
  } else if (tid >= 128 && tid < 128 + N) {
    m_s[tid - 128] = NEG_INF;
    mx_s[tid - 128] = ordered(NEG_INF);
  }
  __syncthreads();
  const int b = work_s[0];
  if (b < 0) {  // no work: the merge never reads this CTA's item
    if (chained_meta != nullptr) pdl_wait();
    return;
  }
  const int lo = work_s[1], hi = work_s[2], item = work_s[3];
  const int kv_start = a.indptr[b], L = a.indptr[b + 1] - kv_start, P = L - T;
  const int n_tiles = (hi - lo + BN - 1) / BN;
  // each role's code is reachable from its own setmaxnreg only
  if (wgi == 0) {
    wg::regs_dec<REGS_PRODUCER>();
    produce<R::EMPTY>(a, smem, kv_start, lo, hi, n_tiles);
    if (chained_meta != nullptr) {  // the producer is done early: off the consumers' path
      pdl_wait();
      if (cta0 && tid < 32)
        for (int i = tid; i < 2 * a.B; i += 32) a.meta[i] = chained_meta[i];
    }
  } else if (wgi == 1) {
    if constexpr (CA == 0) wg::regs_dec<R::S>(); else wg::regs_inc<R::S>();
    s_role<T, CA>(a, smem, b, lo, hi, P, n_tiles, rb, HT, item);
  } else if (CA > 0 || wgi == 2) {
    wg::regs_inc<R::PV>();
    pv_role<T, CA, CA, R::PV_CHUNKS>(a, smem, b, n_tiles, rb, HT, item);
  } else {
    wg::regs_inc<R::PV>();
    pv_role<T, CA, 4, 4>(a, smem, b, n_tiles, rb, HT, item);
  }
#else
  __trap();  // wgmma needs sm_90a: the backend compiles this kernel for nothing else
#endif
}

}  // namespace kvtune
