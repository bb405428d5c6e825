"""The variants `scripts/time_phases.py --variants` times: copies of a kernel source with one
stage left out or changed, each a list of (anchor, replacement) pairs whose anchors occur exactly
once in the part it patches (verify.cu, verify_wgmma.cu or verify_km.cu). time_phases.py's
docstring says what each variant is for; the results folders say what each one measured.
"""
from __future__ import annotations

# (anchor, replacement) pairs per variant; each anchor must occur exactly once in verify.cu
VARIANTS = {
    "full": [],
    "no_tiles": [("const int n_tiles = (hi - lo + BLOCK_N - 1) / BLOCK_N;",
                  "const int n_tiles = 0 * ((hi - lo + BLOCK_N - 1) / BLOCK_N);")],
    "no_q": [("if (a.q_vec16) {  // a warp per row", "if (a.H > 0) {\n  } else if (a.q_vec16) {  //")],
    "no_o_store": [("if (off < 0) continue;", "if (off < 0 || a.H > 0) continue;")],
    "exit_early": [("if (b < 0) return;", "if (b < 0 || a.H > 0) return;")],
    # the tile loop's stages (a.H is never negative: the condition is false at run time, but
    # the compiler cannot know it, so the rest of the loop compiles as it does in the source)
    # (a constant 0 here let NVRTC 13.0 reshape the loop, which then spilled 8 bytes)
    "no_gather": [("ok ? VEC * 2 : 0};", "ok && a.H < 0 ? VEC * 2 : 0};")],
    "no_softmax": [("    {\n      const int n0 = lo + it * BLOCK_N + sub8 * C::CPL;",
                    "    if (a.H < 0) {\n      const int n0 = lo + it * BLOCK_N + sub8 * C::CPL;")],
    # the two barriers inside each tile (after QK^T's S stores, after the softmax) left out: an
    # upper bound on what overlapping the stages could save (the loop-top barrier stays)
    "no_stage_barriers": [("empty past the last tile\n    __syncthreads();\n", "empty past the last tile\n"),
                          ("const int any_grew = __syncthreads_or(grew);", "const int any_grew = grew;")],
    "no_pv": [("for (int ks = 0; ks < C::KT; ++ks) {", "for (int ks = 0; ks < C::KT * (a.H < 0); ++ks) {")],
    "no_pv_mma": [("            mma_bf16(acc[mt][nt], af[mt], b0, b1);\n            if (nt + 1 < C::NT) mma_bf16(",
                   "            if (a.H < 0) mma_bf16(acc[mt][nt], af[mt], b0, b1);\n"
                   "            if (a.H < 0 && nt + 1 < C::NT) mma_bf16(")],
}

# verify_wgmma.cu's gather of tile t + 2 in the 64-row warpgroups' loop, the end of that loop
# (tile t's own P V issued), and the tail's hand-back of tile t - 2's buffer (the gather variants')
_EMPTY = "smem_u32(smem + Lay::EMPTY_OFF + 8 * ((t - 2) % NBUF)), ((t - 2) / NBUF) & 1"
_GATHER = ("    if (t + 2 < n_tiles) {\n      // its buffer's last reader besides the two 64-row warpgroups: the tail, "
           "on tile t - 2\n      if (XR && t >= 2) mbar_wait(" + _EMPTY + ");\n      issue_tile(t + 2, slot_next);\n"
           "    }\n    slot_next = slot_of(t + 4);\n")
_PV_END = "    for (int kk = 0; kk < 2; ++kk) mma_rs_n256(o, pa[kk], v_desc(t, kk));\n    commit();\n  }\n"
# the tail's S^T: both 16-key blocks of the tile, nine mma.sync each, over its column quarter
_TAIL_S = ("#pragma unroll\n    for (int i = 0; i < 9; ++i)\n#pragma unroll\n      for (int h = 0; h < 2; ++h) {\n"
           "        u32 af[4];\n        ldmatrix_x4(kbuf + sw_off(16 * h + (lane & 7) + 8 * ((lane >> 3) & 1), "
           "2 * (9 * w + i) + (lane >> 4), BN),\n                    af[0], af[1], af[2], af[3]);\n"
           "        mma_bf16(cq[h], af, qf[i][0], qf[i][1]);\n      }\n")
_TAIL_S_WGMMA = (
    "    if (t & 1) {\n      fence();\n#pragma unroll\n      for (int kk = 0; kk < 36; ++kk)\n"
    "        asm volatile(\"{\\n.reg .pred p;\\nsetp.ne.b32 p, %6, 0;\\n\"\n"
    "            \"wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 \"\n"
    "            \"{%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\\n}\\n\"\n"
    "            : \"+f\"(cq[0][0]), \"+f\"(cq[0][1]), \"+f\"(cq[0][2]), \"+f\"(cq[0][3])\n"
    "            : \"l\"(desc_sw(kbuf + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024)),\n"
    "              \"l\"(desc_sw(smem_u32(smem) + (kk >> 2) * ROWS * 128 + (kk & 3) * 32, 16, 1024)), \"r\"(kk));\n"
    "      commit();\n      wait0();\n    }\n")
_MBAR_WAIT = "__device__ __forceinline__ void mbar_wait(u32 addr, int parity) {"
_MBAR_TEST = ("__device__ __forceinline__ bool mbar_test(u32 addr, int parity) {\n  u32 done;\n"
              "  asm volatile(\"{\\n.reg .pred p;\\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\\n"
              "selp.u32 %0, 1, 0, p;\\n}\\n\" : \"=r\"(done) : \"r\"(addr), \"r\"(parity) : \"memory\");\n"
              "  return done != 0;\n}\n")

#: batch 1's Q copy under the schedule: whether it runs
_Q_EARLY = "  const bool q_early = B1 && a.B == 1 && a.q_vec16;"
#: the 64-row warpgroups' segment loop: its opening and its first line (the warpgroup index)
_SEG_OPEN = ("  bool first_segment = true;  // later segments find Q's shared memory overwritten by the staged o\n"
             "  for (;;) {\n")
_WGI_LINE = ("  const int tid = tid_x(), mb = ctaid_x(), wgi = (int)__reduce_max_sync(0xffffffffu, "
             "(unsigned)tid >> 7),\n            wt = tid & 127, warp = wt >> 5, lane = tid & 31;\n")

#: warp 0's schedule at the CTA's start (the dispatch's idle check, then the schedule) and its
#: end: where the work-table variants (table_read, table_content) put their read and their write
_SCHEDULE_OPEN = ("  if (tid < 32 && batch_idle(a)) {  // another launch of a per-context dispatch serves this batch\n"
                  "    if (blockIdx.y == 0 && mb == 0) mark_idle(a);\n"
                  "    if (lane == 0) work_s[0] = -1;\n"
                  "  } else if (tid < 32) {\n")
_SCHEDULE_CLOSE = "    __syncwarp();\n    publish_next(true);\n  }\n  init_mbarriers();\n"


def _table_hit(meta_words: str) -> str:
    """The work-table variants' branch on `hit` (their entry read into v by lanes 0-2, the merge's
    meta into m[`meta_words` / 32] for CTA (0, 0)): the entry published as the schedule would have,
    else the idle check, else (left open) the schedule as shipped."""
    return ("    if (hit) {\n"
            "      if (lane == 1) { work_s[0] = v.x; work_s[1] = v.y; work_s[2] = v.z; work_s[3] = v.w; }\n"
            "      if (lane == 2) { work_s[4] = v.x; work_s[5] = v.y; work_s[6] = v.z; work_s[7] = v.w; }\n"
            "      if (cta00)\n"
            "#pragma unroll\n"
            f"        for (int k = 0; k < {meta_words} / 32; ++k)\n"
            "          if (32 * k + lane < 2 * a.B) a.meta[32 * k + lane] = m[k];\n"
            "    } else if (batch_idle(a)) {  // another launch of a per-context dispatch serves this batch\n"
            "      if (cta00) mark_idle(a);\n"
            "      if (lane == 0) work_s[0] = -1;\n"
            "    } else {\n")


#: the same stages of the wgmma split kernel (`--backend wgmma`), anchors in verify_wgmma.cu
WGMMA_VARIANTS = {
    "full": [],
    # both paths (the two 64-row warpgroups and the tail) must agree on the tile count
    "no_tiles": [("  const int n_tiles = (hi - lo + BN - 1) / BN;\n\n",
                  "  const int n_tiles = 0 * ((hi - lo + BN - 1) / BN);\n\n"),
                 ("        const int n_tiles = (hi - lo + BN - 1) / BN;\n        u32 qf",
                  "        const int n_tiles = 0 * ((hi - lo + BN - 1) / BN);\n        u32 qf")],
    "no_q": [("  } else if (a.q_vec16) {\n    for (int i = tid;",
              "  } else if (a.H > 0) {\n  } else if (a.q_vec16) {\n    for (int i = tid;"),
             (_Q_EARLY, _Q_EARLY.replace("a.q_vec16;", "a.q_vec16 && a.H < 0;"))],
    "no_o_store": [("      if (rg < HT)\n        *reinterpret_cast<uint4*>(a.part_o",
                    "      if (rg < HT && a.H < 0)\n        *reinterpret_cast<uint4*>(a.part_o")],
    "exit_early": [("  if (work_s[0] < 0) return;  // no work", "  if (work_s[0] < 0 || a.H > 0) return;  // no work")],
    # the warp merge returns once the split grid is complete: what a merge launch costs with no work
    "merge_exit": [("  pdl_wait();  // the split grid's partials and meta are complete and visible past this point\n"
                    "  if (head >= a.H) return;",
                    "  pdl_wait();  // the split grid's partials and meta are complete and visible past this point\n"
                    "  if (head >= a.H || a.H > 0) return;")],
    "no_gather": [("    const int bytes = ok ? 16 : 0;", "    const int bytes = 0 * ok;")],
    # the 64-row warpgroups' MMAs left out (their barriers and handoffs kept): QK^T, or both P V
    "no_qk_mma": [("      mma_ss_n32(s, desc_add(dq, ", "      if (a.H < 0) mma_ss_n32(s, desc_add(dq, ")],
    "no_pv_mma": [("      mma_ss_pv_n256(o, desc(ps + (tile % NPB) * PBUF",
                   "      if (a.H < 0) mma_ss_pv_n256(o, desc(ps + (tile % NPB) * PBUF"),
                  ("for (int kk = 0; kk < 2; ++kk) mma_rs_n256(o, pa[kk], v_desc(t, kk));",
                   "for (int kk = 0; kk < 2 * (a.H < 0); ++kk) mma_rs_n256(o, pa[kk], v_desc(t, kk));")],
    # the two 64-row warpgroups no longer wait for each other's publication of a tile (its P, max
    # and factors) before their own softmax: the tile-order chain between them cut. Outputs wrong,
    # and the other's P and key buffers are read while they are rewritten (no address depends on
    # them): what that chain costs, at most
    "no_handoff": [("    bar_sync(3 + (tile & 1), 256);  // one barrier per publishing warpgroup", "    //"),
                   ("    bar_arrive(3 + (t & 1), 256);\n", "")],
    # the 64-row warpgroups' key tiles never copied (no cp.async issued; the indices still
    # loaded), and their softmax left out (P, the maxima and l untouched): with the skeleton
    # variant, where its time per tile goes. Outputs wrong
    "no_copy": [("        cp_async<16>(sx[", "        if (a.H < 0) cp_async<16>(sx[")],
    "no_softmax_wg": [("    const int grew = softmax_tile<NPB == 1>(",
                       "    const int grew = a.H > 0 ? 0 : softmax_tile<NPB == 1>(")],
    # outputs right: the 64-row warpgroups' segment loop as a generic lambda instantiated once per
    # warpgroup (wgi a compile-time constant), so the tile index t, its key buffer and the K
    # descriptors are warp-uniform to the compiler and live in uniform registers: no R2UR per wgmma
    # (compiled, NVRTC 13.5, T 9, ROWS 72: the S issue 273 -> 111 / 177 instructions per warp in the
    # two copies; ROWS 64: 110 / 418, one copy's K descriptors vector again). The branch is on a vote
    # (__all_sync), which the compiler knows is warp-uniform: on tid_x() < 128 the copies spilled 8 bytes.
    # Measured 7.7-17.6% slower at H 8: the second copy's instruction fetch
    # (results/kernel/wgmma/phases/uniform-tile-index/)
    "uniform_wg": [
        (_WGI_LINE, "  constexpr int wgi = decltype(wg_c)::value;\n"
                    "  const int tid = tid_x(), mb = ctaid_x(), wt = tid & 127, warp = wt >> 5, lane = tid & 31;\n"),
        (_SEG_OPEN, _SEG_OPEN.replace("  for (;;) {\n", "  auto main_wg = [&](auto wg_c) {\n  for (;;) {\n")),
        ("  first_segment = false;\n  }  // segments\n",
         "  first_segment = false;\n  }  // segments\n  };\n"
         "  if (__all_sync(0xffffffffu, tid_x() < 128)) main_wg(wg::WgC<0>{}); else main_wg(wg::WgC<1>{});\n"),
        ("constexpr int RANGE_RESTART_TILES = 3;\n",
         "constexpr int RANGE_RESTART_TILES = 3;\ntemplate <int V> struct WgC { static constexpr int value = V; };\n")],
    # the shipped warp reduction undone (outputs right): wgi = tid >> 7, which the compiler does not
    # know is warp-uniform, so the tile index and K descriptors take R2UR per wgmma (NVRTC 13.5, T 9,
    # ROWS 72: the S issue 106 -> 273 instructions per warp; 6.0% slower at H 64 x 128k, within
    # -1.8..+0.1% at H 8: results/kernel/wgmma/phases/fixed-order-decisions-interleaved/)
    "wgi_plain": [(_WGI_LINE, "  const int tid = tid_x(), mb = ctaid_x(), wgi = tid >> 7, wt = tid & 127, "
                              "warp = wt >> 5, lane = tid & 31;\n")],
    # outputs right: a warpgroup issues its S of tile t only once the other has issued its P V of
    # tile t - 2 (named barriers 11 / 12), so that P V, which the other waits for before it publishes
    # t - 1, is not queued on the tensor pipe behind the 36 S wgmmas of t
    "pv_before_s": [
        ("      mma_ss_pv_n256(o, desc(ps + (tile % NPB) * PBUF + kk * 256, 128, 512), v_desc(tile, kk));\n"
         "    commit();\n",
         "      mma_ss_pv_n256(o, desc(ps + (tile % NPB) * PBUF + kk * 256, 128, 512), v_desc(tile, kk));\n"
         "    commit();\n    if (tile + 2 < n_tiles) bar_arrive(11 + (tile & 1), 256);\n"),
        ("    if (XR && wt == 0) mbar_arrive(smem_u32(smem + Lay::FULL_OFF + 8 * (t % NBUF)));\n    fence();\n",
         "    if (XR && wt == 0) mbar_arrive(smem_u32(smem + Lay::FULL_OFF + 8 * (t % NBUF)));\n"
         "    if (t >= 2) bar_sync(11 + (t & 1), 256);\n    fence();\n")],
    # ROWS 72: the tail warpgroup only keeps its handshakes (the tiles' buffers and the scrub)
    "tail_idle": [("    mbar_wait(smem_u32(smem + L::FULL_OFF + 8 * buf), par);\n",
                   "    mbar_wait(smem_u32(smem + L::FULL_OFF + 8 * buf), par);\n"
                   "    if (a.H > 0) {\n      const int k0_ = lo + BN * t;\n"
                   "      if (max(k0_, P) < min(k0_ + BN, hi)) {\n"
                   "        bar_arrive(5 + (t & 1), 256);\n        bar_sync(9 + (t & 1), 256);\n      }\n"
                   "      bar_sync(7, 128);\n      if (wt == 0) mbar_arrive(smem_u32(smem + L::EMPTY_OFF + 8 * buf));\n"
                   "      continue;\n    }\n")],
    "tail_no_s_mma": [("        mma_bf16(cq[h], af, qf[i][0], qf[i][1]);",
                       "        if (a.H < 0) mma_bf16(cq[h], af, qf[i][0], qf[i][1]);")],
    "tail_no_ldsm": [("        ldmatrix_x4(kbuf + sw_off(16 * h + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * (9 * w + i)"
                      " + (lane >> 4), BN),\n                    af[0], af[1], af[2], af[3]);",
                      "        af[0] = af[1] = af[2] = af[3] = qf[i][h];")],
    # ROWS 72, outputs wrong (timing only): the tail's S^T as one wgmma m64n8k16 chain per pair of
    # tiles (on odd tiles: A 64 key rows from the tile's buffer, B 8 rows of Q's shared memory),
    # the same MMA work as its 72 mma.sync per tile: whether an N = 8 wgmma stream shares the
    # tensor pipe with the 64-row warpgroups better (the wgmma tail needs Q8 in shared memory, 9 KB
    # the layout does not have)
    "tail_s_wgmma": [(_TAIL_S, _TAIL_S_WGMMA)],
    "tail_no_pv": [("        mma_ss_n8_vt(o[j], desc_add(", "        if (a.H < 0) mma_ss_n8_vt(o[j], desc_add(")],
    # ROWS 72, outputs right: the tail waits for its O^T MMAs of tile t - 1 right after its S^T of
    # tile t (not after the softmax) and hands that key buffer back at the S^T exchange, a softmax
    # earlier (the 64-row warpgroups wait for it before each gather: 10% of their loop's stalls)
    "tail_early_release": [
        ("    if (t > 0 && wt == 0) mbar_arrive(smem_u32(smem + L::EMPTY_OFF + 8 * ((t - 1) % NBUF)));\n"
         "    if (draft) bar_sync(9", "    if (draft) bar_sync(9"),
        ("#pragma unroll\n    for (int h = 0; h < 2; ++h)\n      *reinterpret_cast<float4*>(scr",
         "    wait0();\n    keep32(o);\n"
         "#pragma unroll\n    for (int h = 0; h < 2; ++h)\n      *reinterpret_cast<float4*>(scr"),
        ("    bar_sync(7, 128);\n    const int k0 = lo + BN * t;",
         "    bar_sync(7, 128);\n"
         "    if (t > 0 && wt == 0) mbar_arrive(smem_u32(smem + L::EMPTY_OFF + 8 * ((t - 1) % NBUF)));\n"
         "    const int k0 = lo + BN * t;")],
    # ROWS 72, outputs right: the tail's S^T in C independent accumulator chains per 16-key block
    # (k-steps i % C), summed before the exchange, in place of one chain of nine dependent MMAs
    **{f"tail_chains{c}": [
        ("    float cq[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};\n",
         f"    float cq[2][4] = {{{{0.f, 0.f, 0.f, 0.f}}, {{0.f, 0.f, 0.f, 0.f}}}}, cx[{c - 1}][2][4] = {{}};\n"),
        ("        mma_bf16(cq[h], af, qf[i][0], qf[i][1]);",
         f"        mma_bf16(i % {c} == 0 ? cq[h] : cx[i % {c} - 1][h], af, qf[i][0], qf[i][1]);"),
        ("#pragma unroll\n    for (int h = 0; h < 2; ++h)\n      *reinterpret_cast<float4*>(scr",
         f"#pragma unroll\n    for (int x = 0; x < {c - 1}; ++x)\n#pragma unroll\n    for (int h = 0; h < 2; ++h)\n"
         "#pragma unroll\n      for (int e = 0; e < 4; ++e) cq[h][e] += cx[x][h][e];\n"
         "#pragma unroll\n    for (int h = 0; h < 2; ++h)\n      *reinterpret_cast<float4*>(scr")]
       for c in (2, 3)},
    # outputs right: a 64-row warpgroup issues tile t + 2's gather (and loads tile t + 4's
    # indices) after it published tile t and issued its P V, not between the other warpgroup's
    # publication of t - 1 and its own softmax of t: off the softmax chain that runs the tiles in
    # order, so neither the gather's issue nor a wait for the tail's hand-back delays it
    "gather_after_publish": [(_GATHER, ""), (_PV_END, _PV_END[:-4] + _GATHER + "  }\n")],
    # outputs right: tile t + 2's gather issued where it is when the tail has handed its buffer
    # back (one non-blocking mbarrier test per thread), else after tile t is published and its
    # P V issued: a late tail no longer holds up the softmax chain, an early one keeps the slack
    "gather_if_free": [
        (_MBAR_WAIT, _MBAR_TEST + _MBAR_WAIT),
        (_GATHER, "    bool issued = t + 2 >= n_tiles;\n"
                  "    if (!issued && (!XR || t < 2 || mbar_test(" + _EMPTY + "))) {\n"
                  "      issue_tile(t + 2, slot_next);\n      issued = true;\n    }\n"),
        (_PV_END, _PV_END[:-4] + "    if (!issued) {\n      mbar_wait(" + _EMPTY + ");\n"
                  "      issue_tile(t + 2, slot_next);\n    }\n    slot_next = slot_of(t + 4);\n  }\n")],
    # outputs right: the split table's bounds and values loaded a lane each beside kv_indptr's two
    # ends (one round trip where table_value's walk waits for the bounds, then the value); a
    # table of more than 32 buckets walks as before
    "table_lanes": [
        ("__device__ Schedule plan_schedule(const SplitArgs& a) {\n"
         "  const int total = batch_keys(a), target = batch_nsplit(a, total);\n",
         "struct BatchSize {\n  int total, value;\n};\n"
         "__device__ BatchSize batch_size(const SplitArgs& a) {\n"
         "  const int lane = threadIdx.x & 31, nb = a.num_buckets;\n  const bool mine = lane < nb;\n"
         "  const int bound = mine ? a.split_max_keys[lane] : 0, value = mine ? a.split_values[lane] : 0;\n"
         "  const int total = batch_keys(a);\n  if (nb == 0) return {total, a.grid_nsplit};\n"
         "  if (nb > 32) return {total, table_value(total, a.split_max_keys, a.split_values, nb, a.grid_nsplit)};\n"
         "  const unsigned fits = __ballot_sync(0xffffffffu, mine && total <= bound);\n"
         "  return {total, __shfl_sync(0xffffffffu, value, fits ? __ffs(fits) - 1 : nb - 1)};\n}\n"
         "__device__ Schedule plan_schedule(const SplitArgs& a, int total, int value) {\n"
         "  const int target = min(max(value, 1), a.grid_nsplit);\n"),
        ("  if (tid < 32 && batch_idle(a)) {", "  const BatchSize bsz = tid < 32 ? batch_size(a) : BatchSize{0, 0};\n"
         "  if (tid < 32 && a.num_buckets > 0 && bsz.value == 0) {"),
        ("    const Schedule sc = plan_schedule(a);\n    const int R = sc.R, total = batch_keys(a);\n",
         "    const Schedule sc = plan_schedule(a, bsz.total, bsz.value);\n"
         "    const int R = sc.R, total = bsz.total;\n")],
    # outputs right: the batch-1 instantiation without its Q copy under the schedule (each segment
    # copies its own, as at any batch): what the copy buys
    "no_q_early": [(_Q_EARLY, "  const bool q_early = false;")],
    # outputs right: a CTA whose segment is its last (items: always; ranges: its cursor reached
    # its range's end) returns right after storing o, without the two block barriers and the
    # schedule step that would only find no next segment (the lead "the last segment knows it is
    # last": about 0.5 us of every CTA's end on the timeline, results/kernel/wgmma/timeline/)
    "last_exits": [
        ("        store_o(item);\n"
         "        __syncthreads();  // (4) o stored: Q's shared memory and the key buffers are free\n",
         "        store_o(item);\n        if (work_s[4] == 0 || work_s[5] >= work_s[6]) return;\n"
         "        __syncthreads();  // (4) o stored: Q's shared memory and the key buffers are free\n"),
        ("  store_o(item);\n  __syncthreads();  // (4) o stored: Q's shared memory and the key buffers are free\n",
         "  store_o(item);\n  if (work_s[4] == 0 || work_s[5] >= work_s[6]) return;\n"
         "  __syncthreads();  // (4) o stored: Q's shared memory and the key buffers are free\n")],
    # outputs right where the table's entry is the launch's own: the lead "a work table built once
    # per step and read with one load" (results/kernel/wgmma/timeline/: the device-side schedule is
    # 1.4-1.9 us of a CTA at batch 1-8, 2.6 at 32, 3.8 on ragged64). Each CTA keeps its first
    # segment and the schedule's state in a table in the module's global memory, keyed by the
    # launch's (indptr, indices, B, grid NSPLIT, row blocks, T, key count), and a later launch with the same key
    # reads them in one round trip (beside kv_indptr's two ends, for the key) instead of running
    # the schedule; CTA (0, 0) copies the merge's meta from the table in the same round trip. A
    # per-step plan would build this table in a launch of its own, once for the step's 61 layers.
    "table_read": [
        ("// This launch's schedule: key ranges",
         "constexpr int WT_SLOTS = 127, WT_ENTRIES = 256, WT_META = 128;  // table_read\n"
         "__device__ int4 g_wt[WT_SLOTS][WT_ENTRIES][3];\n"
         "__device__ int g_wt_meta[WT_SLOTS][WT_META];\n"
         "// This launch's schedule: key ranges"),
        (_SCHEDULE_OPEN,
         "  if (tid < 32) {\n"
         "    const unsigned long long ip = (unsigned long long)a.indptr, ix = (unsigned long long)a.indices;\n"
         "    const int slot = (int)((ip >> 9) % WT_SLOTS), e = blockIdx.y * gridDim.x + mb;\n"
         "    const bool in_table = e < WT_ENTRIES && 2 * a.B <= WT_META, cta00 = blockIdx.y == 0 && mb == 0;\n"
         "    const int tag_b = ((a.B * 4096 + a.grid_nsplit) * 16 + (int)gridDim.x) * 64 + T;\n"
         "    int4 v = make_int4(0, 0, 0, 0);\n"
         "    int ends = 0, m[WT_META / 32];\n"
         "    if (in_table && lane < 3) v = __ldcg(&g_wt[slot][e][lane]);\n"
         "    if (lane == 3) ends = a.indptr[a.B];\n"
         "    if (lane == 4) ends = a.indptr[0];\n"
         "#pragma unroll\n"
         "    for (int k = 0; k < WT_META / 32; ++k)\n"
         "      m[k] = cta00 && in_table && 32 * k + lane < 2 * a.B ? __ldcg(&g_wt_meta[slot][32 * k + lane]) : 0;\n"
         "    const int tot = __shfl_sync(0xffffffffu, ends, 3) - __shfl_sync(0xffffffffu, ends, 4);\n"
         "    const bool hit = in_table && __shfl_sync(0xffffffffu, v.x, 0) == tot + 1 &&\n"
         "                     __shfl_sync(0xffffffffu, v.y, 0) == tag_b &&\n"
         "                     __shfl_sync(0xffffffffu, v.z, 0) == (int)ip &&\n"
         "                     __shfl_sync(0xffffffffu, v.w, 0) == (int)ix;\n"
         + _table_hit("WT_META")),
        (_SCHEDULE_CLOSE,
         "    __syncwarp();\n    publish_next(true);\n"
         "    __syncwarp();\n"
         "    if (in_table) {\n"
         "      if (cta00)\n"
         "        for (int i = lane; i < 2 * a.B; i += 32) g_wt_meta[slot][i] = a.meta[i];\n"
         "      if (lane == 0) {\n"
         "        g_wt[slot][e][1] = make_int4(work_s[0], work_s[1], work_s[2], work_s[3]);\n"
         "        g_wt[slot][e][2] = make_int4(work_s[4], work_s[5], work_s[6], work_s[7]);\n"
         "        __threadfence();\n"
         "        g_wt[slot][e][0] = make_int4(total + 1, tag_b, (int)ip, (int)ix);\n"
         "      }\n"
         "    }\n"
         "    }\n  }\n  init_mbarriers();\n")],
    # outputs right: the same read with an exact content key, as a shippable table would need (the
    # design in results/kernel/wgmma/phases/work-table-read/): each CTA's entry keeps the whole
    # kv_indptr it was built for, and a launch hits only when its kv_indptr equals it (read in the
    # same round trip, a few words per lane), with the grid NSPLIT, the row blocks, T, B and the
    # split table's bucket count equal. Not keyed by pointers: input sets of the same lengths share
    # entries, rightly (the same lengths give the same schedule). B <= 79 (else the schedule runs).
    "table_content": [
        ("// This launch's schedule: key ranges",
         "constexpr int WC_ENTRIES = 256, WC_KEY = 160;  // table_content\n"
         "__device__ int4 g_wc[WC_ENTRIES][3];\n"
         "__device__ int g_wc_key[WC_ENTRIES][WC_KEY];\n"
         "__device__ int g_wc_meta[WC_KEY];\n"
         "// This launch's schedule: key ranges"),
        (_SCHEDULE_OPEN,
         "  if (tid < 32) {\n"
         "    const int e = blockIdx.y * gridDim.x + mb, tag1 = (int)gridDim.x * 64 + T;\n"
         "    const bool in_table = e < WC_ENTRIES && 2 * a.B < WC_KEY, cta00 = blockIdx.y == 0 && mb == 0;\n"
         "    int4 v = make_int4(0, 0, 0, 0);\n"
         "    int live[WC_KEY / 32], m[WC_KEY / 32];\n"
         "    bool same = true;\n"
         "    if (in_table && lane < 3) v = __ldcg(&g_wc[e][lane]);\n"
         "#pragma unroll\n"
         "    for (int k = 0; k < WC_KEY / 32; ++k) {\n"
         "      const int i = 32 * k + lane;\n"
         "      const bool in = in_table && i <= a.B;\n"
         "      live[k] = in ? a.indptr[i] : 0;\n"
         "      const int kept = in ? __ldcg(&g_wc_key[e][i]) : 0;  // every load issued: one round trip\n"
         "      same &= kept == live[k];\n"
         "      m[k] = cta00 && in_table && i < 2 * a.B ? __ldcg(&g_wc_meta[i]) : 0;\n"
         "    }\n"
         "    const bool hit = in_table && __all_sync(0xffffffffu, same) &&\n"
         "                     __shfl_sync(0xffffffffu, v.x, 0) == a.grid_nsplit &&\n"
         "                     __shfl_sync(0xffffffffu, v.y, 0) == tag1 && __shfl_sync(0xffffffffu, v.z, 0) == a.B &&\n"
         "                     __shfl_sync(0xffffffffu, v.w, 0) == a.num_buckets + 1;\n"
         + _table_hit("WC_KEY")),
        (_SCHEDULE_CLOSE,
         "    __syncwarp();\n    publish_next(true);\n"
         "    if (in_table) {\n"
         "      if (lane == 0) g_wc[e][0] = make_int4(0, 0, 0, 0);  // invalid while the key changes\n"
         "      __threadfence();\n"
         "      __syncwarp();\n"
         "#pragma unroll\n"
         "      for (int k = 0; k < WC_KEY / 32; ++k)\n"
         "        if (32 * k + lane <= a.B) g_wc_key[e][32 * k + lane] = live[k];\n"
         "      if (cta00)\n"
         "        for (int i = lane; i < 2 * a.B; i += 32) g_wc_meta[i] = a.meta[i];\n"
         "      __threadfence();\n"
         "      __syncwarp();\n"
         "      if (lane == 0) {\n"
         "        g_wc[e][1] = make_int4(work_s[0], work_s[1], work_s[2], work_s[3]);\n"
         "        g_wc[e][2] = make_int4(work_s[4], work_s[5], work_s[6], work_s[7]);\n"
         "        __threadfence();\n"
         "        g_wc[e][0] = make_int4(a.grid_nsplit, tag1, a.B, a.num_buckets + 1);\n"
         "      }\n"
         "    }\n"
         "    }\n  }\n  init_mbarriers();\n")],
    # controls (outputs right; results/kernel/wgmma/phases/variant-order/): full_again, the source
    # with one comment changed (the same code, compiled again); pad_merge, dead stores in the warp
    # merge (its code grows, the split kernel's does not)
    "full_again": [("  }  // the two 64-row warpgroups\n#else",
                    "  }  // the two 64-row warpgroups (a comment: the same code)\n#else")],
    "pad_merge": [("  pdl_wait();  // the split grid's partials and meta are complete and visible past this point\n"
                   "  if (head >= a.H) return;\n",
                   "  pdl_wait();  // the split grid's partials and meta are complete and visible past this point\n"
                   "  if (head >= a.H) return;\n  if (a.T == -1) {  // never\n#pragma unroll\n"
                   "    for (int i = 0; i < 256; ++i) a.out[i * 32 + lane] = (u16)(i * head);\n  }\n")],
    # outputs right: once-per-segment loops kept rolled (#pragma unroll 1), 8.8-10.6 KB less SASS at
    # ROWS 72: the Q copy (roll_q), the partial o store (roll_store), the draft keys' NaN scrub
    "roll_q": [("    for (int i = tid; i < ROWS * CHUNKS; i += 256) {",
                "#pragma unroll 1\n    for (int i = tid; i < ROWS * CHUNKS; i += 256) {"),
               ("    for (int i = tid; i < ROWS * DK; i += 256) {",
                "#pragma unroll 1\n    for (int i = tid; i < ROWS * DK; i += 256) {")],
    "roll_store": [("    for (int c = tid_x(); c < RB * (DV / 8); c += NT) {",
                    "#pragma unroll 1\n    for (int c = tid_x(); c < RB * (DV / 8); c += NT) {")],
    "roll_scrub": [("  for (int c = wt; c < (k_hi - k_lo) * PIECES; c += 128) {",
                    "#pragma unroll 1\n  for (int c = wt; c < (k_hi - k_lo) * PIECES; c += 128) {")],
    # the schedule forced (outputs right): verify.cu's items always, or key ranges whenever B > 1
    # (kernels.cuda.wgmma.forced_schedule, applied by patched_source)
    "items": [],
    "ranges": [],
}

# verify_km.cu (--backend wgmma_km): its stages left out, as above (a.H > 0 and kb != 0 at run time)
KM_VARIANTS = {
    "full": [],
    "no_tiles": [("const int n_tiles = (hi - lo + BN - 1) / BN;",
                  "const int n_tiles = 0 * ((hi - lo + BN - 1) / BN);")],
    "exit_early": [("if (b < 0) {  // no work", "if (b < 0 || a.H > 0) {  // no work")],
    "no_q": [("  if (a.q_vec16) {  // 8 lanes per row", "  if (a.H > 0) {\n  } else if (a.q_vec16) {  //")],
    "no_o_store": [("    if (rg < HT)\n      *reinterpret_cast<uint4*>(a.part_o",
                    "    if (rg < HT && a.H < 0)\n      *reinterpret_cast<uint4*>(a.part_o")],
    "no_gather": [("      bytes[i] = ok ? 16 : 0;", "      bytes[i] = 0 * ok;")],
    "no_copy": [("++p) cp_async<16>(kb + p * PANEL", "++p) if (a.H < 0) cp_async<16>(kb + p * PANEL"),
                ("++i) cp_async<16>(rs + sx", "++i) if (a.H < 0) cp_async<16>(rs + sx")],
    "no_s_mma": [("      mma_n72<0>(s, wg::desc_add(dk,", "      if (a.H < 0) mma_n72<0>(s, wg::desc_add(dk,"),
                 ("      mma_n72<0>(s, wg::desc_add(dr, kk * 32)",
                  "      if (a.H < 0) mma_n72<0>(s, wg::desc_add(dr, kk * 32)")],
    "no_pv_mma": [("      mma_n72<1>(o[m], wg::desc_add(dv,", "      if (kb == 0u) mma_n72<1>(o[m], wg::desc_add(dv,")],
    "no_exp": [("const float p = fast_exp2(s[4 * j + e] - ((e & 1) ? z1 : z0));",
                "const float p = s[4 * j + e] - ((e & 1) ? z1 : z0);")],
    "no_p_store": [("        *reinterpret_cast<u16*>(pt + (n >> 3) * 1024",
                    "        if (a.H < 0) *reinterpret_cast<u16*>(pt + (n >> 3) * 1024")],
}

#: variants that may fault (see the docstring): only when named
UNSAFE = {"no_stage_barriers"}
#: variants whose outputs are right (a schedule forced, a different copy mapping): --oracle checks them
OUTPUTS_RIGHT = {"full", "items", "ranges", "tail_early_release", "tail_chains2", "tail_chains3",
                 "gather_after_publish", "gather_if_free", "uniform_wg", "wgi_plain", "pv_before_s",
                 "table_lanes", "no_q_early", "full_again", "pad_merge", "roll_q", "roll_store",
                 "roll_scrub", "last_exits", "table_read",
                 "table_content"}


def variants_of(backend: str) -> tuple[dict, str]:
    """(the variant table, the source part it patches) of `backend`."""
    return {"wgmma": (WGMMA_VARIANTS, "verify_wgmma.cu"), "wgmma_km": (KM_VARIANTS, "verify_km.cu")}.get(
        backend, (VARIANTS, "verify.cu"))


def patched_source(src: str, variant: str, backend: str = "cuda") -> str:
    """`src` (verify.cu, or verify_wgmma.cu for `backend` wgmma) with `variant`'s stage left out;
    `a+b` applies variant a, then b (e.g. `ranges+no_q`: the schedule forced and Q left out)."""
    from kvtune.kernels.cuda.wgmma import FORCED_RESTART_TILES, forced_schedule
    table, part = variants_of(backend)
    for name in variant.split("+"):
        if backend == "wgmma" and name in FORCED_RESTART_TILES:
            src = forced_schedule(src, name)
        for anchor, repl in table[name]:
            if src.count(anchor) != 1:
                raise SystemExit(f"variant {variant}: anchor {anchor!r} occurs {src.count(anchor)} times in {part}")
            src = src.replace(anchor, repl)
    return src
