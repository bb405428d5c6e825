#!/usr/bin/env python3
"""The launches scripts/profile.sh profiles: T=9, bs=1, H from $H (default 8), three split + merge
launches of the default config of backend $BACKEND (cuda, default; or wgmma) with the overrides
given. `python scripts/profile_split.py [PREFIX [NAME=VALUE,...]]` (default 131072).
"""
import os
import sys
from dataclasses import replace

import torch
from kvtune.kernels import get_backend, make_inputs, verify_attention
from kvtune.kernels.api import describe_problem

prefix = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
over = dict(kv.split("=") for kv in sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else {}
backend, H = os.environ.get("BACKEND", "cuda"), int(os.environ.get("H", "8"))
x = make_inputs(1, 9, H, prefix, device="cuda", seed=3)
be = get_backend(backend)
p = be.default_params(describe_problem(*x.args))
p = replace(p, **{k: int(v) for k, v in over.items()})
print(backend, p, flush=True)
out = torch.empty(9, H, 512, dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    verify_attention(*x.args, backend=backend, params=p, out=out, check_values_=False)
torch.cuda.synchronize()
