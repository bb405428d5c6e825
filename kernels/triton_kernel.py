"""Triton reference kernel for MLA verify attention: split-K flash-decode.

Reads top to bottom: stage 1 (one key range of one request for a group of
heads, all `heads x T` query rows folded into one tile so each key row is loaded once per
split and head group), stage 2 (log-sum-exp merge of the NSPLIT partials), the launcher and
the backend.
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import torch
import triton
import triton.language as tl

from .backends import Backend, LaunchArgs
from .devices import device_sm_count, device_smem_per_block
from .shapes import VerifyProblem, cdiv, next_pow2
from .triton_compat import fix_interpreter_index
from .triton_params import TRITON_PARAMS, TritonParams

LOG2E = 1.4426950408889634


@triton.jit
def _num_splits(L, SplitMaxKeys, SplitValues, NSPLIT: tl.constexpr, NUM_BUCKETS: tl.constexpr):
    """NSPLIT of a request with L keys: the grid's, or the first bucket with L <= bound."""
    if NUM_BUCKETS == 0:
        n = NSPLIT
    else:
        n = tl.load(SplitValues + NUM_BUCKETS - 1)
        for i in tl.static_range(NUM_BUCKETS - 1, -1, -1):
            if L <= tl.load(SplitMaxKeys + i):
                n = tl.load(SplitValues + i)
        n = tl.minimum(tl.maximum(n, 1), NSPLIT)
    return n


@triton.jit
def _verify_split_kernel(
    Q, KV, Indptr, Indices, Mask, PartO, PartLse, SplitMaxKeys, SplitValues,
    qk_scale,                                   # sm_scale * log2(e): softmax in base 2
    stride_qm, stride_qh, stride_kv,
    stride_ps, stride_pm, stride_ph,            # partial o [NSPLIT, B*T, H, DV] (last dim 1)
    stride_ls, stride_lm,                       # partial lse [NSPLIT, B*T, H] (last dim 1)
    H,
    T: tl.constexpr, HEADS_PER_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DV: tl.constexpr, DPE: tl.constexpr, NSPLIT: tl.constexpr, NUM_BUCKETS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= HEADS_PER_BLOCK * T)
    tl.static_assert(BLOCK_M >= 16)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_hg = tl.cdiv(H, HEADS_PER_BLOCK)
    b = pid // num_hg
    hg = pid % num_hg

    kv_start = tl.load(Indptr + b)
    L = tl.load(Indptr + b + 1) - kv_start
    P = L - T                                    # prefix keys; draft key d sits at P + d
    nsplit = _num_splits(L, SplitMaxKeys, SplitValues, NSPLIT, NUM_BUCKETS)
    chunk = tl.cdiv(tl.cdiv(L, nsplit), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)
    hi = tl.where(split < nsplit, hi, lo)        # splits past this request's NSPLIT are empty

    # -- fold the heads x T query rows of this head group into one tile of BLOCK_M rows
    rows = tl.arange(0, BLOCK_M)
    h_loc = rows // T
    t = rows % T
    head = hg * HEADS_PER_BLOCK + h_loc
    row_ok = (rows < HEADS_PER_BLOCK * T) & (head < H)
    qrow = b * T + t
    offs_dv = tl.arange(0, DV)
    offs_pe = tl.arange(0, DPE)
    q_base = Q + qrow[:, None] * stride_qm + head[:, None] * stride_qh
    q_nope = tl.load(q_base + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_base + DV + offs_pe[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:  # the interpreter's bf16 tl.dot is wrong; fp32 is exact there
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    tree_bits = tl.load(Mask + qrow, mask=row_ok, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        slot = tl.load(Indices + kv_start + offs_n, mask=n_ok, other=0).to(tl.int64)
        k_base = KV + slot[None, :] * stride_kv
        k_nope = tl.load(k_base + offs_dv[:, None], mask=n_ok[None, :], other=0.0)    # [DV, BLOCK_N]
        k_pe = tl.load(k_base + DV + offs_pe[:, None], mask=n_ok[None, :], other=0.0)  # [DPE, BLOCK_N]
        if UPCAST:
            k_nope = k_nope.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        qk = tl.dot(q_nope, k_nope)
        qk = tl.dot(q_pe, k_pe, qk)
        qk = qk * qk_scale
        # -- tree mask: the prefix is always visible, draft key d only if bit d is set
        d = offs_n - P
        draft_ok = ((tree_bits[:, None] >> tl.maximum(d, 0)[None, :].to(tl.int64)) & 1) != 0
        visible = ((d < 0)[None, :] | draft_ok) & n_ok[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        # -- online softmax: update m_i and l_i (rows with nothing visible yet stay at -inf)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- acc += P V; V is the first DV columns of the key rows already loaded
        v = tl.trans(k_nope)
        if start_n + BLOCK_N > P:
            # draft keys: a row that may not see one gives it p = 0, and 0 * NaN would still
            # poison that row; a row that sees it gets the NaN through its logit anyway
            v = tl.where(v == v, v, tl.zeros_like(v))
        if UPCAST:
            acc = tl.dot(p, v, acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    # -- partial result of this split: normalised o and lse (natural log); empty -> 0, -inf;
    # a row that read a NaN has l_i = NaN, which must stay NaN in o and lse (not count as empty)
    empty = l_i == 0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
    po = PartO + split * stride_ps + qrow[:, None] * stride_pm + head[:, None] * stride_ph + offs_dv[None, :]
    tl.store(po, o, mask=row_ok[:, None])
    tl.store(PartLse + split * stride_ls + qrow * stride_lm + head, lse, mask=row_ok)


@triton.jit
def _verify_merge_kernel(
    PartO, PartLse, Out, Lse, Indptr, SplitMaxKeys, SplitValues,
    stride_ps, stride_pm, stride_ph, stride_ls, stride_lm,
    stride_om, stride_oh, stride_lsm,
    H,
    T: tl.constexpr, DV: tl.constexpr, NSPLIT: tl.constexpr, NUM_BUCKETS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    m = tl.program_id(0)
    h = tl.program_id(1)
    b = m // T
    L = tl.load(Indptr + b + 1) - tl.load(Indptr + b)
    nsplit = _num_splits(L, SplitMaxKeys, SplitValues, NSPLIT, NUM_BUCKETS)
    offs_dv = tl.arange(0, DV)
    # -- merge the partials by log-sum-exp; empty splits carry lse = -inf and weigh nothing
    m_run = float("-inf")
    s_run = 0.0
    acc = tl.zeros([DV], tl.float32)
    for s in range(0, nsplit):
        lse_s = tl.load(PartLse + s * stride_ls + m * stride_lm + h)
        m_new = tl.maximum(m_run, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_old = tl.exp(m_run - m_safe)
        w_s = tl.exp(lse_s - m_safe)
        o_s = tl.load(PartO + s * stride_ps + m * stride_pm + h * stride_ph + offs_dv)
        acc = acc * w_old + o_s * w_s
        s_run = s_run * w_old + w_s
        m_run = m_new
    empty = s_run == 0   # NaN (a split that read a NaN) is not empty: it stays NaN
    o = acc / tl.where(empty, 1.0, s_run)
    tl.store(Out + m * stride_om + h * stride_oh + offs_dv, o.to(Out.dtype.element_ty))
    if WRITE_LSE:
        lse = tl.where(empty, float("-inf"), m_run + tl.log(tl.where(empty, 1.0, s_run)))
        tl.store(Lse + m * stride_lsm + h, lse)


def kernel_source_hash() -> str:
    """sha256[:16] of this file: the Triton kernel's identity in exported provenance."""
    import hashlib
    return hashlib.sha256(open(__file__, "rb").read()).hexdigest()[:16]


def _interpreting() -> bool:
    """Whether the kernels run under Triton's interpreter: decided when triton.jit wrapped
    them (TRITON_INTERPRET at import time), whatever the environment says now."""
    return type(_verify_split_kernel).__name__ == "InterpretedFunction"


if _interpreting():   # Triton 3.4-3.6's interpreter under NumPy >= 2.4 (triton_compat.py)
    fix_interpreter_index()


def partials(problem: VerifyProblem, nsplit: int, workspace: torch.Tensor):
    """Views of the workspace: partial o `[NSPLIT, B*T, H, Dv]` fp32 and lse `[NSPLIT, B*T, H]` fp32."""
    n_o = nsplit * problem.rows * problem.H * problem.Dv
    n_l = nsplit * problem.rows * problem.H
    ws = workspace.view(torch.uint8)[: 4 * (n_o + n_l)].view(torch.float32)
    return (ws[:n_o].view(nsplit, problem.rows, problem.H, problem.Dv),
            ws[n_o:].view(nsplit, problem.rows, problem.H))


class TritonBackend(Backend):
    name = "triton"
    params_type = TritonParams

    def kernel_hash(self) -> str:
        return kernel_source_hash()

    def supports(self, device: torch.device) -> str | None:
        if device.type == "cpu" and not _interpreting():
            return ("Triton compiles for a GPU and these are CPU tensors; to run it on the CPU, set "
                    "TRITON_INTERPRET=1 in the environment before Python starts (Triton reads it when the "
                    "kernels are imported), e.g. `TRITON_INTERPRET=1 python ...`")
        return None

    def default_params(self, problem: VerifyProblem) -> TritonParams:
        # at most 32 query rows per tile (32 x 512 fp32 accumulators over 8 warps stay in
        # registers); enough splits for about one program per SM (16 without a GPU); 16-key
        # tiles where 32 do not fit the GPU's shared memory (sm_120 from T 33: 64 padded rows)
        block_h = max(1, min(problem.H, 32 // problem.T))
        sms = device_sm_count(problem.device) or 64
        progs = problem.B * cdiv(problem.H, block_h)
        nsplit = min(128, next_pow2(max(1, sms // progs)))
        p = TritonParams(NSPLIT=nsplit, BLOCK_N=32, HEADS_PER_BLOCK=block_h, NUM_WARPS=8, STAGES=2)
        if problem.is_cuda and p.smem_bytes(problem.T, problem.Dk) > device_smem_per_block(problem.device):
            p = replace(p, BLOCK_N=16)
        return p

    def fit_reject(self, params: TritonParams, T: int, arch: str, Dk: int = 576) -> str | None:
        from .cuda.params import ARCH_LIMITS
        if arch not in ARCH_LIMITS:
            return None
        need, limit = params.smem_bytes(T, Dk), ARCH_LIMITS[arch].smem_per_block
        if need > limit:
            return (f"shared memory {need} B per block (a {params.block_m(T)}-row Q tile and a {params.BLOCK_N}-key "
                    f"tile of {Dk} bf16 columns) exceeds {arch}'s {limit} B")
        return None

    def check_params(self, params: TritonParams, problem: VerifyProblem) -> None:
        dpe = problem.Dk - problem.Dv
        if problem.Dv != next_pow2(problem.Dv) or dpe != next_pow2(dpe) or dpe < 16 or problem.Dv < 16:
            raise ValueError(f"triton backend needs power-of-two Dv and Dk-Dv >= 16, got Dk={problem.Dk}, "
                             f"Dv={problem.Dv}")
        TRITON_PARAMS.check_problem(vars(params), T=problem.T, Dk=problem.Dk, Dv=problem.Dv)
        if params.HEADS_PER_BLOCK > problem.H:
            # legal (the padding rows are masked) but wasted work, and often a config meant for
            # another tp; a warning, not an error, since TritonParams() defaults to 2 heads
            warnings.warn(f"TritonParams: HEADS_PER_BLOCK = {params.HEADS_PER_BLOCK} exceeds the {problem.H} "
                          f"head(s) of q; each program computes {params.HEADS_PER_BLOCK - problem.H} head(s) of "
                          "padding (HEADS_PER_BLOCK <= H does the same work with fewer rows)", stacklevel=4)

    def workspace_bytes(self, problem: VerifyProblem, params: TritonParams) -> int:
        return 4 * params.NSPLIT * problem.rows * problem.H * (problem.Dv + 1)

    def launch(self, a: LaunchArgs, params: TritonParams) -> None:
        pb = a.problem
        part_o, part_lse = partials(pb, params.NSPLIT, a.workspace)
        st = a.split_table
        nb = st.num_buckets if st is not None else 0
        smk = st.max_keys if st is not None else a.kv_indptr
        sv = st.nsplit if st is not None else a.kv_indptr
        grid1 = (pb.B * cdiv(pb.H, params.HEADS_PER_BLOCK), params.NSPLIT)
        _verify_split_kernel[grid1](
            a.q, a.kv_cache, a.kv_indptr, a.kv_indices, a.tree_mask, part_o, part_lse, smk, sv,
            a.sm_scale * LOG2E,
            a.q.stride(0), a.q.stride(1), a.kv_cache.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            pb.H,
            T=pb.T, HEADS_PER_BLOCK=params.HEADS_PER_BLOCK, BLOCK_M=params.block_m(pb.T), BLOCK_N=params.BLOCK_N,
            DV=pb.Dv, DPE=pb.Dk - pb.Dv, NSPLIT=params.NSPLIT, NUM_BUCKETS=nb, UPCAST=_interpreting(),
            num_warps=params.NUM_WARPS, num_stages=params.STAGES,   # Triton's launch keywords
        )
        lse = a.lse if a.lse is not None else part_lse  # dummy pointer when not written
        _verify_merge_kernel[(pb.rows, pb.H)](
            part_o, part_lse, a.out, lse, a.kv_indptr, smk, sv,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            a.out.stride(0), a.out.stride(1), lse.stride(0),
            pb.H,
            T=pb.T, DV=pb.Dv, NSPLIT=params.NSPLIT, NUM_BUCKETS=nb, WRITE_LSE=a.lse is not None,
            num_warps=4,
        )
