"""The wgmma_km backend: `verify_km.cu` (sm_90a: H100 / H200), the verify kernel with the keys in
wgmma's M dimension, compiled with NVRTC after `verify.cu` and `verify_wgmma.cu`, whose split
arguments, items schedule and merge kernels it shares.

One CTA per SM (227 KB of shared memory: Q, two 64-key buffers of the first 512 columns, one slot
for the last 64, P^T), 72 query rows per CTA in wgmma's N: a request's H x T rows take
ceil(H x T / 72) CTAs per work item (T 9: 72, 144, 288, 576 rows take 1, 2, 4, 8, no padding).
Three or four warpgroups: a producer that gathers the key tiles, one for S^T, the softmax and the
first DV_SPLIT value columns of O^T, one or two (DV_SPLIT 0) for the other value columns.
Measured on the H200 (results/kernel/wgmma-km/): 1.23-1.25x the wgmma kernel at batch 8 x 64k and
32 x 16k (74-75% of the floor), 0.76-0.89x at batch 1 below 128k; its loop takes 2.8 us per 64-key
tile per SM with no copies at all (HBM: 2.33), and DV_SPLIT 0 (verify_km.cu's comment expected the
PV under the next S^T) was slower than 128 and 192 at every shape. Its parameters:
`params.WGMMA_KM_PARAMS`.
"""
from __future__ import annotations

import torch

from ..backends import LaunchArgs
from ..shapes import VerifyProblem, cdiv
from .backend import (DK, DV, MERGE_EXPR, SplitLaunch, device_arch, pdl_enabled, sm_count,
                      work_items)
from .params import ARCH_LIMITS, WgmmaKmParams
from .wgmma import MERGE_WARP_EXPR, WGMMA_ARCHS, Sm90aBackend, _Loaded, sm90a_fit, sm90a_reject

#: the sources of its module, in order (nvrtc.SOURCE_PARTS)
PARTS = ("verify.cu", "verify_wgmma.cu", "verify_km.cu")
ROWS = 72        # query rows per CTA (wgmma's N)
TILE = 64        # keys per tile (wgmma's M)
#: mirror of km::SMEM_BYTES in verify_km.cu (the kernel traps if launched with less): Q's 9 panels,
#: two key buffers of 8 panels, the rope slot, P^T, the running max, factors and column maxima,
#: a flag, the item, three mbarriers
SMEM_BYTES = 9 * ROWS * 128 + 2 * 8 * TILE * 128 + TILE * 128 + ROWS * TILE * 2 + 3 * ROWS * 4 + 16 + 16 + 3 * 8


def threads(dv_split: int) -> int:
    """Threads per CTA (km::Roles<CA>::THREADS): the producer, the S warpgroup and one PV warpgroup,
    or two where the S warpgroup holds no value columns (DV_SPLIT 0)."""
    return 512 if dv_split == 0 else 384


def row_blocks(H: int, T: int) -> int:
    """CTAs per work item: the request's H x T query rows in blocks of 72."""
    return cdiv(H * T, ROWS)


def one_wave(H: int, T: int, sms: int) -> int:
    """NSPLIT for one wave: NSPLIT x row blocks CTAs, one resident per SM."""
    return max(1, min(256, sms // row_blocks(H, T)))


def split_expr(T: int, dv_split: int, align: int) -> str:
    return f"kvtune::verify_km_kernel<{T}, {dv_split // 64}, {align}>"


def module_name(T: int, dv_split: int, align: int) -> str:
    from .backend import MERGE_SPLIT_GROUPS
    return f"verify_km_T{T}_DV{dv_split}_A{align}_MSG{MERGE_SPLIT_GROUPS}"


def compile_km(T: int, arch: str = "sm_90", dv_split: int = 192, align: int = 64):
    """Compile (or fetch) the module for T draft tokens, `dv_split` value columns in the S
    warpgroup and splits in multiples of `align` keys (no GPU needed); `arch` must have wgmma."""
    from .nvrtc import compile_module
    if arch not in WGMMA_ARCHS:
        raise ValueError(f"arch: the wgmma_km kernel needs {' or '.join(WGMMA_ARCHS)}, got {arch}")
    for name, value in (("DV_SPLIT", dv_split), ("SPLIT_ALIGN", align)):
        bad = WgmmaKmParams.declaration.params[name].violation(value)
        if bad:
            raise ValueError(f"{name}: {bad}")
    return compile_module(module_name(T, dv_split, align),
                          [split_expr(T, dv_split, align), MERGE_EXPR, MERGE_WARP_EXPR], arch + "a", parts=PARTS)


class WgmmaKmBackend(Sm90aBackend):
    name = "wgmma_km"
    params_type = WgmmaKmParams
    parts = PARTS

    def default_params(self, problem: VerifyProblem) -> WgmmaKmParams:
        return WgmmaKmParams(NSPLIT=one_wave(problem.H, problem.T, sm_count(problem)))

    def _check_kernel(self, params: WgmmaKmParams, problem: VerifyProblem) -> None:
        WgmmaKmParams.declaration.check_problem(vars(params), T=problem.T, Dk=DK, Dv=DV)

    def _reject_on(self, params: WgmmaKmParams, problem: VerifyProblem, arch: str) -> str | None:
        return sm90a_reject(self.name, arch, SMEM_BYTES,
                            lambda: compile_km(problem.T, arch, params.DV_SPLIT, params.SPLIT_ALIGN),
                            (split_expr(problem.T, params.DV_SPLIT, params.SPLIT_ALIGN),))

    def fit_reject(self, params: WgmmaKmParams, T: int, arch: str, Dk: int = DK) -> str | None:
        return sm90a_fit(self.name, arch, SMEM_BYTES) if arch in ARCH_LIMITS else None

    def split_smem_bytes(self, params: WgmmaKmParams, T: int) -> int:
        return SMEM_BYTES

    def _get(self, T: int, device: torch.device, dv_split: int, align: int) -> _Loaded:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        got = self._kernels.get((T, dv_split, align, idx))
        if got is None:
            from .nvrtc import load_kernels
            why = self.smem_reject(SMEM_BYTES, T, idx)
            if why:
                raise ValueError(why)
            arch = device_arch(idx)
            expr = split_expr(T, dv_split, align)
            ks = load_kernels(compile_km(T, arch, dv_split, align), idx, {expr: SMEM_BYTES})
            got = _Loaded(ks[expr], ks[MERGE_EXPR], ks[MERGE_WARP_EXPR], pdl_enabled(arch))
            self._kernels[(T, dv_split, align, idx)] = got
        return got

    def split_launch(self, a: LaunchArgs, params: WgmmaKmParams) -> SplitLaunch:
        pb = a.problem
        k = self._get(pb.T, pb.device, params.DV_SPLIT, params.SPLIT_ALIGN)
        split_shape = ((row_blocks(pb.H, pb.T), work_items(params, pb.B), 1), (threads(params.DV_SPLIT), 1, 1))
        # chainable: verify_km_kernel's chained_meta (a per-context dispatch's later launch)
        return k.split_launch(params, pb, split_shape, SMEM_BYTES,
                              "the wgmma_km kernel's copies are 16 bytes: use the cuda backend with a smaller VEC",
                              chainable=True)
