"""The CUDA kernels' parameters (`verify.cu`, and `verify_wgmma.cu` for sm_90a), declared once:
legal values, the rules that mirror the kernels' static_asserts, and the per-arch limits a config
is judged against.
Imports neither torch nor the NVRTC bindings."""
from __future__ import annotations

from dataclasses import dataclass

from ..params import Declaration, Param, declared

CUDA_PARAMS = Declaration("CudaParams", [
    Param("NSPLIT", range(1, 1025), 64,
          "key-range splits per head group across the batch (a launch-time value): the batch's keys are cut "
          "into at most max(NSPLIT, B) splits (whole tiles): chunk is the least multiple of BLOCK_N with "
          "sum_b ceil(L_b / chunk) <= max(NSPLIT, B), and request b is cut into ceil(L_b / chunk) equal "
          "pieces; for one request, its split count", launch=True),
    Param("VEC", (2, 4, 8), 8, "bf16 elements per gathered vector load (4/8/16-byte cp.async)"),
    Param("BLOCK_N", (16, 32, 64, 128), 32, "keys per tile"),
    Param("NUM_WARPS", (4, 8, 16, 32), 8, "warps per block (each warp owns DV / NUM_WARPS value columns)"),
    Param("HEADS_PER_BLOCK", range(1, 65), 8, "heads whose HEADS_PER_BLOCK x T query rows share one CTA"),
    Param("STAGES", range(2, 5), 2, "cp.async pipeline depth"),
    Param("CTAS_PER_SM", range(1, 5), 1,
          "CTAs per SM the kernel's registers are capped for (the launch bound's minimum blocks): 2 lets one "
          "CTA's QK^T overlap another's softmax, if the shared memory of both fits the SM"),
], rules=[
    # verify.cu's Config: THREADS >= BLOCK_N && THREADS % BLOCK_N == 0 (powers of two: the first)
    ("threads_cover_tile", "BLOCK_N", "NUM_WARPS * 32 >= BLOCK_N", "each key of a tile needs a thread"),
    ("draft_tokens", "T", "1 <= T <= 64", "the CUDA kernel supports 1..64 draft tokens (one int64 mask per row)"),
    ("rows_per_cta", "HEADS_PER_BLOCK", "HEADS_PER_BLOCK * T <= 256", "HEADS_PER_BLOCK x T rows per CTA exceed 256"),
    ("o_accumulator", "NUM_WARPS", "Dv // 16 // NUM_WARPS * cdiv(HEADS_PER_BLOCK * T, 8) * 4 <= 192",
     "the O accumulator needs over 192 registers per thread; use more warps or fewer heads"),
], nsplit_per_batch=True)


@declared(CUDA_PARAMS)
class CudaParams:
    """Parameters of the CUDA kernel (all but NSPLIT are template arguments); fields, legal
    values, defaults and meanings: `CUDA_PARAMS`."""

    @property
    def threads(self) -> int:
        return self.NUM_WARPS * 32


WGMMA_PARAMS = Declaration("WgmmaParams", [
    Param("NSPLIT", range(1, 1025), 66,
          "key-range splits per row block across the batch (a launch-time value), cut as the cuda "
          "backend's NSPLIT is (32-key tiles); one CTA per SM, so NSPLIT x ceil(H x T / ROWS) near the SM "
          "count is one wave", launch=True),
    Param("ROWS", (64, 72), 64,
          "query rows per CTA (a template value): 64, two warpgroups on wgmma m64; or 72, a third "
          "warpgroup that runs rows 64-71 with the keys in M (mma.sync, wgmma m64n8): H x T = 72 takes one "
          "CTA per split instead of two, 144 two instead of three"),
    Param("COPY_LANES", (4, 8), 4,
          "lanes per key row in the key gather (a template value): 4, a 64-byte piece per lane group "
          "(two rows per quarter warp share bank groups: 2-way conflicts); 8, whole 128-byte lines and "
          "no conflicts, two rows per thread (measured: faster where many CTAs stream, slower at batch 1)"),
], rules=[
    ("draft_tokens", "T", "1 <= T <= 64", "the wgmma kernel supports 1..64 draft tokens (one int64 mask per row)"),
], nsplit_per_batch=True)


@declared(WGMMA_PARAMS)
class WgmmaParams:
    """Parameters of the wgmma kernel (`verify_wgmma.cu`, sm_90a): 32-key tiles, 4 key buffers,
    one CTA per SM (the 227 KB it fills), 64 or 72 query rows per CTA; fields, legal values,
    defaults and meanings: `WGMMA_PARAMS`."""


WGMMA_KM_PARAMS = Declaration("WgmmaKmParams", [
    Param("NSPLIT", range(1, 1025), 132,
          "key-range splits per row block across the batch (a launch-time value), cut as the cuda backend's "
          "NSPLIT is, in pieces of SPLIT_ALIGN keys; one CTA per SM, so NSPLIT x ceil(H x T / 72) near the SM "
          "count is one wave", launch=True),
    Param("DV_SPLIT", (0, 128, 192), 192,
          "value columns (of 512) whose O^T the S warpgroup accumulates beside S^T and the softmax (a template "
          "value); one PV warpgroup takes the rest, or, at 0, two take 256 each (four warpgroups, 512 threads) "
          "and the S warpgroup's path per tile is S^T and the softmax alone (256 would leave the PV warpgroup "
          "too few registers: it spills)"),
    Param("SPLIT_ALIGN", (32, 64), 64,
          "keys a split's length is a multiple of (a template value): 64, whole 64-key tiles; 32, twice the "
          "splits at short contexts, with an odd piece's last tile half empty"),
], rules=[
    ("draft_tokens", "T", "1 <= T <= 64", "the wgmma_km kernel supports 1..64 draft tokens (one int64 mask per row)"),
], nsplit_per_batch=True)


@declared(WGMMA_KM_PARAMS)
class WgmmaKmParams:
    """Parameters of the keys-in-M wgmma kernel (`verify_km.cu`, sm_90a): 64-key tiles in wgmma's M,
    72 query rows per CTA in N, a producer warpgroup, one CTA per SM; fields, legal values,
    defaults and meanings: `WGMMA_KM_PARAMS`."""


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM and per-block resources of one compute capability (bytes, threads, registers)."""

    smem_per_block: int
    smem_per_sm: int
    threads_per_sm: int
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    max_threads_per_block: int = 1024


#: What compile-check, static_reject and the device profiles (configs/devices) judge configs
#: against, per arch (opt-in dynamic shared memory per block).
ARCH_LIMITS: dict[str, ArchLimits] = {
    "sm_80": ArchLimits(smem_per_block=163 * 1024, smem_per_sm=164 * 1024, threads_per_sm=2048),
    "sm_86": ArchLimits(smem_per_block=99 * 1024, smem_per_sm=100 * 1024, threads_per_sm=1536),
    "sm_89": ArchLimits(smem_per_block=99 * 1024, smem_per_sm=100 * 1024, threads_per_sm=1536),
    "sm_90": ArchLimits(smem_per_block=227 * 1024, smem_per_sm=228 * 1024, threads_per_sm=2048),
    "sm_120": ArchLimits(smem_per_block=99 * 1024, smem_per_sm=100 * 1024, threads_per_sm=1536),
}


def arch_limits(arch: str) -> ArchLimits:
    if arch not in ARCH_LIMITS:
        raise ValueError(f"arch: no limits known for {arch!r}; known: {sorted(ARCH_LIMITS)}")
    return ARCH_LIMITS[arch]
