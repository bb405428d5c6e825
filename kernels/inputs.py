"""Realistic inputs for tests and measurements.

A KV pool larger than the requests need, each request's slots a random scattered subset
(a fragmented cache), ragged prefix lengths, chain or random trees, fresh random values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .shapes import MAX_DRAFT_TOKENS
from .tree import chain_parents, random_parents, tree_mask_from_parents


@dataclass
class VerifyInputs:
    """One verify call's inputs (see `verify_attention` for shapes and layouts)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    tree_mask: torch.Tensor
    sm_scale: float
    prefix_lens: list[int]
    parents: list[list[int]]
    kv_lora_rank: int = 512
    extra: dict = field(default_factory=dict)

    @property
    def args(self) -> tuple:
        """Positional arguments of `verify_attention`."""
        return (self.q, self.kv_cache, self.kv_indptr, self.kv_indices, self.tree_mask, self.sm_scale)

    @property
    def B(self) -> int:
        return len(self.prefix_lens)

    @property
    def T(self) -> int:
        return len(self.parents[0])


def make_inputs(batch: int, draft_tokens: int, heads: int, prefix_lens: int | Sequence[int], *,
                tree: str | Sequence = "chain", kv_lora_rank: int = 512, rope_dim: int = 64,
                pool_factor: float = 1.5, row_stride: int | None = None, indices_dtype=torch.int32,
                device="cpu", seed: int | None = None, generator: torch.Generator | None = None,
                sm_scale: float | None = None, q_noncontiguous: bool = False,
                device_values: bool = False) -> VerifyInputs:
    """Build fresh random inputs.

    prefix_lens: one int for every request, or one per request (ragged).
    tree: "chain", "random", or explicit parents (`[T]` or `[B, T]`).
    pool_factor: the KV pool holds `pool_factor` times the tokens the batch needs.
    row_stride: kv_cache row stride in elements (> Dk to test padded rows).
    q_noncontiguous: q is a strided view (heads dimension not packed).
    device_values: on a CUDA device, draw q and the KV pool there (a device generator seeded
        from `generator`): the same structure (indices, tree) as without, other values, and no
        host copy of the pool (a 64 x 128k batch's pool is 15 GB, about 45 s to draw on the
        host). By default values are drawn on the CPU, the same on any device.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(seed if seed is not None else
                                                  int(torch.randint(0, 2**31 - 1, (1,))))
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch: expected an int >= 1, got {batch!r}")
    if isinstance(prefix_lens, int):
        prefix_lens = [prefix_lens] * batch
    prefix_lens = [int(p) for p in prefix_lens]
    if len(prefix_lens) != batch:
        raise ValueError(f"prefix_lens: {len(prefix_lens)} values for batch={batch}")
    if min(prefix_lens) < 0:
        raise ValueError(f"prefix_lens: a prefix holds >= 0 keys, got {min(prefix_lens)}")
    if isinstance(tree, str) and tree not in ("chain", "random"):
        raise ValueError(f"tree: expected 'chain', 'random' or parent lists, got {tree!r}")
    for name, v, most in (("draft_tokens", draft_tokens, MAX_DRAFT_TOKENS), ("heads", heads, None)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (most is not None and v > most):
            raise ValueError(f"{name}: expected an int >= 1{f' and <= {most}' if most else ''}, got {v!r}")
    T, H = draft_tokens, heads
    Dk = kv_lora_rank + rope_dim
    if tree == "chain":
        parents = [chain_parents(T) for _ in range(batch)]
    elif tree == "random":
        parents = [random_parents(T, generator) for _ in range(batch)]
    else:
        parents = _explicit_parents(tree, batch, T)
    mask = tree_mask_from_parents(parents)

    lens = [p + T for p in prefix_lens]
    total = sum(lens)
    num_slots = max(total + 1, int(total * pool_factor))
    perm = torch.randperm(num_slots, generator=generator)[:total]
    indptr = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)

    stride = Dk if row_stride is None else row_stride
    if stride < Dk:
        raise ValueError(f"row_stride {stride} < Dk {Dk}")
    if device_values and torch.device(device).type == "cuda":
        g = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))

        def draw(*shape):  # bf16 straight away: no fp32 copy of the pool either
            return torch.empty(*shape, dtype=torch.bfloat16, device=device).normal_(generator=g)
    else:  # on the CPU with the seeded generator, then moved: the same values on any device
        def draw(*shape):
            return torch.randn(*shape, generator=generator).to(torch.bfloat16).to(device)
    kv_cache = draw(num_slots, stride)[:, :Dk]
    if q_noncontiguous:
        q = draw(batch * T, H, 2 * Dk)[:, :, :Dk]  # row stride 2*Dk: heads not packed
    else:
        q = draw(batch * T, H, Dk)
    scale = sm_scale if sm_scale is not None else (128 + rope_dim) ** -0.5
    return VerifyInputs(q=q, kv_cache=kv_cache, kv_indptr=indptr.to(device),
                        kv_indices=perm.to(indices_dtype).to(device), tree_mask=mask.to(device),
                        sm_scale=scale, prefix_lens=prefix_lens, parents=parents, kv_lora_rank=kv_lora_rank)


def _explicit_parents(tree, batch: int, T: int) -> list[list]:
    """Parent lists given to `make_inputs`: one tree `[T]` for every request or one per request
    `[B, T]`; each of draft_tokens entries (its values are checked by tree_mask_from_parents)."""
    tree = tree.tolist() if hasattr(tree, "tolist") else list(tree)
    if tree and isinstance(tree[0], (list, tuple)):
        parents = [list(p) for p in tree]
        if len(parents) != batch:
            raise ValueError(f"tree: {len(parents)} parent lists for batch={batch}")
    else:
        parents = [list(tree)] * batch
    for b, p in enumerate(parents):
        if len(p) != T:
            raise ValueError(f"tree: parent list {b} has {len(p)} entries, but draft_tokens={T}")
    return parents


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32; NaN or inf anywhere gives inf (never passes)."""
    out = out.float()
    ref = ref.float().to(out.device)   # an oracle computed on the CPU against a GPU output
    if not torch.isfinite(out).all():
        return float("inf")
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num
