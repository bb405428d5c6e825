"""Draft-token trees and their packed visibility masks.

A tree of T <= 64 draft tokens is given by parent lists: `parents[i] < i`, -1 for a root.
Row i of the mask is an int64 whose bit j says draft query i may see draft key j; a node
sees its ancestors and itself. The prefix is always visible and is not in the mask.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch

from .shapes import MAX_DRAFT_TOKENS


def _row_bits(parents: Sequence[int], where: str) -> list[int]:
    T = len(parents)
    if T == 0 or T > MAX_DRAFT_TOKENS:
        raise ValueError(f"parents{where}: need 1..{MAX_DRAFT_TOKENS} draft tokens, got {T}")
    bits: list[int] = []
    for i, p in enumerate(parents):
        if isinstance(p, bool) or not isinstance(p, numbers.Integral):   # 0.5 would silently become 0
            raise ValueError(f"parents{where}[{i}] = {p!r}: a parent must be an int")
        p = int(p)
        if not -1 <= p < i:
            raise ValueError(f"parents{where}[{i}] = {p}: a parent must be -1 (root) or an earlier node (< {i})")
        bits.append((bits[p] if p >= 0 else 0) | (1 << i))
    # bit 63 makes the value negative as an int64; the kernels only test single bits.
    return [b - (1 << 64) if b >= (1 << 63) else b for b in bits]


def tree_mask_from_parents(parents, device=None) -> torch.Tensor:
    """Packed tree mask from parent lists.

    parents: `[T]` (one tree) or `[B, T]` (one tree per request), list or int tensor.
    Returns int64 `[T]` or `[B*T]` (flattened, request-major) on `device`.
    """
    if isinstance(parents, torch.Tensor):
        if parents.dtype.is_floating_point or parents.dtype == torch.bool:
            raise ValueError(f"parents must hold integers, got dtype {parents.dtype}")
    if hasattr(parents, "tolist"):   # a tensor or numpy array: nested lists, its rows as trees
        parents = parents.tolist()
    if not isinstance(parents, (list, tuple)):
        raise ValueError(f"parents: expected a list `[T]` or `[B, T]` of parent indices, got {parents!r}")
    parents = list(parents)
    if parents and isinstance(parents[0], (list, tuple)):
        T = len(parents[0])
        rows: list[int] = []
        for b, tree in enumerate(parents):
            if len(tree) != T:
                raise ValueError(f"parents[{b}] has {len(tree)} nodes, parents[0] has {T}: T must be constant")
            rows += _row_bits(tree, f"[{b}]")
    else:
        rows = _row_bits(parents, "")
    return torch.tensor(rows, dtype=torch.int64, device=device)


def chain_parents(T: int) -> list[int]:
    """A chain (causal) tree: node i's parent is i - 1."""
    return [i - 1 for i in range(T)]


def random_parents(T: int, generator: torch.Generator | None = None) -> list[int]:
    """A random tree: node 0 is the root, node i's parent uniform in [0, i) (or -1 for a
    second root with small probability, as forests of drafts occur)."""
    out = [-1]
    for i in range(1, T):
        r = int(torch.randint(-1, i, (1,), generator=generator))
        out.append(r)
    return out
