"""The wgmma backend: `verify_wgmma.cu` (sm_90a: H100 / H200), compiled with NVRTC after
`verify.cu`, whose split arguments, key-balanced schedule and block merge kernel it shares; a
launch whose requests hold few splits merges with `verify_wgmma.cu`'s warp merge instead
(`uses_warp_merge`).

Its key tiling is fixed by the shared memory it fills (four 32-key buffers, 225 KB: one CTA per
SM); NSPLIT and ROWS are its parameters (`params.WGMMA_PARAMS`). A request's H x T query rows take
ceil(H x T / ROWS) CTAs per work item, each reading the item's keys. With ROWS 64 at T 9, 576
rows (H 64) waste nothing, 288 (H 32) pad to 320, 144 (H 16) to 192 and 72 (H 8) to 128; ROWS 72
adds a third warpgroup for rows 64-71 (keys in M: 8 rows cost 8 rows), so 72, 144, 288 and 576
rows take 1, 2, 4 and 8 CTAs per split.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..backends import LaunchArgs
from ..shapes import VerifyProblem, cdiv
from .backend import (DK, DV, MERGE_EXPR, SplitLaunch, SplitMergeBackend, device_arch,
                      merge_shape, nvrtc_unsupported, pdl_enabled, sm_count, work_items)
from .params import ARCH_LIMITS, WgmmaParams

#: the sources of its module, in order (nvrtc.SOURCE_PARTS)
PARTS = ("verify.cu", "verify_wgmma.cu")
ROWS = 64       # query rows of the two main warpgroups (wgmma's M)
TAIL_ROWS = 8   # rows 64-71 of the tail warpgroup (ROWS 72)


#: verify_wgmma.cu's choice between its two schedules (items / key ranges) weighs each request
#: boundary inside a range as this many key tiles; patched, it forces one schedule.
_RESTART_DECL = re.compile(r"constexpr int RANGE_RESTART_TILES = (-?\d+);")
#: the patched values: items always (no range ever wins), or ranges whenever B >= 2
FORCED_RESTART_TILES = {"items": 10**6, "ranges": -10**6}


def restart_tiles(source: str) -> int:
    """RANGE_RESTART_TILES as `source` (verify_wgmma.cu's text) declares it."""
    found = _RESTART_DECL.findall(source)
    if len(found) != 1:
        raise ValueError(f"verify_wgmma.cu declares RANGE_RESTART_TILES {len(found)} times, not once")
    return int(found[0])


def forced_schedule(source: str, schedule: str) -> str:
    """`source` (verify_wgmma.cu's text) with its schedule forced: "items" always, or "ranges"
    whenever a batch holds two requests or more (batch 1 always runs items). For tests and
    `scripts/time_phases.py`, compiled in memory through `nvrtc.source_override`."""
    if schedule not in FORCED_RESTART_TILES:
        raise ValueError(f"schedule: 'items' or 'ranges', got {schedule!r}")
    restart_tiles(source)
    return _RESTART_DECL.sub(f"constexpr int RANGE_RESTART_TILES = {FORCED_RESTART_TILES[schedule]};", source)


def _main_bytes(npb: int) -> int:
    """Q, four key buffers, npb P buffers, the running max, npb sets of rescale factors, both
    warpgroups' l, npb rescale flags and the schedule's 8 ints (the segment, R, the cursor)."""
    return ROWS * DK * 2 + 4 * 32 * DK * 2 + npb * ROWS * 32 * 2 + ROWS * 4 + npb * ROWS * 4 + 2 * ROWS * 4 \
        + npb * 4 + 32


#: mirror of wg::Layout<0>::SMEM_BYTES in verify_wgmma.cu (the kernel traps if launched with less)
SMEM_BYTES = _main_bytes(2)
#: wg::Layout<8>::SMEM_BYTES: one P buffer, then the tail's (from a 16-byte boundary): its S^T
#: quarters, two P^T buffers, maxima, factors, l, and 2 x 4 mbarriers
SMEM_BYTES_TAIL = cdiv(_main_bytes(1), 16) * 16 + 4 * 2 * 32 * 16 + 2 * 32 * TAIL_ROWS * 2 + 2 * TAIL_ROWS * 4 \
    + TAIL_ROWS * 4 + 2 * TAIL_ROWS * 4 + 2 * 4 * 8


def threads(rows: int) -> int:
    """Threads per CTA: two warpgroups, a third for the tail rows."""
    return 256 if rows == ROWS else 384


def smem_bytes(rows: int) -> int:
    """Dynamic shared memory per CTA for `rows` query rows (wg::SMEM_BYTES or wg::SMEM_BYTES_XR)."""
    return SMEM_BYTES if rows == ROWS else SMEM_BYTES_TAIL


#: the archs that have wgmma (sm_90a features; not sm_100 / sm_120)
WGMMA_ARCHS = ("sm_90",)


def row_blocks(H: int, T: int, rows: int = ROWS) -> int:
    """CTAs per work item: the request's H x T query rows in blocks of `rows`."""
    return cdiv(H * T, rows)


def default_rows(H: int, T: int) -> int:
    """72 where the tail warpgroup saves a third of the row blocks or more (H x T = 65-72: 1 block
    instead of 2, 129-144: 2 instead of 3); 64 elsewhere. Measured on the H200 at T 9, 128k keys
    (results/kernel/wgmma/tail-warpgroup/): 72 rows H 8 1.27x, H 16 1.02x; at H 64 (8 blocks instead of 9) the
    tail's MMAs cost more than the block they save (463 vs 398 us)."""
    return ROWS + TAIL_ROWS if 2 * row_blocks(H, T) >= 3 * row_blocks(H, T, ROWS + TAIL_ROWS) else ROWS


def one_wave(H: int, T: int, rows: int, sms: int) -> int:
    """NSPLIT for one wave: NSPLIT x row blocks CTAs, one resident per SM (a 136th CTA on 132 SMs
    doubles the time)."""
    return max(1, min(256, sms // row_blocks(H, T, rows)))


#: lanes per key row in the gather when not given: WgmmaParams.COPY_LANES's declared default
COPY_LANES = WgmmaParams.declaration.params["COPY_LANES"].default


def split_expr(T: int, rows: int = ROWS, lanes: int = COPY_LANES, b1: bool = False) -> str:
    """The split kernel's name expression; `b1`: the instantiation for launches of one request,
    which copies Q while the schedule runs (verify_wgmma.cu's B1)."""
    return f"kvtune::verify_wgmma_kernel<{T}, {rows - ROWS}, {lanes}, {int(b1)}>"


def split_exprs(T: int, rows: int = ROWS, lanes: int = COPY_LANES) -> tuple[str, str]:
    """Both instantiations of the split kernel a module holds: any batch, then batch 1."""
    return split_expr(T, rows, lanes), split_expr(T, rows, lanes, b1=True)


def module_name(T: int, rows: int = ROWS, lanes: int = COPY_LANES) -> str:
    from .backend import MERGE_SPLIT_GROUPS
    return f"verify_wgmma_T{T}_R{rows}_CL{lanes}_MSG{MERGE_SPLIT_GROUPS}"


def compile_wgmma(T: int, arch: str = "sm_90", rows: int = ROWS, lanes: int = COPY_LANES):
    """Compile (or fetch) the module for T draft tokens, `rows` query rows per CTA and `lanes`
    lanes per key row in the gather (no GPU needed); `arch` must have wgmma."""
    from .nvrtc import compile_module
    if arch not in WGMMA_ARCHS:
        raise ValueError(f"arch: the wgmma kernel needs {' or '.join(WGMMA_ARCHS)}, got {arch}")
    if rows not in (ROWS, ROWS + TAIL_ROWS):
        raise ValueError(f"rows: the wgmma kernel takes {ROWS} or {ROWS + TAIL_ROWS} query rows per CTA, got {rows}")
    bad = WgmmaParams.declaration.params["COPY_LANES"].violation(lanes)
    if bad:
        raise ValueError(f"lanes (COPY_LANES): {bad}")
    return compile_module(module_name(T, rows, lanes), [*split_exprs(T, rows, lanes), MERGE_EXPR, MERGE_WARP_EXPR],
                          arch + "a", parts=PARTS)


#: verify_wgmma.cu's merge with a warp per (row, head) pair
MERGE_WARP_EXPR = "kvtune::verify_merge_warp_kernel"
#: the warp merge serves launches whose requests hold at most this many work items on average
#: (max(NSPLIT, B) / B): it waits one load round trip per 4 splits, where verify.cu's merge
#: spreads a pair's splits over 16 groups but runs 4 x B x T x H blocks of two barriers each.
#: Measured at H 8 / 16, split + merge (results/kernel/wgmma/batch-merge/): 33 splits per request
#: (batch 4 at NSPLIT 132) 50.96 us warp against 53.01 block; 44 (batch 3) 40.71 against 42.93;
#: 66 (H 16, batch 1) 85.01 against 79.40; 132: 63.62 against 47.29. The crossing lies between
#: 44 and 66.
WARP_MERGE_MAX_SPLITS = 48


def uses_warp_merge(NSPLIT: int, B: int) -> bool:
    """Whether a launch of `B` requests at `NSPLIT` merges with verify_merge_warp_kernel."""
    return cdiv(max(NSPLIT, B), B) <= WARP_MERGE_MAX_SPLITS


def merge_warp_shape(B: int, T: int, H: int) -> tuple[tuple, tuple]:
    """((grid x, y, z), (block x, y, z)) of the warp merge: a block per row and 8 heads."""
    return (B * T, cdiv(H, 8), 1), (256, 1, 1)


def sm90a_fit(kernel: str, arch: str, smem: int) -> str | None:
    """Why a kernel of the sm_90a backends cannot fit `arch` before any compile: no wgmma there,
    or `smem` bytes per block over the arch's; or None."""
    if arch not in WGMMA_ARCHS:
        return f"the {kernel} kernel needs sm_90 (H100 / H200); {arch} has no wgmma"
    if smem > ARCH_LIMITS[arch].smem_per_block:
        return f"shared memory {smem} B per block exceeds {arch}'s {ARCH_LIMITS[arch].smem_per_block} B"
    return None


def sm90a_reject(kernel: str, arch: str, smem: int, build, exprs: tuple[str, ...]) -> str | None:
    """Why a kernel of the sm_90a backends (`kernel`: its backend's name) cannot run on `arch`: no
    wgmma there, `smem` bytes per block over the arch's, a compile error or spills of any of
    `exprs` (the split kernels a launch may use) in the module `build()` compiles; or None."""
    why = sm90a_fit(kernel, arch, smem)
    if why is not None:
        return why
    from .nvrtc import NvrtcError
    try:
        mod = build()
    except NvrtcError as e:
        return f"compile error on {arch}a: {e}"
    for expr in exprs:
        res = mod.resources[expr]
        if res.spills:
            return f"register spills on {arch}a: {res.spill_stores} B stores / {res.spill_loads} B loads ({expr})"
    return None


@dataclass
class _Loaded:
    split: object
    merge: object
    merge_warp: object
    pdl: bool
    split_b1: object = None   # the instantiation for one request (verify_wgmma.cu's B1); None: `split`

    def split_for(self, B: int) -> object:
        """The split kernel a launch of `B` requests runs."""
        return self.split_b1 if B == 1 and self.split_b1 is not None else self.split

    def merge_for(self, NSPLIT: int, B: int, T: int, H: int) -> tuple[object, tuple | None]:
        """The merge kernel a launch of `B` requests at `NSPLIT` uses, and its (grid, block), or
        None for verify.cu's merge_shape."""
        if uses_warp_merge(NSPLIT, B):
            return self.merge_warp, merge_warp_shape(B, T, H)
        return self.merge, None

    def split_launch(self, params, pb: VerifyProblem, split_shape: tuple, smem: int, vec_hint: str,
                     chainable: bool = False) -> SplitLaunch:
        """The launch of `params` for problem `pb` on these kernels, with the merge of `merge_for`."""
        merge_k, shape = self.merge_for(params.NSPLIT, pb.B, pb.T, pb.H)
        kind = "block" if shape is None else "warp"
        shape = shape or merge_shape(pb.B, pb.T, pb.H)
        return SplitLaunch(params, self.split_for(pb.B), split_shape, smem, 8, vec_hint, work_items(params, pb.B),
                           merge_k, kind, shape, self.pdl, chainable)


class Sm90aBackend(SplitMergeBackend):
    """What the sm_90a backends share: a kernel hash of their module's source parts (`parts`),
    and the GPUs they run on (those with wgmma)."""
    parts: tuple[str, ...] = PARTS

    def kernel_hash(self) -> str:
        from .nvrtc import kernel_source_hash
        return kernel_source_hash(self.parts)

    def supports(self, device: torch.device) -> str | None:
        return nvrtc_unsupported(device, lambda arch: arch in WGMMA_ARCHS, "wgmma (sm_90: H100 / H200)")

    def _device_hint(self, T: int, limit: int, arch: str) -> str:
        return "backend='cuda' has configs for smaller shared memory"


class WgmmaBackend(Sm90aBackend):
    name = "wgmma"
    params_type = WgmmaParams

    def default_params(self, problem: VerifyProblem) -> WgmmaParams:
        rows = default_rows(problem.H, problem.T)
        return WgmmaParams(NSPLIT=one_wave(problem.H, problem.T, rows, sm_count(problem)), ROWS=rows)

    def _check_kernel(self, params: WgmmaParams, problem: VerifyProblem) -> None:
        WgmmaParams.declaration.check_problem(vars(params), T=problem.T, Dk=DK, Dv=DV)

    def _reject_on(self, params: WgmmaParams, problem: VerifyProblem, arch: str) -> str | None:
        return sm90a_reject(self.name, arch, smem_bytes(params.ROWS),
                            lambda: compile_wgmma(problem.T, arch, params.ROWS, params.COPY_LANES),
                            split_exprs(problem.T, params.ROWS, params.COPY_LANES))

    def fit_reject(self, params: WgmmaParams, T: int, arch: str, Dk: int = DK) -> str | None:
        return sm90a_fit(self.name, arch, smem_bytes(params.ROWS)) if arch in ARCH_LIMITS else None

    def split_smem_bytes(self, params: WgmmaParams, T: int) -> int:
        return smem_bytes(params.ROWS)

    def _get(self, T: int, rows: int, device: torch.device, lanes: int = COPY_LANES) -> _Loaded:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        got = self._kernels.get((T, rows, lanes, idx))
        if got is None:
            from .nvrtc import load_kernels
            smem = smem_bytes(rows)
            why = self.smem_reject(smem, T, idx)
            if why:
                raise ValueError(why)
            arch = device_arch(idx)
            any_b, one_b = split_exprs(T, rows, lanes)
            ks = load_kernels(compile_wgmma(T, arch, rows, lanes), idx, {any_b: smem, one_b: smem})
            got = _Loaded(ks[any_b], ks[MERGE_EXPR], ks[MERGE_WARP_EXPR], pdl_enabled(arch), ks[one_b])
            self._kernels[(T, rows, lanes, idx)] = got
        return got

    def split_launch(self, a: LaunchArgs, params: WgmmaParams) -> SplitLaunch:
        pb = a.problem
        rows = params.ROWS
        k = self._get(pb.T, rows, pb.device, params.COPY_LANES)
        split_shape = ((row_blocks(pb.H, pb.T, rows), work_items(params, pb.B), 1), (threads(rows), 1, 1))
        return k.split_launch(params, pb, split_shape, smem_bytes(rows),
                              "the wgmma kernel's copies are 16 bytes: use the cuda backend with a smaller VEC")
