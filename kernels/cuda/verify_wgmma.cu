// MLA verify attention, split-K, with wgmma (sm_90a only: H100 / H200). Compiled appended to
// verify.cu: it takes the same SplitArgs, the same key-balanced schedule (find_work) and writes
// the same partials, which verify.cu's merge kernel combines.
//
// One CTA: 64 + XR query rows (rows r = head * T + t of one request; H*T rows take
// ceil(H*T / (64 + XR)) row blocks, blockIdx.x) against one work item's keys (blockIdx.y), in
// 32-key tiles gathered through the index list by cp.async into the 128-byte-swizzled layout
// wgmma reads. XR = 8 adds the tail warpgroup for rows 64-71 (wg::tail_loop). Two warpgroups
// play ping-pong over rows 0-63 (scripts/stream_probe.py measured this loop):
// - warpgroup w owns tiles w, w + 2, ...: it gathers them (tile t + 2 as soon as S of tile t is
//   done and tile t-2's buffer is free), runs S = Q K^T (36 wgmma m64n32k16, both operands in shared memory), the
//   softmax in registers (a row's 32 keys sit in one quad: no shared memory), and P V on its 256
//   value columns with P from registers; it publishes P (4 KB) for the other warpgroup, which
//   runs P V of the same tile on its own 256 columns behind its next QK^T;
// - a lazy row max: it moves only past RESCALE_SLACK (log2 units); one bar.red.or per tile tells
//   the warpgroup whether any row moved, and only then are the maxima and factors shared and O
//   rescaled;
// - softmax steps run in tile order (each waits for the other warpgroup's publication of the
//   previous tile), so both warpgroups see the same running max.
// Shared memory: Q 72 KB + four 36 KB key buffers + two P buffers (one with the tail) + the
// tail's: 225-226 KB, one CTA per SM (wg::Layout). Register use is near the cap (o: 128 fp32 per
// thread for 64 rows x 256 columns; with the tail, setmaxnreg gives the two 184 and the tail 136).

namespace kvtune {
namespace wg {

constexpr int ROWS = 64;                        // query rows per CTA: wgmma's M
constexpr int BN = 32;                          // keys per tile
constexpr int NBUF = 4;                         // key buffers: t-1 (the other's PV), t, t+1, t+2 (loading)
constexpr int CHUNKS = DK / 8;                  // 16-byte chunks per row: 72
constexpr int KBUF = BN * DK * 2;               // 36864 bytes per key tile
constexpr int PBUF = ROWS * BN * 2;             // 4096 bytes per tile's P
constexpr int K_OFF = ROWS * DK * 2;            // after Q (73728)
constexpr int XR_ROWS = 8;                      // the tail warpgroup's rows (ROWS 72)
static_assert(K_OFF % 1024 == 0 && KBUF % 1024 == 0, "128-byte swizzle atoms are 1024-byte aligned");

// Shared memory after Q and the key buffers, per shape: XR = 0 (64 rows) or XR_ROWS (72, the tail).
template <int XR>
struct Layout {
  // P buffers: with two, the owner of tile t+1 writes its P while the other warpgroup's PV of t
  // may still read t's; the tail's shared memory leaves room for one, and then t+1's P waits for
  // that PV (3-7% at 64 rows where the loop is compute-bound, measured)
  static constexpr int NPB = XR ? 1 : 2;
  static constexpr int P_OFF = K_OFF + NBUF * KBUF;
  static constexpr int M_OFF = P_OFF + NPB * PBUF;       // float [ROWS]: running max, log2 units
  static constexpr int ALPHA_OFF = M_OFF + ROWS * 4;     // float [NPB][ROWS]: the tile's rescale factors
  static constexpr int L_OFF = ALPHA_OFF + NPB * ROWS * 4;  // float [2][ROWS]: each warpgroup's l
  static constexpr int GREW_OFF = L_OFF + 2 * ROWS * 4;  // int [NPB]: the tile moved some row's max
  static constexpr int WORK_OFF = GREW_OFF + NPB * 4;    // int [8]: the segment (b, lo, hi, item), R, x, x_end, chunk
  // the tail's, from a 16-byte boundary
  static constexpr int TSCR_OFF = (WORK_OFF + 32 + 15) / 16 * 16;  // float4 [4][2][32]: S^T per column quarter
  static constexpr int TP_OFF = TSCR_OFF + 4 * 2 * 32 * 16;  // bf16 P^T [2 (tile parity)][4 key groups][8][8]
  static constexpr int TMAX_OFF = TP_OFF + 2 * BN * XR_ROWS * 2;  // float [2][8]: each 16-key half's row maxima
  static constexpr int TALPHA_OFF = TMAX_OFF + 2 * XR_ROWS * 4;  // float [8]: the tile's rescale factors
  static constexpr int TL_OFF = TALPHA_OFF + XR_ROWS * 4;  // float [2][8]: l of each 16-key half
  static constexpr int FULL_OFF = TL_OFF + 2 * XR_ROWS * 4;  // u64 mbarrier [NBUF]: key buffer landed
  static constexpr int EMPTY_OFF = FULL_OFF + NBUF * 8;  // u64 mbarrier [NBUF]: the tail is done with it
  static constexpr int SMEM_BYTES = XR ? EMPTY_OFF + NBUF * 8 : WORK_OFF + 32;
  static_assert(FULL_OFF % 8 == 0 && TSCR_OFF % 16 == 0, "mbarriers are 8-byte aligned, the S^T quarters float4s");
  static_assert(SMEM_BYTES <= 227 * 1024, "over sm_90's shared memory per block");
};

// wgmma matrix descriptor: start address, leading / stride byte offsets (no swizzle, base 0)
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32);
}
__device__ __forceinline__ u64 desc_sw(u32 addr, u32 lbo, u32 sbo) {  // 128-byte swizzle
  return desc(addr, lbo, sbo) | ((u64)1 << 62);
}
// Byte offset of 16-byte chunk c (columns 8c .. 8c+7) of row r in a [rows][576] operand, 128-byte
// swizzle: 9 panels of 64 columns, each rows x 128 bytes; chunk c of row r lands at
// ((c % 8) ^ (r % 8)) * 16, so 8 rows' copies of one chunk hit 8 different bank groups.
__device__ __forceinline__ u32 sw_off(int r, int c, int rows) {
  return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) * 16);
}
// Descriptor d moved `bytes` further (a multiple of 16, a compile-time constant at every use):
// the start-address field (bits 0-13, address / 16) never carries, since shared memory ends below
// 256 KB. The loops build each tile's descriptors as its first plus such offsets: built from
// their addresses, the S descriptors alone were about 1,100 of the loop's 4,038 warp instructions
// per tile (ncu, results/kernel/wgmma/phases/tile-loop/), and both 64-row warpgroups and the tail
// issue their MMAs on the critical path (results/kernel/wgmma/phases/descriptor-arithmetic/).
__device__ __forceinline__ u64 desc_add(u64 d, u32 bytes) { return d + (bytes >> 4); }
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// generic-proxy writes (cp.async, st.shared) made visible to wgmma's async proxy
__device__ __forceinline__ void async_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ int bar_or(int id, int pred) {  // warpgroup-wide OR (128 threads)
  int r;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.s32 p, %2, 0;\nbar.red.or.pred q, %1, 128, p;\nselp.s32 %0, 1, 0, q;\n}\n"
               : "=r"(r) : "r"(id), "r"(pred) : "memory");
  return r;
}
// The accumulators stay in registers across wgmma's asynchronous writes: these empty asm
// statements keep the compiler from moving their reads above a wait.
__device__ __forceinline__ void keep128(float (&o)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(o[i])::"memory");
}
__device__ __forceinline__ void keep16(float (&s)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) asm volatile("" : "+f"(s[i])::"memory");
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  return (u32)bf16_bits(lo) | ((u32)bf16_bits(hi) << 16);
}

// wgmma with the accumulators in registers (m64 nN k16, bf16 in, fp32 out)
__device__ __forceinline__ void mma_ss_n32(float (&d)[16], u64 da, u64 db, int acc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "l"(da), "l"(db), "r"(acc));
}
// O += P V: P from registers (the A fragments of the own softmax), V transposed (MN-major)
__device__ __forceinline__ void mma_rs_n256(float (&d)[128], const u32 (&a)[4], u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
// O += P V: P from shared memory (the other warpgroup's), V transposed (MN-major)
__device__ __forceinline__ void mma_ss_pv_n256(float (&d)[128], u64 da, u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "l"(da), "l"(db), "r"(1));
}

// Accumulator element i of m64nN (this thread): row 16 warp + lane / 4 + 8 ((i >> 1) & 1),
// column 8 (i >> 2) + 2 (lane % 4) + (i & 1).
__device__ __forceinline__ void rescale(float (&o)[128], float (&l)[2], float a0, float a1) {
  l[0] *= a0;
  l[1] *= a1;
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] *= ((i >> 1) & 1) ? a1 : a0;
}

// The softmax of one tile (S already scaled to log2 units and masked to -inf), lazy max, for
// this thread's rows r0 = 16 warp + lane / 4 and r1 = r0 + 8. When some row's max moves (one
// bar.red.or over the warpgroup, barrier `bar`), the maxima go to m_s and the factors to alpha_t
// and this warpgroup's O and l are rescaled once its MMAs in flight are done. P leaves as the A
// fragments of the own PV (a[kk]: rows g / g+8, keys 16 kk + 2 t4 .. and + 8) and in shared
// memory at pt for the other warpgroup (K-major core matrices). Returns whether a max moved.
template <bool ONE_P>
__device__ __forceinline__ int softmax_tile(float (&s)[16], float* m_s, float* alpha_t, unsigned char* pt, int bar,
                                            int r0, int r1, int t4, float (&o)[128], float (&l)[2], u32 (&a)[2][4]) {
  const float NEG_INF = -__int_as_float(0x7f800000);
  float m0 = m_s[r0], m1 = m_s[r1], mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    if ((i >> 1) & 1) mx1 = fmaxf(mx1, s[i]); else mx0 = fmaxf(mx0, s[i]);
  }
  // false while both are -inf: a row that saw nothing yet keeps m = -inf
  const int grew = bar_or(bar, (mx0 > m0 + RESCALE_SLACK) | (mx1 > m1 + RESCALE_SLACK));
  if (grew) {  // each warp owns its 16 rows: a row max is a quad reduction
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float n0 = mx0 > m0 + RESCALE_SLACK ? mx0 : m0, n1 = mx1 > m1 + RESCALE_SLACK ? mx1 : m1;
    const float a0 = n0 == m0 ? 1.f : fast_exp2(m0 - n0), a1 = n1 == m1 ? 1.f : fast_exp2(m1 - n1);
    if (t4 == 0) {
      m_s[r0] = n0;
      m_s[r1] = n1;
      alpha_t[r0] = a0;
      alpha_t[r1] = a1;
    }
    m0 = n0;
    m1 = n1;
    wait0();  // own O: the other tile's PV may still be accumulating into it
    keep128(o);
    rescale(o, l, a0, a1);
  }
  const float z0 = m0 == NEG_INF ? 0.f : m0, z1 = m1 == NEG_INF ? 0.f : m1;  // masked keys: ex2(-inf) = 0
  float p[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    p[i] = fast_exp2(s[i] - (((i >> 1) & 1) ? z1 : z0));
    l[(i >> 1) & 1] += p[i];
  }
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    a[kk][0] = pack_bf16(p[8 * kk + 0], p[8 * kk + 1]);
    a[kk][1] = pack_bf16(p[8 * kk + 2], p[8 * kk + 3]);
    a[kk][2] = pack_bf16(p[8 * kk + 4], p[8 * kk + 5]);
    a[kk][3] = pack_bf16(p[8 * kk + 6], p[8 * kk + 7]);
  }
  if constexpr (ONE_P) {  // the one P buffer holds the other warpgroup's tile, whose PV on this
    wait0();               // warpgroup's columns (issued behind this QK^T) may be reading it
    keep128(o);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    *(u32*)(pt + (r0 >> 3) * 512 + j * 128 + (r0 & 7) * 16 + 4 * t4) = pack_bf16(p[4 * j], p[4 * j + 1]);
    *(u32*)(pt + (r1 >> 3) * 512 + j * 128 + (r1 & 7) * 16 + 4 * t4) = pack_bf16(p[4 * j + 2], p[4 * j + 3]);
  }
  return grew;
}

// A NaN in a draft key's V must not reach the rows that may not see that key (their p is 0, and
// 0 * NaN = NaN): zero the NaN values of V in rows k_lo .. k_hi-1 of a key buffer, after QK^T
// read them (a row that sees the key has a NaN score already) and before any PV.
__device__ __forceinline__ void scrub_nan_v(unsigned char* kbuf, int k_lo, int k_hi, int wt) {
  constexpr int PIECES = DV / 8;
  for (int c = wt; c < (k_hi - k_lo) * PIECES; c += 128) {
    const int k = k_lo + c / PIECES;
    uint4* piece = reinterpret_cast<uint4*>(kbuf + sw_off(k, c % PIECES, BN));
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

// mbarriers between a key tile's owner and the tail warpgroup (arrival count 1 each)
__device__ __forceinline__ void mbar_init(u32 addr) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 addr) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 addr, int parity) {
  u32 done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  } while (!done);
}
template <int N>
__device__ __forceinline__ void regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
// Registers per thread after the split (setmaxnreg): 2 x 128 x MAIN + 128 x TAIL <= 384 x 168, the
// launch's. 184 / 136: no spills from NVRTC 13.0 (the H200's) or 13.5; 192 / 120 spills the tail.
constexpr int REGS_MAIN = 184, REGS_TAIL = 136;

// O^T += V^T P^T for the tail rows: m64n8k16, V^T from a key buffer (MN-major), P^T K-major
__device__ __forceinline__ void mma_ss_n8_vt(float (&d)[4], u64 da, u64 db) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 1, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "l"(da), "l"(db), "r"(1));
}
__device__ __forceinline__ void keep32(float (&o)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(o[j][i])::"memory");
}

// The tail warpgroup: query rows r0 .. r0 + 7 of the CTA's block against the same key tiles, with
// the keys in M so that 8 rows cost 8 rows (a 64-row warpgroup would spend 56 on padding).
// S^T = K Q8^T on mma.sync m16n8k16: warp w takes the tile's 32 keys over the columns 144 w ..
// + 143, its Q8 fragments in registers; the quarters meet in shared memory.
// Warps 0-1 run the softmax (exact running max; a row's 32 keys sit in 2 warps x 8 lanes) and
// write P^T; O^T = V^T P^T runs on wgmma m64n8k16 over all 512 value columns (o[j]: columns
// 64 j + 16 w + g (+ 8 for i >= 2), rows 2 t4 + (i & 1)). Tile t waits for its owner's `full`
// arrival; `empty` tells the owner the buffer may be refilled; a tile holding draft keys meets its
// owner on named barriers 5 / 6 (S^T read the raw keys) and 9 / 10 (V scrubbed of NaNs). A tile's
// O^T MMAs run under the next tile's S^T and softmax; `empty` of tile t - 1 follows their wait.
// mt: running max (log2 units), lt: this thread's l, both for rows 2 t4, 2 t4 + 1 (warps 0-1).
// Q8 as mma.sync B fragments of warp w: row g of the tail, columns 16 ks + 2 t4 (+1) and + 8 for
// the k-steps ks = 9 w + i; loaded by the kernel's prologue, under its Q and first tiles.
template <int T>
__device__ __forceinline__ void tail_q(const SplitArgs& a, int b, int rbase, int HT, u32 (&qf)[9][2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, w = (threadIdx.x >> 5) & 3;
  const int qrow = rbase + g;
  const bool q_ok = qrow < HT, q_word = a.q_vec16;  // 16-byte aligned rows: a column pair is one word
  const u16* q = a.q + (q_ok ? (i64)(b * T + qrow % T) * a.q_stride_m + (i64)(qrow / T) * a.q_stride_h : 0) +
                 16 * 9 * w + 2 * t4;
#pragma unroll
  for (int i = 0; i < 9; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u16* e = q + 16 * i + 8 * h;
      qf[i][h] = !q_ok ? 0u : q_word ? *reinterpret_cast<const u32*>(e) : (u32)e[0] | ((u32)e[1] << 16);
    }
}

template <int T>
__device__ __forceinline__ void tail_loop(const SplitArgs& a, unsigned char* smem, int b, int P, int lo, int hi,
                                          int n_tiles, int rbase, int HT, const u32 (&qf)[9][2], float (&o)[8][4],
                                          float (&mt)[2], float (&lt)[2]) {
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int wt = threadIdx.x & 127, w = wt >> 5, lane = wt & 31, g = lane >> 2, t4 = lane & 3;
  const int kb = w & 1;  // after the S^T reduction, warps 0 / 1 hold keys 16 kb .. of the tile
  using L = Layout<XR_ROWS>;
  const u32 ks = smem_u32(smem + K_OFF);
  float* scr = reinterpret_cast<float*>(smem + L::TSCR_OFF);
  float* tmax = reinterpret_cast<float*>(smem + L::TMAX_OFF);
  float* talpha = reinterpret_cast<float*>(smem + L::TALPHA_OFF);
  u64 bits[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int rg = rbase + 2 * t4 + j;
    bits[j] = rg < HT ? (u64)a.tree_mask[b * T + rg % T] : 0ull;
  }
  for (int t = 0; t < n_tiles; ++t) {
    const int buf = t % NBUF, par = (t / NBUF) & 1;
    const u32 kbuf = ks + buf * KBUF;
    mbar_wait(smem_u32(smem + L::FULL_OFF + 8 * buf), par);
    // P^T by tile parity: tile t - 1's O^T MMAs, which every tail warp waits for only before its
    // own stores, may still read the other buffer
    unsigned char* tpp = smem + L::TP_OFF + (t & 1) * (BN * XR_ROWS * 2);
    const u32 tp = smem_u32(tpp);
    // warp w: both 16-key blocks over columns 144 w .. 144 w + 143; the four quarters meet in
    // shared memory
    float cq[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int i = 0; i < 9; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u32 af[4];
        ldmatrix_x4(kbuf + sw_off(16 * h + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * (9 * w + i) + (lane >> 4), BN),
                    af[0], af[1], af[2], af[3]);
        mma_bf16(cq[h], af, qf[i][0], qf[i][1]);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float4*>(scr + ((w * 2 + h) * 32 + lane) * 4) = make_float4(cq[h][0], cq[h][1], cq[h][2], cq[h][3]);
    bar_sync(7, 128);
    const int k0 = lo + BN * t;
    const bool draft = max(k0, P) < min(k0 + BN, hi);  // uniform: the owner meets the tail on it
    if (draft) bar_arrive(5 + (t & 1), 256);           // this tile's keys are read: the owner may scrub V
    float pv[4], c[4] = {0.f, 0.f, 0.f, 0.f};
    if (w < 2) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float4 h = *reinterpret_cast<const float4*>(scr + ((q * 2 + kb) * 32 + lane) * 4);
        c[0] += h.x;
        c[1] += h.y;
        c[2] += h.z;
        c[3] += h.w;
      }
      float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // c[i]: key 16 kb + g + 8 (i >> 1), row 2 t4 + (i & 1)
        const int n = k0 + 16 * kb + g + 8 * (i >> 1), d = n - P;
        const bool vis = (n < hi) & ((d < 0) | (bool)((bits[i & 1] >> (d & 63)) & 1ull));
        c[i] = vis ? c[i] * a.qk_scale : NEG_INF;
        mx[i & 1] = fmaxf(mx[i & 1], c[i]);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 4));
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 8));
        mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], 16));
        if (g == 0) tmax[kb * XR_ROWS + 2 * t4 + j] = mx[j];
      }
      bar_sync(8, 64);
      float z[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float m_new = fmaxf(mt[j], fmaxf(tmax[2 * t4 + j], tmax[XR_ROWS + 2 * t4 + j]));
        const float alpha = m_new == mt[j] ? 1.f : fast_exp2(mt[j] - m_new);
        mt[j] = m_new;
        z[j] = m_new == NEG_INF ? 0.f : m_new;
        lt[j] *= alpha;
        if (kb == 0 && g == 0) talpha[2 * t4 + j] = alpha;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pv[i] = fast_exp2(c[i] - z[i & 1]);
        lt[i & 1] += pv[i];
      }
    }
    // O^T += V^T P^T of tile t - 1 ran under this tile's S^T and softmax: done now, so its P^T
    // may be overwritten, O^T rescaled and its key buffer handed back
    wait0();
    keep32(o);
    if (w < 2) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int k = 16 * kb + g + 8 * (i >> 1), r = 2 * t4 + (i & 1);
        *reinterpret_cast<u16*>(tpp + (k >> 3) * 128 + r * 16 + (k & 7) * 2) = bf16_bits(pv[i]);
      }
      async_fence();  // P^T: generic stores, read by wgmma
    }
    bar_sync(7, 128);  // P^T and the factors are out; the S^T halves and maxima may be rewritten
    if (t > 0 && wt == 0) mbar_arrive(smem_u32(smem + L::EMPTY_OFF + 8 * ((t - 1) % NBUF)));
    if (draft) bar_sync(9 + (t & 1), 256);  // the owner has scrubbed V of NaNs
    const float a0 = talpha[2 * t4], a1 = talpha[2 * t4 + 1];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[j][i] *= (i & 1) ? a1 : a0;
    const u64 dv = desc_sw(kbuf, 4096, 1024), dp = desc(tp, 128, 512);
    fence();
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
        mma_ss_n8_vt(o[j], desc_add(dv, j * (BN * 128) + (2 * kk) * 1024), desc_add(dp, kk * 256));
    commit();
  }
  wait0();  // the last tile's (no owner waits for its buffer)
  keep32(o);
}


// ---------------------------------------------------------------- the schedule: items or ranges
// A CTA's work is a list of segments (a request's keys lo .. hi-1, its partial `item`), run one
// after the other. Two ways to cut a batch, chosen per launch on the device (capture-safe: every
// CTA computes the same choice from the same metadata):
// - items (verify.cu's find_item): each request cut on its own into equal pieces, at most
//   max(NSPLIT, B) of them, one per CTA. Best for one request or equal ones; in a ragged batch
//   the pieces are up to total / (NSPLIT - B + 1) keys (every request rounds up one piece).
// - ranges: the batch's keys, concatenated request after request, cut into NSPLIT ranges of R
//   keys (whole tiles); CTA c runs range c, one segment per request the range overlaps. Every
//   CTA holds R keys, and pays a restart (Q, its first tiles' gather latency, the o store) per
//   request boundary inside its range. Segments are numbered in key order, so a request's
//   segments are consecutive items (the merge's meta), at most NSPLIT + B - 1 of them.
// Ranges where items' chunk is at least 1.2 x (R + RANGE_RESTART_TILES x the request boundaries a
// range holds), in key tiles. Measured on the H200 (results/kernel/wgmma/schedule/): where ranges
// promised 7-16% fewer tiles on the busiest CTA they lost 2-7% (bandwidth shared by all SMs, not
// the longest piece, bounds those batches) or won 4%; at 26% they won 2%, at 2.3x 1.84x.
constexpr int RANGE_RESTART_TILES = 3;

struct Seg {
  int b, lo, hi, item;  // b = -1: no more work for this CTA
};

// A thread's gather slots for one tile: one 32-bit word per key row it copies.
template <int NR>
struct SlotWord {
  using type = u64;
};
template <>
struct SlotWord<1> {
  using type = u32;
};

// The thread's and block's indices read again at each segment (volatile): what derives from them
// is then computed per segment, not hoisted above the segment loop and held in registers across
// the tile loop (which spilled at ROWS 72's 184 / 136 registers).
__device__ __forceinline__ int tid_x() {
  int v;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(v));
  return v;
}
__device__ __forceinline__ int ctaid_x() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v));
  return v;
}

// This launch's schedule: key ranges of R keys (a multiple of BN) where they are faster, else
// R = 0 and items of at most `chunk` keys (chunk_tiles, searched once per CTA). Warp-wide.
struct Schedule {
  int R, chunk;
};
__device__ Schedule plan_schedule(const SplitArgs& a) {
  const int total = batch_keys(a), target = batch_nsplit(a, total);
  const int chunk = chunk_tiles<BN>(a, total, max(target, a.B));
  if (a.B == 1) return {0, chunk * BN};
  const int r_tiles = max(((total + target - 1) / target + BN - 1) / BN, 1);
  const int boundaries = (a.B - 1 + target - 1) / target;  // request starts per range, rounded up
  return {5 * chunk >= 6 * (r_tiles + RANGE_RESTART_TILES * boundaries) ? r_tiles * BN : 0, chunk * BN};
}

// The segment at key position x of the concatenated keys (x < x_end <= total), range length R:
// the request holding x, its keys up to x_end, and its item = the segment starts before x
// (range starts c R < x, and request starts that are not range starts). Warp-wide.
__device__ Seg range_segment(const SplitArgs& a, int R, int x, int x_end) {
  const int lane = threadIdx.x & 31, base = a.indptr[0];
  Seg s = {-1, 0, 0, 0};
  int inner = 0;  // requests with keys whose start lies inside a range, before x
  for (int b0 = 0; b0 < a.B; b0 += 32) {
    const int b = b0 + lane;
    const int st = b < a.B ? a.indptr[b] - base : 0, en = b < a.B ? a.indptr[b + 1] - base : 0;
    const bool has = en > st;
    inner += __popc(__ballot_sync(0xffffffffu, has && st < x && st % R != 0));
    const unsigned mine = __ballot_sync(0xffffffffu, has && st <= x && x < en);
    if (mine) {  // warp-uniform
      const int src = __ffs(mine) - 1;
      const int st_b = __shfl_sync(0xffffffffu, st, src), en_b = __shfl_sync(0xffffffffu, en, src);
      s.b = b0 + src;
      s.lo = x - st_b;
      s.hi = min(en_b, x_end) - st_b;
    }
  }
  s.item = (x + R - 1) / R + inner;
  return s;
}

// Every request's (first item, item count) under ranges of R keys, for the merge: request b
// starts at item ceil(st / R) + (requests before it starting inside a range); it holds the
// range starts in [st, en) and one more segment if it starts inside a range. A request of no
// keys has none (the merges write o = 0 and lse = -inf for it). Warp-wide.
__device__ void range_meta(const SplitArgs& a, int R) {
  const int lane = threadIdx.x & 31, base = a.indptr[0];
  int run = 0;
  for (int b0 = 0; b0 < a.B; b0 += 32) {
    const int b = b0 + lane;
    const int st = b < a.B ? a.indptr[b] - base : 0, en = b < a.B ? a.indptr[b + 1] - base : 0;
    const int inside = en > st && st % R != 0;
    const int incl = warp_inclusive_sum(inside, lane);
    if (b < a.B) {
      const int first_range = (st + R - 1) / R;
      a.meta[2 * b] = en > st ? first_range + run + incl - inside : 0;
      a.meta[2 * b + 1] = en > st ? (en + R - 1) / R - first_range + inside : 0;
    }
    run += __shfl_sync(0xffffffffu, incl, 31);
  }
}

// This CTA's next segment (warp 0). R = 0: items of at most `chunk` keys (x = 0 before the
// first, then -1); else ranges: x = the next key position of the CTA's range [x, x_end).
__device__ Seg next_segment(const SplitArgs& a, int R, int chunk, int& x, int x_end, bool write_meta) {
  if (R == 0) {
    Seg s = {-1, 0, 0, 0};
    if (x == 0) {
      const Work w = find_item<BN>(a, blockIdx.y, write_meta, chunk);
      if (w.b >= 0) {
        const int L = a.indptr[w.b + 1] - a.indptr[w.b];
        s = {w.b, w.split * w.chunk, min(w.split * w.chunk + w.chunk, L), (int)blockIdx.y};
      }
    }
    x = -1;
    return s;
  }
  if (write_meta) range_meta(a, R);
  if (x >= x_end) return {-1, 0, 0, 0};
  const Seg s = range_segment(a, R, x, x_end);
  x += s.hi - s.lo;
  return s;
}
}  // namespace wg

// grid (ceil(H * T / (64 + XR)), NSPLIT + B): x the row block, y the work item; block 256 (two
// warpgroups) + 128 with XR = 8 (the tail warpgroup: rows 64-71 of each block, wg::tail_loop);
// dynamic smem wg::Layout<XR>::SMEM_BYTES. CL: lanes per key row in the gather (COPY_LANES): 4 puts a
// quarter warp's two rows on the same four bank groups (2-way conflicts), 8 fills eight with whole
// 128-byte lines but holds two slots per thread (results/kernel/wgmma/phases/gather-bank-groups/).
// B1: the launch holds one request (its own instantiation; see the Q copy under the schedule).
template <int T, int XR, int CL, int B1>
__global__ void __launch_bounds__(XR ? 384 : 256, 1) verify_wgmma_kernel(const SplitArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wg;
  const float NEG_INF = -__int_as_float(0x7f800000);
  static_assert(T >= 1 && T <= 64, "T in [1, 64]: the tree mask is one int64 per row");
  static_assert(XR == 0 || XR == XR_ROWS, "the tail warpgroup takes 8 rows or none");
  static_assert(CL == 4 || CL == 8, "COPY_LANES: 4 or 8 lanes per key row");
  static_assert(B1 == 0 || B1 == 1, "B1: one request per launch (1) or any number (0)");
  constexpr int RB = ROWS + XR, NT = XR ? 384 : 256;  // query rows and threads per CTA
  using Lay = Layout<XR>;
  constexpr int NPB = Lay::NPB;
  extern __shared__ __align__(1024) unsigned char smem[];
  {  // the launcher sizes dynamic smem from a Python mirror; the swizzle needs 1024-byte atoms
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dyn));
    if (dyn < (u32)Lay::SMEM_BYTES || (smem_u32(smem) & 1023u)) __trap();
  }
  unsigned char* Qs = smem;
  unsigned char* Ks = smem + K_OFF;
  unsigned char* Ps = smem + Lay::P_OFF;
  float* m_s = reinterpret_cast<float*>(smem + Lay::M_OFF);
  float* alpha_s = reinterpret_cast<float*>(smem + Lay::ALPHA_OFF);
  float* l_s = reinterpret_cast<float*>(smem + Lay::L_OFF);
  int* grew_s = reinterpret_cast<int*>(smem + Lay::GREW_OFF);
  int* work_s = reinterpret_cast<int*>(smem + Lay::WORK_OFF);
  const int tid = threadIdx.x, wgi = tid >> 7, wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3, r0 = 16 * warp + g, r1 = r0 + 8;
  const int mb = blockIdx.x;
  const int HT = a.H * T;
  const u32 qs = smem_u32(Qs), ks = smem_u32(Ks), ps = smem_u32(Ps);
  pdl_launch_dependents();  // the merge waits for this whole grid before it reads anything
  // With one request every segment's Q rows are the same, so warps 1-7 copy the first segment's
  // while warp 0 runs the schedule (batch 1 x 4k / 16k: -0.81 / -1.12 us; the same code compiled
  // in and never run made batch 8 1.1-1.4 us slower, hence an instantiation of its own:
  // results/kernel/wgmma/phases/q-under-schedule/, variant-order/).
  const bool q_early = B1 && a.B == 1 && a.q_vec16;  // a.B: a wrong launch still reads the right rows
  if (q_early && tid >= 32 && tid < 256) {
    for (int i = tid - 32; i < ROWS * CHUNKS; i += 224) {
      const int r = i / CHUNKS, c = i % CHUNKS, rg = mb * RB + r;
      const bool ok = rg < HT;
      const u16* src = ok ? a.q + (i64)(rg % T) * a.q_stride_m + (i64)(rg / T) * a.q_stride_h + c * 8 : a.q;
      cp_async<16>(qs + sw_off(r, c, ROWS), src, ok ? 16 : 0);
    }
    cp_async_commit();
  }

  // Warp 0 runs the schedule; its state (R, 0: items; the cursor x of this CTA's range and its
  // end) stays in shared memory between segments, not in registers the loop needs.
  auto publish_next = [&](bool first) {  // warp 0: the next segment into work_s
    int x = work_s[5];
    const Seg sg = next_segment(a, work_s[4], work_s[7], x, work_s[6], first && blockIdx.y == 0 && mb == 0);
    __syncwarp();
    if (lane == 0) {
      work_s[0] = sg.b;
      work_s[1] = sg.lo;
      work_s[2] = sg.hi;
      work_s[3] = sg.item;
      work_s[5] = x;
    }
  };
  // The tail's mbarriers start every segment at phase 0: all key buffers are idle between them.
  auto init_mbarriers = [&]() {
    if (XR && tid == 0)
      for (int i = 0; i < NBUF; ++i) {
        mbar_init(smem_u32(smem + Lay::FULL_OFF + 8 * i));
        mbar_init(smem_u32(smem + Lay::EMPTY_OFF + 8 * i));
      }
  };
  if (tid < 32 && batch_idle(a)) {  // another launch of a per-context dispatch serves this batch
    if (blockIdx.y == 0 && mb == 0) mark_idle(a);
    if (lane == 0) work_s[0] = -1;
  } else if (tid < 32) {
    const Schedule sc = plan_schedule(a);
    const int R = sc.R, total = batch_keys(a);
    const int x = R > 0 ? (int)min((i64)blockIdx.y * R, (i64)total) : 0;
    if (lane == 0) {
      work_s[4] = R;
      work_s[5] = x;
      work_s[6] = R > 0 ? min(x + R, total) : 0;
      work_s[7] = sc.chunk;
    }
    __syncwarp();
    publish_next(true);
  }
  init_mbarriers();
  __syncthreads();
  if (q_early && work_s[0] < 0) cp_async_wait<0>();  // no copy into shared memory outlives the CTA
  if (work_s[0] < 0) return;  // no work: the merge never reads this CTA's items
  constexpr int OPITCH = DV * 2 + 16;  // bytes per staged o row: +16 puts a store's 8 rows on 8 bank quads
  static_assert(RB * OPITCH <= K_OFF + KBUF, "staged o fits in Q's shared memory and the first key buffer");
  // The segment's normalised o rows leave from shared memory (staged there by both paths).
  auto store_o = [&](int item) {
    const int rb = ctaid_x() * RB;
    for (int c = tid_x(); c < RB * (DV / 8); c += NT) {
      const int r = c / (DV / 8), k = c % (DV / 8), rg = rb + r;
      if (rg < HT)
        *reinterpret_cast<uint4*>(a.part_o + (((i64)item * T + rg % T) * a.H + rg / T) * DV + 8 * k) =
            *reinterpret_cast<const uint4*>(Qs + r * OPITCH + 16 * k);
    }
  };
  // Both paths run every segment in step: per segment five block barriers each (prologue done,
  // l shared, o staged, o stored, next segment published).
  // Each path's code is reachable from its own setmaxnreg only (ptxas ignores both otherwise).
  if (XR && wgi == 2) {  // the tail warpgroup: rows 64 .. 71
    if constexpr (XR != 0) {
      regs_dec<REGS_TAIL>();
      for (;;) {
        const int tid = tid_x(), mb = ctaid_x(), wt = tid & 127, warp = wt >> 5, lane = tid & 31;
        const int g = lane >> 2, t4 = lane & 3;
        const int b = work_s[0], lo = work_s[1], hi = work_s[2];
        const int L = a.indptr[b + 1] - a.indptr[b];
        const int n_tiles = (hi - lo + BN - 1) / BN;
        u32 qf[9][2];
        tail_q<T>(a, b, mb * RB + ROWS, HT, qf);
        __syncthreads();  // (1) the main warpgroups' prologue
        float o8[8][4], mt[2] = {NEG_INF, NEG_INF}, lt[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) o8[j][i] = 0.f;
        const int rbase = mb * RB + ROWS;
        tail_loop<T>(a, smem, b, L - T, lo, hi, n_tiles, rbase, HT, qf, o8, mt, lt);
        float* tl = reinterpret_cast<float*>(smem + Lay::TL_OFF);
        if (warp < 2) {  // l of each 16-key half, over the 8 lanes that share t4
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float v = lt[j];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            if (g == 0) tl[warp * XR_ROWS + 2 * t4 + j] = v;
          }
        }
        __syncthreads();  // (2) l; both row blocks' MMAs are done: Q's shared memory is free
        const int cta_x = ctaid_x();  // read again: kept across the loop, the row indices spilled
        const int item = work_s[3];  // read here: not held in a register across the tile loop
        float inv[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int r = 2 * t4 + j, rg = cta_x * RB + ROWS + r;
          const float l = tl[r] + tl[XR_ROWS + r];
          inv[j] = l == 0.f ? 0.f : 1.f / l;
          if (warp == 0 && g == 0 && rg < HT)
            a.part_lse[((i64)item * T + rg % T) * a.H + rg / T] = l == 0.f ? NEG_INF : (mt[j] + __log2f(l)) * LN2;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            *reinterpret_cast<u16*>(Qs + (ROWS + 2 * t4 + (i & 1)) * OPITCH + (64 * j + 16 * warp + g + 8 * (i >> 1)) * 2) =
                bf16_bits(o8[j][i] * inv[i & 1]);
        __syncthreads();  // (3) o staged
        store_o(item);
        __syncthreads();  // (4) o stored: Q's shared memory and the key buffers are free
        __syncthreads();  // (5) the next segment published
        if (work_s[0] < 0) break;
      }
    }
  } else {  // the two 64-row warpgroups
    if constexpr (XR != 0) regs_inc<REGS_MAIN>();
  bool first_segment = true;  // later segments find Q's shared memory overwritten by the staged o
  for (;;) {
  // wgi through a warp reduction: uniform to the compiler, so the tile index and the K descriptors
  // derived from it live in uniform registers (H 64 x 128k 6.0% faster, H 8 within -1.8..+0.1%:
  // results/kernel/wgmma/phases/fixed-order-decisions-interleaved/)
  const int tid = tid_x(), mb = ctaid_x(), wgi = (int)__reduce_max_sync(0xffffffffu, (unsigned)tid >> 7),
            wt = tid & 127, warp = wt >> 5, lane = tid & 31;
  const int t4 = lane & 3, r0 = 16 * warp + (lane >> 2), r1 = r0 + 8;
  const int b = work_s[0], lo = work_s[1], hi = work_s[2];
  const int kv_start = a.indptr[b];
  const int L = a.indptr[b + 1] - kv_start;
  const int P = L - T;  // prefix keys; draft key d sits at P + d
  const int n_tiles = (hi - lo + BN - 1) / BN;

  // -- Q: rows mb * 64 .. of this request (row r: head r / T, draft token r % T), zero past H * T
  if (q_early && first_segment) {  // copied under the schedule
  } else if (a.q_vec16) {
    for (int i = tid; i < ROWS * CHUNKS; i += 256) {
      const int r = i / CHUNKS, c = i % CHUNKS, rg = mb * RB + r;
      const bool ok = rg < HT;
      const u16* src = ok ? a.q + (i64)(b * T + rg % T) * a.q_stride_m + (i64)(rg / T) * a.q_stride_h + c * 8 : a.q;
      cp_async<16>(qs + sw_off(r, c, ROWS), src, ok ? 16 : 0);
    }
  } else {
    for (int i = tid; i < ROWS * DK; i += 256) {
      const int r = i / DK, col = i % DK, rg = mb * RB + r;
      *reinterpret_cast<u16*>(Qs + sw_off(r, col >> 3, ROWS) + (col & 7) * 2) =
          rg < HT ? a.q[(i64)(b * T + rg % T) * a.q_stride_m + (i64)(rg / T) * a.q_stride_h + col] : (u16)0;
    }
  }
  cp_async_commit();

  // -- key tiles: CL lanes per key row; this thread copies rows crow + RPP h (h < NR) of its
  // warpgroup's tiles, chunks csub + CL k
  constexpr int RPP = 128 / CL, NR = BN / RPP;  // rows per pass of the warpgroup, rows per thread
  const int crow = wt / CL, csub = wt % CL;
  using Slots = typename SlotWord<NR>::type;  // NR raw 32-bit slots, row h in word h
  // A slot is loaded two tiles before its copy is issued, as a raw 32-bit word (the low word of an
  // int64 index, as verify.cu reads it): converting it at the load would wait for the load there.
  // The pointer is offset by the request's first key once: NVRTC 13.0 otherwise kept kv_start
  // apart and spilled it at T 1, ROWS 72 (one store before the loop, three reloads in it).
  const int idx_shift = a.indices_64 ? 1 : 0;
  const int* idx32 = reinterpret_cast<const int*>(a.indices) + ((i64)kv_start << idx_shift);
  auto slot_of = [&](int t) -> Slots {  // ~0u: past the split (the row is zero-filled)
    Slots r = 0;
#pragma unroll
    for (int h = 0; h < NR; ++h) {
      const int n = lo + BN * t + crow + RPP * h;
      const u32 s = (t >= n_tiles || n >= hi) ? ~0u : (u32)idx32[(i64)n << idx_shift];
      r |= (Slots)s << (32 * h);
    }
    return r;
  };
  auto issue_tile = [&](int t, Slots slots) {
    const u32 dst = ks + (t % NBUF) * KBUF;
#pragma unroll
    for (int h = 0; h < NR; ++h) {
      const u32 slot = (u32)(slots >> (32 * h));
      const bool ok = slot != ~0u;
      const u16* src = ok ? a.kv + (i64)slot * a.kv_stride : a.kv;
      const int bytes = ok ? 16 : 0;
      // sw_off of chunk c = csub + CL k (csub < CL): c & 7 = csub + (CL k & 7), c >> 3 = CL k >> 3, so
      // each copy's address is one of 8 / CL swizzled row offsets plus a compile-time panel offset
      const int r = crow + RPP * h;
      u32 sx[8 / CL];
#pragma unroll
      for (int j = 0; j < 8 / CL; ++j) sx[j] = dst + r * 128 + (((csub + CL * j) ^ (r & 7)) * 16);
#pragma unroll
      for (int k = 0; k < CHUNKS / CL; ++k)
        cp_async<16>(sx[k % (8 / CL)] + ((CL * k) >> 3) * (BN * 128), src + (csub + CL * k) * 8, bytes);
    }
    cp_async_commit();
  };
  if (wgi < n_tiles) issue_tile(wgi, slot_of(wgi));
  Slots slot_next = slot_of(wgi + 2);
  for (int i = tid; i < ROWS; i += 256) m_s[i] = NEG_INF;
  // this thread's rows' tree-mask bits
  u64 bits0, bits1;
  {
    const int rg0 = mb * RB + r0, rg1 = mb * RB + r1;
    bits0 = rg0 < HT ? (u64)a.tree_mask[b * T + rg0 % T] : 0ull;
    bits1 = rg1 < HT ? (u64)a.tree_mask[b * T + rg1 % T] : 0ull;
  }
  cp_async_wait<0>();  // Q and this warpgroup's first tile
  async_fence();
  __syncthreads();  // (1) Q, m_s and the first tiles visible to both warpgroups (and the tail)

  float o[128], l[2] = {0.f, 0.f}, s[16];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  // V for this warpgroup's 256 value columns (panels 4 wgi ..), keys 16 kk ..: MN-major
  auto v_desc = [&](int t, int kk) {
    return desc_sw(ks + (t % NBUF) * KBUF + (4 * wgi) * (BN * 128) + (2 * kk) * 1024, 4096, 1024);
  };
  auto other_tile = [&](int tile) {  // published: its P, max and factors; then its PV on these columns
    bar_sync(3 + (tile & 1), 256);  // one barrier per publishing warpgroup: never completed by one alone
    if (grew_s[tile % NPB]) {
      wait0();
      keep128(o);
      rescale(o, l, alpha_s[(tile % NPB) * ROWS + r0], alpha_s[(tile % NPB) * ROWS + r1]);
    }
    fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      mma_ss_pv_n256(o, desc(ps + (tile % NPB) * PBUF + kk * 256, 128, 512), v_desc(tile, kk));
    commit();
  };
  int t = wgi;
  for (; t < n_tiles; t += 2) {
    // tile t's keys have landed: this thread's copies, then the warpgroup's
    cp_async_wait<0>();
    async_fence();
    bar_sync(1 + wgi, 128);
    if (XR && wt == 0) mbar_arrive(smem_u32(smem + Lay::FULL_OFF + 8 * (t % NBUF)));
    fence();
    const u64 dq = desc_sw(qs, 16, 1024), dk = desc_sw(ks + (t % NBUF) * KBUF, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 36; ++kk)
      mma_ss_n32(s, desc_add(dq, (kk >> 2) * ROWS * 128 + (kk & 3) * 32), desc_add(dk, (kk >> 2) * BN * 128 + (kk & 3) * 32),
                 kk);
    commit();
    if (t >= 1) {
      other_tile(t - 1);
      wait1();  // S of tile t done; the other tile's PV runs on under the softmax
    } else {
      wait0();
    }
    keep16(s);
    // tile t+2 into the buffer of t-2, as early as it is free: its last readers were this
    // warpgroup's PV of t-2 (done: committed before S of t) and the other's (done before it
    // published t-1, which other_tile waited for)
    if (t + 2 < n_tiles) {
      // its buffer's last reader besides the two 64-row warpgroups: the tail, on tile t - 2
      if (XR && t >= 2) mbar_wait(smem_u32(smem + Lay::EMPTY_OFF + 8 * ((t - 2) % NBUF)), ((t - 2) / NBUF) & 1);
      issue_tile(t + 2, slot_next);
    }
    slot_next = slot_of(t + 4);
    const int k0 = lo + BN * t;
    {  // draft keys in this tile: NaNs out of their V (uniform over the warpgroup)
      const int d_lo = max(k0, P), d_hi = min(k0 + BN, hi);
      if (d_lo < d_hi) {
        if (XR) bar_sync(5 + (t & 1), 256);  // the tail has read the raw keys
        scrub_nan_v(Ks + (t % NBUF) * KBUF, d_lo - k0, d_hi - k0, wt);
        async_fence();
        bar_sync(1 + wgi, 128);
        if (XR) bar_arrive(9 + (t & 1), 256);
      }
    }
    // scale to log2 units; -inf for keys past the split and draft keys the row may not see
    const bool all_visible = k0 + BN <= min(hi, P);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int n = k0 + 8 * (i >> 2) + 2 * t4 + (i & 1), d = n - P;
      const u64 bits = ((i >> 1) & 1) ? bits1 : bits0;
      // bitwise, not short-circuit: fewer branches
      const bool vis = all_visible | ((n < hi) & ((d < 0) | (bool)((bits >> (d & 63)) & 1ull)));
      s[i] = vis ? s[i] * a.qk_scale : NEG_INF;
    }
    u32 pa[2][4];
    const int grew = softmax_tile<NPB == 1>(s, m_s, alpha_s + (t % NPB) * ROWS, Ps + (t % NPB) * PBUF, 1 + wgi, r0,
                                            r1, t4, o, l, pa);
    if (wt == 0) grew_s[t % NPB] = grew;
    // every MMA this warpgroup issued is done, the other's PV of t-1 included: the other
    // warpgroup may reuse t-1's P buffer and key buffer once this one publishes t
    wait0();
    keep128(o);
    async_fence();
    bar_arrive(3 + (t & 1), 256);
    fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) mma_rs_n256(o, pa[kk], v_desc(t, kk));
    commit();
  }
  // the other warpgroup's last tile; none when the item holds no key (a request of 0 keys, which
  // the value checks reject but capture skips: o = 0 and lse = -inf, as verify.cu writes)
  if (t >= 1 && t - 1 < n_tiles) other_tile(t - 1);
  wait0();
  keep128(o);

  // -- l of both warpgroups (each summed its own tiles' keys; both rescaled by every move)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v = l[h];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (t4 == 0) l_s[wgi * ROWS + (h ? r1 : r0)] = v;
  }
  __syncthreads();  // (2)
  const float l0 = l_s[r0] + l_s[ROWS + r0], l1 = l_s[r1] + l_s[ROWS + r1];
  const float i0 = l0 == 0.f ? 0.f : 1.f / l0, i1 = l1 == 0.f ? 0.f : 1.f / l1;  // NaN stays NaN
  // partial row of row rg: ((item * T + t) * H + head)
  const int item = work_s[3];  // read here: not held in a register across the tile loop
  const int rg0 = ctaid_x() * RB + r0, rg1 = rg0 + 8;
  const i64 pr0 = rg0 < HT ? ((i64)item * T + rg0 % T) * a.H + rg0 / T : -1;
  const i64 pr1 = rg1 < HT ? ((i64)item * T + rg1 % T) * a.H + rg1 / T : -1;
  if (wgi == 0 && t4 == 0) {  // l = 0: the row saw no key here; a NaN l (a NaN was read) stays NaN
    if (pr0 >= 0) a.part_lse[pr0] = l0 == 0.f ? NEG_INF : (m_s[r0] + __log2f(l0)) * LN2;
    if (pr1 >= 0) a.part_lse[pr1] = l1 == 0.f ? NEG_INF : (m_s[r1] + __log2f(l1)) * LN2;
  }
  // -- o leaves through Q's shared memory (free: both warpgroups' MMAs ended before the barrier
  // above) as 16-byte stores of whole rows; the accumulator's own 4-byte stores (8 rows x 16 bytes
  // per warp store) cost 2-3.5 us per call (scripts/time_phases.py --backend wgmma, no_o_store)
#pragma unroll
  for (int i = 0; i < 128; i += 2) {
    const bool hi_row = (i >> 1) & 1;
    const float inv = hi_row ? i1 : i0;
    *reinterpret_cast<u32*>(Qs + (hi_row ? r1 : r0) * OPITCH + (256 * wgi + 8 * (i >> 2) + 2 * t4) * 2) =
        pack_bf16(o[i] * inv, o[i + 1] * inv);
  }
  __syncthreads();  // (3) o staged
  store_o(item);
  __syncthreads();  // (4) o stored: Q's shared memory and the key buffers are free
  if (tid < 32) publish_next(false);
  init_mbarriers();
  __syncthreads();  // (5) the next segment published
  if (work_s[0] < 0) break;
  first_segment = false;
  }  // segments
  }  // the two 64-row warpgroups
#else
  __trap();  // wgmma needs sm_90a: the backend compiles this kernel for nothing else
#endif
}

// ---------------------------------------------------------------- merge of a few splits per request
// grid (B*T, ceil(H / 8)); block 256: a warp per (row, head) pair, all DV columns (16 per lane:
// two 16-byte loads per split, each warp load a whole 512-byte half of the row; lanes 32 bytes
// apart made each of the two loads fetch every 32-byte sector from L2, twice the bytes; results/
// kernel/wgmma/merge-sectors/), no shared memory and no block barrier. verify.cu's merge gives
// each (pair, 128 columns) a block of 256 threads and two block barriers: with a few splits per
// request (batches) its 4 x B x T x H blocks run in waves of a few microseconds each (H 8, T 9,
// batch 64 at 4k: 82.6 us of a 227.5-us call, results/kernel/wgmma/batch-merge/); here 64 x 72
// pairs are about 1.5 waves (3 blocks per SM) and a warp waits only for its loads, one round trip
// per 4 splits. The backend picks it where requests have few splits (wgmma.uses_warp_merge); any
// count is merged correctly.
__global__ void __launch_bounds__(256, 3) verify_merge_warp_kernel(const MergeArgs a) {
  constexpr int U = 4;  // splits in flight per lane: 8 16-byte loads
  static_assert(32 % U == 0, "a group of U splits never straddles the 32 weights a lane round holds");
  const float NEG_INF = -__int_as_float(0x7f800000);
  const int lane = threadIdx.x & 31, head = blockIdx.y * 8 + (threadIdx.x >> 5);
  const int row = blockIdx.x, b = row / a.T, t = row % a.T;
  pdl_wait();  // the split grid's partials and meta are complete and visible past this point
  if (head >= a.H) return;
  const int first = a.meta[2 * b], nsplit = min(a.meta[2 * b + 1], MAX_NSPLIT);
  if (nsplit < 0) return;  // the split launch was idle (`batch_idle`): another launch serves the batch
  const i64 split_stride = (i64)a.T * a.H;  // partial rows per work item
  const i64 pair0 = ((i64)first * a.T + t) * a.H + head;
  // the max over the splits (a lane per split); the first 32 kept for their weights
  const float l_first = lane < nsplit ? a.part_lse[lane * split_stride + pair0] : NEG_INF;
  float m = l_first;
  for (int k = lane + 32; k < nsplit; k += 32) m = fmaxf(m, a.part_lse[k * split_stride + pair0]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float o[16], s = 0.f;
#pragma unroll
  for (int e = 0; e < 16; ++e) o[e] = 0.f;
  // lane's columns: 8 * lane .. + 7 (half 0) and DV / 2 + 8 * lane .. + 7 (half 1)
  const uint4* base = reinterpret_cast<const uint4*>(a.part_o + pair0 * DV) + lane;
  const i64 step = split_stride * (DV / 8);  // uint4s per work item
  for (int k0 = 0; k0 < nsplit; k0 += 32) {
    const int k = k0 + lane;
    const float l = k0 == 0 ? l_first : (k < nsplit ? a.part_lse[k * split_stride + pair0] : NEG_INF);
    // as verify_merge_kernel: an empty split (lse -inf) weighs 0 and is not read; when every
    // split is NaN, m is -inf (fmaxf skips NaN) and the NaN is kept
    const float w = k >= nsplit ? 0.f : (m == NEG_INF ? (l != l ? l : 0.f) : __expf(l - m));
    s += w;
    const int nk = min(32, nsplit - k0);
    for (int j0 = 0; j0 < nk; j0 += U) {
      uint4 v[U][2];
      float wj[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // every load of the group issued before any is used
        wj[u] = __shfl_sync(0xffffffffu, w, (j0 + u) & 31);
        const bool use = j0 + u < nk && wj[u] != 0.f;
        // no address formed past the used splits; ld.global.cg, not the non-coherent path: with
        // programmatic dependent launch the split grid wrote these while this grid was resident
        const uint4* src = base + (i64)(use ? k0 + j0 + u : 0) * step;
        v[u][0] = use ? __ldcg(src) : make_uint4(0u, 0u, 0u, 0u);
        v[u][1] = use ? __ldcg(src + DV / 16) : make_uint4(0u, 0u, 0u, 0u);
        if (!use) wj[u] = 0.f;
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 p[4] = {v[u][h].x, v[u][h].y, v[u][h].z, v[u][h].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            o[8 * h + 2 * e] += wj[u] * __uint_as_float(p[e] << 16);
            o[8 * h + 2 * e + 1] += wj[u] * __uint_as_float(p[e] & 0xffff0000u);
          }
        }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  const float inv = s == 0.f ? 0.f : 1.f / s;  // NaN stays NaN
  u16* dst = a.out + (i64)row * a.out_stride_m + (i64)head * a.out_stride_h + 8 * lane;
  if ((reinterpret_cast<u64>(dst) & 15) == 0) {  // the usual dense output: a 16-byte store per half
    u32 w8[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) w8[e] = (u32)bf16_bits(o[2 * e] * inv) | ((u32)bf16_bits(o[2 * e + 1] * inv) << 16);
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(w8[0], w8[1], w8[2], w8[3]);
    reinterpret_cast<uint4*>(dst + DV / 2)[0] = make_uint4(w8[4], w8[5], w8[6], w8[7]);
  } else {
#pragma unroll
    for (int e = 0; e < 16; ++e) dst[(e >> 3) * (DV / 2) + (e & 7)] = bf16_bits(o[e] * inv);
  }
  if (a.lse != nullptr && lane == 0) a.lse[(i64)row * a.lse_stride_m + head] = s == 0.f ? NEG_INF : m + __logf(s);
}

}  // namespace kvtune
