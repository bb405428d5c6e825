#!/usr/bin/env python3
"""The launches scripts/profile.sh profiles: T=9, bs=1, H from $H (default 8), three split + merge
launches of the default config of backend $BACKEND (cuda, default; or wgmma) with the overrides
given. `python scripts/profile_split.py [PREFIX [NAME=VALUE,...]]` (default 131072).
$WGMMA_SOURCE (a file) is compiled in place of kernels/cuda/verify_wgmma.cu, to profile another
version of it beside the shipped one, e.g. one from git history:
    git show 142f66a:kernels/cuda/verify_wgmma.cu > /tmp/direct-store.cu
    WGMMA_SOURCE=/tmp/direct-store.cu BACKEND=wgmma H=64 bash scripts/profile.sh 131072
"""
import contextlib
import os
import sys
from dataclasses import replace

import torch
from kvtune.kernels import get_backend, make_inputs, verify_attention
from kvtune.kernels.api import describe_problem
from kvtune.kernels.cuda import nvrtc

prefix = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
over = dict(kv.split("=") for kv in sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else {}
backend, H = os.environ.get("BACKEND", "cuda"), int(os.environ.get("H", "8"))
x = make_inputs(1, 9, H, prefix, device="cuda", seed=3)
be = get_backend(backend)
p = be.default_params(describe_problem(*x.args))
p = replace(p, **{k: int(v) for k, v in over.items()})
print(backend, p, flush=True)
out = torch.empty(9, H, 512, dtype=torch.bfloat16, device="cuda")
src = os.environ.get("WGMMA_SOURCE")
with nvrtc.source_override(open(src).read(), "verify_wgmma.cu") if src else contextlib.nullcontext():
    print("wgmma source", nvrtc.kernel_source_hash(("verify.cu", "verify_wgmma.cu")), flush=True)
    for _ in range(3):
        verify_attention(*x.args, backend=backend, params=p, out=out, check_values_=False)
    torch.cuda.synchronize()
