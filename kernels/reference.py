"""The fp32 oracle: plain torch, one request at a time. The definition of correct."""
from __future__ import annotations

import torch

from .backends import Backend, LaunchArgs


def visibility(T: int, prefix_len: int, tree_mask_rows: torch.Tensor) -> torch.Tensor:
    """Bool `[T, prefix_len + T]`: which keys each draft query of one request may see.

    tree_mask_rows: the request's `[T]` int64 mask rows.
    """
    j = torch.arange(T, device=tree_mask_rows.device)
    draft = ((tree_mask_rows[:, None] >> j[None, :]) & 1).bool()
    prefix = torch.ones(T, prefix_len, dtype=torch.bool, device=tree_mask_rows.device)
    return torch.cat([prefix, draft], dim=1)


def reference_attention(q, kv_cache, kv_indptr, kv_indices, tree_mask, sm_scale, kv_lora_rank=512):
    """fp32 verify attention. Returns (o `[B*T, H, Dv]` fp32, lse `[B*T, H]` fp32).

    A row that sees no key gets o = 0 and lse = -inf. NaN in, NaN out for the rows it
    touches: a NaN in q[i, h], or in a key row that row i may see (V is part of that row),
    makes o[i, h] and lse[i, h] NaN; every other row is as if the NaN were not there.
    """
    B = kv_indptr.numel() - 1
    T = q.shape[0] // B
    H = q.shape[1]
    Dv = kv_lora_rank
    o = torch.zeros(B * T, H, Dv, dtype=torch.float32, device=q.device)
    lse = torch.full((B * T, H), float("-inf"), dtype=torch.float32, device=q.device)
    indptr = kv_indptr.tolist()
    for b in range(B):
        s, e = indptr[b], indptr[b + 1]
        idx = kv_indices[s:e].long()
        k = kv_cache[idx].float()                       # [L, Dk]
        # a row gives an invisible key weight exactly 0, and 0 * NaN would still poison it;
        # a visible NaN value reaches its rows anyway, through the logit of the same key row
        v = torch.nan_to_num(k[:, :Dv], nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        qb = q[b * T:(b + 1) * T].float()               # [T, H, Dk]
        logits = torch.einsum("thd,ld->thl", qb, k) * sm_scale
        vis = visibility(T, (e - s) - T, tree_mask[b * T:(b + 1) * T])   # [T, L]
        logits = logits.masked_fill(~vis[:, None, :], float("-inf"))
        # in fp64: torch's fp32 reduction can differ by an ulp on a process's first call (measured on
        # CPU: 1 bf16 ulp in ~100 outputs of 2 runs in 20), and the oracle must answer the same every time
        row_lse = torch.logsumexp(logits.double(), dim=-1).float()   # [T, H]
        # a row that sees nothing (lse = -inf) gets p = 0, a row that read a NaN (lse = NaN) p = NaN
        p = torch.exp(logits - torch.where(row_lse == float("-inf"), 0.0, row_lse)[..., None])
        o[b * T:(b + 1) * T] = torch.einsum("thl,ld->thd", p, v)
        lse[b * T:(b + 1) * T] = row_lse
    return o, lse


class ReferenceBackend(Backend):
    """The oracle behind the common interface (allocates; not for timing)."""

    name = "reference"
    params_type = None

    def check_params(self, params, problem) -> None:
        if params is not None:
            raise ValueError(f"params: the reference backend takes no parameters, got {params!r}")

    def launch(self, args: LaunchArgs, params) -> None:
        o, lse = reference_attention(args.q, args.kv_cache, args.kv_indptr, args.kv_indices, args.tree_mask,
                                     args.sm_scale, args.problem.Dv)
        args.out.copy_(o)
        if args.lse is not None:
            args.lse.copy_(lse)
