"""Typed descriptions of the model and of one verify call.

`ModelShape` is what a deployment names (heads, MLA widths, draft tokens); `VerifyProblem`
is what one call of `verify_attention` sees after its metadata was checked.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_DRAFT_TOKENS = 64  # the tree mask is one int64 per query row


@dataclass(frozen=True)
class ModelShape:
    """An MLA model in absorbed form, as the verify kernel sees it.

    num_heads: query heads of the whole model (split over tp ranks).
    kv_lora_rank: Dv, the latent width; V is the first Dv columns of a cached row.
    qk_rope_head_dim: the rope part; Dk = kv_lora_rank + qk_rope_head_dim.
    draft_tokens: T, draft tokens per request (1..64).
    sm_scale: softmax scale; None means (qk_nope_head_dim + qk_rope_head_dim) ** -0.5.
    qk_nope_head_dim: per-head nope width before absorption (only used for sm_scale).
    """

    num_heads: int
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    draft_tokens: int = 9
    sm_scale: float | None = None
    qk_nope_head_dim: int = 128

    def __post_init__(self):
        for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "draft_tokens", "qk_nope_head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {v!r}")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"ModelShape.draft_tokens must be <= {MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.sm_scale is not None and not (isinstance(self.sm_scale, (int, float)) and self.sm_scale > 0
                                              and math.isfinite(self.sm_scale)):
            raise ValueError(f"ModelShape.sm_scale must be a positive finite float, got {self.sm_scale!r}")

    @property
    def dk(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dv(self) -> int:
        return self.kv_lora_rank

    @property
    def scale(self) -> float:
        if self.sm_scale is not None:
            return float(self.sm_scale)
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    def heads_per_rank(self, tp: int) -> int:
        """Query heads on one tensor-parallel rank: num_heads / tp."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
            raise ValueError(f"tp must be a positive int, got {tp!r}")
        if self.num_heads % tp:
            raise ValueError(f"tp={tp} does not divide num_heads={self.num_heads}")
        return self.num_heads // tp

    def flops_per_key(self, tp: int) -> int:
        """FLOP per key token of one request at this tp: 2*T*H*(Dk+Dv)."""
        return 2 * self.draft_tokens * self.heads_per_rank(tp) * (self.dk + self.dv)


@dataclass(frozen=True)
class VerifyProblem:
    """The static description of one verify call (no tensor values).

    B requests, T draft tokens each, H heads on this rank; q is [B*T, H, Dk], o is [B*T, H, Dv].
    """

    B: int
    T: int
    H: int
    Dk: int
    Dv: int
    device: torch.device

    @property
    def rows(self) -> int:
        return self.B * self.T

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def overlapping(t) -> bool:
    """Whether two elements of tensor `t` may share memory (an `expand`ed or `as_strided`
    output: every row would write the same place). Contiguous is the fast answer; otherwise
    the dims of more than one element, by stride, must each step past all the smaller ones
    (padded and transposed layouts pass)."""
    if t.is_contiguous():
        return False
    reach = 0
    for stride, n in sorted(zip(t.stride(), t.shape)):
        if n > 1:
            if stride <= reach:
                return True
            reach += (n - 1) * stride
    return False


def byte_span(t) -> tuple[int, int]:
    """[first, last + 1) byte addresses that tensor `t`'s elements can touch (empty for no elements)."""
    p, reach = t.data_ptr(), 1
    for n, s in zip(t.shape, t.stride()):  # torch strides are never negative
        if n == 0:
            return (p, p)
        reach += (n - 1) * s
    return (p, p + reach * t.element_size())
