"""`verify_attention`: the one entry point every backend shares.

Checks the metadata (shapes, dtypes, devices) always, and the values that need a host read
(indptr monotonic, slots in range, each request holding its T draft keys) unless the current
stream is being captured into a CUDA graph, where a host sync is illegal.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .backends import Backend, LaunchArgs, SplitTable, call_workspace_bytes, get_backend, launch_all
from .shapes import MAX_DRAFT_TOKENS, ModelShape, VerifyProblem, byte_span, overlapping

DEFAULT_KV_LORA_RANK = 512


def is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _need_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _check_q_and_cache(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank) -> None:
    """Shapes, dtypes and strides of q `[B*T, H, Dk]` and kv_cache `[num_slots, Dk]` (bf16, last
    dimension contiguous), and 0 < kv_lora_rank <= Dk; a ValueError naming the argument."""
    if q.dim() != 3:
        raise ValueError(f"q: expected [B*T, H, Dk], got shape {tuple(q.shape)}")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"q: expected dtype torch.bfloat16, got {q.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q: the last (Dk) dimension must be contiguous (stride 1)")
    if kv_cache.dim() != 2:
        raise ValueError(f"kv_cache: expected [num_slots, Dk], got shape {tuple(kv_cache.shape)}")
    if kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"kv_cache: expected dtype torch.bfloat16, got {kv_cache.dtype}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: rows must be contiguous (last-dimension stride 1)")
    Dk = q.shape[2]
    if kv_cache.shape[1] != Dk:
        # blame the one that is not the MLA width (ModelShape's kv_lora_rank 512 + rope 64) when the other is
        mla = ModelShape(num_heads=1).dk
        who = "q" if kv_cache.shape[1] == mla else "kv_cache"
        raise ValueError(f"{who}: q's Dk {Dk} != kv_cache's row width {kv_cache.shape[1]}; q [B*T, H, Dk] and "
                         f"kv_cache [num_slots, Dk] share Dk = kv_lora_rank + rope dims ({mla} for DeepSeek-V3 "
                         f"and Kimi-K2)")
    if not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank <= Dk:
        raise ValueError(f"kv_lora_rank: must be an int in (0, Dk={Dk}], got {kv_lora_rank!r}")


def describe_problem(q, kv_cache, kv_indptr, kv_indices, tree_mask, sm_scale,
                     kv_lora_rank: int = DEFAULT_KV_LORA_RANK) -> VerifyProblem:
    """Check the metadata of a verify call and return its `VerifyProblem`.

    Raises ValueError naming the offending argument. Reads no tensor values.
    """
    q = _need_tensor(q, "q")
    kv_cache = _need_tensor(kv_cache, "kv_cache")
    kv_indptr = _need_tensor(kv_indptr, "kv_indptr")
    kv_indices = _need_tensor(kv_indices, "kv_indices")
    tree_mask = _need_tensor(tree_mask, "tree_mask")
    _check_q_and_cache(q, kv_cache, kv_lora_rank)
    device, Dk = q.device, q.shape[2]
    for name, t in (("kv_cache", kv_cache), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("tree_mask", tree_mask)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, but q is on {device}; all tensors must share a device")
    if kv_indptr.dim() != 1 or kv_indptr.numel() < 2:
        raise ValueError(f"kv_indptr: expected [B+1] with B >= 1, got shape {tuple(kv_indptr.shape)}")
    if kv_indptr.dtype != torch.int32:
        raise ValueError(f"kv_indptr: expected dtype torch.int32, got {kv_indptr.dtype}")
    if kv_indices.dim() != 1:
        raise ValueError(f"kv_indices: expected a 1-D tensor, got shape {tuple(kv_indices.shape)}")
    if kv_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_indices: expected dtype torch.int32 or torch.int64, got {kv_indices.dtype}")
    if kv_indices.numel() and kv_indices.stride(0) != 1:
        raise ValueError("kv_indices: must be contiguous")
    if not kv_indptr.is_contiguous():
        raise ValueError("kv_indptr: must be contiguous")
    B = kv_indptr.numel() - 1
    if q.shape[0] % B:
        raise ValueError(f"q: {q.shape[0]} query rows is not a multiple of B={B} (from kv_indptr); "
                         "T = q.shape[0] // B must divide exactly")
    T = q.shape[0] // B
    if not 1 <= T <= MAX_DRAFT_TOKENS:
        raise ValueError(f"q: T = {T} draft tokens per request; the tree mask supports 1..{MAX_DRAFT_TOKENS}")
    if tree_mask.dtype != torch.int64:
        raise ValueError(f"tree_mask: expected dtype torch.int64, got {tree_mask.dtype}")
    if tree_mask.dim() != 1 or tree_mask.numel() != B * T:
        raise ValueError(f"tree_mask: expected shape [{B * T}] (B*T), got {tuple(tree_mask.shape)}")
    if not tree_mask.is_contiguous():
        raise ValueError("tree_mask: must be contiguous")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
    H = q.shape[1]
    if H < 1:
        raise ValueError("q: needs at least one head")
    return VerifyProblem(B=B, T=T, H=H, Dk=Dk, Dv=kv_lora_rank, device=device)


def check_values(problem: VerifyProblem, kv_cache, kv_indptr, kv_indices, tree_mask=None) -> int:
    """Checks that read tensor values (one host sync). Not callable under graph capture.
    Returns the highest slot the requests use + 1 (0: none), the pool size they need."""
    if tree_mask is not None and problem.T < 64:
        # a bit at or past T names a draft key that does not exist; the kernels would ignore
        # it (or, in another backend, read past the request), so it is a caller's bug
        beyond = (tree_mask >> problem.T) != 0
        if bool(beyond.any()):
            i = int(torch.nonzero(beyond)[0])
            raise ValueError(f"tree_mask: row {i} ({int(tree_mask[i]):#x}) sets bits at or beyond T={problem.T}; "
                             f"bit j means draft key j, 0 <= j < T")
    indptr = kv_indptr.to("cpu", torch.int64)
    if int(indptr[0]) < 0:
        raise ValueError(f"kv_indptr: kv_indptr[0] = {int(indptr[0])} is negative")
    lens = indptr[1:] - indptr[:-1]
    if bool((lens < 0).any()):
        b = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"kv_indptr: not monotonic at request {b} ({int(indptr[b])} > {int(indptr[b + 1])})")
    if int(indptr[-1]) > kv_indices.numel():
        raise ValueError(f"kv_indptr: kv_indptr[-1] = {int(indptr[-1])} exceeds kv_indices' length "
                         f"{kv_indices.numel()}")
    short = lens < problem.T
    if bool(short.any()):
        b = int(torch.nonzero(short)[0])
        raise ValueError(f"kv_indptr: request {b} holds {int(lens[b])} keys, fewer than its T={problem.T} "
                         "draft keys")
    used = kv_indices[int(indptr[0]):int(indptr[-1])]
    if used.numel():
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= kv_cache.shape[0]:
            n = kv_cache.shape[0]   # the runtime's plan without num_slots passes an unbounded stand-in
            bound = f"[0, {n})" if n < 1 << 62 else "[0, ...): slots are >= 0"
            raise ValueError(f"kv_indices: slot {lo if lo < 0 else hi} out of range {bound}")
        return hi + 1
    return 0


def workspace_bytes(problem: VerifyProblem, backend: str | Backend = "triton", params: Any = None) -> int:
    """Scratch bytes `verify_attention` needs for `problem` with `backend`/`params`."""
    be = get_backend(backend)
    params = _resolve_params(be, params, problem, "params")
    return be.workspace_bytes(problem, params)


def _resolve_params(be: Backend, params: Any, problem: VerifyProblem, what: str) -> Any:
    """`params`, or the backend's default when None, after checking it is the backend's
    parameter type and legal for `problem` (a ValueError naming `what` otherwise). The default
    is checked too: a shape the backend cannot run (a Dv it does not take) fails here, named,
    not in its compiler."""
    if params is None:
        params = be.default_params(problem)
    elif be.params_type is not None and not isinstance(params, be.params_type):
        raise ValueError(f"{what}: backend {be.name!r} takes {be.params_type.__name__}, got {type(params).__name__}")
    be.check_params(params, problem)
    return params


def verify_attention(q, kv_cache, kv_indptr, kv_indices, tree_mask, sm_scale, backend="triton",
                     params=None, out=None, return_lse=False, *, lse=None, workspace=None,
                     split_table: SplitTable | None = None, kv_lora_rank: int = DEFAULT_KV_LORA_RANK,
                     check_values_: bool | None = None):
    """MLA verify attention of T draft tokens per request against a gathered KV cache.

    q: `[B*T, H, Dk]` bf16, request-major rows (row b*T+t is draft t of request b).
    kv_cache: `[num_slots, Dk]` bf16, one token per row (row stride may exceed Dk);
        V is a row's first `kv_lora_rank` (Dv) columns.
    kv_indptr: `[B+1]` int32; kv_indices: int32 or int64; request b's keys are
        `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`: its P_b prefix slots, then its T drafts.
    tree_mask: `[B*T]` int64, bit j of row i = draft query i may see draft key j.
    sm_scale: softmax scale.
    backend: "reference" | "triton" | "cuda" (or any registered name / Backend instance).
    params: the backend's parameter dataclass; None = its default.
    out: optional `[B*T, H, Dv]` bf16 output; lse: optional `[B*T, H]` fp32 (implies return_lse).
    workspace: optional scratch tensor of at least `workspace_bytes(...)` bytes, so the call
        need not allocate (CUDA-graph capture).
    split_table: optional per-request NSPLIT chosen on the device (see `SplitTable`).
    check_values_: force (True) or skip (False) the value checks; default: on, except
        during CUDA-graph capture.

    Returns o `[B*T, H, Dv]` bf16, or (o, lse) with lse `[B*T, H]` fp32 (natural log; -inf
    for a row that sees no key) when `return_lse` or `lse` is given.
    """
    problem = describe_problem(q, kv_cache, kv_indptr, kv_indices, tree_mask, sm_scale, kv_lora_rank)
    given = dict(out=out, lse=lse, workspace=workspace)  # the results the caller passed (check_separate)
    be = get_backend(backend)
    why = be.supports(problem.device)
    if why:
        raise ValueError(f"backend: {be.name} cannot run here: {why}")
    params = _resolve_params(be, params, problem, "params")
    capturing = is_capturing(problem.device)
    do_check = (not capturing) if check_values_ is None else check_values_
    if do_check:
        check_values(problem, kv_cache, kv_indptr, kv_indices, tree_mask)
    shape_o = (problem.rows, problem.H, problem.Dv)
    if out is None:
        out = torch.empty(shape_o, dtype=torch.bfloat16, device=problem.device)
    else:
        check_out(out, problem)
    if lse is not None:
        return_lse = True
        check_lse(lse, problem)
    elif return_lse:
        lse = torch.empty(shape_o[:2], dtype=torch.float32, device=problem.device)
    need = be.workspace_bytes(problem, params)
    if workspace is None:
        if need:
            workspace = torch.empty(need, dtype=torch.uint8, device=problem.device)
    else:
        _check_workspace(workspace, problem, need)
    if split_table is not None:
        _check_split_table(split_table, problem.device, be)
    check_separate(dict(q=q, kv_cache=kv_cache, kv_indptr=kv_indptr, kv_indices=kv_indices, tree_mask=tree_mask,
                        **split_table_tensors(split_table)), given)
    be.launch(LaunchArgs(problem, q, kv_cache, kv_indptr, kv_indices, tree_mask, float(sm_scale), out, lse,
                         workspace, split_table), params)
    return (out, lse) if return_lse else out


def verify_attention_dispatch(q, kv_cache, kv_indptr, kv_indices, tree_mask, sm_scale, launches, out, *,
                              lse=None, workspace, kv_lora_rank: int = DEFAULT_KV_LORA_RANK,
                              check_values_: bool | None = None):
    """One call of a per-context dispatch: every launch of `launches`, (backend, params,
    split_table) each, on one batch, as the runtime's `run` launches them (`backends.launch_all`):
    the launch whose split table holds the batch's bucket computes, the others exit at once.

    Inputs as `verify_attention`'s; out `[B*T, H, Dv]` bf16 and workspace (at least
    `backends.call_workspace_bytes` bytes) are required, lse `[B*T, H]` fp32 optional. Returns out.
    """
    problem = describe_problem(q, kv_cache, kv_indptr, kv_indices, tree_mask, sm_scale, kv_lora_rank)
    calls = []
    for i, (backend, params, table) in enumerate(launches):
        be = get_backend(backend)
        why = be.supports(problem.device)
        if why:
            raise ValueError(f"launches[{i}]: {be.name} cannot run here: {why}")
        params = _resolve_params(be, params, problem, f"launches[{i}]")
        if table is not None:
            _check_split_table(table, problem.device, be)
        calls.append((be, params, table))
    if not calls:
        raise ValueError("launches: expected at least one (backend, params, split_table)")
    do_check = (not is_capturing(problem.device)) if check_values_ is None else check_values_
    if do_check:
        check_values(problem, kv_cache, kv_indptr, kv_indices, tree_mask)
    check_out(out, problem)
    if lse is not None:
        check_lse(lse, problem)
    _check_workspace(workspace, problem, call_workspace_bytes(problem, [(p, be) for be, p, _ in calls]))
    tables = {k: v for i, (_, _, t) in enumerate(calls) for k, v in split_table_tensors(t, f"launches[{i}]").items()}
    check_separate(dict(q=q, kv_cache=kv_cache, kv_indptr=kv_indptr, kv_indices=kv_indices, tree_mask=tree_mask,
                        **tables), dict(out=out, lse=lse, workspace=workspace))
    launch_all([(be, p, LaunchArgs(problem, q, kv_cache, kv_indptr, kv_indices, tree_mask, float(sm_scale), out,
                                   lse, workspace, t)) for be, p, t in calls])
    return out


def check_out(out, problem) -> None:
    """`out` for `problem`: bf16 [rows, H, Dv] on its device (`_check_result`)."""
    _check_result(out, "out", [problem.rows, problem.H, problem.Dv], torch.bfloat16, "bf16", problem.device)


def check_lse(lse, problem) -> None:
    """`lse` for `problem`: fp32 [rows, H] on its device (`_check_result`)."""
    _check_result(lse, "lse", [problem.rows, problem.H], torch.float32, "fp32", problem.device)


def _check_result(t, name: str, shape: list, dtype, dtype_name: str, device: torch.device) -> None:
    """A preallocated result (`out` [rows, H, Dv] bf16, `lse` [rows, H] fp32): a tensor of that
    shape, dtype and device with a contiguous last dimension and no overlap with itself
    (`check_distinct`); a ValueError naming `name` and the expected shape otherwise."""
    if not isinstance(t, torch.Tensor) or list(t.shape) != shape or t.dtype != dtype or t.device != device:
        got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise ValueError(f"{name}: expected {dtype_name} {shape} on {device}, got {got}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (strides {list(t.stride())})")
    check_distinct(t, name)


def check_distinct(t: torch.Tensor, name: str) -> None:
    """A ValueError naming `name` when elements of the output `t` share memory (`overlapping`)."""
    if overlapping(t):
        raise ValueError(f"{name}: its elements overlap in memory (strides {list(t.stride())}): rows would write "
                         "the same place; pass a tensor of distinct elements")


def check_separate(inputs: dict, results: dict) -> None:
    """A ValueError naming both when a result (out, lse, workspace) shares memory with an input
    (q, kv_cache, the metadata, a split table) or with another result: the kernels read the inputs
    while other CTAs write the results, so the answer would depend on the order the CTAs ran in.
    `inputs` and `results`: name -> tensor or None. Only results the caller passed need checking (a
    fresh allocation shares nothing); each span is computed once."""
    res = [(n, byte_span(t)) for n, t in results.items() if t is not None]
    if not res:
        return
    spans = res + [(n, byte_span(t)) for n, t in inputs.items() if t is not None]
    for i, (rn, (r0, r1)) in enumerate(res):
        for other, (t0, t1) in spans[i + 1:]:
            if r0 < t1 and t0 < r1:
                raise ValueError(f"{rn}: shares memory with {other}: the kernel would read what it writes; "
                                 f"pass a separate tensor")


def split_table_tensors(table, name: str = "split_table") -> dict:
    """A split table's tensors as check_separate's inputs (none for None)."""
    return {} if table is None else {f"{name}.max_keys": table.max_keys, f"{name}.nsplit": table.nsplit}


def _check_workspace(workspace, problem, need: int) -> None:
    _need_tensor(workspace, "workspace")
    have = workspace.numel() * workspace.element_size()
    # 1-D: the backends cut their partials out of it by byte offset
    if workspace.device != problem.device or workspace.dim() != 1 or not workspace.is_contiguous() or have < need:
        raise ValueError(f"workspace: need a contiguous 1-D tensor (e.g. torch.uint8) of >= {need} bytes on "
                         f"{problem.device}, got {workspace.dim()}-D, {have} bytes on {workspace.device}")
    if workspace.data_ptr() % 16:
        raise ValueError("workspace: must start at a 16-byte aligned address (kernels use vector accesses)")


def _check_split_table(split_table, device, be) -> None:
    """A ValueError naming the field unless `split_table` is a SplitTable of 1-D int32 tensors
    on `device`, as many NSPLIT values as bounds (>= 1), and holds buckets another launch serves
    (NSPLIT 0) only for a backend `be` whose NSPLIT counts the batch's splits."""
    if getattr(split_table, "dispatch", False) and not be.nsplit_per_batch:
        raise ValueError(f"split_table: holds buckets another launch serves (NSPLIT 0), which backend "
                         f"{be.name} cannot skip (it picks NSPLIT per request); only backends whose NSPLIT "
                         "counts the batch's splits (cuda, wgmma) take such tables")
    if not isinstance(split_table, SplitTable):
        raise ValueError(f"split_table: expected a SplitTable, got {type(split_table).__name__}")
    for name, t in (("max_keys", split_table.max_keys), ("nsplit", split_table.nsplit)):
        if t.dtype != torch.int32 or t.device != device or t.dim() != 1:
            raise ValueError(f"split_table.{name}: expected a 1-D int32 tensor on {device}")
    if split_table.max_keys.numel() < 1 or split_table.nsplit.numel() != split_table.max_keys.numel():
        raise ValueError(f"split_table: needs as many NSPLIT values as bounds (>= 1), got "
                         f"{split_table.nsplit.numel()} and {split_table.max_keys.numel()}")
