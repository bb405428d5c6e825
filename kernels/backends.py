"""The backend interface and its registry.

Every implementation of the verify contract (the fp32 oracle, the Triton kernel, the
NVRTC-compiled CUDA kernel) is a `Backend`: a parameter dataclass, a default, a workspace
size, a static feasibility check and a launch. `verify_attention`, the tuner, the runtime
and the conformance tests all go through this interface, so backends are interchangeable.
"""
from __future__ import annotations

import abc
import dataclasses
import importlib
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .shapes import VerifyProblem


@dataclass(frozen=True)
class SplitTable:
    """Per-request NSPLIT, chosen on the device from the request's key count L_b.

    Request b uses `nsplit[i]` for the first bucket i with `L_b <= max_keys[i]`, and the
    last bucket's NSPLIT beyond the last bound. Both are int32 `[num_buckets]` tensors on
    the kernel's device; every entry must be in [1, params.NSPLIT] (the grid size). Used by
    the serving runtime so that one captured CUDA graph stays tuned while contexts grow.

    A value 0 marks a bucket the launch does not serve (`dispatch`): the runtime's per-context
    dispatch launches each compile-time config of an entry with a table holding its own buckets
    only, and a launch whose batch falls in a 0 bucket writes nothing. Only backends whose
    NSPLIT counts the batch's splits (`Backend.nsplit_per_batch`: cuda, wgmma) take such tables.
    Build it with `SplitTable.build`, which checks the values and sets `dispatch` from them (the
    tensors are not read back on the launch path: a table made directly is taken to hold no 0).
    """

    max_keys: torch.Tensor
    nsplit: torch.Tensor
    dispatch: bool = False   # some bucket is 0: served by another launch

    @staticmethod
    def build(max_keys: list[int], nsplit: list[int], device) -> "SplitTable":
        if len(max_keys) != len(nsplit) or not max_keys:
            raise ValueError("SplitTable needs as many NSPLIT values as bucket bounds (at least one)")
        for name, vals in (("bounds", max_keys), ("NSPLIT values", nsplit)):   # int32 on the device
            if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or not -2**31 <= v < 2**31
                   for v in vals):
                raise ValueError(f"SplitTable {name} must be int32 integers, got {list(vals)}")
        if any(b <= a for a, b in zip(max_keys, max_keys[1:])):
            raise ValueError(f"SplitTable bounds must increase strictly, got {max_keys}")
        if any(int(n) < 0 for n in nsplit) or not any(int(n) > 0 for n in nsplit):
            raise ValueError(f"SplitTable NSPLIT values must be >= 1 (0: a bucket another launch serves), "
                             f"and one at least >= 1, got {nsplit}")
        return SplitTable(torch.tensor(max_keys, dtype=torch.int32, device=device),
                          torch.tensor(nsplit, dtype=torch.int32, device=device),
                          dispatch=any(int(n) == 0 for n in nsplit))

    @property
    def num_buckets(self) -> int:
        return int(self.max_keys.numel())


def bucket_index(bounds: list[int], keys: int) -> int:
    """The split-table bucket of `keys` keys: the first whose bound is >= keys, else the last
    (host mirror of the kernels' rule, verify.cu's `table_value`)."""
    return next((i for i, bound in enumerate(bounds) if keys <= bound), len(bounds) - 1)


def split_bounds(backend: "Backend | str", max_prefixes: list[int], T: int, batch: int) -> list[int]:
    """The split-table bounds for context buckets of `max_prefixes` tokens at a batch bucket
    of `batch` requests: a request's keys (prefix + T drafts), or, for a backend whose NSPLIT
    counts the batch's splits, the bucket's batch of them."""
    be = get_backend(backend) if isinstance(backend, str) else backend
    scale = batch if be.nsplit_per_batch else 1
    return [(c + T) * scale for c in max_prefixes]


@dataclass
class LaunchArgs:
    """Everything one launch needs, already validated by `verify_attention`.

    q `[B*T, H, Dk]` bf16 (last dim contiguous); kv_cache `[num_slots, Dk]` bf16 (row
    stride >= Dk); kv_indptr `[B+1]` int32; kv_indices int32/int64; tree_mask `[B*T]`
    int64; out `[B*T, H, Dv]` bf16; lse `[B*T, H]` fp32 or None; workspace a flat tensor of
    at least `backend.workspace_bytes(problem, params)` bytes on the device.
    """

    problem: VerifyProblem
    q: torch.Tensor
    kv_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    tree_mask: torch.Tensor
    sm_scale: float
    out: torch.Tensor
    lse: torch.Tensor | None
    workspace: torch.Tensor | None
    split_table: SplitTable | None = None


class Backend(abc.ABC):
    """One implementation of the verify-attention contract."""

    name: str = ""
    #: the frozen parameter dataclass of this backend (None for the oracle)
    params_type: type | None = None

    @property
    def nsplit_per_batch(self) -> bool:
        """NSPLIT counts splits of the whole batch's keys, not per request: a split table is then
        looked up at the batch's total key count (`split_bounds`). Declared with the parameters
        (`params.Declaration.nsplit_per_batch`)."""
        decl = getattr(self.params_type, "declaration", None)
        return bool(decl is not None and decl.nsplit_per_batch)

    def default_params(self, problem: VerifyProblem) -> Any:
        """The untuned default for this problem (None for backends without parameters)."""
        return None

    def check_params(self, params: Any, problem: VerifyProblem) -> None:
        """Raise ValueError if `params` cannot run `problem` (mirrors the kernel's asserts)."""

    def workspace_bytes(self, problem: VerifyProblem, params: Any) -> int:
        """Bytes of scratch one launch needs (split-K partials)."""
        return 0

    def static_reject(self, params: Any, problem: VerifyProblem, arch: str | None = None) -> str | None:
        """Why `params` is statically impossible on `arch` (compile error, spills, shared
        memory over the limit), or None. Costs no GPU time."""
        try:
            self.check_params(params, problem)
        except ValueError as e:
            return str(e)
        return None

    def fit_reject(self, params: Any, T: int, arch: str, Dk: int = 576) -> str | None:
        """Why `params` cannot fit `arch` at T draft tokens and Dk key columns, judged without compiling (the kernel's
        shared memory and threads against the arch's limits), or None when it may: compiling can
        still reject it (`static_reject`). The tuner plans its studies with it, so a search space
        need not restate the kernel's shared-memory model."""
        return None

    def kernel_hash(self) -> str | None:
        """Identity of the kernel source (sha256[:16]) recorded in exported provenance, or
        None for a backend without a kernel (the oracle)."""
        return None

    def supports(self, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None."""
        return None

    @abc.abstractmethod
    def launch(self, args: LaunchArgs, params: Any) -> None:
        """Write `args.out` (and `args.lse` when given); no host sync, no allocation."""



def _chains(backends) -> bool:
    """Whether a call's launches on `backends` can run as one per-context dispatch chain (every
    backend on verify.cu's split arguments and merge: `kernels.cuda.backend.launch_dispatch`)."""
    return len(backends) > 1 and all(hasattr(be, "split_launch") for be in backends)


def launch_all(calls: list[tuple[Backend, Any, LaunchArgs]]) -> None:
    """A call's launches, (backend, params, args) each: one, or a per-context dispatch's every
    config (the one whose split table holds the batch's bucket computes, the others exit at
    once). The split-merge backends' dispatch runs as one chain where it can (one merge after all
    the split kernels; `kernels.cuda.backend.chain_order`); anything else launches in turn."""
    if _chains([be for be, _, _ in calls]):
        from .cuda.backend import launch_dispatch, on_tensors_device
        a0 = calls[0][2]
        on_tensors_device(a0, lambda: launch_dispatch([(a, be.split_launch(a, p)) for be, p, a in calls]))
        return
    for be, p, a in calls:
        be.launch(a, p)


def call_workspace_bytes(problem: VerifyProblem, launches: list[tuple[Any, Backend]]) -> int:
    """Workspace bytes of a call whose launches are `launches`, (params, backend) each: the most
    any one needs, or a dispatch chain's (one partial layout for the most work items, a meta per
    chained launch)."""
    need = max(be.workspace_bytes(problem, p) for p, be in launches)
    if _chains([be for _, be in launches]):
        from .cuda.backend import chain_workspace_bytes, work_items
        need = max(need, chain_workspace_bytes(problem, [work_items(p, problem.B) for p, _ in launches]))
    return need

# Parameter names a backend used before, per backend: old -> current. Only readers of
# committed evidence (trials tables, Optuna studies, the review) translate them; everything
# else rejects an old name with an error that names the current one (`renamed_hint`).
RENAMED_PARAMS: dict[str, dict[str, str]] = {
    "triton": {"BLOCK_H": "HEADS_PER_BLOCK", "num_warps": "NUM_WARPS", "num_stages": "STAGES"},
}


def rename_legacy_params(backend: str, values: dict) -> dict:
    """`values` with `backend`'s old parameter names replaced by the current ones."""
    renamed = RENAMED_PARAMS.get(backend, {})
    return {renamed.get(k, k): v for k, v in values.items()}


def renamed_hint(unknown, known) -> str:
    """'; BLOCK_H was renamed HEADS_PER_BLOCK, ...' for the unknown names that are old names of
    known ones, else ''."""
    old_to_new = {old: new for m in RENAMED_PARAMS.values() for old, new in m.items()}
    hits = [f"{u} was renamed {old_to_new[u]}" for u in unknown if old_to_new.get(u) in known]
    return "; " + ", ".join(hits) if hits else ""


def params_from_dict(params_type: type, values: dict, where: str = "params", complete: bool = False) -> Any:
    """Build a parameter dataclass from a mapping, naming unknown or missing keys.

    complete=True requires every field, defaults included: a tuned YAML must say what was
    measured, since a backend's defaults may change between versions."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping of parameter names to values, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(params_type)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown parameter(s) {unknown} for {params_type.__name__}; "
                         f"known: {sorted(fields)}{renamed_hint(unknown, fields)}")
    missing = sorted(n for n, f in fields.items() if n not in values and (
        complete or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)))
    if missing:
        why = " (a tuned file names every parameter: defaults change between versions)" if complete else ""
        raise ValueError(f"{where}: missing parameter(s) {missing} for {params_type.__name__}{why}")
    return params_type(**values)


# name -> "module:attribute" of a zero-argument constructor; imported lazily so that the
# CUDA backend's NVRTC bindings load only when asked for.
_REGISTRY: dict[str, str] = {
    "reference": "kvtune.kernels.reference:ReferenceBackend",
    "triton": "kvtune.kernels.triton_kernel:TritonBackend",
    "cuda": "kvtune.kernels.cuda.backend:CudaBackend",
    "wgmma": "kvtune.kernels.cuda.wgmma:WgmmaBackend",
    "wgmma_km": "kvtune.kernels.cuda.wgmma_km:WgmmaKmBackend",
}
_INSTANCES: dict[str, Backend] = {}


def register_backend(name: str, factory: str | Callable[[], Backend]) -> None:
    """Register a backend under `name` ("module:attr" string or a constructor). Tests use
    this to plug in deliberately broken variants."""
    _INSTANCES.pop(name, None)
    if callable(factory):
        _INSTANCES[name] = factory()
        _REGISTRY[name] = "<instance>"
    else:
        _REGISTRY[name] = factory


def unregister_backend(name: str) -> None:
    _INSTANCES.pop(name, None)
    _REGISTRY.pop(name, None)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str | Backend) -> Backend:
    """The backend registered as `name` (a Backend instance is returned as is)."""
    if isinstance(name, Backend):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown backend {name!r}; known: {backend_names()}")
    if name not in _INSTANCES:
        module, attr = _REGISTRY[name].split(":")
        _INSTANCES[name] = getattr(importlib.import_module(module), attr)()
    return _INSTANCES[name]
