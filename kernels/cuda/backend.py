"""The CUDA backend: the NVRTC-compiled launch of `verify.cu`.

The kernel lives in `verify.cu` (split kernel + log-sum-exp merge, work balanced by keys
across the batch); `nvrtc.py` compiles it to CUBIN for the exact arch and caches it; its
parameters, the rules mirroring its static_asserts and the per-arch limits are declared in
`params.py`. This module mirrors the kernel's shared-memory layout and QK^T tiling, sizes its
workspace, judges a config statically for any arch (`static_reject`, no GPU needed) and
launches it on torch's current stream with no allocation and no host sync, so a CUDA graph
can capture it.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch

from ..backends import Backend, LaunchArgs
from ..devices import device_arch, device_sm_count, device_smem_per_block  # noqa: F401 (device_arch re-exported)
from ..shapes import VerifyProblem, cdiv
from .params import ARCH_LIMITS, CUDA_PARAMS, ArchLimits, CudaParams, arch_limits  # noqa: F401 (re-exported)

DK, DV = 576, 512
KV_BITS = 16  # the cached K/V element type (a template value of verify.cu): bf16; fp8 e4m3 comes next
MERGE_SPLIT_GROUPS = 16  # the merge kernel's SG: split groups merged in parallel per (row, head, 128 columns),
# 16 threads each (8 columns per thread)


def qk_tilings(p: CudaParams, T: int) -> list[tuple[int, int, int]]:
    """Every (QMT, QRG, QKS) tiling of S^T = K Q^T that verify.cu's Config accepts for `p` at
    T: QMT divides the key m16 tiles, the QRG row groups are all non-empty, QKS divides the 36
    k16 steps, and the tiling needs no more warps than the block has."""
    nt, kt = cdiv(p.HEADS_PER_BLOCK * T, 8), p.BLOCK_N // 16
    return [(qmt, qrg, qks) for qmt in (1, 2, 4) if kt % qmt == 0
            for qrg in range(1, nt + 1) if cdiv(nt, cdiv(nt, qrg)) == qrg
            for qks in (1, 2, 3, 4, 6, 9, 12, 18, 36) if (kt // qmt) * qrg * qks <= p.NUM_WARPS]


def qk_tiling(p: CudaParams, T: int) -> tuple[int, int, int]:
    """How the warps tile S^T = K Q^T (the kernel's QMT, QRG, QKS template values): QMT key
    m16 tiles per warp, QRG groups of the row n8 tiles, QKS slices of the 576-wide reduction.

    Every warp busy first (an idle warp leaves a tensor unit of its SM sub-partition idle),
    then the least shared-memory traffic per key: K is re-read once per row group, Q once
    per key group, and each slice writes and the softmax reads one fp32 S partial. The S
    accumulators must fit beside the O accumulator (QMT x row tiles per group x 4 registers)."""
    rows_pad = cdiv(p.HEADS_PER_BLOCK * T, 8) * 8
    nt, kt = rows_pad // 8, p.BLOCK_N // 16
    cap = min(255, 65536 // (p.threads * p.CTAS_PER_SM) // 8 * 8)
    budget = max(8, cap - (DV // 16 // p.NUM_WARPS) * nt * 4 - 52)
    legal = qk_tilings(p, T)
    def pick(budget):
        best = None
        for qmt, qrg, qks in legal:
            s_nt = cdiv(nt, qrg)
            if qmt * s_nt * 4 > budget:
                continue
            warps = (kt // qmt) * qrg * qks
            traffic = 2 * DK * qrg + 2 * DK * rows_pad // (16 * qmt) + 8 * rows_pad * qks
            key = (-warps, traffic, qmt * s_nt)
            if best is None or key < best[0]:
                best = (key, (qmt, qrg, qks))
        return best[1] if best else None
    # no tiling within the register budget: pick one regardless (static_reject then judges
    # the spills)
    return pick(budget) or pick(10 ** 9) or (1, 1, 1)


@dataclass(frozen=True)
class KernelGeometry:
    """Derived compile-time constants (mirror of `Config` in verify.cu)."""

    rows: int
    row_tiles: int
    acc_regs: int
    smem_bytes: int
    qk: tuple[int, int, int]   # (QMT, QRG, QKS), see qk_tiling

    @staticmethod
    def of(p: CudaParams, T: int) -> "KernelGeometry":
        rows = p.HEADS_PER_BLOCK * T
        nt = cdiv(rows, 8)
        rows_pad = nt * 8
        kpitch, ppitch, spitch = DK + 8, p.BLOCK_N + 8, p.BLOCK_N + 4
        qk = qk_tiling(p, T)
        smem = (rows_pad * kpitch * 2 + p.STAGES * p.BLOCK_N * kpitch * 2 + qk[2] * rows_pad * spitch * 4
                + rows_pad * ppitch * 2 + 2 * rows_pad * 4 + 2 * p.threads * 4)
        return KernelGeometry(rows=rows, row_tiles=nt, acc_regs=(DV // 16 // p.NUM_WARPS) * nt * 4, smem_bytes=smem,
                              qk=qk)


def split_expr(p: CudaParams, T: int) -> str:
    qmt, qrg, qks = qk_tiling(p, T)
    return (f"kvtune::verify_split_kernel<{p.VEC},{p.BLOCK_N},{p.NUM_WARPS},{p.HEADS_PER_BLOCK},{p.STAGES},{T},"
            f"{qmt},{qrg},{qks},{KV_BITS},{p.CTAS_PER_SM}>")


MERGE_EXPR = f"kvtune::verify_merge_kernel<{MERGE_SPLIT_GROUPS}>"


def module_name(p: CudaParams, T: int) -> str:
    """Readable cache name from every template value (NSPLIT is not one)."""
    qmt, qrg, qks = qk_tiling(p, T)
    return (f"verify_T{T}_VEC{p.VEC}_BN{p.BLOCK_N}_W{p.NUM_WARPS}_HPB{p.HEADS_PER_BLOCK}_S{p.STAGES}"
            f"_QK{qmt}x{qrg}x{qks}_KV{KV_BITS}_C{p.CTAS_PER_SM}_MSG{MERGE_SPLIT_GROUPS}")


def compile_params(p: CudaParams, T: int, arch: str):
    """Compile (or fetch) the module for `p` at T draft tokens on `arch` (no GPU needed)."""
    from .nvrtc import compile_module
    return compile_module(module_name(p, T), [split_expr(p, T), MERGE_EXPR], arch)


def check_static(p: CudaParams, T: int) -> None:
    """The kernel's static_asserts that depend on T (`CUDA_PARAMS`' rules), as ValueErrors
    naming the field."""
    CUDA_PARAMS.check_problem(vars(p), T=T, Dk=DK, Dv=DV)


# ---------------------------------------------------------------- kernel arguments (mirror verify.cu)

class _SplitArgs(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("indptr", ctypes.c_void_p),
                ("indices", ctypes.c_void_p), ("tree_mask", ctypes.c_void_p), ("part_o", ctypes.c_void_p),
                ("part_lse", ctypes.c_void_p), ("meta", ctypes.c_void_p), ("split_max_keys", ctypes.c_void_p),
                ("split_values", ctypes.c_void_p),
                ("q_stride_m", ctypes.c_int64), ("q_stride_h", ctypes.c_int64), ("kv_stride", ctypes.c_int64),
                ("qk_scale", ctypes.c_float),
                ("H", ctypes.c_int), ("B", ctypes.c_int), ("num_buckets", ctypes.c_int),
                ("grid_nsplit", ctypes.c_int), ("indices_64", ctypes.c_int), ("q_vec16", ctypes.c_int)]


class _MergeArgs(ctypes.Structure):
    _fields_ = [("part_o", ctypes.c_void_p), ("part_lse", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("lse", ctypes.c_void_p), ("meta", ctypes.c_void_p),
                ("out_stride_m", ctypes.c_int64), ("out_stride_h", ctypes.c_int64), ("lse_stride_m", ctypes.c_int64),
                ("H", ctypes.c_int), ("T", ctypes.c_int)]


# sizes static_assert'ed in verify.cu: a layout change on either side fails loudly
assert ctypes.sizeof(_SplitArgs) == 136 and ctypes.sizeof(_MergeArgs) == 72


def work_items(p, B: int) -> int:
    """Upper bound on the key-balanced schedule's work items per head group (the split
    grid's y): the kernel's chunk keeps sum_b ceil(L_b / chunk) <= max(NSPLIT, B). `p`: the
    parameters of a backend on verify.cu's schedule (CudaParams, WgmmaParams)."""
    return p.NSPLIT + B


def split_workspace_bytes(p, problem: VerifyProblem) -> int:
    """The workspace of a launch on verify.cu's schedule and merge: per work item the partial o
    in bf16 (half the split-K traffic of fp32) and lse in fp32 for its T x H rows; then the
    per-request (first item, count) table."""
    return work_items(p, problem.B) * problem.T * problem.H * (2 * problem.Dv + 4) + 8 * problem.B


def merge_shape(B: int, T: int, H: int) -> tuple[tuple, tuple]:
    """((grid x, y, z), (block x, y, z)) of the merge launch."""
    return (B * T * H, DV // 128, 1), (16 * MERGE_SPLIT_GROUPS, 1, 1)


def launch_shapes(p: CudaParams, B: int, T: int, H: int) -> tuple[tuple, tuple]:
    """((grid x, y, z), (block x, y, z)) of the split launch and of the merge launch."""
    return ((cdiv(H, p.HEADS_PER_BLOCK), work_items(p, B), 1), (p.threads, 1, 1)), merge_shape(B, T, H)


def pdl_enabled(arch: str) -> bool:
    """Programmatic dependent launch of the merge (sm_90 and newer) when KVTUNE_CUDA_PDL=1.
    Off by default: on the H200 it gained nothing (within 1.5%, slower as often as faster;
    results/kernel/v2/bench.csv, the "PDL off" rows)."""
    import os
    return int(arch.split("_")[1]) >= 90 and os.environ.get("KVTUNE_CUDA_PDL", "0") == "1"

LOG2E = 1.4426950408889634


def sm_count(problem: VerifyProblem, default: int = 132) -> int:
    """SMs of the problem's GPU, or `default` (an H100/H200's) when the problem is planned
    without one."""
    if not (problem.is_cuda and torch.cuda.is_available()):
        return default
    return device_sm_count(problem.device)


def nvrtc_unsupported(device: torch.device, archs_ok, need: str) -> str | None:
    """Why an NVRTC-compiled kernel cannot run on `device` (`archs_ok(arch)` says whether its
    arch can, `need` names what it needs), or None."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not archs_ok(device_arch(device)):
        return f"needs {need}, got {device_arch(device)}"
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError as e:
        return f"cuda-bindings missing: {e}"
    return None


def on_tensors_device(a: LaunchArgs, launch) -> None:
    """`launch()` in the context of the problem's GPU: the driver calls use the thread's current
    context, and the tensors may sit on another GPU than the current one."""
    idx = a.problem.device.index
    if idx is not None and idx != torch.cuda.current_device():
        with torch.cuda.device(idx):
            return launch()
    return launch()


class SplitMergeBackend(Backend):
    """What the NVRTC backends built on verify.cu's SplitArgs, schedule and merge share: their
    parameter type and the MLA widths checked before their own checks (`_check_kernel`), the
    split workspace, `static_reject`'s default arch before their own reasons (`_reject_on`), and
    the launch in the tensors' device context (`_launch`)."""

    def __init__(self):
        self._kernels: dict[tuple, object] = {}

    def check_params(self, params, problem: VerifyProblem) -> None:
        if not isinstance(params, self.params_type):
            raise ValueError(f"params: the {self.name} backend takes {self.params_type.__name__}, "
                             f"got {type(params).__name__}")
        if problem.Dk != DK or problem.Dv != DV:
            raise ValueError(f"{self.name} backend is built for Dk={DK}, Dv={DV} (kv_lora_rank 512 + rope 64); "
                             f"got Dk={problem.Dk}, Dv={problem.Dv}")
        self._check_kernel(params, problem)

    def _check_kernel(self, params, problem: VerifyProblem) -> None:
        """The backend's own checks of `params` against `problem` (ValueError)."""

    def workspace_bytes(self, problem: VerifyProblem, params) -> int:
        return split_workspace_bytes(params, problem)

    def static_reject(self, params, problem: VerifyProblem, arch: str | None = None) -> str | None:
        why = super().static_reject(params, problem)
        if why is not None:
            return why
        if arch is None:
            arch = device_arch(problem.device) if problem.is_cuda else "sm_90"
        return self._reject_on(params, problem, arch)

    def _reject_on(self, params, problem: VerifyProblem, arch: str) -> str | None:
        """Why `params` cannot build or fit on `arch` (compile error, spills, shared memory), or None."""
        return None

    def split_smem_bytes(self, params, T: int) -> int:
        """Dynamic shared memory per block that `params`' split kernel asks for at T."""
        raise NotImplementedError

    def _device_hint(self, T: int, limit: int, arch: str) -> str:
        """What runs instead on a device of `limit` bytes per block ('' for nothing to say)."""
        return ""

    def smem_reject(self, need: int, T: int, device: torch.device | int) -> str | None:
        """Why a split kernel of `need` bytes of shared memory per block cannot launch on the CUDA
        `device` (its own opt-in limit, an arch without an ARCH_LIMITS entry included), or None."""
        limit = device_smem_per_block(device)
        if need <= limit:
            return None
        arch = device_arch(device)
        hint = self._device_hint(T, limit, arch)
        return (f"params: {need} bytes of shared memory per block ({self.name} kernel) exceed this device's "
                f"{limit} ({arch})" + (f"; {hint}" if hint else ""))

    def device_reject(self, params, T: int, device: torch.device | int) -> str | None:
        """Why `params` cannot launch at T on the CUDA `device`, or None (the check every launch's
        first compile makes, and the untuned fallback's)."""
        return self.smem_reject(self.split_smem_bytes(params, T), T, device)

    def launch(self, a: LaunchArgs, params) -> None:
        on_tensors_device(a, lambda: launch_split_merge(a, self.split_launch(a, params)))

    def split_launch(self, a: LaunchArgs, params) -> SplitLaunch:
        """The kernels, shapes and merge of a launch of `params` for `a` (compiling on first use)."""
        raise NotImplementedError


class CudaBackend(SplitMergeBackend):
    name = "cuda"
    params_type = CudaParams

    # -- parameters
    def kernel_hash(self) -> str:
        from .nvrtc import kernel_source_hash
        return kernel_source_hash()

    def default_params(self, problem: VerifyProblem) -> CudaParams:
        # 72 query rows per CTA (8 heads at T=9): one key read feeds 9 row tiles. 8 warps hold
        # the 512 x 72 O accumulator in 144 registers each and leave room for 2-key-tile QK^T
        # warp tiles (half the shared-memory traffic per key of 16 warps; qk_tiling).
        # NSPLIT: about one CTA per SM.
        hpb = max(1, min(problem.H, 72 // problem.T))
        sms = sm_count(problem)
        arch = device_arch(problem.device) if problem.is_cuda and torch.cuda.is_available() else "sm_90"
        p = default_for_arch(problem.T, hpb, arch)
        # NSPLIT counts splits of the whole batch's keys per head group (key-balanced); rounded
        # down: one CTA over the SM count is a second wave (H 56 on 132 SMs: 7 x 19 = 133)
        return replace(p, NSPLIT=max(1, min(256, sms // cdiv(problem.H, p.HEADS_PER_BLOCK))))

    def _check_kernel(self, params: CudaParams, problem: VerifyProblem) -> None:
        check_static(params, problem.T)

    def _reject_on(self, params: CudaParams, problem: VerifyProblem, arch: str) -> str | None:
        return reject_reason(params, problem.T, arch)

    def fit_reject(self, params: CudaParams, T: int, arch: str, Dk: int = DK) -> str | None:
        return fit_reason(params, T, arch) if arch in ARCH_LIMITS else None

    def split_smem_bytes(self, params: CudaParams, T: int) -> int:
        return KernelGeometry.of(params, T).smem_bytes

    def _device_hint(self, T: int, limit: int, arch: str) -> str:
        return fit_hint(T, limit, arch)

    def supports(self, device: torch.device) -> str | None:
        return nvrtc_unsupported(device, lambda arch: int(arch.split("_")[1]) >= 80, "sm_80 or newer")

    # -- launch
    def _get(self, params: CudaParams, T: int, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = (params.VEC, params.BLOCK_N, params.NUM_WARPS, params.HEADS_PER_BLOCK, params.STAGES,
               params.CTAS_PER_SM, T, idx)
        got = self._kernels.get(key)
        if got is None:
            from .nvrtc import load_kernels
            why = self.device_reject(params, T, idx)
            if why:
                raise ValueError(why)
            arch = device_arch(idx)
            geo = KernelGeometry.of(params, T)
            mod = compile_params(params, T, arch)
            ks = load_kernels(mod, idx, {split_expr(params, T): geo.smem_bytes})
            got = (ks[split_expr(params, T)], ks[MERGE_EXPR], geo, pdl_enabled(arch))
            self._kernels[key] = got
        return got

    def split_launch(self, a: LaunchArgs, params: CudaParams) -> SplitLaunch:
        pb = a.problem
        split_k, merge_k, geo, pdl = self._get(params, pb.T, pb.device)
        split_shape, merge_launch = launch_shapes(params, pb.B, pb.T, pb.H)
        return SplitLaunch(params, split_k, split_shape, geo.smem_bytes, params.VEC, "use a smaller VEC",
                           work_items(params, pb.B), merge_k, "block", merge_launch, pdl)


@dataclass(frozen=True)
class SplitLaunch:
    """One config's launch on verify.cu's SplitArgs and merge, resolved for a call
    (`SplitMergeBackend.split_launch`): the split kernel and its ((grid), (block)), `smem` bytes of
    dynamic shared memory, `vec`-element key loads (`vec_hint` ends the error for KV rows they
    cannot read), its work items per head group, the merge kernel, its kind ("block": verify.cu's,
    "warp": verify_wgmma.cu's) and its ((grid), (block)), whether the merge may start early (PDL),
    and `chainable`: the split kernel takes a second argument (verify_km.cu's chained_meta) and
    can follow another split launch of one per-context dispatch, one merge after both."""
    params: object
    split_k: object
    split_shape: tuple
    smem: int
    vec: int
    vec_hint: str
    items: int
    merge_k: object
    merge_kind: str
    merge_launch: tuple
    pdl: bool
    chainable: bool = False


def _split_args(a: LaunchArgs, sl: SplitLaunch, part_o: int, part_lse: int, meta: int) -> _SplitArgs:
    pb, q, kv, st = a.problem, a.q, a.kv_cache, a.split_table
    if kv.stride(0) % sl.vec or kv.data_ptr() % (2 * sl.vec):
        raise ValueError(f"kv_cache: row stride {kv.stride(0)} / base address must be multiples of "
                         f"VEC={sl.vec} elements for {2 * sl.vec}-byte loads; {sl.vec_hint}")
    q_vec16 = int(q.data_ptr() % 16 == 0 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0)
    nb = st.num_buckets if st is not None else 0
    smk = st.max_keys.data_ptr() if st is not None else a.kv_indptr.data_ptr()
    sv = st.nsplit.data_ptr() if st is not None else a.kv_indptr.data_ptr()
    return _SplitArgs(q.data_ptr(), kv.data_ptr(), a.kv_indptr.data_ptr(), a.kv_indices.data_ptr(),
                      a.tree_mask.data_ptr(), part_o, part_lse, meta, smk, sv,
                      q.stride(0), q.stride(1), kv.stride(0), a.sm_scale * LOG2E,
                      pb.H, pb.B, nb, sl.params.NSPLIT, int(a.kv_indices.dtype == torch.int64), q_vec16)


def _layout(a: LaunchArgs, items: int) -> tuple[int, int, int]:
    """(part_o, part_lse, meta) addresses in the workspace for `items` work items per head group
    (split_workspace_bytes' layout)."""
    pb = a.problem
    n_rows = items * pb.T * pb.H   # partial rows
    base = a.workspace.data_ptr()
    return base, base + 2 * n_rows * pb.Dv, base + 2 * n_rows * pb.Dv + 4 * n_rows


def _launch_split(sl: SplitLaunch, sa: _SplitArgs, stream, chained_meta: int | None = None) -> None:
    """The split kernel with `sa`; `chained_meta` (a chainable launch only): None for a launch of
    its own (the pointer argument null), else the address of its own [B][2] meta, launched with
    programmatic serialization after the split launch before it."""
    from cuda.bindings import driver as drv
    from .nvrtc import check_driver
    if not sl.chainable:
        sp = (ctypes.c_void_p * 1)(ctypes.addressof(sa))
    else:
        cm = ctypes.c_void_p(chained_meta or 0)
        sp = (ctypes.c_void_p * 2)(ctypes.addressof(sa), ctypes.addressof(cm))
    if chained_meta is None:
        check_driver(drv.cuLaunchKernel(sl.split_k.function, *sl.split_shape[0], *sl.split_shape[1], sl.smem,
                                        stream, ctypes.addressof(sp), 0), "cuLaunchKernel(verify_split)")
    else:
        grid = tuple(v for dims in sl.split_shape for v in dims)
        check_driver(drv.cuLaunchKernelEx(_pdl_config(grid, stream, sl.smem), sl.split_k.function,
                                          ctypes.addressof(sp), 0), "cuLaunchKernelEx(verify_split, chained)")


def _launch_merge(a: LaunchArgs, sl: SplitLaunch, part_o: int, part_lse: int, meta: int, stream) -> None:
    from cuda.bindings import driver as drv
    from .nvrtc import check_driver
    pb, out, lse = a.problem, a.out, a.lse
    ma = _MergeArgs(part_o, part_lse, out.data_ptr(), lse.data_ptr() if lse is not None else 0, meta,
                    out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0, pb.H, pb.T)
    mp = (ctypes.c_void_p * 1)(ctypes.addressof(ma))
    merge_grid = tuple(v for dims in sl.merge_launch for v in dims)
    if sl.pdl:
        check_driver(drv.cuLaunchKernelEx(_pdl_config(merge_grid, stream), sl.merge_k.function,
                                          ctypes.addressof(mp), 0), "cuLaunchKernelEx(verify_merge)")
    else:
        check_driver(drv.cuLaunchKernel(sl.merge_k.function, *merge_grid, 0, stream, ctypes.addressof(mp), 0),
                     "cuLaunchKernel(verify_merge)")


def _stream(a: LaunchArgs):
    from cuda.bindings import driver as drv
    return drv.CUstream(torch.cuda.current_stream(a.problem.device).cuda_stream)


def launch_split_merge(a: LaunchArgs, sl: SplitLaunch) -> None:
    """Launch `sl`'s split kernel and then its merge on torch's current stream: no allocation, no
    host sync (a CUDA graph can capture it)."""
    part_o, part_lse, meta = _layout(a, sl.items)
    sa = _split_args(a, sl, part_o, part_lse, meta)
    stream = _stream(a)
    _launch_split(sl, sa, stream)
    _launch_merge(a, sl, part_o, part_lse, meta, stream)


def chain_order(launches: list[SplitLaunch]) -> list[int] | None:
    """The order in which a per-context dispatch's launches run as one chain (split kernels one
    after the other, one merge after the last), or None where they cannot: a chain needs every
    launch but the first chainable (the first is launched plainly, so any split kernel may lead).
    KVTUNE_DISPATCH_CHAIN=0 turns chains off (each launch with its own merge, the idle ones
    marking the meta)."""
    import os
    if len(launches) < 2 or os.environ.get("KVTUNE_DISPATCH_CHAIN", "1") == "0":
        return None
    plain = [i for i, sl in enumerate(launches) if not sl.chainable]
    if len(plain) > 1:
        return None
    return plain + [i for i, sl in enumerate(launches) if sl.chainable]


def chain_merge(launches: list[SplitLaunch]) -> SplitLaunch:
    """The launch whose merge a chain runs: any merge combines any launch's partials, and the one
    chosen for the most work items suits the most splits per request (the warp merge waits a round
    trip per 4 splits: 18 us at 132 splits where verify.cu's takes 4.8; wgmma.uses_warp_merge)."""
    return max(launches, key=lambda sl: sl.items)


def chain_workspace_bytes(problem: VerifyProblem, items: list[int]) -> int:
    """The workspace of a chain of launches with `items` work items each: one partial layout for
    the most items, then a [B][2] meta for each chained launch."""
    return max(items) * problem.T * problem.H * (2 * problem.Dv + 4) + 8 * problem.B * len(items)


def launch_dispatch(calls: list[tuple[LaunchArgs, SplitLaunch]]) -> None:
    """A per-context dispatch's launches (each (args, launch), the same call but for its split
    table): as one chain where `chain_order` allows (the idle split grids overlap the active one
    and one merge runs), else each split + merge in turn."""
    order = chain_order([sl for _, sl in calls])
    if order is None:
        for a, sl in calls:
            launch_split_merge(a, sl)
        return
    a0 = calls[0][0]
    part_o, part_lse, meta = _layout(a0, max(sl.items for _, sl in calls))
    scratch = meta + 8 * a0.problem.B
    stream = _stream(a0)
    for n, i in enumerate(order):
        a, sl = calls[i]
        _launch_split(sl, _split_args(a, sl, part_o, part_lse, meta), stream,
                      None if n == 0 else scratch + 8 * a.problem.B * (n - 1))
    _launch_merge(a0, chain_merge([sl for _, sl in calls]), part_o, part_lse, meta, stream)


def _pdl_config(grid: tuple, stream, smem: int = 0):
    """A launch config that lets the kernel start while the previous one on `stream` drains
    (it must griddepcontrol.wait before reading that kernel's results)."""
    from cuda.bindings import driver as drv
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = grid
    cfg.sharedMemBytes = smem
    cfg.hStream = stream
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


#: Archs whose 4-warp configs of one head build cleanly at T 41-48, the only T where 4 warps
#: alone bring the default under 99 KB: NVRTC 13 builds them without spills for sm_120, while for
#: sm_80/86/89 they take 255 registers and spill (tests/test_cuda_compile.py), so 99-KB sm_86 and
#: sm_89 stop at T 40.
FOUR_WARP_ARCHS = ("sm_120",)


def default_for_arch(T: int, heads_per_block: int, arch: str) -> CudaParams:
    """The default template values for `arch`: the sm_90 shape (32-key tiles, 2 stages),
    shrunk (16-key tiles, then fewer heads per CTA, then 4 warps on FOUR_WARP_ARCHS) until its
    shared memory fits the arch. Where even the smallest does not fit (sm_120 above T 48,
    sm_86/sm_89 above T 40), the smallest is returned and `fit_reason` says why it cannot run."""
    limit = ARCH_LIMITS[arch].smem_per_block if arch in ARCH_LIMITS else ARCH_LIMITS["sm_120"].smem_per_block
    p = CudaParams(VEC=8, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=heads_per_block, STAGES=2)
    if KernelGeometry.of(p, T).smem_bytes > limit:
        p = replace(p, BLOCK_N=16)
    while KernelGeometry.of(p, T).smem_bytes > limit and p.HEADS_PER_BLOCK > 1:
        p = replace(p, HEADS_PER_BLOCK=p.HEADS_PER_BLOCK // 2)
    if KernelGeometry.of(p, T).smem_bytes > limit:
        # 4 warps keep fewer per-warp partial-S buffers (T 41-48: 113.5 -> 101.0 KB)
        p = min(least_configs(T, arch), key=lambda q: KernelGeometry.of(q, T).smem_bytes, default=p)
    return p


def least_configs(T: int, arch: str) -> list[CudaParams]:
    """The smallest configs legal at T that build cleanly where they fit on `arch` (one head,
    16-key tiles, 2 stages; 8 warps, and 4 on FOUR_WARP_ARCHS)."""
    out = []
    for warps in (4, 8) if arch in FOUR_WARP_ARCHS else (8,):
        q = CudaParams(VEC=8, BLOCK_N=16, NUM_WARPS=warps, HEADS_PER_BLOCK=1, STAGES=2)
        try:
            check_static(q, T)
        except ValueError:
            continue
        out.append(q)
    return out


def fit_hint(T: int, limit: int, arch: str, where: str = "here") -> str:
    """What to change when a config's shared memory exceeds `limit` bytes at T on `arch`
    (`where`: the device or arch, for the message)."""
    need = min(KernelGeometry.of(q, T).smem_bytes for q in least_configs(T, arch))
    if need <= limit:
        return "use fewer STAGES, BLOCK_N, HEADS_PER_BLOCK or NUM_WARPS"
    return (f"no cuda config fits T={T} draft tokens {where} (the smallest that builds on {arch}, one head "
            f"and 16-key tiles, needs {need} B: the T query rows stay in shared memory); use fewer draft "
            "tokens or backend='triton'")


def reject_reason(params: CudaParams, T: int, arch: str) -> str | None:
    """Why `params` cannot run at T on `arch` (compile error, spills, smem/regs over the
    arch's limits), or None. Compiles with NVRTC on the CPU."""
    from .nvrtc import NvrtcError
    try:
        check_static(params, T)
    except ValueError as e:
        return str(e)
    why = fit_reason(params, T, arch)
    if why is not None:
        return why
    lim = arch_limits(arch)
    try:
        mod = compile_params(params, T, arch)
    except NvrtcError as e:
        return f"compile error on {arch}: {e}"
    res = mod.resources[split_expr(params, T)]
    if res.spills:
        return (f"register spills on {arch}: {res.spill_stores} B stores / {res.spill_loads} B loads "
                f"({res.registers} registers)")
    if res.registers * params.threads * params.CTAS_PER_SM > lim.regs_per_sm:
        return (f"{res.registers} registers x {params.threads} threads x {params.CTAS_PER_SM} CTAs exceed "
                f"{arch}'s {lim.regs_per_sm} per SM")
    return None


def fit_reason(params: CudaParams, T: int, arch: str) -> str | None:
    """Why `params` cannot fit `arch` at T before any compile (shared memory per block and per
    SM for CTAS_PER_SM CTAs, threads per SM), or None."""
    lim = arch_limits(arch)
    geo = KernelGeometry.of(params, T)
    if geo.smem_bytes > lim.smem_per_block:
        return (f"shared memory {geo.smem_bytes} B per block exceeds {arch}'s {lim.smem_per_block} B "
                f"(STAGES={params.STAGES}, BLOCK_N={params.BLOCK_N}, HEADS_PER_BLOCK={params.HEADS_PER_BLOCK})")
    if params.threads * params.CTAS_PER_SM > lim.threads_per_sm:
        return (f"{params.CTAS_PER_SM} CTAs x {params.threads} threads exceed {arch}'s {lim.threads_per_sm} "
                "per SM")
    # the driver reserves 1 KB of shared memory per resident CTA
    if params.CTAS_PER_SM > 1 and params.CTAS_PER_SM * (geo.smem_bytes + 1024) > lim.smem_per_sm:
        return (f"{params.CTAS_PER_SM} CTAs x {geo.smem_bytes} B of shared memory exceed {arch}'s "
                f"{lim.smem_per_sm} B per SM (CTAS_PER_SM={params.CTAS_PER_SM})")
    return None
