"""The wgmma backend: `verify_wgmma.cu` (sm_90a: H100 / H200), compiled with NVRTC after
`verify.cu`, whose split arguments, key-balanced schedule and merge kernel it shares.

Its block shape is fixed by the shared memory it fills (64 query rows, four 32-key buffers,
225 KB: one CTA per SM); NSPLIT is its one parameter (`params.WGMMA_PARAMS`). A request's
H x T query rows take ceil(H x T / 64) CTAs per work item, each reading the item's keys: at T 9,
576 rows (H 64) waste nothing, 288 (H 32) pad to 320, 144 (H 16) to 192 and 72 (H 8) to 128.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import LaunchArgs
from ..shapes import VerifyProblem, cdiv
from .backend import (DK, DV, MERGE_EXPR, SplitMergeBackend, device_arch, launch_split_merge, nvrtc_unsupported,
                      pdl_enabled, sm_count, work_items)
from .params import ARCH_LIMITS, WgmmaParams

#: the sources of its module, in order (nvrtc.SOURCE_PARTS)
PARTS = ("verify.cu", "verify_wgmma.cu")
ROWS = 64       # query rows per CTA (wgmma's M)
THREADS = 256   # two warpgroups
#: mirror of wg::SMEM_BYTES in verify_wgmma.cu (the kernel traps if launched with less): Q, four
#: key buffers, two P buffers, the running max, two sets of rescale factors, both warpgroups' l,
#: the two rescale flags and the work item
SMEM_BYTES = ROWS * DK * 2 + 4 * 32 * DK * 2 + 2 * ROWS * 32 * 2 + ROWS * 4 + 2 * ROWS * 4 + 2 * ROWS * 4 + 2 * 4 + 16
#: the archs that have wgmma (sm_90a features; not sm_100 / sm_120)
WGMMA_ARCHS = ("sm_90",)


def row_blocks(H: int, T: int) -> int:
    """CTAs per work item: the request's H x T query rows in blocks of 64."""
    return cdiv(H * T, ROWS)


def split_expr(T: int) -> str:
    return f"kvtune::verify_wgmma_kernel<{T}>"


def module_name(T: int) -> str:
    from .backend import MERGE_SPLIT_GROUPS
    return f"verify_wgmma_T{T}_MSG{MERGE_SPLIT_GROUPS}"


def compile_wgmma(T: int, arch: str = "sm_90"):
    """Compile (or fetch) the module for T draft tokens (no GPU needed); `arch` must have wgmma."""
    from .nvrtc import compile_module
    if arch not in WGMMA_ARCHS:
        raise ValueError(f"arch: the wgmma kernel needs {' or '.join(WGMMA_ARCHS)}, got {arch}")
    return compile_module(module_name(T), [split_expr(T), MERGE_EXPR], arch + "a", parts=PARTS)


@dataclass
class _Loaded:
    split: object
    merge: object
    pdl: bool


class WgmmaBackend(SplitMergeBackend):
    name = "wgmma"
    params_type = WgmmaParams

    def kernel_hash(self) -> str:
        from .nvrtc import kernel_source_hash
        return kernel_source_hash(PARTS)

    def default_params(self, problem: VerifyProblem) -> WgmmaParams:
        # one wave: NSPLIT x row blocks CTAs, one resident per SM (a 136th CTA on 132 SMs doubles
        # the time)
        sms = sm_count(problem)
        return WgmmaParams(NSPLIT=max(1, min(256, sms // row_blocks(problem.H, problem.T))))

    def _check_kernel(self, params: WgmmaParams, problem: VerifyProblem) -> None:
        WgmmaParams.declaration.check_problem(vars(params), T=problem.T, Dk=DK, Dv=DV)

    def _reject_on(self, params: WgmmaParams, problem: VerifyProblem, arch: str) -> str | None:
        if arch not in WGMMA_ARCHS:
            return f"the wgmma kernel needs sm_90 (H100 / H200); {arch} has no wgmma"
        if SMEM_BYTES > ARCH_LIMITS[arch].smem_per_block:
            return f"shared memory {SMEM_BYTES} B per block exceeds {arch}'s {ARCH_LIMITS[arch].smem_per_block} B"
        from .nvrtc import NvrtcError
        try:
            mod = compile_wgmma(problem.T, arch)
        except NvrtcError as e:
            return f"compile error on {arch}a: {e}"
        res = mod.resources[split_expr(problem.T)]
        if res.spills:
            return f"register spills on {arch}a: {res.spill_stores} B stores / {res.spill_loads} B loads"
        return None

    def supports(self, device: torch.device) -> str | None:
        return nvrtc_unsupported(device, lambda arch: arch in WGMMA_ARCHS, "wgmma (sm_90: H100 / H200)")

    def _get(self, T: int, device: torch.device) -> _Loaded:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        got = self._kernels.get((T, idx))
        if got is None:
            from .nvrtc import load_kernels
            arch = device_arch(idx)
            limit = torch.cuda.get_device_properties(idx).shared_memory_per_block_optin
            if SMEM_BYTES > limit:
                raise ValueError(f"wgmma: {SMEM_BYTES} bytes of shared memory per block exceed this device's {limit}")
            ks = load_kernels(compile_wgmma(T, arch), idx, {split_expr(T): SMEM_BYTES})
            got = _Loaded(ks[split_expr(T)], ks[MERGE_EXPR], pdl_enabled(arch))
            self._kernels[(T, idx)] = got
        return got

    def _launch(self, a: LaunchArgs, params: WgmmaParams) -> None:
        pb = a.problem
        k = self._get(pb.T, pb.device)
        split_shape = ((row_blocks(pb.H, pb.T), work_items(params, pb.B), 1), (THREADS, 1, 1))
        launch_split_merge(a, params, k.split, split_shape, SMEM_BYTES, k.merge, k.pdl, 8,
                           "the wgmma kernel's copies are 16 bytes: use the cuda backend with a smaller VEC")
