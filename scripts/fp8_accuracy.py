#!/usr/bin/env python3
"""Diagnosis (not a test): what quantizing Q and P to e4m3 would cost in accuracy, for a loop
that runs both MMAs in fp8 on an fp8 (e4m3, per-tensor scale) key cache.

The keys-in-M loop with 64-key steps fits sm_90's 227 KB only with keys, Q and P all in e4m3:
fp8 wgmma takes both operands in fp8 (results/kernel/wgmma/phases/tile-loop/). The fp8 cache is
the deployment's own data, so the reference here is the fp32 oracle (`reference_attention`) on
the dequantized cache and the bf16 Q. Each variant computes the same attention in fp32 from
fake-quantized operands (quantized to e4m3 and back):
  bf16 P        Q as given, P rounded to bf16 (what the shipped kernels do)
  fp8 Q         Q per (token, head) row scaled to e4m3's 448 and quantized, P in bf16
  fp8 P         P (in [0, 1] after the running max) scaled by 448 and quantized, Q as given
  fp8 Q+P       both
The row sum l is taken from the unquantized fp32 P, as FlashAttention-3's fp8 path does. The
error is ||o - ref|| / ||ref||, the correctness gate's measure (the tuner's tolerance: 1e-2).
`--sharpen` multiplies Q by a factor: attention more peaked than the random inputs' (logits of
standard deviation about 1 at factor 1).

    python scripts/fp8_accuracy.py --prefixes 4096,65536 --sharpen 1,4 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

E4M3_MAX = 448.0


def fake_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x quantized to e4m3 at `scale` (x / scale must fit +-448) and back, in fp32."""
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_cache(kv: torch.Tensor) -> torch.Tensor:
    """The key cache as an e4m3 cache with one per-tensor scale holds it, dequantized (fp32)."""
    kv = kv.float()
    return fake_e4m3(kv, kv.abs().max().clamp_min(1e-30) / E4M3_MAX)


def emulated(q, kv, indptr, indices, tree_mask, sm_scale, fp8_q: bool, fp8_p: bool, dv: int = 512):
    """Verify attention in fp32 from fake-quantized operands: o `[B*T, H, Dv]`."""
    from kvtune.kernels.reference import visibility
    B = indptr.numel() - 1
    T, H = q.shape[0] // B, q.shape[1]
    o = torch.zeros(B * T, H, dv)
    for b in range(B):
        s, e = int(indptr[b]), int(indptr[b + 1])
        k = kv[indices[s:e].long()]
        qb = q[b * T:(b + 1) * T].float()
        if fp8_q:   # one scale per (token, head) row
            qb = fake_e4m3(qb, qb.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / E4M3_MAX)
        logits = torch.einsum("thd,ld->thl", qb, k) * sm_scale
        vis = visibility(T, (e - s) - T, tree_mask[b * T:(b + 1) * T])
        logits = logits.masked_fill(~vis[:, None, :], float("-inf"))
        p = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        row_sum = p.sum(dim=-1, keepdim=True)
        p = fake_e4m3(p, 1.0 / E4M3_MAX) if fp8_p else p.to(torch.bfloat16).float()
        o[b * T:(b + 1) * T] = torch.einsum("thl,ld->thd", p, k[:, :dv]) / row_sum
    return o


def main(argv=None) -> int:
    from kvtune.kernels import make_inputs, reference_attention, rel_error
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", default="4096,65536")
    ap.add_argument("--sharpen", default="1,4", help="factors Q is multiplied by")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default=None, help="a folder for fp8_accuracy.json")
    args = ap.parse_args(argv)
    variants = {"bf16 P": (False, False), "fp8 Q": (True, False), "fp8 P": (False, True), "fp8 Q+P": (True, True)}
    rows = []
    for prefix in [int(p) for p in args.prefixes.split(",")]:
        for sharpen in [float(f) for f in args.sharpen.split(",")]:
            for seed in range(args.seeds):
                x = make_inputs(1, 9, args.heads, prefix, tree="random", seed=seed)
                q = (x.q.float() * sharpen).to(torch.bfloat16)
                kv = fp8_cache(x.kv_cache)
                ref, _ = reference_attention(q, kv, x.kv_indptr, x.kv_indices, x.tree_mask, x.sm_scale)
                row = {"prefix": prefix, "sharpen": sharpen, "seed": seed}
                for name, (fq, fp) in variants.items():
                    o = emulated(q, kv, x.kv_indptr, x.kv_indices, x.tree_mask, x.sm_scale, fq, fp)
                    row[name] = float(rel_error(o, ref))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'prefix':>7} {'sharpen':>7} {'seed':>4} " + " ".join(f"{v:>9}" for v in variants))
    for r in rows:
        print(f"{r['prefix']:>7} {r['sharpen']:>7g} {r['seed']:>4} " + " ".join(f"{r[v]:>9.2e}" for v in variants))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_accuracy.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
