"""How the runtime serves each batch entry of the exported YAML: `Plan` and the helpers that
build plans from the YAML (`plans`), the model's shape on this rank (`model_on_rank`).

A plan is one batch entry (or the untuned fallback): its backend, parameters and split table,
and, for a per-context dispatch (buckets of the entry naming their own compile-time params, on
the entry's backend or another, `TunedEntry.configs`), the other configs' (params, split table,
backend) triples, launched after the first on every call; each table holds 0 at the buckets
another config serves, and a launch whose batch falls there exits at once (`SplitTable`).

Never imports the tuner, Optuna or pandas.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .api import DEFAULT_KV_LORA_RANK
from .backends import Backend, SplitTable, bucket_index, get_backend, params_from_dict, split_bounds
from .lookup import ENV_VERIFY, ProvenanceError, warn_once
from .shapes import MAX_DRAFT_TOKENS, VerifyProblem
from .tuned import TunedDefaults, TunedEntry

#: the untuned fallback where the CUDA kernel cannot run (CPU tensors under Triton's
#: interpreter, no NVRTC, a T whose CUDA default does not fit the GPU's shared memory)
DEFAULT_BACKEND = "triton"


def default_backend(problem: VerifyProblem) -> str:
    """The backend of the untuned fallback for `problem`: cuda where its default config runs the
    problem on its device (every GPU from sm_80 at the contract's Dk 576 / Dv 512; the H200
    measured Triton's default 3-9x slower), else DEFAULT_BACKEND (Triton serves any Dk, Dv, T)."""
    if not problem.is_cuda:
        return DEFAULT_BACKEND
    try:
        be = get_backend("cuda")
    except ImportError:
        return DEFAULT_BACKEND
    if be.supports(problem.device) is not None:
        return DEFAULT_BACKEND
    params = be.default_params(problem)
    try:
        be.check_params(params, problem)     # the model's dimensions, T's rules
    except ValueError:
        return DEFAULT_BACKEND
    # the device's own limit, as the launch checks it (an arch without a table entry included)
    return DEFAULT_BACKEND if be.device_reject(params, problem.T, problem.device) else "cuda"


#: how a plan without a YAML entry names its source (`Plan.untuned`)
UNTUNED_SOURCE = "untuned default"

@dataclass(frozen=True)
class Plan:
    """How batches of up to `max_batch` requests run (one per batch entry of the YAML).

    split_table: device-side NSPLIT per context bucket (None: the grid's NSPLIT always).
    entry: the YAML entry (None for the untuned fallback); `source` says where it came from.
    others: a per-context dispatch's other configs, (params, split table, backend) each, launched
    after this one on every call (empty: one config serves every bucket).
    """

    max_batch: int
    backend: Backend
    params: Any
    split_table: SplitTable | None
    entry: TunedEntry | None
    source: str
    others: tuple = ()

    @property
    def untuned(self) -> bool:
        """Whether this plan is the fallback backend's untuned default (no YAML entry for its tp)."""
        return self.entry is None and self.source.startswith(UNTUNED_SOURCE)

    def bucket_nsplits(self) -> tuple[int, ...]:
        """The NSPLIT of each context bucket of the entry, within its config's grid (the plan's
        params.NSPLIT, or under a dispatch the bucket's own config's)."""
        out = []
        configs = self.entry.configs()
        for i in range(len(self.entry.buckets)):
            k = self._config_of(configs, i)
            _, cp, ns = configs[k]
            grid = getattr(self.params, "NSPLIT", ns[i]) if k == 0 else cp.get("NSPLIT", ns[i])
            out.append(max(1, min(ns[i], grid)))
        return tuple(out)

    @staticmethod
    def _config_of(configs, i: int) -> int:
        return next(k for k, (_, _, ns) in enumerate(configs) if ns[i] > 0)

    def bucket_of(self, prefix_len: int, T: int, batch: int = 1) -> int:
        """The index of the context bucket the device picks for `batch` requests of `prefix_len`
        tokens and T drafts each (host mirror): a backend that picks NSPLIT per request looks
        up the request's keys (`TunedEntry.bucket_for`), one whose NSPLIT counts the batch's
        splits the batch's keys against bounds scaled by the entry's batch (`split_bounds`)."""
        if not self.backend.nsplit_per_batch:
            return self.entry.buckets.index(self.entry.bucket_for(prefix_len))
        bounds = split_bounds(self.backend, [b.max_context for b in self.entry.buckets], T, self.max_batch)
        return bucket_index(bounds, batch * (prefix_len + T))

    def nsplit_for(self, prefix_len: int, T: int, batch: int = 1) -> int:
        """The NSPLIT the kernel picks on the device for `batch` requests of `prefix_len` tokens
        and T drafts each, at this plan's own batch bucket (host mirror of the device's choice)."""
        grid = getattr(self.params, "NSPLIT", 1)
        if self.split_table is None:
            return grid
        return self.bucket_nsplits()[self.bucket_of(prefix_len, T, batch)]

    def launches(self, first: tuple | None = None) -> tuple:
        """Every launch of a call, in order: (params, split table, backend) each. `first`: the
        (params, split table) of the plan's own launch where a call's are not the plan's (a batch
        past its bucket, NSPLIT scaled)."""
        params, table = first if first is not None else (self.params, self.split_table)
        return ((params, table, self.backend), *self.others)

    def launch_for_keys(self, keys: int, T: int) -> tuple:
        """The (params, split table, backend) of the launch that serves a batch of `keys` keys in
        all (prefixes and drafts): this plan's, or under a per-context dispatch its bucket's
        config's, the bucket chosen as the device chooses it (the first split-table bound >=
        keys, else the last)."""
        if not self.others:
            return self.launches()[0]
        bounds = split_bounds(self.backend, [b.max_context for b in self.entry.buckets], T, self.max_batch)
        return self.launches()[self._config_of(self.entry.configs(), bucket_index(bounds, keys))]

    def params_for_keys(self, keys: int, T: int):
        """The parameters of the launch that serves a batch of `keys` keys (`launch_for_keys`)."""
        return self.launch_for_keys(keys, T)[0]


def problem_of(kw: dict, batch: int) -> VerifyProblem:
    return VerifyProblem(B=batch, T=kw["T"], H=kw["H"], Dk=kw["Dk"], Dv=kw["Dv"], device=kw["device"])


def _usable_backend(name: str, device: torch.device, what: str) -> Backend:
    """The backend `name`, or a ValueError naming `what` asked for it and why it cannot run here."""
    try:
        be = get_backend(name)
    except ImportError as e:
        raise ValueError(f"{what}: backend {name!r} cannot be imported: {e}") from None
    why = be.supports(device)
    if why:
        raise ValueError(f"{what}: backend {name!r} cannot run on {device}: {why}")
    return be


def _fallback_hint(fallback: str, device) -> str:
    """The allow_mismatch hint, where the fallback backend can run here (else it would fail alike)."""
    try:
        _usable_backend(fallback, device, "fallback")
    except ValueError:
        return ""
    return f" (allow_mismatch=True falls back to {fallback}'s defaults)"


def _plan_from_entry(e: TunedEntry, forced: str | None, fallback: str, allow_mismatch: bool, kw: dict,
                     max_batch: int, source: str) -> Plan:
    """A Plan from one YAML entry. The entry's parameters and split table, unless
    `KVTUNE_VERIFY` forces another backend, or (allow_mismatch) the entry's backend cannot
    run here: then the `fallback` backend's default parameters, logged once."""
    if e.heads_per_rank != kw["H"]:
        warn_once(f"heads:{source}", f"kvtune: {source}: tuned for {e.heads_per_rank} heads per rank, "
                   f"running {kw['H']}")
    why = None
    # a forced backend serves alone: an entry whose buckets launch other backends too is overridden
    overridden = forced is not None and [forced] != e.backends()
    usable = {}
    if not overridden:
        try:
            for name in e.backends():
                usable[name] = _usable_backend(name, kw["device"], f"{source}: backend")
        except ValueError as err:
            if forced is not None or not allow_mismatch:
                raise ValueError(f"{err}{_fallback_hint(fallback, kw['device'])}") from None
            why = f"{err}; falling back to {fallback}"
    if overridden or why is not None:
        be = _usable_backend(fallback, kw["device"], f"{ENV_VERIFY}={forced}" if forced else "backend")
        params = be.default_params(problem_of(kw, min(e.max_batch, max_batch)))
        why = why or f"{ENV_VERIFY}={forced} overrides {source}'s backend " + \
            (repr(e.backend) if len(e.backends()) == 1 else f"dispatch over {e.backends()}")
        warn_once(f"fallback:{source}:{fallback}", f"kvtune: {why}: running {be.name} " +
                  (f"with its default parameters {params}" if params is not None else "(it takes no parameters)"))
        return Plan(e.max_batch, be, params, None, None, f"{source}, replaced by {be.name} defaults")
    be = usable[e.backend]
    params = params_from_dict(be.params_type, dict(e.params), where=f"{source}: params", complete=True) \
        if be.params_type is not None else None
    grid = getattr(params, "NSPLIT", None)
    configs = e.configs()
    for b in usable.values():
        if len(configs) > 1 and not b.nsplit_per_batch:
            raise ValueError(f"{source}: buckets name their own params (a per-context dispatch), which backend "
                             f"{b.name} cannot serve (it picks NSPLIT per request; cuda, wgmma and wgmma_km can)")
    if grid is None:
        return Plan(e.max_batch, be, params, None, e, source)
    # the kernel compares L_b = prefix + T keys with the bound; the YAML's bounds are prefixes
    bounds = split_bounds(be, [b.max_context for b in e.buckets], kw["T"], e.max_batch)
    table = SplitTable.build(bounds, [min(n, grid) for n in configs[0][2]], kw["device"])
    others = tuple((params_from_dict(usable[name].params_type, cp, where=f"{source}: buckets[].params",
                                     complete=True),
                    SplitTable.build(bounds, ns, kw["device"]), usable[name]) for name, cp, ns in configs[1:])
    return Plan(e.max_batch, be, params, table, e, source, others)


def model_on_rank(tuned: TunedDefaults | None, tp: int, allow_mismatch: bool, **given) -> dict:
    """The model's shape on this rank (T, H, Dk, Dv, sm_scale): the YAML's `model` (heads =
    num_heads / tp), unless the caller gives a value, which must then match it (or
    allow_mismatch); a given sm_scale is used as given (it does not change what was tuned),
    logged once where it differs from the YAML's. Without a YAML, draft_tokens, heads and
    sm_scale must be given (one error names every missing one); kv_lora_rank and rope_dim
    default to 512 and 64."""
    m = tuned.model if tuned is not None else {}
    src = tuned.source if tuned is not None else "<no tuned defaults>"
    if tuned is None:
        missing = [f"{n}=" for n in ("draft_tokens", "heads", "sm_scale") if given[n] is None]
        if missing:
            # a guessed 192**-0.5 would drop the model's YaRN mscale (Kimi-K2: 0.131, not 0.072)
            raise ValueError(f"{', '.join(missing)}: no tuned defaults file gives the model's shape; pass "
                             f"{', '.join(missing)} (heads: per rank; sm_scale: the model's softmax scale, "
                             "YaRN mscale included)")

    for name in ("draft_tokens", "heads", "kv_lora_rank", "rope_dim"):
        v = given[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name}: expected an int >= 1 (or None: the YAML's), got {v!r}")
    v = given["sm_scale"]
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
        raise ValueError(f"sm_scale: expected a positive finite float (or None: the YAML's), got {v!r}")

    def pick(name, from_yaml, default=None):
        v = given[name]
        if from_yaml is None:
            return v if v is not None else default
        if v is not None and v != from_yaml:
            msg = f"{src}: {name}: tuned for {from_yaml!r}, runtime asked for {v!r}"
            if not allow_mismatch:
                raise ProvenanceError(msg + " (pass allow_mismatch=True to use these defaults anyway)")
            warn_once(f"model:{msg}", f"kvtune: {msg}")
            return v
        return from_yaml

    yaml_heads = None
    if tuned is not None:
        if m["num_heads"] % tp:
            raise ValueError(f"tp: {tp} does not divide {src}: model.num_heads={m['num_heads']}")
        yaml_heads = m["num_heads"] // tp
    T = pick("draft_tokens", m.get("draft_tokens"))
    H = pick("heads", yaml_heads)
    Dv = pick("kv_lora_rank", m.get("kv_lora_rank"), DEFAULT_KV_LORA_RANK)
    dpe = pick("rope_dim", m.get("qk_rope_head_dim"), 64)
    sm_scale = given["sm_scale"] if given["sm_scale"] is not None else m["sm_scale"]
    if tuned is not None and not math.isclose(sm_scale, m["sm_scale"], rel_tol=1e-4):
        msg = f"{src}: model.sm_scale is {m['sm_scale']!r}, running with the given sm_scale={sm_scale!r}"
        warn_once(f"model:{msg}", f"kvtune: {msg}")
    if not 1 <= T <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft_tokens: {T} not in [1, {MAX_DRAFT_TOKENS}]")
    return dict(T=T, H=H, Dk=Dv + dpe, Dv=Dv, sm_scale=sm_scale)


def plans(tuned: TunedDefaults | None, kw: dict, mode: str, backend: str | None, allow_mismatch: bool) -> list[Plan]:
    """One plan per batch entry of tp this rank can hit (up to the first covering max_batch);
    the untuned default of the fallback backend without entries. Each plan's params are checked
    at the largest batch it serves."""
    tp, max_batch, device = kw["tp"], kw["max_batch"], kw["device"]
    src = tuned.source if tuned is not None else "<no tuned defaults>"
    forced = mode if mode != "auto" else None
    entries = tuned.entries_for(tp) if tuned is not None else []
    if tuned is not None and not entries:
        warn_once(f"notp:{src}:{tp}", f"kvtune: {src} has no entry for tp={tp}; falling back to the "
                  "backend's untuned default parameters")
    plans: list[Plan] = []
    fallback = forced or backend or default_backend(problem_of(kw, max_batch))
    for e in entries:
        plans.append(_plan_from_entry(e, forced, fallback, allow_mismatch, kw, max_batch,
                                      f"{src} (tp={tp}, max_batch={e.max_batch})"))
        if e.max_batch >= max_batch:
            break
    if not plans:
        be = _usable_backend(fallback, device, f"{ENV_VERIFY}={forced}" if forced else "backend")
        params = be.default_params(problem_of(kw, max_batch))
        plans.append(Plan(max_batch, be, params, None, None, f"{UNTUNED_SOURCE} of {fallback}"))
    for p in plans:
        for params, _, be in p.launches():   # a dispatch's every config
            try:
                be.check_params(params, problem_of(kw, min(p.max_batch, max_batch)))
            except ValueError as exc:  # the YAML's params (or the model) do not fit this rank's problem
                raise type(exc)(f"{p.source}: params {params}: {exc}") from None
    return plans
