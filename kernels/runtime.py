"""Serving runtime: read the exported YAML once, then run the tuned verify kernel every step.

Reads top to bottom: `VerifyAttention` (the object a serving engine creates once per
(deployment, tp) and calls inside its CUDA graphs) with its construction from the YAML, and
`StepPlan`. How each batch entry runs (`Plan`, built from the YAML) is `plans.py`; finding,
loading and provenance-checking the YAML is `lookup.py` (its names are re-exported here).

Never imports the tuner, Optuna or pandas: only torch, PyYAML and the kernels.

Policy (see `tuned.py` and the README's "Bucket policy"): a batch of n requests uses the
first entry of its tp with n <= max_batch (the largest entry beyond); the context bucket is
chosen on the device from the split table. CUDA's NSPLIT counts splits of the whole batch
(work balanced by keys) and is used as tuned at any batch. Triton's NSPLIT counts splits per
request: a batch of n run with an entry tuned at batch m != n keeps the entry's CTA count,
each bucket's NSPLIT becoming max(1, floor(NSPLIT * m / n)) (at most the backend's largest
NSPLIT), so a batch between buckets fills the GPU as the tuned batch did and never launches
more split CTAs than it.

Serving calls attention once per layer with the same metadata, so the work is split in
two (`VerifyAttention.plan` once per step, `VerifyAttention.run` once per layer); the
`__call__` of before is plan + run.

`KVTUNE_VERIFY`: `auto` (default) runs what the YAML names; `reference|triton|cuda|wgmma|wgmma_km` forces
that backend (the YAML's parameters are used for entries of that backend, its default
parameters elsewhere); `off` makes `from_defaults` return None so the caller keeps its own
attention path.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import torch

from .api import check_lse, check_out, check_separate, is_capturing, verify_attention, verify_attention_dispatch
from .api import check_values as api_check_values
from .backends import LaunchArgs, SplitTable, bucket_index, call_workspace_bytes, launch_all, split_bounds
from .plans import DEFAULT_BACKEND, Plan, model_on_rank  # noqa: F401 - DEFAULT_BACKEND re-exported
from .plans import plans as build_plans
from .shapes import VerifyProblem
from .tuned import TunedDefaults

from .lookup import (  # noqa: F401 - re-exported: the runtime's public lookup names
    ENV_CONFIG_DIR, ENV_VERIFY, VERIFY_MODES, ProvenanceError, backend_kernel_hash, reset_warn_once, warn_once,
    check_provenance, config_dirs, defaults_file_names, device_arch, device_name, find_defaults, load_defaults,
    packaged_defaults_dir, provenance_mismatches, resolve_device, slug, verify_mode,
)

log = logging.getLogger("kvtune.runtime")

#: bf16 tolerance of the start-up self-check against the oracle (||o-ref|| / ||ref||)
SELF_CHECK_TOL = 3e-2


# -- the verify-attention object -------------------------------------------------------

class VerifyAttention:
    """The tuned verify kernel of one (deployment, tp), ready to call inside CUDA graphs.

    Build it with `from_defaults`. Per decode step, `plan(kv_indptr, kv_indices, tree_mask)`
    once (validation; the batch entry chosen on the host from `kv_indptr.shape`, static
    under a graph), then `run(q, kv_cache, out)` per layer, which only launches the kernel.
    Neither allocates (the workspace and output were allocated up front) nor syncs with the
    host under graph capture, and NSPLIT per request is chosen on the device from the split
    table, so one captured graph stays tuned as contexts grow. Calling the object is plan +
    run.

    Attributes: T (draft tokens), H (heads on this rank), Dk, Dv, sm_scale, max_batch,
    max_context, plans (sorted by max_batch), workspace_bytes (scratch), allocated_bytes
    (everything it preallocated).
    """

    def __init__(self, *, plans: list[Plan], T: int, H: int, Dk: int, Dv: int, sm_scale: float, tp: int,
                 max_batch: int, max_context: int, device: torch.device, tuned: TunedDefaults | None,
                 workspace_budget_bytes: int | None = None, preallocate_out: bool = True,
                 check_values: bool = True):
        self.plans = sorted(plans, key=lambda p: p.max_batch)
        self.T, self.H, self.Dk, self.Dv = T, H, Dk, Dv
        self.sm_scale = float(sm_scale)
        self.tp = tp
        self.max_batch, self.max_context = max_batch, max_context
        self.device = device
        self.tuned = tuned
        self.check_values = flag(check_values, "check_values", None)
        # batch size -> plan index, so the call does one list lookup
        self._plan_of_batch = [0] * (max_batch + 1)
        for n in range(1, max_batch + 1):
            self._plan_of_batch[n] = next((i for i, p in enumerate(self.plans) if n <= p.max_batch),
                                          len(self.plans) - 1)
        self._batch_launches(max_batch, T, device)
        extrapolated = [n for n in range(1, max_batch + 1)
                        if self._launch[n][2] is not None and n > self._launch[n][0].max_batch]
        if extrapolated:
            warn_once(f"extrapolate:{id(self)}", f"kvtune: batches {extrapolated[0]}..{extrapolated[-1]} are past "
                       f"the largest tuned batch bucket: NSPLIT scaled by max_batch/batch", logging.INFO)
        self._problems = [None] + [self.problem(n) for n in range(1, max_batch + 1)]
        self._step: StepPlan | None = None
        # a per-context dispatch's configs run one after the other on the same workspace
        need = max(call_workspace_bytes(self.problem(n), [(params, be) for params, _, be in
                                                          self._launch[n][0].launches(self._launch[n][1:])])
                   for n in range(1, max_batch + 1))
        self.workspace_bytes = need
        out_bytes = max_batch * T * H * Dv * 2 if preallocate_out else 0
        table_bytes = sum(8 * t.num_buckets for t in {id(t): t for n in range(1, max_batch + 1) for t in (
            self._launch[n][2], *(o[1] for o in self._launch[n][0].others)) if t is not None}.values())
        self.allocated_bytes = need + out_bytes + table_bytes
        if workspace_budget_bytes is not None and self.allocated_bytes > workspace_budget_bytes:
            raise ValueError(f"workspace_budget_bytes: VerifyAttention for max_batch={max_batch} needs "
                             f"{self.allocated_bytes} bytes ({need} scratch + {out_bytes} output + {table_bytes} "
                             f"split tables), over the "
                             f"budget of {workspace_budget_bytes}; lower max_batch or the tuned NSPLIT")
        self.workspace = torch.empty(max(need, 1), dtype=torch.uint8, device=device)
        self.out_buf = (torch.empty(max_batch * T, H, Dv, dtype=torch.bfloat16, device=device)
                        if preallocate_out else None)
        untuned = tuned is None or all(p.untuned for p in self.plans)
        log.info("kvtune: VerifyAttention tp=%d max_batch=%d max_context=%d preallocated %d bytes (%d scratch); "
                 "defaults from %s", tp, max_batch, max_context, self.allocated_bytes, need,
                 "none (untuned backend defaults)" if tuned is None else
                 f"{tuned.source}, which has no entry for tp={tp} (untuned backend defaults)" if untuned else
                 tuned.source)

    def _batch_launches(self, max_batch: int, T: int, device: torch.device) -> None:
        """Fill `_launch[n]` and `_nsplits[n]` for every batch n in 1..max_batch."""
        # A batch of n requests run with an entry tuned at batch m keeps the entry's CTA count
        # (split CTAs ~ requests x NSPLIT): NSPLIT_n = max(1, floor(NSPLIT_m * m / n)) per context
        # bucket, at most the declared largest NSPLIT. Past the largest bucket (n > m) reusing
        # the tuned NSPLIT would launch n/m times the CTAs (measured on the H200: 2x slower at
        # batch 4 with batch-1 NSPLIT); between buckets (n < m) it would leave (m-n)/m of them
        # idle. Floor, not ceil: the tuned count may fill the GPU exactly (tp 8, batch 1: NSPLIT
        # 132 on 132 SMs), and one CTA more is a second wave. The grid (params.NSPLIT) is the
        # largest scaled value, so the workspace of any n stays within that of the entry's own
        # batch m (the sweep enforced the budget there). _launch[n] = (plan, params, split
        # table) for batch n; _nsplits[n] = NSPLIT per context bucket (None: no table, the
        # grid's NSPLIT).
        self._launch: list[tuple] = [None] * (max_batch + 1)
        self._nsplits: list[tuple | None] = [None] * (max_batch + 1)
        variants: dict = {}
        for n in range(1, max_batch + 1):
            i = self._plan_of_batch[n]
            p = self.plans[i]
            if p.entry is not None and p.split_table is not None:
                tuned_ns = p.bucket_nsplits()
                # a backend whose NSPLIT counts the batch's splits keeps its CTA count unscaled
                most = type(p.params).declaration.params["NSPLIT"].legal[-1]
                scaled = tuned_ns if p.backend.nsplit_per_batch else \
                    tuple(_scaled_nsplit(x, p.max_batch, n, most) for x in tuned_ns)
                self._nsplits[n] = scaled
                if scaled == tuned_ns:
                    self._launch[n] = (p, p.params, p.split_table)
                    continue
                if (i, scaled) not in variants:
                    variants[(i, scaled)] = (
                        p, dataclasses.replace(p.params, NSPLIT=max(scaled)),
                        SplitTable.build(split_bounds(p.backend, [b.max_context for b in p.entry.buckets], T,
                                                      p.max_batch), list(scaled), device))
                self._launch[n] = variants[(i, scaled)]
            elif p.untuned and p.params is not None:
                # no tuning to scale: the backend's own default for this batch size (its NSPLIT
                # fills the GPU for n requests), not the one sized for max_batch
                params = p.backend.default_params(self.problem(n))
                self._launch[n] = variants.setdefault((i, params), (p, params, None))
            else:
                self._launch[n] = (p, p.params, p.split_table)

    # -- construction from the exported YAML
    @classmethod
    def from_defaults(cls, tuned: TunedDefaults | str | os.PathLike | None = None, tp: int = 1,
                      max_batch: int = 1, max_context: int = 131072, device: torch.device | str | None = None,
                      *, deployment: str | None = None, model: str | None = None, draft_tokens: int | None = None,
                      heads: int | None = None, kv_lora_rank: int | None = None, rope_dim: int | None = None,
                      sm_scale: float | None = None, backend: str | None = None,
                      workspace_budget_bytes: int | None = None, allow_mismatch: bool = False,
                      warmup: bool = True, preallocate_out: bool = True,
                      check_values: bool = True) -> "VerifyAttention | None":
        """Build the runtime for one (deployment, tp) from tuned defaults.

        tuned: a `TunedDefaults`, a YAML file or folder, or None (search `KVTUNE_CONFIG_DIR`,
            then the packaged defaults, for `<deployment>.yaml`, then `<model>__<device>.yaml`).
        deployment, model: the names looked up (`load_defaults`); model is the export's
            `model.name` (e.g. "Kimi-K2").
        tp, max_batch, max_context: this rank's tensor parallelism, the largest batch and
            prefix length it must serve (buffers are sized for them; longer prefixes still
            run, with the last context bucket).
        draft_tokens, heads, kv_lora_rank, rope_dim, sm_scale: the model on this rank;
            default from the YAML's `model` (heads = num_heads / tp). Required without a YAML.
        backend: the backend of the untuned fallback (default: cuda where its default config
            runs on `device`, triton elsewhere: `plans.default_backend`). `KVTUNE_VERIFY`
            overrides both the YAML's and this choice.
        workspace_budget_bytes: refuse (ValueError) to preallocate more than this.
        warmup: compile every config at start-up and self-check it against the oracle.
        preallocate_out: keep an output buffer so a call without `out=` does not allocate.
        check_values: `plan` reads the metadata's values outside graph capture (one host sync
            per step, not per layer); False skips that (an engine that trusts its metadata).

        Returns None when `KVTUNE_VERIFY=off`: the caller keeps its own attention path.
        """
        mode = verify_mode()
        if mode == "off":
            warn_once("mode:off", f"kvtune: {ENV_VERIFY}=off: the tuned verify runtime is disabled",
                      logging.INFO)
            return None
        device = resolve_device(device)
        for name, v in (("tp", tp), ("max_batch", max_batch), ("max_context", max_context)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if not isinstance(tuned, TunedDefaults):
            tuned = load_defaults(tuned, deployment=deployment, model=model, device=device,
                                  allow_mismatch=allow_mismatch)
        else:
            check_provenance(tuned, device, deployment=deployment, model=model, allow_mismatch=allow_mismatch)
        kw = model_on_rank(tuned, tp, allow_mismatch, draft_tokens=draft_tokens, heads=heads,
                            kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, sm_scale=sm_scale)
        kw.update(tp=tp, max_batch=max_batch, max_context=max_context, device=device, tuned=tuned)
        plans = build_plans(tuned, kw, mode, backend, allow_mismatch)
        self = cls(plans=plans, workspace_budget_bytes=workspace_budget_bytes, preallocate_out=preallocate_out,
                   check_values=check_values, **kw)
        if warmup:
            self.warmup()
        return self

    def problem(self, batch: int) -> VerifyProblem:
        return VerifyProblem(B=batch, T=self.T, H=self.H, Dk=self.Dk, Dv=self.Dv, device=self.device)

    def plan_for(self, batch: int) -> Plan:
        """The plan serving a batch of `batch` requests (host side, no sync)."""
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch: {batch!r} requests; this VerifyAttention serves 1..{self.max_batch}")
        return self.plans[self._plan_of_batch[batch]]

    def params_for(self, batch: int, keys: int | None = None):
        """The backend parameters a batch of `batch` requests launches with (the plan's, with
        the grid NSPLIT scaled down past the largest tuned batch bucket). keys: the batch's
        keys in all (prefixes and drafts); under a per-context dispatch, the parameters of the
        config that serves them (host mirror of the device's choice)."""
        p = self.plan_for(batch)             # validates batch
        if keys is not None and p.others:
            return p.params_for_keys(keys, self.T)
        return self._launch[batch][1]

    def direct_config(self, batch: int, keys: int) -> tuple[Any, Any]:
        """(backend, params) of one plain `verify_attention` call (no split table, no runtime)
        running what `run` launches for `batch` requests holding `keys` keys in all (prefixes
        and drafts): the launch that serves those keys, NSPLIT its split table's value for them
        (the device's rule: the first bound >= keys, else the last; clamped to [1, the grid]).
        The kernels write the same partials; the merge is the one the direct NSPLIT picks.
        For benchmarks and tests: it reads the table back (a host sync), never on the launch
        path. A backend that picks NSPLIT per request (Triton) has no one value: ValueError."""
        p = self.plan_for(batch)
        if p.others:
            params, table, be = p.launch_for_keys(keys, self.T)
        else:
            _, params, table = self._launch[batch]
            be = p.backend
        if table is None:
            return be, params
        if not be.nsplit_per_batch:
            raise ValueError(f"batch: the {be.name} backend picks NSPLIT per request from its split table; "
                             "no one NSPLIT runs the batch as `run` does")
        v = table.nsplit.tolist()[bucket_index(table.max_keys.tolist(), keys)]
        return be, dataclasses.replace(params, NSPLIT=min(max(v, 1), params.NSPLIT))

    def nsplit_for(self, batch: int, prefix_len: int) -> int:
        """NSPLIT the kernel will choose on the device for `batch` requests of `prefix_len`
        tokens each (host mirror): per request for Triton; for a backend whose NSPLIT counts
        the batch's splits, from the batch's keys, as `direct_config` reads it, without a sync."""
        p = self.plan_for(batch)
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, numbers.Integral) or prefix_len < 0:
            raise ValueError(f"prefix_len: expected a prefix length in tokens >= 0, got {prefix_len!r}")
        _, params, table = self._launch[batch]
        if table is None:
            return getattr(params, "NSPLIT", 1)
        return self._nsplits[batch][p.bucket_of(prefix_len, self.T, batch)]

    def warmup(self) -> None:
        """Compile every plan's kernel now (not in the first captured step) and check it
        against the oracle on fresh inputs: a config that computes wrong values fails here."""
        from .inputs import make_inputs, rel_error
        from .reference import reference_attention
        # each distinct launch (a plan, or a plan scaled past its batch bucket) once, at a batch
        # that uses it: its first, or 2 when that uses it too (a ragged pair of requests)
        users: dict = {}
        for n in range(1, self.max_batch + 1):
            p, params, table = self._launch[n]
            users.setdefault((id(p), params, id(table)), (p, params, table, []))[3].append(n)
        for i, (p, params, table, batches) in enumerate(users.values()):
            n = 2 if 2 in batches else batches[0]
            inp = make_inputs(n, self.T, self.H, [(1, 37)[b % 2] for b in range(n)], tree="random",
                              kv_lora_rank=self.Dv, rope_dim=self.Dk - self.Dv, device=self.device, seed=1234 + i,
                              sm_scale=self.sm_scale)
            ref, _ = reference_attention(*inp.args, kv_lora_rank=self.Dv)
            # a per-context dispatch: each config on its own (its grid NSPLIT: these short
            # requests fall in the first bucket, which one config serves), then all of them as
            # `run` launches them (`launch_all`: one chain where it can), the idle ones writing nothing
            every = p.launches((params, table))
            checks = [every[:1]] if not p.others else [((c, None, be),) for c, _, be in every] + [every]
            for launches in checks:
                out = torch.full((n * self.T, self.H, self.Dv), float("nan"), dtype=torch.bfloat16,
                                 device=self.device)
                if len(launches) == 1:
                    (c, t, be), = launches
                    verify_attention(*inp.args, backend=be, params=c, out=out, workspace=self.workspace,
                                     split_table=t, kv_lora_rank=self.Dv, check_values_=True)
                else:
                    verify_attention_dispatch(*inp.args, [(be, c, t) for c, t, be in launches], out,
                                              workspace=self.workspace, kv_lora_rank=self.Dv, check_values_=True)
                err = rel_error(out, ref)
                if not err <= SELF_CHECK_TOL:
                    raise RuntimeError(f"kvtune: start-up self-check failed for {p.source}: backend(s) "
                                       f"{[be.name for _, _, be in launches]} params {[c for c, _, _ in launches]} "
                                       f"give relative error {err:.3g} against the oracle")

    def describe(self) -> dict:
        """A plain summary (for logs): plans, parameters, buckets and preallocated bytes."""
        return {"tp": self.tp, "T": self.T, "H": self.H, "max_batch": self.max_batch,
                "max_context": self.max_context, "workspace_bytes": self.workspace_bytes,
                "allocated_bytes": self.allocated_bytes,
                "plans": [{"max_batch": p.max_batch, "backend": p.backend.name, "params": p.params,
                           "buckets": [(b.max_context, b.NSPLIT) + ((b.backend,) if b.backend else ()) +
                                       ((b.params,) if b.params else ()) for b in p.entry.buckets]
                           if p.entry else None,
                           "source": p.source} for p in self.plans]}

    # -- plan once per step, run once per layer
    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, tree_mask: torch.Tensor, *,
             num_slots: int | None = None, check_values: bool | None = None) -> StepPlan:
        """Take one decode step's metadata: validate it and bind it to the launch for its batch.

        kv_indptr `[B+1]` int32 (contiguous); kv_indices `[>= kv_indptr[B]]` int32/int64
        (contiguous; request b's slots are `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`: its
        prefix, then its T drafts); tree_mask `[B*T]` int64 (bit j of row b*T+t: draft t of
        request b may see draft j); all on this object's device. B in 1..max_batch.
        num_slots: rows of the KV pools `run` will read; slots are checked against it, and
            `run` refuses a kv_cache with fewer rows. None: the slot range is not checked.
        check_values: read the values (indptr monotonic and within kv_indices, each request
            holding its T drafts, slots in range; one host sync). None: the object's setting
            (`check_values=` of the constructor, default True). Never during graph capture.

        The batch entry, its parameters and its split table are chosen here, on the host,
        from the static shapes; the NSPLIT of each request is chosen by the kernel on the
        device. No allocation, no launch, no host sync under capture: capture-safe. The
        tensors are referenced, not copied: keep them unchanged until the step's last `run`.
        The plan is also kept as the default of `run` (`self.last_plan`).

        Raises ValueError naming the argument. Returns the `StepPlan`.
        """
        dev = self.device
        for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("tree_mask", tree_mask)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device != dev:
                raise ValueError(f"{name}: on {t.device}, this VerifyAttention runs on {dev}")
        if kv_indptr.dim() != 1 or kv_indptr.dtype != torch.int32 or not kv_indptr.is_contiguous():
            raise ValueError(f"kv_indptr: expected a contiguous 1-D int32 tensor [B+1], got {_got(kv_indptr)}")
        B = kv_indptr.shape[0] - 1
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"kv_indptr: shape {tuple(kv_indptr.shape)} gives B={B} requests; this "
                             f"VerifyAttention serves 1..{self.max_batch}")
        if kv_indices.dim() != 1 or kv_indices.dtype not in (torch.int32, torch.int64) or \
                (kv_indices.numel() and kv_indices.stride(0) != 1):
            raise ValueError(f"kv_indices: expected a contiguous 1-D int32/int64 tensor, got {_got(kv_indices)}")
        rows = B * self.T
        if tuple(tree_mask.shape) != (rows,) or tree_mask.dtype != torch.int64 or not tree_mask.is_contiguous():
            raise ValueError(f"tree_mask: expected a contiguous int64 tensor [{rows}] (B*T for B={B}, T={self.T}), "
                             f"got {_got(tree_mask)}")
        if num_slots is not None and (isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1):
            raise ValueError(f"num_slots: expected an int >= 1 or None, got {num_slots!r}")
        problem = self._problems[B]
        do_check = flag(check_values, "check_values", self.check_values)
        if do_check and not is_capturing(dev):
            # the one host sync of a step, outside graphs (the api's checks: one definition)
            top = api_check_values(problem, _Pool(num_slots), kv_indptr, kv_indices, tree_mask)
            slots_used = top if num_slots is None else None
        else:
            slots_used = None
        p, params, table = self._launch[B]
        step = StepPlan(B, rows, kv_indptr, kv_indices, tree_mask, num_slots, p, params, table, problem, slots_used,
                        owner=self)
        self._step = step
        return step

    @property
    def last_plan(self) -> StepPlan | None:
        """The plan `run` uses when it is given none (the last one `plan` returned)."""
        return self._step

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None = None, *,
            lse: torch.Tensor | None = None, sm_scale: float | None = None, plan: StepPlan | None = None):
        """One layer's verify attention for a planned step: launches the tuned kernel(s) only.

        q `[B*T, H, Dk]` bf16 (last dim contiguous); kv_cache `[num_slots, Dk]` bf16 (rows
        contiguous, row stride may exceed Dk), this layer's pool; out `[B*T, H, Dv]` bf16
        (default: a view of the preallocated buffer, overwritten by the next run); lse
        optional `[B*T, H]` fp32 to fill (natural log). sm_scale: default the model's.
        plan: a `StepPlan` from `plan` (default: the last one).

        Checks shapes, dtypes and devices only (no tensor value is read); no allocation, no
        host sync, no packing: capture-safe. Shapes that do not match the plan raise a
        ValueError naming the argument. Returns out, or (out, lse) when lse is given.
        """
        step = self._step if plan is None else plan
        if not isinstance(step, StepPlan):
            raise ValueError("plan: no StepPlan to run; call plan(kv_indptr, kv_indices, tree_mask) first"
                             if step is None else f"plan: expected a StepPlan, got {type(step).__name__}")
        if step.owner is not self:   # its batch entry, problem and split table are another object's
            raise ValueError("plan: made by another VerifyAttention's plan(); run a plan of this object (its workspace "
                             "and launches are sized for its own tp, heads and max_batch)")
        dev, rows = self.device, step.rows
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != (rows, self.H, self.Dk):
            raise ValueError(f"q: expected [{rows}, {self.H}, {self.Dk}] (B*T, H, Dk) for the planned B={step.B}, "
                             f"T={self.T}, got {list(getattr(q, 'shape', []))}")
        if q.dtype != torch.bfloat16 or q.device != dev or q.stride(-1) != 1:
            raise ValueError(f"q: expected bf16 on {dev} with a contiguous last dim, got {q.dtype} on {q.device} "
                             f"(strides {list(q.stride())})")
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 2 or kv_cache.shape[1] != self.Dk:
            raise ValueError(f"kv_cache: expected [num_slots, {self.Dk}], got {list(getattr(kv_cache, 'shape', []))}")
        if kv_cache.dtype != torch.bfloat16 or kv_cache.device != dev or kv_cache.stride(-1) != 1:
            raise ValueError(f"kv_cache: expected bf16 rows, contiguous, on {dev}, got {kv_cache.dtype} on "
                             f"{kv_cache.device} (strides {list(kv_cache.stride())})")
        if step.slots_used is not None and kv_cache.shape[0] < step.slots_used:
            raise ValueError(f"kv_cache: {kv_cache.shape[0]} slots, but the planned kv_indices use slot "
                             f"{step.slots_used - 1}")
        if step.num_slots is not None and kv_cache.shape[0] < step.num_slots:
            raise ValueError(f"kv_cache: {kv_cache.shape[0]} slots, fewer than the num_slots={step.num_slots} "
                             "its plan checked the indices against")
        out_given = out is not None
        if out is None:
            if self.out_buf is None:
                raise ValueError("out: required (this VerifyAttention was built with preallocate_out=False)")
            out = self.out_buf[:rows]
        else:
            check_out(out, step.problem)
        if lse is not None:
            check_lse(lse, step.problem)
        if out_given or lse is not None:  # the runtime's own buffers share nothing with the caller's
            check_separate(dict(q=q, kv_cache=kv_cache, kv_indptr=step.kv_indptr, kv_indices=step.kv_indices,
                                tree_mask=step.tree_mask, workspace=self.workspace),
                           dict(out=out if out_given else None, lse=lse))
        if sm_scale is None:
            sm_scale = self.sm_scale
        elif isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not 0 < sm_scale < math.inf:
            raise ValueError(f"sm_scale: expected a positive finite float, got {sm_scale!r}")
        # a per-context dispatch launches every config of the entry: the one whose split table
        # holds the batch's bucket runs, the others exit at once (their bucket's value is 0)
        launch_all([(be, params, LaunchArgs(step.problem, q, kv_cache, step.kv_indptr, step.kv_indices,
                                            step.tree_mask, float(sm_scale), out, lse, self.workspace, table))
                    for params, table, be in step.plan.launches((step.params, step.split_table))])
        return out if lse is None else (out, lse)

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, tree_mask: torch.Tensor, out: torch.Tensor | None = None, *,
                 lse: torch.Tensor | None = None, sm_scale: float | None = None):
        """`plan` + `run` in one call (for one layer; a multi-layer step plans once).

        q `[B*T, H, Dk]` bf16; kv_cache `[num_slots, Dk]` bf16 (row stride may exceed Dk);
        kv_indptr `[B+1]` int32; kv_indices int32/int64 (request b: its prefix slots, then
        its T draft slots); tree_mask `[B*T]` int64 (bit j: may see draft j).
        out: `[B*T, H, Dv]` bf16, default a view of the preallocated buffer (overwritten by
        the next call). lse: optional `[B*T, H]` fp32 to fill. sm_scale: default the model's.

        No allocation; no host sync under graph capture (outside it, the value checks of
        `plan` read the metadata once unless built with check_values=False).
        Returns out, or (out, lse) when lse is given.
        """
        num_slots = kv_cache.shape[0] if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 2 else None
        step = self.plan(kv_indptr, kv_indices, tree_mask, num_slots=num_slots)
        return self.run(q, kv_cache, out, lse=lse, sm_scale=sm_scale, plan=step)


def _got(t: torch.Tensor) -> str:
    """dtype, shape and, where they are not a contiguous tensor's, strides: what a metadata error shows."""
    strides = "" if t.is_contiguous() else f" with strides {list(t.stride())} (not contiguous)"
    return f"{t.dtype} {list(t.shape)}{strides}"


@dataclass(frozen=True)
class StepPlan:
    """One step's metadata, validated and bound to the launch of its batch (`VerifyAttention.plan`).

    B requests, rows = B*T query rows; kv_indptr/kv_indices/tree_mask: the planned tensors
    (referenced); num_slots: the pool size the slots were checked against (None: unchecked);
    plan/params/split_table: the batch entry, its launch parameters (NSPLIT scaled to the
    batch) and device-side NSPLIT table; problem: the launch's `VerifyProblem`; slots_used: with
    the values checked and no num_slots, the highest slot kv_indices use + 1 (`run` refuses a
    smaller pool).
    """

    B: int
    rows: int
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    tree_mask: torch.Tensor
    num_slots: int | None
    plan: Plan
    params: Any
    split_table: SplitTable | None
    problem: VerifyProblem
    #: without num_slots, the highest slot the checked kv_indices use + 1 (None: not read)
    slots_used: int | None = None
    #: the VerifyAttention that made it: its workspace and launches are sized for this plan only
    owner: Any = dataclasses.field(default=None, repr=False, compare=False)


class _Pool:
    """Stands in for a KV pool in `api.check_values`, which reads only `shape[0]` (the slot
    count): plan checks slots before any layer's pool is at hand. No count: no bound."""

    def __init__(self, num_slots: int | None):
        self.shape = (num_slots if num_slots is not None else 1 << 62, 0)


def flag(value, name: str, default: bool | None) -> bool:
    """A switch argument: True or False, or None for `default` (when there is one). Anything
    else is refused: 0 or "False" would silently read as off or on."""
    if value is None and default is not None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False{' (or None)' if default is not None else ''}, "
                         f"got {value!r}")
    return value


def _scaled_nsplit(nsplit: int, tuned_batch: int, batch: int, most: int) -> int:
    """NSPLIT for `batch` requests from one tuned at `tuned_batch`: at most the tuned CTA
    count (floor), at least one split per request, and at most `most` (the backend's largest
    NSPLIT: a batch far under its bucket would otherwise ask for more splits than it takes)."""
    return min(most, max(1, nsplit * tuned_batch // batch))
