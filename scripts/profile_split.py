#!/usr/bin/env python3
"""The launches scripts/profile.sh profiles: H=8, T=9, bs=1, three split + merge launches of the
CUDA default config. `python scripts/profile_split.py [PREFIX [NAME=VALUE,...]]` (default 131072).
"""
import sys
import torch
from kvtune.kernels import make_inputs, verify_attention
from kvtune.kernels.api import describe_problem
from kvtune.kernels.cuda.backend import CudaBackend
from dataclasses import replace
prefix = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
over = dict(kv.split("=") for kv in sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else {}
x = make_inputs(1, 9, 8, prefix, device="cuda", seed=3)
be = CudaBackend()
p = be.default_params(describe_problem(*x.args))
p = replace(p, **{k: int(v) for k, v in over.items()})
print(p, flush=True)
out = torch.empty(9, 8, 512, dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    verify_attention(*x.args, backend="cuda", params=p, out=out, check_values_=False)
torch.cuda.synchronize()
