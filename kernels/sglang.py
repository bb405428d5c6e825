"""SGLang-layout adapter: run kvtune's tuned verify kernel where SGLang's Triton backend
calls `extend_attention_fwd` for MLA target-verify.

SGLang's layout (target verify, page size 1, `python/sglang/srt/layers/attention/
triton_backend.py` + `triton_ops/extend_attention.py`):
- `q_extend` `[B*T, H, Dk]`; `k_extend` `[B*T, 1, Dk]` the drafts' own keys (MLA: the
  latent + rope row), `v_extend` its first Dv columns; `o_extend` `[B*T, H, Dv]`.
- `k_buffer` `[num_slots, 1, Dk]` the layer's KV pool; `v_buffer` a view of its first Dv
  columns (MLA).
- `qo_indptr` `[B+1]` = `arange(B+1) * T`; `kv_indptr` `[B+1]` over the PREFIXES only,
  `kv_indices` the prefix slots.
- `custom_mask`: flat bool; request b's block starts at `mask_indptr[b]` and is
  `T x (P_b + T)` row-major (row stride P_b + T): row t = draft query t, columns = the
  prefix, then the T drafts. With `skip_prefix_custom_mask=True` (SGLang's default) the
  prefix columns are not read: the prefix is always visible, as in kvtune's contract.
- Before the call SGLang has already written the drafts' K/V into `k_buffer` at
  `forward_batch.out_cache_loc` (`set_kv_buffer(layer, out_cache_loc, k, v)`).

kvtune's kernel reads every key (prefix and draft) from the pool through one index list,
and takes the draft visibility as one int64 per query row. The adapter builds both on the
device with one small Triton launch (no host sync, no allocation: its buffers are
preallocated for max batch and context), then runs the tuned `VerifyAttention`. The
metadata is the same for every layer of a step, so `plan` packs it once per step and `run`
per layer only launches the kernel; `extend_attention_fwd` is both, per call:
- combined indices: request b's prefix slots followed by its T draft slots, at
  `kv_indptr[b] + b*T`; combined indptr `kv_indptr + arange(B+1)*T`.
- draft slots: `out_cache_loc` (pass `forward_batch.out_cache_loc`; the drafts' K/V are
  already there). Without it, the adapter needs `scratch_slots`: `max_batch*T` slots the
  caller reserved in the pool once at start-up; each `run` then copies that layer's
  `k_extend` there first (one small launch), so the pool need not hold the drafts.
- tree mask: bit j of row (b, t) = `custom_mask[mask_indptr[b] + t*(P_b+T) + P_b + j]`;
  without a custom mask, a chain (`is_causal`) or all drafts visible.

Buffers are sized for `max_batch * (max_context + T)` combined keys. Under CUDA graphs a
batch whose prefixes add up to more cannot be refused without a host sync: the extra keys
are dropped (never read or written out of bounds), the result of that batch is wrong, and
a sticky device flag records it (`overflowed()`, read it outside the graph). Eager calls
with `check_values=True` raise instead.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from .api import is_capturing
from .backends import get_backend
from .runtime import StepPlan, VerifyAttention, flag
from .shapes import cdiv, next_pow2

# how the draft visibility is given (the kernel's MASK_MODE): SGLang's flat custom mask, or
# none with is_causal (a chain) or without (every draft sees every draft)
MASK_CUSTOM, MASK_CAUSAL, MASK_FULL = 0, 1, 2
_PACK_BLOCK = 1024          # combined-index entries per program iteration
_PACK_MAX_CHUNKS = 64       # programs per request (each strides over its key range)


@triton.jit
def _pack_verify_kernel(
    KvIndptr, KvIndices, DraftSlots, Mask, MaskIndptr,
    OutIndptr, OutIndices, OutTree, Overflow,
    capacity, num_req,
    T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
    MASK_MODE: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    start = tl.load(KvIndptr + b).to(tl.int64)
    end = tl.load(KvIndptr + b + 1).to(tl.int64)
    P = end - start
    L = P + T
    dst = start + b * T                          # request b's first key in the combined list

    # -- combined key list: the prefix slots, then the T draft slots; entries past the
    #    capacity are dropped (the indptr below is clamped to match, and the flag set)
    for s in range(c * BLOCK, L, NUM_CHUNKS * BLOCK):
        offs = s + tl.arange(0, BLOCK)
        ok = offs < L
        in_prefix = offs < P
        pre = tl.load(KvIndices + start + offs, mask=in_prefix, other=0).to(tl.int64)
        dft = tl.load(DraftSlots + b * T + (offs - P), mask=ok & (offs >= P), other=0).to(tl.int64)
        slot = tl.where(in_prefix, pre, dft)
        tl.store(OutIndices + dst + offs, slot.to(OutIndices.dtype.element_ty), mask=ok & (dst + offs < capacity))

    if c == 0:
        tl.store(OutIndptr + b + 1, tl.minimum(end + (b + 1) * T, capacity).to(tl.int32))
        if b == 0:
            tl.store(OutIndptr, tl.minimum(start, capacity).to(tl.int32))
        if b == num_req - 1:
            # indptr is monotonic, so the last request's end is the furthest write
            over = (end + (b + 1) * T > capacity).to(tl.int32)
            tl.store(Overflow, tl.maximum(tl.load(Overflow), over))

        # -- packed tree mask: bit j of row t = draft query t may see draft key j
        t = tl.arange(0, BLOCK_T)
        j = tl.arange(0, BLOCK_T)
        t_ok = t < T
        j_ok = j < T
        if MASK_MODE == 0:                       # MASK_CUSTOM
            mstart = tl.load(MaskIndptr + b).to(tl.int64)
            mptr = Mask + mstart + t[:, None].to(tl.int64) * L + P + j[None, :]
            vis = tl.load(mptr, mask=t_ok[:, None] & j_ok[None, :], other=0) != 0
        elif MASK_MODE == 1:                     # MASK_CAUSAL
            vis = (j[None, :] <= t[:, None]) & j_ok[None, :]
        else:                                    # MASK_FULL
            vis = j_ok[None, :] & t_ok[:, None]
        one = tl.full([BLOCK_T, BLOCK_T], 1, tl.int64)
        bits = tl.where(vis, one << j[None, :].to(tl.int64), 0)
        tl.store(OutTree + b * T + t, tl.sum(bits, axis=1), mask=t_ok)   # disjoint bits: sum == or


@triton.jit
def _write_drafts_kernel(KExt, DraftSlots, KV, stride_kext, stride_kv,
                         T: tl.constexpr, BLOCK_T: tl.constexpr, DK: tl.constexpr, BLOCK_DK: tl.constexpr):
    """Copy request b's T draft key rows (this layer's k_extend) into their pool slots: the
    one per-layer launch besides the kernel, and only when SGLang did not store them."""
    b = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_DK)
    t_ok = t < T
    rows = b * T + t
    dmask = t_ok[:, None] & (d < DK)[None, :]
    k = tl.load(KExt + rows[:, None].to(tl.int64) * stride_kext + d[None, :], mask=dmask, other=0.0)
    slots = tl.load(DraftSlots + rows, mask=t_ok, other=0).to(tl.int64)
    tl.store(KV + slots[:, None] * stride_kv + d[None, :], k, mask=dmask)


def _index_tensor(x, name: str, device, min_numel: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64) or x.dim() != 1 or x.device != device:
        raise ValueError(f"{name}: expected a 1-D int32/int64 tensor on {device}, got {x.dtype} "
                         f"{list(x.shape)} on {x.device}")
    if x.numel() < min_numel:
        raise ValueError(f"{name}: needs at least {min_numel} entries, got {x.numel()}")
    if x.stride(0) != 1:
        raise ValueError(f"{name}: must be contiguous")
    return x


#: the runtime's argument names in its errors, as SGLang's call names them
_RUNTIME_NAMES = {"q": "q_extend", "kv_cache": "k_buffer", "out": "o_extend", "lse": "lse_extend"}


@dataclass(frozen=True)
class AdapterPlan:
    """One step's packed SGLang metadata (`SGLangVerifyAdapter.plan`): B requests, the
    runtime's `StepPlan` over the adapter's packed buffers, the drafts' slots, whether `run`
    copies each layer's k_extend there, and the slot count checked (None: unchecked)."""

    B: int
    verify_plan: StepPlan
    slots: torch.Tensor
    write: bool
    num_slots: int | None
    #: without num_slots, the highest slot the checked kv_indices and draft slots use + 1 (None: not read)
    slots_used: int | None = None
    #: the adapter that packed it and its plan count then: every plan packs into the adapter's one
    #: set of buffers (fixed addresses, so graphs can capture them), so only the latest can run
    owner: Any = field(default=None, repr=False, compare=False)
    generation: int = 0


class SGLangVerifyAdapter:
    """`extend_attention_fwd` for SGLang's MLA target-verify, backed by a `VerifyAttention`.

    Create once per (deployment, tp) with `from_defaults` (None when `KVTUNE_VERIFY=off`:
    keep SGLang's own kernel). Per step, `plan(...)` once with SGLang's forward metadata
    (qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, out_cache_loc), then
    `run(q_extend, k_buffer, o_extend)` per layer. `extend_attention_fwd` (or the object)
    takes SGLang's arguments plus `out_cache_loc=forward_batch.out_cache_loc` and does both.

    scratch_slots: optional 1-D int32/int64 tensor on the runtime's device, at least
    max_batch * T distinct slots of the KV pool that no prefix uses: where a plan is given no
    `out_cache_loc`, each step's drafts' keys are written there (request-major, T per request).

    Attributes: verify (the VerifyAttention), capacity (combined keys the buffers hold),
    allocated_bytes (everything preallocated, the runtime's included).
    """

    def __init__(self, verify: VerifyAttention, *, scratch_slots: torch.Tensor | None = None):
        self.verify = verify
        v = verify
        dev = v.device
        # plan packs the metadata with a Triton kernel whatever backend runs the attention (the
        # reference one too): say so here, not as Triton's driver error at the first plan
        why = get_backend("triton").supports(dev)
        if why:
            raise ValueError(f"device {dev}: the adapter packs each step's metadata with Triton. {why}")
        self.capacity = v.max_batch * (v.max_context + v.T)
        if self.capacity >= 2**31:
            raise ValueError(f"max_batch * (max_context + T) = {self.capacity} combined keys exceeds int32 indexing")
        self.indptr = torch.zeros(v.max_batch + 1, dtype=torch.int32, device=dev)
        # zeros, not empty: a dropped (overflowing) entry then still names a valid slot (0)
        self.indices = torch.zeros(self.capacity, dtype=torch.int32, device=dev)
        self.tree = torch.zeros(v.max_batch * v.T, dtype=torch.int64, device=dev)
        self.overflow = torch.zeros(1, dtype=torch.int32, device=dev)
        self.scratch_slots = None
        if scratch_slots is not None:
            self.scratch_slots = _index_tensor(scratch_slots, "scratch_slots", dev, v.max_batch * v.T)
        self.num_chunks = max(1, min(_PACK_MAX_CHUNKS, cdiv(v.max_context + v.T, _PACK_BLOCK)))
        self.allocated_bytes = v.allocated_bytes + 4 * (self.indptr.numel() + self.indices.numel() + 1) \
            + 8 * self.tree.numel()
        self._step: AdapterPlan | None = None
        self._generation = 0

    @classmethod
    def from_defaults(cls, tuned=None, tp: int = 1, max_batch: int = 1, max_context: int = 131072, device=None,
                      *, scratch_slots: torch.Tensor | None = None, **kwargs) -> "SGLangVerifyAdapter | None":
        """`VerifyAttention.from_defaults(...)` (same arguments; no output buffer: SGLang
        passes `o_extend`) wrapped in the adapter; None when `KVTUNE_VERIFY=off`. scratch_slots:
        as for the class (1-D int32/int64, >= max_batch * T slots, on the device)."""
        kwargs.setdefault("preallocate_out", False)
        verify = VerifyAttention.from_defaults(tuned, tp, max_batch, max_context, device, **kwargs)
        return None if verify is None else cls(verify, scratch_slots=scratch_slots)

    def overflowed(self) -> bool:
        """Whether any call since the last `reset_overflow()` had more combined keys than the
        buffers hold (its output was wrong). Reads the device: call outside graph capture."""
        return bool(self.overflow.item())

    def reset_overflow(self) -> None:
        self.overflow.zero_()

    # -- plan once per step (SGLang's forward metadata), run once per layer
    def plan(self, qo_indptr, kv_indptr, kv_indices, custom_mask=None, mask_indptr=None, *, is_causal: bool = False,
             out_cache_loc=None, max_len_extend=None, skip_prefix_custom_mask: bool = True,
             write_draft_kv: bool = False, num_slots: int | None = None,
             check_values: bool | None = None) -> AdapterPlan:
        """Take one step's SGLang target-verify metadata: validate it and pack it, once for all layers.

        qo_indptr `[B+1]` int32/int64 (= arange(B+1)*T); kv_indptr `[B+1]` int32/int64 over
        the PREFIXES; kv_indices int32/int64, the prefix slots; custom_mask flat bool/uint8
        (request b's block `T x (P_b+T)` row-major at mask_indptr[b]; its prefix columns are
        not read) with mask_indptr `[B+1]` int32/int64, or None: is_causal picks a chain or
        all-visible drafts. out_cache_loc `[>= B*T]` int32/int64: the drafts' slots in the
        pool (`forward_batch.out_cache_loc`); None = the adapter's scratch_slots, then `run`
        copies each layer's k_extend there. write_draft_kv: `run` also copies k_extend into
        out_cache_loc (when SGLang did not store the drafts). max_len_extend: T if given.
        num_slots: the pool's slot count; slots are checked against it (with check_values)
            and `run` refuses a smaller k_buffer. None: not checked.
        check_values: read the metadata's values (qo_indptr, kv_indptr monotonic, capacity,
            slot range; one host sync). None: the runtime's setting. Never under capture.

        One launch packs the combined index list (prefix slots, then draft slots), its indptr
        and the int64 tree mask into the preallocated buffers; no allocation, no host sync
        under capture. The plan is kept as `run`'s default. Errors name the argument.
        """
        v = self.verify
        T = v.T
        dev = v.device
        if custom_mask is not None and not skip_prefix_custom_mask:
            raise ValueError("skip_prefix_custom_mask: False would mask prefix keys; kvtune's contract always "
                             "shows the prefix (SGLang's target verify uses True)")
        qo_indptr = _index_tensor(qo_indptr, "qo_indptr", dev, 2)
        B = qo_indptr.numel() - 1
        if B > v.max_batch:
            raise ValueError(f"qo_indptr: B={B} requests; this adapter serves 1..{v.max_batch}")
        if max_len_extend is not None and (isinstance(max_len_extend, (bool, torch.Tensor)) or
                                           not isinstance(max_len_extend, numbers.Integral) or max_len_extend != T):
            raise ValueError(f"max_len_extend: {max_len_extend!r}; this adapter was built for T={T} draft tokens")
        kv_indptr = _index_tensor(kv_indptr, "kv_indptr", dev, B + 1)
        if kv_indptr.numel() != B + 1:
            raise ValueError(f"kv_indptr: expected {B + 1} entries (B+1), got {kv_indptr.numel()}")
        kv_indices = _index_tensor(kv_indices, "kv_indices", dev, 0)
        if custom_mask is not None:
            mode, mask, mask_indptr = MASK_CUSTOM, *_custom_mask_args(custom_mask, mask_indptr, B, T, dev)
        else:
            mode = MASK_CAUSAL if is_causal else MASK_FULL
            mask, mask_indptr = kv_indptr, kv_indptr     # unused pointers
        if out_cache_loc is not None:
            slots = _index_tensor(out_cache_loc, "out_cache_loc", dev, B * T)
            write = bool(write_draft_kv)
        elif self.scratch_slots is not None:
            slots, write = self.scratch_slots, True
        else:
            raise ValueError("out_cache_loc: needed to find the drafts' keys in k_buffer (pass "
                             "forward_batch.out_cache_loc), or build the adapter with scratch_slots=")
        if num_slots is not None and (isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1):
            raise ValueError(f"num_slots: expected an int >= 1 or None, got {num_slots!r}")
        do_check = flag(check_values, "check_values", v.check_values)
        if do_check and not is_capturing(dev):
            slots_used = self._check_values(B, T, qo_indptr, kv_indptr, kv_indices, slots, num_slots, custom_mask,
                                            mask_indptr)
        else:
            slots_used = None

        _pack_verify_kernel[(B, self.num_chunks)](
            kv_indptr, kv_indices, slots, mask, mask_indptr,
            self.indptr, self.indices, self.tree, self.overflow,
            self.capacity, B,
            T=T, BLOCK_T=max(16, next_pow2(T)), BLOCK=_PACK_BLOCK, NUM_CHUNKS=self.num_chunks,
            MASK_MODE=mode, num_warps=4,
        )
        # the packed buffers are right by construction (and clamped on overflow): no re-check
        vstep = v.plan(self.indptr[:B + 1], self.indices, self.tree[:B * T], check_values=False)
        self._generation += 1
        step = AdapterPlan(B, vstep, slots, write, num_slots, slots_used, owner=self, generation=self._generation)
        self._step = step
        return step

    @property
    def last_plan(self) -> AdapterPlan | None:
        """The plan `run` uses when it is given none (the last one `plan` returned)."""
        return self._step

    def run(self, q_extend, k_buffer, o_extend, *, v_buffer=None, k_extend=None, lse_extend=None, sm_scale=None,
            plan: AdapterPlan | None = None):
        """One layer's target-verify attention for a planned step: launches the tuned kernel(s).

        q_extend `[B*T, H, Dk]` bf16; k_buffer `[num_slots, 1, Dk]` or `[num_slots, Dk]`
        bf16, this layer's pool; o_extend `[B*T, H, Dv]` bf16, written; v_buffer (optional)
        must be k_buffer's first Dv columns; k_extend `[B*T, 1, Dk]` or `[B*T, Dk]` bf16,
        needed only when the plan writes the drafts' keys (scratch slots, write_draft_kv);
        lse_extend optional `[B*T, H]` fp32; sm_scale: default the model's (`verify.sm_scale`, from
        the defaults file or `from_defaults(sm_scale=)`), not SGLang's 1/sqrt(Dk), which would drop
        MLA's 1/sqrt(192) and YaRN's mscale. plan: an `AdapterPlan` from this adapter's latest
        `plan` (default); an earlier one is refused, since each plan repacks the same buffers.

        Shape, dtype and device checks only; no packing, no allocation, no host sync.
        Returns o_extend (or (o_extend, lse_extend)).
        """
        v = self.verify
        step = self._step if plan is None else plan
        if not isinstance(step, AdapterPlan):
            raise ValueError("plan: no AdapterPlan to run; call plan(qo_indptr, kv_indptr, kv_indices, ...) first"
                             if step is None else f"plan: expected an AdapterPlan, got {type(step).__name__}")
        if step.owner is not self:
            raise ValueError("plan: made by another SGLangVerifyAdapter; run a plan of this adapter")
        if step.generation != self._generation:
            raise ValueError(f"plan: superseded (plan {step.generation} of this adapter; plan {self._generation} has "
                             "since repacked its buffers, which every plan shares so CUDA graphs can capture them); "
                             "run the latest plan, or use one adapter per micro-batch")
        dev, rows = v.device, step.B * v.T
        for name, t, shape in (("q_extend", q_extend, (rows, v.H, v.Dk)), ("o_extend", o_extend, (rows, v.H, v.Dv))):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected {list(shape)} for the planned B={step.B}, T={v.T}, got {got}")
        kv = self._pool(k_buffer, v_buffer, v.Dk, v.Dv, dev)
        if kv.shape[0] >= 2**31:
            raise ValueError(f"k_buffer: {kv.shape[0]} slots exceed int32 indexing")
        if step.slots_used is not None and kv.shape[0] < step.slots_used:
            raise ValueError(f"k_buffer: {kv.shape[0]} slots, but the planned kv_indices / draft slots use slot "
                             f"{step.slots_used - 1}")
        if step.num_slots is not None and kv.shape[0] < step.num_slots:
            raise ValueError(f"k_buffer: {kv.shape[0]} slots, fewer than the num_slots={step.num_slots} planned")
        if step.write:
            k_ext = self._k_extend(k_extend, rows, v.Dk, kv.dtype)
            _write_drafts_kernel[(step.B,)](k_ext, step.slots, kv, k_ext.stride(0), kv.stride(0), T=v.T,
                                            BLOCK_T=max(16, next_pow2(v.T)), DK=v.Dk, BLOCK_DK=next_pow2(v.Dk),
                                            num_warps=4)
        try:   # sm_scale None: the runtime's, the model's scale
            return v.run(q_extend, kv, o_extend, lse=lse_extend, sm_scale=sm_scale, plan=step.verify_plan)
        except ValueError as exc:  # the runtime's checks, in the caller's argument names
            head, sep, rest = str(exc).partition(":")
            if sep and head in _RUNTIME_NAMES:
                for ours, theirs in _RUNTIME_NAMES.items():  # check_separate names a second argument
                    rest = rest.replace(f" shares memory with {ours}:", f" shares memory with {theirs}:")
                raise ValueError(f"{_RUNTIME_NAMES[head]}:{rest}") from None
            raise

    @staticmethod
    def _k_extend(k_extend, rows: int, Dk: int, dtype) -> torch.Tensor:
        """k_extend as `[rows, Dk]` (a view: nothing is copied), or a ValueError."""
        k_ext = None
        if isinstance(k_extend, torch.Tensor):
            k_ext = k_extend[:, 0] if k_extend.dim() == 3 and k_extend.shape[1] == 1 else k_extend
        if k_ext is None or k_ext.dim() != 2 or tuple(k_ext.shape) != (rows, Dk) or k_ext.dtype != dtype \
                or k_ext.stride(-1) != 1:
            raise ValueError(f"k_extend: expected [{rows}, 1, {Dk}] {dtype} with contiguous rows, got "
                             f"{getattr(k_extend, 'dtype', None)} {list(getattr(k_extend, 'shape', []))}")
        return k_ext

    # -- SGLang's call: plan + run
    def extend_attention_fwd(self, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                             kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend,
                             k_scale=1.0, v_scale=1.0, sm_scale=None, logit_cap=0.0, skip_prefix_custom_mask=True,
                             sliding_window_size=-1, sinks=None, window_kv_offsets=None, xai_temperature_len=-1,
                             lse_extend=None, *, out_cache_loc=None, write_draft_kv: bool = False):
        """SGLang's `extend_attention_fwd` argument layout (the version with k_scale/v_scale
        after max_len_extend; pass `sm_scale=` by keyword on older SGLang): `plan` + `run`
        in one call. A 61-layer step should `plan` once and `run` per layer instead.

        q_extend `[B*T, H, Dk]` bf16; k_extend `[B*T, 1, Dk]` or `[B*T, Dk]` bf16 (read only
        when the adapter writes the drafts' keys); v_extend unused (MLA: part of k);
        o_extend `[B*T, H, Dv]` bf16, written; k_buffer `[num_slots, 1, Dk]` or
        `[num_slots, Dk]` bf16; v_buffer its first Dv columns (a view); qo_indptr `[B+1]`
        (= arange*T); kv_indptr `[B+1]` int32/int64 over prefixes; kv_indices the prefix
        slots; custom_mask flat bool/uint8 (or None: is_causal picks chain or all-visible);
        mask_indptr `[B+1]` int32/int64; max_len_extend == T; sm_scale: None is the model's
        (`verify.sm_scale`), not SGLang's 1/sqrt(Dk).
        out_cache_loc: `[>= B*T]` int32/int64, the drafts' slots in k_buffer (SGLang's
            `forward_batch.out_cache_loc`); None = use `scratch_slots` and copy k_extend there.
        write_draft_kv: also copy k_extend into `out_cache_loc` (when SGLang did not save it).
        lse_extend: optional `[B*T, H]` fp32, filled with the natural-log LSE.

        Returns o_extend (or (o_extend, lse_extend) when lse_extend is given).
        Unsupported SGLang options (logit cap, sliding window, sinks, xai temperature, KV
        scales, a prefix custom mask) raise ValueError: use SGLang's kernel for those.
        """
        v = self.verify
        # -- options the tuned kernel does not implement: refuse rather than ignore
        if logit_cap:
            raise ValueError(f"logit_cap: {logit_cap!r}; kvtune's verify kernel has no logit cap")
        if sliding_window_size is not None and sliding_window_size > 0:
            raise ValueError(f"sliding_window_size: {sliding_window_size}; not supported by kvtune's verify kernel")
        for name, val in (("sinks", sinks), ("window_kv_offsets", window_kv_offsets)):
            if val is not None:
                raise ValueError(f"{name}: not supported by kvtune's verify kernel (pass None)")
        if xai_temperature_len is not None and xai_temperature_len > 0:
            raise ValueError(f"xai_temperature_len: {xai_temperature_len}; not supported")
        for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None and (isinstance(val, (bool, torch.Tensor)) or not isinstance(val, numbers.Real)
                                    or float(val) != 1.0):
                raise ValueError(f"{name}: {val!r}; kvtune reads an unscaled bf16 KV cache (1.0 or None). On an "
                                 "SGLang without k_scale/v_scale arguments pass sm_scale= by keyword")
        if not isinstance(q_extend, torch.Tensor) or q_extend.dim() != 3:
            raise ValueError("q_extend: expected a [B*T, H, Dk] tensor")
        if isinstance(qo_indptr, torch.Tensor) and qo_indptr.dim() == 1 and \
                q_extend.shape[0] != (qo_indptr.numel() - 1) * v.T:
            raise ValueError(f"q_extend: {q_extend.shape[0]} rows, expected B*T = {qo_indptr.numel() - 1}*{v.T} "
                             "(B from qo_indptr)")
        kv = self._pool(k_buffer, v_buffer, v.Dk, v.Dv, q_extend.device)
        self._k_extend(k_extend, q_extend.shape[0], v.Dk, kv.dtype)   # SGLang always passes it: check it always
        step = self.plan(qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, is_causal=is_causal,
                         out_cache_loc=out_cache_loc, max_len_extend=max_len_extend,
                         skip_prefix_custom_mask=skip_prefix_custom_mask, write_draft_kv=write_draft_kv,
                         num_slots=kv.shape[0])
        return self.run(q_extend, k_buffer, o_extend, v_buffer=v_buffer, k_extend=k_extend, lse_extend=lse_extend,
                        sm_scale=sm_scale, plan=step)

    __call__ = extend_attention_fwd

    @staticmethod
    def _pool(k_buffer, v_buffer, Dk: int, Dv: int, dev) -> torch.Tensor:
        """k_buffer as `[num_slots, Dk]` (a view), after checking v_buffer is its first Dv columns."""
        if not isinstance(k_buffer, torch.Tensor) or k_buffer.device != dev:
            raise ValueError(f"k_buffer: expected a tensor on {dev}")
        if k_buffer.dim() == 3 and k_buffer.shape[1] == 1:
            kv = k_buffer[:, 0, :]
        elif k_buffer.dim() == 2:
            kv = k_buffer
        else:
            raise ValueError(f"k_buffer: expected [num_slots, 1, {Dk}] (one MLA latent head), "
                             f"got {list(k_buffer.shape)}")
        if kv.shape[1] != Dk:
            raise ValueError(f"k_buffer: row width {kv.shape[1]}, expected Dk={Dk}")
        if kv.dtype != torch.bfloat16:   # checked before k_extend, which must match it
            raise ValueError(f"k_buffer: expected bf16, got {kv.dtype} (kvtune's kernels read a bf16 KV cache; "
                             "an fp8 one is not supported yet)")
        if v_buffer is not None:
            if not isinstance(v_buffer, torch.Tensor):
                raise ValueError(f"v_buffer: expected a view of k_buffer's first {Dv} columns (MLA) or None, got "
                                 f"{type(v_buffer).__name__}")
            vb = v_buffer[:, 0, :] if v_buffer.dim() == 3 and v_buffer.shape[1] == 1 else v_buffer
            if vb.dim() != 2 or vb.data_ptr() != kv.data_ptr() or vb.shape[1] != Dv or vb.stride(0) != kv.stride(0):
                raise ValueError(f"v_buffer: must be a view of k_buffer's first {Dv} columns (MLA); got "
                                 f"{list(v_buffer.shape)} at another address or stride")
        return kv

    def _check_values(self, B, T, qo_indptr, kv_indptr, kv_indices, slots, num_slots, custom_mask=None,
                      mask_indptr=None) -> int | None:
        """Host-syncing checks of the SGLang metadata (once per step, outside graph capture), the
        mask's layout included when there is a custom_mask. Returns, without num_slots, the highest
        slot used + 1 (for `run`'s k_buffer check), else None."""
        want = torch.arange(B + 1, device=qo_indptr.device, dtype=torch.int64) * T
        if not torch.equal(qo_indptr.to(torch.int64), want):
            raise ValueError(f"qo_indptr: expected arange(B+1)*T (every request verifies T={T} drafts), "
                             f"got {qo_indptr.tolist()}")
        ip = kv_indptr.to("cpu", torch.int64)
        if bool((ip[1:] < ip[:-1]).any()) or int(ip[0]) < 0 or int(ip[-1]) > kv_indices.numel():
            raise ValueError(f"kv_indptr: must be monotonic within kv_indices' {kv_indices.numel()} entries, "
                             f"got {ip.tolist()}")
        if int(ip[-1]) + B * T > self.capacity:
            raise ValueError(f"kv_indptr: {int(ip[-1])} prefix keys + {B * T} drafts exceed the adapter's "
                             f"capacity {self.capacity} (max_batch * (max_context + T)); build it larger")
        if custom_mask is not None:
            _check_mask_blocks(T, ip, custom_mask, mask_indptr)
        top = 0
        for name, used in (("kv_indices", kv_indices[int(ip[0]):int(ip[-1])]),
                           ("out_cache_loc" if slots is not self.scratch_slots else "scratch_slots", slots[:B * T])):
            if not used.numel():
                continue
            lo, hi = int(used.min()), int(used.max())
            if lo < 0 or (num_slots is not None and hi >= num_slots):
                bad = lo if lo < 0 else hi
                raise ValueError(f"{name}: slot {bad} out of range [0, {num_slots if num_slots is not None else 'inf'})"
                                 " (num_slots)")
            top = max(top, hi + 1)
        _check_draft_slots(kv_indices[int(ip[0]):int(ip[-1])], slots[:B * T],
                           "scratch_slots" if slots is self.scratch_slots else "out_cache_loc")
        # without num_slots, run refuses a k_buffer these slots would read or write past
        return top if num_slots is None else None


def _check_draft_slots(prefix: torch.Tensor, drafts: torch.Tensor, name: str) -> None:
    """A ValueError naming `name` unless the B*T draft slots are distinct and none is a prefix slot:
    a draft slot shared with a prefix key (or another draft) would be read as both, and where
    `run` writes the drafts' keys it would overwrite the other key in the pool."""
    d = drafts.to(torch.int64)
    vals, counts = torch.unique(d, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{name}: slot {int(vals[counts > 1][0])} is given to two draft tokens; each draft needs "
                         "its own slot")
    if prefix.numel():
        shared = torch.isin(d, prefix.to(torch.int64))
        if bool(shared.any()):
            i = int(torch.nonzero(shared)[0])
            raise ValueError(f"{name}: slot {int(d[i])} (draft row {i}) is also a prefix slot in kv_indices; a "
                             "draft's key must live in a slot of its own")


def _custom_mask_args(custom_mask, mask_indptr, B: int, T: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """custom_mask as the pack kernel reads it (uint8 view) and mask_indptr, after the checks
    that need no value read."""
    if not isinstance(custom_mask, torch.Tensor) or custom_mask.dim() != 1 or custom_mask.device != dev \
            or custom_mask.dtype not in (torch.bool, torch.uint8, torch.int8):
        raise ValueError("custom_mask: expected a flat bool (or uint8) tensor on the device")
    mask_indptr = _index_tensor(mask_indptr, "mask_indptr", dev, B + 1)
    if mask_indptr.numel() != B + 1:
        raise ValueError(f"mask_indptr: expected {B + 1} entries (B+1), got {mask_indptr.numel()}")
    if custom_mask.numel() < B * T * T:  # each request's block holds T x (P_b + T) >= T x T entries
        raise ValueError(f"custom_mask: {custom_mask.numel()} entries, fewer than the B*T*T = {B * T * T} "
                         f"that {B} requests' T x (P_b+T) blocks need at least")
    return (custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask), mask_indptr


def _check_mask_blocks(T: int, ip: torch.Tensor, custom_mask: torch.Tensor, mask_indptr: torch.Tensor) -> None:
    """Host-syncing check of SGLang's mask layout: request b's `T x (P_b+T)` block starts at
    mask_indptr[b], the blocks back to back (mask_indptr[b+1] - mask_indptr[b] = T (P_b + T)) and
    inside custom_mask. The pack kernel reads the mask at those offsets without bounds. ip:
    kv_indptr on the host, int64."""
    mi = mask_indptr.to("cpu", torch.int64)
    want = T * ((ip[1:] - ip[:-1]) + T)
    got = mi[1:] - mi[:-1]
    if int(mi[0]) < 0 or not torch.equal(got, want):
        bad = int((got != want).nonzero()[0]) if not torch.equal(got, want) else 0
        raise ValueError(f"mask_indptr: request {bad}'s block must hold T x (P_b+T) = {int(want[bad])} entries "
                         f"(T={T}, P_b={int(ip[bad + 1] - ip[bad])}) from a start >= 0, got mask_indptr "
                         f"{int(mi[bad])}..{int(mi[bad + 1])}")
    if int(mi[-1]) > custom_mask.numel():
        raise ValueError(f"custom_mask: {custom_mask.numel()} entries, but mask_indptr places the blocks at "
                         f"{int(mi[0])}..{int(mi[-1])} (SGLang's mask_indptr starts at 0): one of the two is wrong")


def sglang_verify_args(inp, *, mask_dtype: torch.dtype = torch.bool, indices_dtype: torch.dtype = torch.int32,
                       loc_dtype: torch.dtype = torch.int64) -> dict:
    """Rewrite kvtune-layout `VerifyInputs` in SGLang's target-verify layout (tests, benchmarks).

    Returns the keyword arguments of `extend_attention_fwd` plus `out_cache_loc`:
    kv_indptr/kv_indices over the prefixes only, the drafts' slots as out_cache_loc (their
    keys stay in the pool, as after SGLang's set_kv_buffer) and copied to k_extend
    `[B*T, 1, Dk]`, the flat custom mask (row stride P_b + T, prefix columns True) with
    its mask_indptr, o_extend `[B*T, H, Dv]` filled with NaN. Reads the inputs on the host.
    """
    from .reference import visibility
    B, T, dev = inp.B, inp.T, inp.q.device
    Dv = inp.kv_lora_rank
    ip = inp.kv_indptr.tolist()
    plens = [ip[b + 1] - ip[b] - T for b in range(B)]
    pre = torch.cat([inp.kv_indices[ip[b]:ip[b] + plens[b]] for b in range(B)])
    loc = torch.cat([inp.kv_indices[ip[b + 1] - T:ip[b + 1]] for b in range(B)]).to(loc_dtype)
    mask = torch.cat([visibility(T, plens[b], inp.tree_mask[b * T:(b + 1) * T]).flatten() for b in range(B)])
    k_buffer = inp.kv_cache.unsqueeze(1)
    k_extend = inp.kv_cache[loc.long()].unsqueeze(1).contiguous()
    return dict(
        q_extend=inp.q, k_extend=k_extend, v_extend=k_extend[..., :Dv],
        o_extend=torch.full((B * T, inp.q.shape[1], Dv), float("nan"), dtype=torch.bfloat16, device=dev),
        k_buffer=k_buffer, v_buffer=k_buffer[..., :Dv],
        qo_indptr=torch.arange(B + 1, dtype=torch.int32, device=dev) * T,
        kv_indptr=torch.tensor([0] + plens, device=dev).cumsum(0).to(torch.int32),
        kv_indices=pre.to(indices_dtype), custom_mask=mask.to(mask_dtype), is_causal=False,
        mask_indptr=torch.tensor([0] + [T * (p + T) for p in plens], device=dev).cumsum(0),
        max_len_extend=T, sm_scale=inp.sm_scale, out_cache_loc=loc)
