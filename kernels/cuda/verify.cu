// MLA verify attention, split-K, for NVRTC: one templated source for sm_80 .. sm_120.
//
// Reads top to bottom: the PTX helpers (cp.async, ldmatrix, mma.sync), the compile-time
// configuration with its static_asserts, the split kernel (one key range of one request for
// a group of heads), and the log-sum-exp merge of the partials.
//
// Shapes: q [B*T, H, DK] bf16 (row/head strides given), kv [num_slots, DK] bf16 (row stride
// given), kv_indptr [B+1] int32, kv_indices int32 or int64, tree_mask [B*T] int64.
//
// Work is balanced by keys, not by requests: the batch's keys are cut into at most NSPLIT
// splits per head group (NSPLIT from the split table, looked up at the batch's total key
// count; B splits if NSPLIT < B). chunk is the least multiple of BLOCK_N for which
// sum_b ceil(L_b / chunk) <= max(NSPLIT, B); request b is cut into n_b = ceil(L_b / chunk)
// equal pieces of ceil(L_b / n_b) keys rounded up to whole tiles (so ceil(L_b / piece_b) = n_b
// items). Work items are numbered request after request. A long request in a ragged batch
// thus gets many splits and a short one few, and equal requests never leave a short remainder
// split beside full ones (64 requests of 4k keys at NSPLIT 132: 128 splits of 2k keys, not 64
// of 3.8k and 64 of 300), so no CTA holds a long tail while the rest of the GPU idles.
// Partials, per work item: o [ITEMS, T, H, DV] bf16 (normalised per split), lse [ITEMS, T, H]
// fp32 (natural log; -inf for a row that saw nothing in that split, NaN where a NaN was read);
// meta [B][2] int32: each request's first item and its item count, written by CTA (0, 0) for
// the merge.
//
// The split kernel computes S^T = K Q^T and O^T = V^T P^T ("swap AB"): keys and the value
// width sit in the MMA's M dimension (16), the heads x T query rows of the request sit in N
// (8), so H*T = 72 rows pad to 72, not 80, and each gathered key row is read from global
// memory once per split and head group.
#include <cuda_bf16.h>

namespace kvtune {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

constexpr int DK = 576;   // kv_lora_rank + qk_rope_head_dim
constexpr int DV = 512;   // kv_lora_rank: V is the first DV columns of a cached row
constexpr float LN2 = 0.6931471805599453f;
constexpr float RESCALE_SLACK = 8.f;  // log2 units: see the softmax step

// ---------------------------------------------------------------- PTX helpers (sm_80 class)

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// BYTES-wide asynchronous global->shared copy; src_bytes = 0 zero-fills the destination.
template <int BYTES>
__device__ __forceinline__ void cp_async(u32 dst, const void* src, int src_bytes) {
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(BYTES),
                 "r"(src_bytes));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2(u32 addr, u32& r0, u32& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// c[16x8] += a[16x16] * b[16x8], bf16 operands, fp32 accumulators.
// Not volatile: a pure register operation, free to be scheduled among the ldmatrix loads.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ u16 bf16_bits(float x) {
  __nv_bfloat16 h = __float2bfloat16_rn(x);
  return *reinterpret_cast<u16*>(&h);
}

// The split table's value for L keys: the grid's NSPLIT without a table, else the first bucket
// with L <= bound (the last bucket beyond the last bound). Same rule as Triton's (which applies
// it per request; here L is the batch's total). 0 marks a bucket this launch does not serve: a
// per-context dispatch puts several compile-time configs in one graph, one launch each, and
// every launch but the one whose table holds the batch's bucket does nothing (`batch_idle`).
__device__ __forceinline__ int table_value(int L, const int* max_keys, const int* values, int nb, int grid_nsplit) {
  if (nb == 0) return grid_nsplit;
  int n = values[nb - 1];
  for (int i = 0; i < nb; ++i) {
    if (L <= max_keys[i]) { n = values[i]; break; }
  }
  return n;
}
// NSPLIT for L keys: the table's value clamped to [1, grid_nsplit].
__device__ __forceinline__ int num_splits(int L, const int* max_keys, const int* values, int nb,
                                          int grid_nsplit) {
  return min(max(table_value(L, max_keys, values, nb, grid_nsplit), 1), grid_nsplit);
}

// ---------------------------------------------------------------- configuration

template <int VEC, int BLOCK_N, int NUM_WARPS, int HPB, int STAGES, int T, int QMT, int QRG, int QKS, int KV_BITS,
          int CTAS>
struct Config {
  // The cached K/V element type is a template value: an fp8 (e4m3, per-tensor scale) cache
  // halves every shape's bytes and comes next; only bf16 ships.
  static_assert(KV_BITS == 16, "KV_BITS: only a bf16 KV cache is implemented");
  static_assert(CTAS >= 1 && CTAS <= 4, "CTAS_PER_SM in [1, 4]");
  static_assert(VEC == 2 || VEC == 4 || VEC == 8, "VEC must be 2, 4 or 8 bf16 (4/8/16-byte copies)");
  static_assert(BLOCK_N == 16 || BLOCK_N == 32 || BLOCK_N == 64 || BLOCK_N == 128, "BLOCK_N in {16,32,64,128}");
  static_assert(NUM_WARPS == 4 || NUM_WARPS == 8 || NUM_WARPS == 16 || NUM_WARPS == 32, "NUM_WARPS in {4,8,16,32}");
  static_assert(STAGES >= 2 && STAGES <= 4, "STAGES in [2, 4]");
  static_assert(T >= 1 && T <= 64, "T in [1, 64]: the tree mask is one int64 per row");
  static_assert(HPB >= 1 && HPB * T <= 256, "HEADS_PER_BLOCK * T must be in [1, 256]");

  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int ROWS = HPB * T;          // query rows of one CTA
  static constexpr int NT = (ROWS + 7) / 8;     // n8 tiles of query rows
  static constexpr int ROWS_PAD = NT * 8;
  static constexpr int KT = BLOCK_N / 16;       // m16 tiles of keys
  // smem pitches: a 16-byte pad makes each row start 16 bytes further round the banks, so
  // the 8 row addresses of an ldmatrix hit 8 different 16-byte bank groups.
  static constexpr int KPITCH = DK + 8;         // bf16 per K / Q row (1168 bytes = 73 x 16)
  static constexpr int PPITCH = BLOCK_N + 8;    // bf16 per P row
  static constexpr int SPITCH = BLOCK_N + 4;    // fp32 per S row: fragment stores conflict-free
  static constexpr int OPITCH = DV + 8;         // bf16 per staged o row (1040 bytes = 65 x 16), over Q
  static_assert(OPITCH <= KPITCH, "the o staging rows must fit in the Q rows they reuse");

  // S^T = K Q^T: warps tile (KT / QMT key groups of QMT m16 tiles) x (QRG row groups of S_NT
  // n8 tiles) x (QKS slices of the 576-wide reduction, summed by the softmax step). The
  // launcher picks the tiling (backend.qk_tiling): every warp busy, then the least shared-
  // memory traffic per key (K re-read once per row group, Q once per key group, S partials).
  static_assert(QMT >= 1 && KT % QMT == 0, "QMT must divide BLOCK_N / 16");
  static_assert(QRG >= 1 && QRG <= NT, "QRG in [1, row tiles]");
  static_assert(QKS >= 1 && (DK / 16) % QKS == 0, "QKS must divide the 36 k16 steps of DK");
  static constexpr int WS_K = KT / QMT;
  static constexpr int S_KS = QKS;
  static constexpr int S_MT = QMT;
  static constexpr int WS_R = QRG;
  static constexpr int S_NT = (NT + QRG - 1) / QRG;
  static_assert((NT + S_NT - 1) / S_NT == QRG, "QRG row groups must all be non-empty");
  static constexpr int S_KSTEPS = DK / 16 / QKS;
  static constexpr int QK_WARPS = WS_K * WS_R * S_KS;
  static_assert(QK_WARPS <= NUM_WARPS, "the QK^T tiling needs more warps than the block has");
  // O^T = V^T P^T: each warp owns DV / NUM_WARPS value columns for every query row
  static constexpr int PV_MT = (DV / 16) / NUM_WARPS;
  static_assert(PV_MT >= 1, "NUM_WARPS <= DV / 16");
  static_assert(PV_MT * NT * 4 <= 192, "O accumulator over 192 registers per thread: fewer rows or more warps");

  // gathered key copy: TPR threads per key row, each CPT chunks of VEC elements
  static constexpr int CPR = DK / VEC;
  static_assert(THREADS >= BLOCK_N && THREADS % BLOCK_N == 0, "threads must cover the key rows of a tile");
  static constexpr int TPR = THREADS / BLOCK_N;
  static constexpr int CPT = (CPR + TPR - 1) / TPR;
  // slots are staged in shared memory a chunk of THREADS keys at a time, one chunk ahead, so
  // no tile issue waits on an index load
  static constexpr int TPC = THREADS / BLOCK_N;  // tiles per slot chunk

  // online softmax: 8 lanes per row, BLOCK_N / 8 columns per lane
  static constexpr int GROUPS = THREADS / 8;
  static constexpr int PASSES = (ROWS + GROUPS - 1) / GROUPS;
  static constexpr int CPL = BLOCK_N / 8;

  // shared memory layout (bytes)
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + ROWS_PAD * KPITCH * 2;
  static constexpr int K_STAGE = BLOCK_N * KPITCH * 2;
  static constexpr int S_OFF = K_OFF + STAGES * K_STAGE;
  static constexpr int P_OFF = S_OFF + S_KS * ROWS_PAD * SPITCH * 4;
  static constexpr int ALPHA_OFF = P_OFF + ROWS_PAD * PPITCH * 2;
  static constexpr int L_OFF = ALPHA_OFF + ROWS_PAD * 4;
  static constexpr int SLOT_OFF = L_OFF + ROWS_PAD * 4;
  static constexpr int SMEM_BYTES = SLOT_OFF + 2 * THREADS * 4;
  static_assert(P_OFF % 16 == 0 && S_OFF % 16 == 0, "P is zeroed and o rows staged in 16-byte pieces");
  static_assert(QKS * SPITCH * 4 >= 8, "the epilogue keeps an 8-byte offset per row over the S partials");
};

struct SplitArgs {
  const u16* q;             // [B*T, H, DK] bf16
  const u16* kv;            // [num_slots, DK] bf16
  const int* indptr;        // [B+1]
  const void* indices;      // int32 or int64
  const i64* tree_mask;     // [B*T]
  u16* part_o;              // [ITEMS, T, H, DV] bf16
  float* part_lse;          // [ITEMS, T, H]
  int* meta;                // [B][2]: first item, item count
  const int* split_max_keys;
  const int* split_values;
  i64 q_stride_m, q_stride_h, kv_stride;  // in elements
  float qk_scale;           // sm_scale * log2(e)
  int H, B, num_buckets, grid_nsplit, indices_64, q_vec16;
};
static_assert(sizeof(SplitArgs) == 136, "SplitArgs must match backend._SplitArgs");

// The work item `item` of the key-balanced schedule (see the top of this file), found by one
// warp (find_work): a binary search for the chunk (chunk_tiles), then a scan of the requests'
// split counts, 32 requests at a time (find_item). With write_meta, the warp also records every
// request's (first item, item count) for the merge. b = -1: past the last item; chunk = the keys
// per split of request b.
struct Work {
  int b, split, chunk;
};
// Lane i gets v_0 + ... + v_i over the warp's lanes (all 32 lanes must call).
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}
__device__ int count_splits(const SplitArgs& a, int chunk) {  // sum_b max(ceil(L_b / chunk), 1), warp-wide
  const int lane = threadIdx.x & 31;
  int n = 0;
  for (int b = lane; b < a.B; b += 32) n += max((a.indptr[b + 1] - a.indptr[b] + chunk - 1) / chunk, 1);
  return __reduce_add_sync(0xffffffffu, n);
}
// The items' chunk in whole tiles of BLOCK_N keys: the fewest tiles per piece that cut every
// request into pieces, cap of them at most in all (cap = max(NSPLIT for the batch, B)). Warp-wide.
template <int BLOCK_N>
__device__ int chunk_tiles(const SplitArgs& a, int total, int cap) {
  // k_hi tiles always fit (sum_b ceil(L_b / c) < total / c + B <= cap + 1 at c >= total / (cap -
  // B + 1)), fewer than k_lo never can (the sum is at least total / c)
  int k_lo = max((total + cap - 1) / cap, 1);
  k_lo = (k_lo + BLOCK_N - 1) / BLOCK_N;
  const int denom = max(cap - a.B + 1, 1);
  int k_hi = max(((total + denom - 1) / denom + BLOCK_N - 1) / BLOCK_N, 1);
  while (k_lo < k_hi) {  // uniform across the warp: every lane holds the same bounds
    const int mid = (k_lo + k_hi) >> 1;
    if (count_splits(a, mid * BLOCK_N) <= cap) k_hi = mid; else k_lo = mid + 1;
  }
  return k_hi;
}
__device__ __forceinline__ int batch_keys(const SplitArgs& a) { return a.indptr[a.B] - a.indptr[0]; }
__device__ __forceinline__ int batch_nsplit(const SplitArgs& a, int total) {
  return num_splits(total, a.split_max_keys, a.split_values, a.num_buckets, a.grid_nsplit);
}
// Whether another launch of a per-context dispatch serves this batch (its bucket's table value
// is 0 here): then CTA (0, 0) marks every request's item count -1 (`mark_idle`), no CTA does
// anything else, and the merge launched after it writes nothing.
__device__ __forceinline__ bool batch_idle(const SplitArgs& a) {
  return a.num_buckets > 0 &&
         table_value(batch_keys(a), a.split_max_keys, a.split_values, a.num_buckets, a.grid_nsplit) == 0;
}
__device__ __forceinline__ void mark_idle(const SplitArgs& a) {  // warp-wide
  for (int b = threadIdx.x & 31; b < a.B; b += 32) {
    a.meta[2 * b] = 0;
    a.meta[2 * b + 1] = -1;
  }
}

// Work item `item` of the items schedule with pieces of at most `chunk` keys (a multiple of
// BLOCK_N, from chunk_tiles): each request cut into equal pieces in whole tiles, requests in
// order. b = -1 past the last item. write_meta: also every request's (first item, item count)
// for the merge. Warp-wide.
template <int BLOCK_N>
__device__ Work find_item(const SplitArgs& a, int item, bool write_meta, int chunk) {
  const int lane = threadIdx.x & 31;
  Work w = {-1, 0, chunk};
  int run = 0;  // items of the requests before this group of 32
  for (int b0 = 0; b0 < a.B; b0 += 32) {
    const int b = b0 + lane;
    const int L = b < a.B ? a.indptr[b + 1] - a.indptr[b] : 0;
    const int parts = max((L + chunk - 1) / chunk, 1);
    // equal pieces in whole tiles: piece <= chunk, and ceil(L / piece) = parts
    const int piece = max(((L + parts - 1) / parts + BLOCK_N - 1) / BLOCK_N * BLOCK_N, BLOCK_N);
    const int n = b < a.B ? parts : 0;
    const int incl = warp_inclusive_sum(n, lane);
    const int start = run + incl - n;
    if (write_meta && b < a.B) {
      a.meta[2 * b] = start;
      a.meta[2 * b + 1] = n;
    }
    const unsigned mine = __ballot_sync(0xffffffffu, b < a.B && item >= start && item < start + n);
    if (mine) {  // warp-uniform
      const int src = __ffs(mine) - 1;
      w.b = b0 + src;
      w.split = item - __shfl_sync(0xffffffffu, start, src);
      w.chunk = __shfl_sync(0xffffffffu, piece, src);
    }
    run += __shfl_sync(0xffffffffu, incl, 31);
  }
  return w;
}
template <int BLOCK_N>
__device__ Work find_work(const SplitArgs& a, int item, bool write_meta) {
  if (batch_idle(a)) {
    if (write_meta) mark_idle(a);
    return {-1, 0, 0};
  }
  const int total = batch_keys(a);
  const int chunk = chunk_tiles<BLOCK_N>(a, total, max(batch_nsplit(a, total), a.B)) * BLOCK_N;
  return find_item<BLOCK_N>(a, item, write_meta, chunk);
}

// Programmatic dependent launch (sm_90 and newer): the merge grid may start while the split
// grid drains, and waits for the split grid's results with griddepcontrol.wait. Older archs
// order the two launches as plain stream work, and both calls compile to nothing.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------- split kernel
// grid (ceil(H / HPB), NSPLIT + B): x the head group, y the work item; block NUM_WARPS * 32;
// dynamic smem Config::SMEM_BYTES. CTAS: CTAs per SM the registers are capped for.
template <int VEC, int BLOCK_N, int NUM_WARPS, int HPB, int STAGES, int T, int QMT, int QRG, int QKS, int KV_BITS,
          int CTAS>
__global__ void __launch_bounds__(NUM_WARPS * 32, CTAS) verify_split_kernel(const SplitArgs a) {
  using C = Config<VEC, BLOCK_N, NUM_WARPS, HPB, STAGES, T, QMT, QRG, QKS, KV_BITS, CTAS>;
  extern __shared__ __align__(128) unsigned char smem[];
  u16* Qs = reinterpret_cast<u16*>(smem + C::Q_OFF);
  u16* Ks = reinterpret_cast<u16*>(smem + C::K_OFF);
  float* Ss = reinterpret_cast<float*>(smem + C::S_OFF);
  u16* Ps = reinterpret_cast<u16*>(smem + C::P_OFF);
  float* alpha_s = reinterpret_cast<float*>(smem + C::ALPHA_OFF);
  float* l_s = reinterpret_cast<float*>(smem + C::L_OFF);
  u32* slot_s = reinterpret_cast<u32*>(smem + C::SLOT_OFF);  // [2][THREADS], ~0u = past the end

  {  // the launcher sizes dynamic smem from a Python mirror of Config: never run short of it
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
    if (dyn < (u32)C::SMEM_BYTES) __trap();
  }
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hg = blockIdx.x, item = blockIdx.y;
  // the merge may launch now: it waits for this whole grid before it reads anything
  pdl_launch_dependents();

  // -- which request and key range: warp 0 scans the batch, the block learns it through smem
  __shared__ int work_s[3];
  if (warp == 0) {
    const Work w = find_work<BLOCK_N>(a, item, item == 0 && hg == 0);
    if (lane == 0) {
      work_s[0] = w.b;
      work_s[1] = w.split;
      work_s[2] = w.chunk;
    }
  }
  __syncthreads();
  const int b = work_s[0];
  if (b < 0) return;                            // past the batch's last item: the merge never reads it
  const int split = work_s[1], chunk = work_s[2];
  const int kv_start = a.indptr[b];
  const int L = a.indptr[b + 1] - kv_start;
  const int P = L - T;                          // prefix keys; draft key d sits at P + d
  const int lo = split * chunk;                 // < L: every item of the schedule holds keys
  const int hi = min(lo + chunk, L);
  const int n_tiles = (hi - lo + BLOCK_N - 1) / BLOCK_N;

  // -- zero the padded P rows once, alpha of padded rows 0 (their O columns are never stored)
  for (int i = tid; i < C::ROWS_PAD * C::PPITCH / 8; i += C::THREADS)
    reinterpret_cast<uint4*>(Ps)[i] = make_uint4(0u, 0u, 0u, 0u);
  for (int r = tid; r < C::ROWS_PAD; r += C::THREADS) alpha_s[r] = 0.f;

  // -- slot chunk 0 first, so its loads are not queued behind the Q copy
  auto fetch_slot = [&](int c) -> u32 {  // slot of key lo + c * THREADS + tid, ~0u past the end
    const int n = lo + c * C::THREADS + tid;
    if (n >= hi) return ~0u;
    return a.indices_64 ? (u32) reinterpret_cast<const i64*>(a.indices)[kv_start + n]
                        : (u32) reinterpret_cast<const int*>(a.indices)[kv_start + n];
  };
  slot_s[tid] = fetch_slot(0);

  // -- Q tile: the HPB x T rows of this head group, zero for padded rows / heads past H
  const u32 qs_base = smem_u32(Qs);
  if (a.q_vec16) {  // a warp per row: the row's address once, then 16-byte copies by lane
    constexpr int QC = DK / 8;
    for (int r = warp; r < C::ROWS_PAD; r += NUM_WARPS) {
      const int head = hg * HPB + r / T;
      const bool ok = r < C::ROWS && head < a.H;
      const u16* src = ok ? a.q + (i64)(b * T + r % T) * a.q_stride_m + (i64)head * a.q_stride_h : a.q;
#pragma unroll
      for (int c = lane; c < QC; c += 32)
        cp_async<16>(qs_base + (r * C::KPITCH + c * 8) * 2, ok ? src + c * 8 : a.q, ok ? 16 : 0);
    }
  } else {
    for (int c = tid; c < C::ROWS_PAD * DK; c += C::THREADS) {
      const int r = c / DK, col = c % DK;
      const int head = hg * HPB + r / T;
      const bool ok = r < C::ROWS && head < a.H;
      Qs[r * C::KPITCH + col] =
          ok ? a.q[(i64)(b * T + r % T) * a.q_stride_m + (i64)head * a.q_stride_h + col] : (u16)0;
    }
  }

  // -- gathered key tiles: thread `tid` copies row tid / TPR of each tile, chunks sub + TPR*i
  const int my_row = tid / C::TPR, my_sub = tid % C::TPR;
  const u32 ks_base = smem_u32(Ks);
  // A tile's copy is set up once (slot lookup, addresses) and its CPT chunks issued separately:
  // inside the main loop they are spread over the QK^T k-steps, because a burst of CPT
  // cp.async per thread fills the load queue and the next write to an address register
  // waits for the queue to drain (about 6% of the kernel's time when issued in one burst).
  struct TileCopy {
    const u16* src;
    u32 dst;
    int bytes;  // 16-byte copies: VEC * 2; 0 zero-fills (rows past the split's end); -1 no tile
  };
  auto tile_copy = [&](int tile) -> TileCopy {
    if (tile >= n_tiles) return {a.kv, 0u, -1};
    const u32 slot = slot_s[((tile / C::TPC) & 1) * C::THREADS + (tile % C::TPC) * BLOCK_N + my_row];
    const bool ok = slot != ~0u;
    return {ok ? a.kv + (i64)slot * a.kv_stride : a.kv,
            ks_base + (tile % STAGES) * C::K_STAGE + my_row * C::KPITCH * 2, ok ? VEC * 2 : 0};
  };
  auto copy_chunk = [&](const TileCopy& t, int i) {
    const int c = my_sub + i * C::TPR;
    if (t.bytes >= 0 && (C::CPR % C::TPR == 0 || c < C::CPR))
      cp_async<VEC * 2>(t.dst + c * VEC * 2, t.src + c * VEC, t.bytes);
  };
  auto issue_tile = [&](int tile) {
    const TileCopy t = tile_copy(tile);
#pragma unroll
    for (int i = 0; i < C::CPT; ++i) copy_chunk(t, i);
  };
  // stage chunk `c` (slots of keys lo + c*THREADS ..) from the prefetched register into its buffer
  u32 pending = fetch_slot(1);
  auto stage_chunk = [&](int c) {
    slot_s[(c & 1) * C::THREADS + tid] = pending;
    pending = fetch_slot(c + 1);
  };

  __syncthreads();  // chunk 0 visible to every issuing thread
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s > 0 && s % C::TPC == 0) {
      stage_chunk(s / C::TPC);
      __syncthreads();
    }
    issue_tile(s);
    cp_async_commit();  // group 0 also carries the Q tile
  }
  if ((STAGES - 1) % C::TPC == 0) stage_chunk((STAGES - 1) / C::TPC);  // published by the loop's first barrier

  // -- per-row softmax state, owned by the 8 lanes of row group tid / 8
  const int grp = tid >> 3, sub8 = tid & 7;
  float m_run[C::PASSES], l_run[C::PASSES];
  i64 bits[C::PASSES];
#pragma unroll
  for (int p = 0; p < C::PASSES; ++p) {
    m_run[p] = -__int_as_float(0x7f800000);
    l_run[p] = 0.f;
    const int r = p * C::GROUPS + grp;
    bits[p] = r < C::ROWS ? a.tree_mask[b * T + r % T] : 0;
  }

  float acc[C::PV_MT][C::NT][4];
#pragma unroll
  for (int mt = 0; mt < C::PV_MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

  const int g = lane >> 2, t4 = lane & 3;
  const int wk = warp % C::WS_K, wr = (warp / C::WS_K) % C::WS_R, wks = warp / (C::WS_K * C::WS_R);
  const int dv0 = warp * C::PV_MT * 16;
  const u32 ps_base = smem_u32(Ps);

  for (int it = 0; it < n_tiles; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile `it` visible to all; every warp is done with tile it-1's stage
    const TileCopy next = tile_copy(it + STAGES - 1);  // issued below, committed after QK^T
    if ((it + STAGES) % C::TPC == 0) stage_chunk((it + STAGES) / C::TPC);  // read after the next barrier
    const u32 kst = ks_base + (it % STAGES) * C::K_STAGE;

    // -- S^T = K Q^T over the 576-wide reduction
    if (C::QK_WARPS == NUM_WARPS || warp < C::QK_WARPS) {
      float sacc[C::S_MT][C::S_NT][4];
#pragma unroll
      for (int mt = 0; mt < C::S_MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[mt][nt][e] = 0.f;
      // Branch-free so that ptxas can hoist the next k-step's ldmatrix above this step's MMAs:
      // the last row group may be short (9 row tiles in groups of 5); its missing tiles re-read
      // the last real one, and their S is never stored.
      const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
      const u32 a_base = kst + ((wk * C::S_MT * 16 + a_row) * C::KPITCH + wks * C::S_KSTEPS * 16 + a_col) * 2;
      constexpr int NBP = (C::S_NT + 1) / 2;  // ldmatrix loads of Q per k-step: pairs of row tiles
      u32 b_base[NBP];
#pragma unroll
      for (int np = 0; np < NBP; ++np) {
        const int tile = min(wr * C::S_NT + 2 * np + (lane >> 4), C::NT - 1);
        b_base[np] = qs_base + ((tile * 8 + (lane & 7)) * C::KPITCH + wks * C::S_KSTEPS * 16 + ((lane >> 3) & 1) * 8) * 2;
      }
#pragma unroll
      for (int kk = 0; kk < C::S_KSTEPS; ++kk) {
        u32 af[C::S_MT][4], bq[NBP][4];
#pragma unroll
        for (int mt = 0; mt < C::S_MT; ++mt)
          ldmatrix_x4(a_base + (mt * 16 * C::KPITCH + kk * 16) * 2, af[mt][0], af[mt][1], af[mt][2], af[mt][3]);
#pragma unroll
        for (int np = 0; np < NBP; ++np) {
          if (2 * np + 1 < C::S_NT) {
            ldmatrix_x4(b_base[np] + kk * 32, bq[np][0], bq[np][1], bq[np][2], bq[np][3]);
          } else {
            ldmatrix_x2(b_base[np] + kk * 32, bq[np][0], bq[np][1]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < C::S_NT; ++nt)
#pragma unroll
          for (int mt = 0; mt < C::S_MT; ++mt)
            mma_bf16(sacc[mt][nt], af[mt], bq[nt / 2][(nt % 2) * 2], bq[nt / 2][(nt % 2) * 2 + 1]);
#pragma unroll
        for (int i = 0; i < C::CPT; ++i)
          if (i * C::S_KSTEPS / C::CPT == kk) copy_chunk(next, i);  // each chunk at exactly one k-step
      }
      // c0: (key g, row 2t), c1: (key g, row 2t+1), c2/c3: key g+8
#pragma unroll
      for (int mt = 0; mt < C::S_MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::S_NT; ++nt) {
          const int ntg = wr * C::S_NT + nt;
          if (ntg < C::NT) {
            const int key = (wk * C::S_MT + mt) * 16 + g, row = ntg * 8 + 2 * t4;
            float* Sk = Ss + wks * C::ROWS_PAD * C::SPITCH;
            Sk[row * C::SPITCH + key] = sacc[mt][nt][0];
            Sk[(row + 1) * C::SPITCH + key] = sacc[mt][nt][1];
            Sk[row * C::SPITCH + key + 8] = sacc[mt][nt][2];
            Sk[(row + 1) * C::SPITCH + key + 8] = sacc[mt][nt][3];
          }
        }
    } else {
#pragma unroll
      for (int i = 0; i < C::CPT; ++i) copy_chunk(next, i);
    }
    cp_async_commit();  // one group per iteration, empty past the last tile
    __syncthreads();

    // -- online softmax (base 2): tree mask on draft keys, update m and l, P to smem as bf16.
    // The max in use only moves when a row's tile max exceeds it by more than RESCALE_SLACK
    // (then P <= 2^RESCALE_SLACK, harmless in fp32 sums and bf16 P): most tiles rescale no
    // row, and the barrier's OR tells every warp to skip the O^T rescale.
    int grew = 0;
    // A NaN in a draft key's V must not reach the rows that may not see that key (their p is
    // 0, and 0 * NaN = NaN): zero the NaN values of the tile's draft keys here, after QK^T read
    // them (V is part of the key, so a row that sees it already has a NaN score) and before PV.
    {
      const int t0 = lo + it * BLOCK_N, d_lo = max(t0, P), d_hi = min(t0 + BLOCK_N, hi);
      if (d_lo < d_hi) {  // the same for every thread: the tile holds draft keys
        u16* vs = Ks + (it % STAGES) * (C::K_STAGE / 2);
        constexpr int PIECES = DV / 8;  // 16-byte pieces of a V row
        for (int c = tid; c < (d_hi - d_lo) * PIECES; c += C::THREADS) {
          uint4* piece = reinterpret_cast<uint4*>(vs + (d_lo - t0 + c / PIECES) * C::KPITCH + (c % PIECES) * 8);
          const uint4 v = *piece;
          u32 w[4] = {v.x, v.y, v.z, v.w};
          bool nan = false;
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const u32 sh = 16 * (e & 1);
            if (((w[e >> 1] >> sh) & 0x7fffu) > 0x7f80u) {  // a bf16 NaN
              w[e >> 1] &= ~(0xffffu << sh);
              nan = true;
            }
          }
          if (nan) *piece = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
    {
      const int n0 = lo + it * BLOCK_N + sub8 * C::CPL;
      // every key of the tile a prefix key inside the split: no per-key visibility test
      const bool all_visible = lo + (it + 1) * BLOCK_N <= min(hi, P);
      // Every pass's S loads first: the P stores below could alias them as far as the
      // compiler knows, so loads written after a store would wait for it, and the passes'
      // load -> shuffle -> exp chains would run one after another instead of interleaved.
      // Rows past ROWS read the last real row (rows past ROWS_PAD lie outside S) and are
      // masked below, with no branch.
      float s[C::PASSES][C::CPL];
#pragma unroll
      for (int p = 0; p < C::PASSES; ++p) {
        const float* src = Ss + min(p * C::GROUPS + grp, C::ROWS - 1) * C::SPITCH + sub8 * C::CPL;
        // sum the QKS partials of this row's CPL keys
        if constexpr (C::CPL % 4 == 0) {
#pragma unroll
          for (int j = 0; j < C::CPL; j += 4) {
            float4 v = *reinterpret_cast<const float4*>(src + j);
#pragma unroll
            for (int h = 1; h < C::S_KS; ++h) {
              const float4 w = *reinterpret_cast<const float4*>(src + h * C::ROWS_PAD * C::SPITCH + j);
              v.x += w.x; v.y += w.y; v.z += w.z; v.w += w.w;
            }
            s[p][j] = v.x; s[p][j + 1] = v.y; s[p][j + 2] = v.z; s[p][j + 3] = v.w;
          }
        } else {
#pragma unroll
          for (int j = 0; j < C::CPL; ++j) {
            float v = src[j];
#pragma unroll
            for (int h = 1; h < C::S_KS; ++h) v += src[h * C::ROWS_PAD * C::SPITCH + j];
            s[p][j] = v;
          }
        }
      }
#pragma unroll
      for (int p = 0; p < C::PASSES; ++p) {
        const int r = p * C::GROUPS + grp;
        const bool row_ok = r < C::ROWS;
        float mx = -__int_as_float(0x7f800000);
#pragma unroll
        for (int j = 0; j < C::CPL; ++j) {
          // bitwise, not short-circuit: ptxas turns && / || here into 6 branches per key
          const int d = n0 + j - P;
          const bool draft_ok = (d < 0) | (bool)(((unsigned long long)bits[p] >> (d & 63)) & 1ull);
          const bool vis = row_ok & (all_visible | ((n0 + j < hi) & draft_ok));
          s[p][j] = vis ? s[p][j] * a.qk_scale : -__int_as_float(0x7f800000);
          mx = fmaxf(mx, s[p][j]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        const bool grow = mx > m_run[p] + RESCALE_SLACK;   // false while both are -inf
        const float m_new = grow ? mx : m_run[p];
        const float m_safe = m_new == -__int_as_float(0x7f800000) ? 0.f : m_new;
        const float alpha = grow ? fast_exp2(m_run[p] - m_new) : 1.f;
        grew |= grow && row_ok;
        float psum = 0.f;
#pragma unroll
        for (int j = 0; j < C::CPL; j += 2) {
          const float p0 = fast_exp2(s[p][j] - m_safe), p1 = fast_exp2(s[p][j + 1] - m_safe);
          psum += p0 + p1;
          const u32 packed = (u32)bf16_bits(p0) | ((u32)bf16_bits(p1) << 16);
          if (row_ok) *reinterpret_cast<u32*>(Ps + r * C::PPITCH + sub8 * C::CPL + j) = packed;
        }
        if (row_ok && sub8 == 0) alpha_s[r] = alpha;
        l_run[p] = l_run[p] * alpha + psum;  // lane-partial sums; reduced once at the end
        m_run[p] = m_new;
      }
    }
    const int any_grew = __syncthreads_or(grew);

    // -- O^T = alpha * O^T + V^T P^T; V is the first DV columns of the key rows already in smem
    {
      if (any_grew) {  // some row's max in use moved: rescale its O^T columns
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt) {
          const float a0 = alpha_s[nt * 8 + 2 * t4], a1 = alpha_s[nt * 8 + 2 * t4 + 1];
#pragma unroll
          for (int mt = 0; mt < C::PV_MT; ++mt) {
            acc[mt][nt][0] *= a0;
            acc[mt][nt][1] *= a1;
            acc[mt][nt][2] *= a0;
            acc[mt][nt][3] *= a1;
          }
        }
      }
      const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;
      const int v_key = (lane & 7) + (lane >> 4) * 8, v_col = ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < C::KT; ++ks) {
        u32 af[C::PV_MT][4];
#pragma unroll
        for (int mt = 0; mt < C::PV_MT; ++mt)
          ldmatrix_x4_trans(kst + ((ks * 16 + v_key) * C::KPITCH + dv0 + mt * 16 + v_col) * 2, af[mt][0], af[mt][1],
                            af[mt][2], af[mt][3]);
        // P^T fragments two row tiles at a time: few of them live at once
#pragma unroll
        for (int nt = 0; nt < C::NT; nt += 2) {
          u32 b0, b1, b2 = 0, b3 = 0;
          if (nt + 1 < C::NT) {
            ldmatrix_x4(ps_base + ((nt * 8 + b_row) * C::PPITCH + ks * 16 + b_col) * 2, b0, b1, b2, b3);
          } else {
            ldmatrix_x2(ps_base + ((nt * 8 + (lane & 7)) * C::PPITCH + ks * 16 + b_col) * 2, b0, b1);
          }
#pragma unroll
          for (int mt = 0; mt < C::PV_MT; ++mt) {
            mma_bf16(acc[mt][nt], af[mt], b0, b1);
            if (nt + 1 < C::NT) mma_bf16(acc[mt][nt + 1], af[mt], b2, b3);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // -- this split's lse (natural log), l for the normalisation of o, and where each row of
  // o goes (-1: a head past H), kept over the S partials (every warp is past the last
  // softmax, the last reader of S)
  i64* row_off = reinterpret_cast<i64*>(smem + C::S_OFF);
#pragma unroll
  for (int p = 0; p < C::PASSES; ++p) {
    float l = l_run[p];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    const int r = p * C::GROUPS + grp;
    if (r < C::ROWS && sub8 == 0) {
      l_s[r] = l;
      const int head = hg * HPB + r / T;
      const i64 pr = ((i64)item * T + r % T) * a.H + head;  // partial row
      row_off[r] = head < a.H ? pr * DV : -1;
      if (head < a.H) {  // l = 0: the row saw no key here; a NaN l (a NaN was read) stays NaN
        const float lse = l == 0.f ? -__int_as_float(0x7f800000) : (m_run[p] + __log2f(l)) * LN2;
        a.part_lse[pr] = lse;
      }
    }
  }
  __syncthreads();

  // -- normalised partial o, staged through shared memory (over Q, whose last reader passed
  // the loop's last barrier) so that it leaves in 16-byte row-contiguous stores: storing the
  // fragments directly takes 2-byte stores, each half of a 32-byte sector, 144 per thread.
  // Fragments: c0 (dv g, row 2t), c1 (dv g, row 2t+1), c2/c3 dv g+8.
  u16* Os = Qs;  // [ROWS_PAD][OPITCH] bf16
#pragma unroll
  for (int nt = 0; nt < C::NT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = nt * 8 + 2 * t4 + j;
      const float l = r < C::ROWS ? l_s[r] : 0.f;
      const float inv = l == 0.f ? 0.f : 1.f / l;  // NaN stays NaN
      u16* dst = Os + r * C::OPITCH + dv0 + g;
#pragma unroll
      for (int mt = 0; mt < C::PV_MT; ++mt) {
        dst[mt * 16] = bf16_bits(acc[mt][nt][j] * inv);
        dst[mt * 16 + 8] = bf16_bits(acc[mt][nt][2 + j] * inv);
      }
    }
  }
  __syncthreads();
  constexpr int CHUNKS = DV / 8;  // 16-byte pieces of a row
  for (int c = tid; c < C::ROWS * CHUNKS; c += C::THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const i64 off = row_off[r];
    if (off < 0) continue;
    *reinterpret_cast<uint4*>(a.part_o + off + col) = *reinterpret_cast<const uint4*>(Os + r * C::OPITCH + col);
  }
}

// ---------------------------------------------------------------- merge kernel

struct MergeArgs {
  const u16* part_o;        // [ITEMS, T, H, DV] bf16
  const float* part_lse;    // [ITEMS, T, H]
  u16* out;                 // [B*T, H, DV] bf16 (strides given)
  float* lse;               // [B*T, H] fp32 or null
  const int* meta;          // [B][2]: first item, item count (written by the split kernel)
  i64 out_stride_m, out_stride_h, lse_stride_m;
  int H, T;
};
static_assert(sizeof(MergeArgs) == 72, "MergeArgs must match backend._MergeArgs");

constexpr int MAX_NSPLIT = 1024;

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();  // red is reused between calls
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  v = red[0];
  for (int i = 1; i < nw; ++i) v = is_max ? fmaxf(v, red[i]) : v + red[i];
  return v;
}

// grid (B*T*H, DV / 128); block SG * 16: one (row, head) pair and 128 of its DV columns per
// block. All split weights are computed first (the lse loads are independent). Then split
// group sg sums w_k * o_k over splits sg, sg+SG, ..., 8 columns (16 bytes) per thread, loading
// MB splits (cp.async into shared memory) before adding any, so that a batch's loads are in
// flight together; a loop that loads and adds one split at a time waits one memory round trip
// per split (the first version of this kernel did: about 10 us at 132 splits on the H200).
// The SG group sums are added through shared memory, one column per thread.
template <int SG>
__global__ void __launch_bounds__(SG * 16) verify_merge_kernel(const MergeArgs a) {
  constexpr int MB = 8;
  __shared__ float w_s[MAX_NSPLIT];
  __shared__ float red[32];
  __shared__ __align__(16) float red_o[SG * 128];  // [split group][column]
  __shared__ __align__(16) uint4 stage[MB][SG * 16];  // one batch of o pieces per thread
  const int pair = blockIdx.x;                  // = row * H + head
  const int row = pair / a.H, head = pair % a.H;
  const int b = row / a.T, t = row % a.T;
  pdl_wait();  // the split grid's partials and meta are complete and visible past this point
  const int first = a.meta[2 * b], nsplit = min(a.meta[2 * b + 1], MAX_NSPLIT);
  if (nsplit < 0) return;  // the split launch was idle (`batch_idle`): another launch serves the batch
  const float NEG_INF = -__int_as_float(0x7f800000);
  const i64 split_stride = (i64)a.T * a.H;     // partial rows per work item
  const i64 pair0 = ((i64)first * a.T + t) * a.H + head;  // this pair's row in the request's first item

  // -- weights: w_k = exp(lse_k - max); an empty split (lse = -inf) weighs 0 and is not read
  float m = NEG_INF;
  for (int k = threadIdx.x; k < nsplit; k += blockDim.x) {
    const float l = a.part_lse[k * split_stride + pair0];
    w_s[k] = l;
    m = fmaxf(m, l);
  }
  m = block_reduce(m, red, true);
  float s = 0.f;
  for (int k = threadIdx.x; k < nsplit; k += blockDim.x) {
    // every split NaN leaves m = -inf (fmaxf skips NaN): keep the NaN, do not weigh it 0
    const float w = m == NEG_INF ? (w_s[k] != w_s[k] ? w_s[k] : 0.f) : __expf(w_s[k] - m);
    w_s[k] = w;
    s += w;
  }
  s = block_reduce(s, red, false);  // its barriers also publish w_s

  const int sg = threadIdx.x / 16, c = threadIdx.x % 16;
  const int col0 = blockIdx.y * 128;
  float o[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = 0.f;
  const u16* base = a.part_o + pair0 * DV + col0 + c * 8;
  for (int k0 = sg; k0 < nsplit; k0 += SG * MB) {
    // the batch's loads as cp.async: nothing the compiler can sink to its first use, so all
    // MB are in flight together; splits past nsplit or of weight 0 (never written) zero-fill
#pragma unroll
    for (int u = 0; u < MB; ++u) {
      const int k = k0 + u * SG;
      const bool use = k < nsplit && w_s[k] != 0.f;
      cp_async<16>(smem_u32(&stage[u][threadIdx.x]), base + (use ? k : 0) * split_stride * DV, use ? 16 : 0);
    }
    cp_async_commit();
    cp_async_wait<0>();  // each thread reads back only its own copies: no barrier
#pragma unroll
    for (int u = 0; u < MB; ++u) {
      const int k = k0 + u * SG;
      const float w = k < nsplit ? w_s[k] : 0.f;
      const uint4 v = stage[u][threadIdx.x];
      const u32 p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o[2 * e] += w * __uint_as_float(p[e] << 16);
        o[2 * e + 1] += w * __uint_as_float(p[e] & 0xffff0000u);
      }
    }
  }
  float4* dst4 = reinterpret_cast<float4*>(red_o + sg * 128 + c * 8);
  dst4[0] = make_float4(o[0], o[1], o[2], o[3]);
  dst4[1] = make_float4(o[4], o[5], o[6], o[7]);
  __syncthreads();
  if (threadIdx.x >= 128) return;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < SG; ++i) sum += red_o[i * 128 + threadIdx.x];
  const float inv = s == 0.f ? 0.f : 1.f / s;  // NaN stays NaN
  a.out[(i64)row * a.out_stride_m + (i64)head * a.out_stride_h + col0 + threadIdx.x] = bf16_bits(sum * inv);
  if (a.lse != nullptr && threadIdx.x == 0 && blockIdx.y == 0)
    a.lse[(i64)row * a.lse_stride_m + head] = s == 0.f ? NEG_INF : m + __logf(s);
}

}  // namespace kvtune
