"""The Triton backend's shared-memory model (`TritonParams.smem_bytes`, `fit_reject`) against
what Triton itself compiles for sm_120 on this CPU (no GPU needed: compiling stops at the cubin),
and the sm_120 cases it decides."""
import json
import os
import subprocess
import sys

import pytest

from kvtune.kernels.triton_kernel import TritonBackend, TritonParams

CASES = [(9, 4, 16, 2), (9, 2, 32, 2), (48, 1, 32, 1), (33, 1, 16, 2), (16, 2, 32, 3)]   # T, heads, keys, stages

# Triton compiles only outside its interpreter (the tests run under it): a child process
COMPILE = """
import inspect, json, sys, warnings
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvtune.kernels.triton_kernel import TritonParams, _verify_split_kernel
types = {"Q": "*bf16", "KV": "*bf16", "PartO": "*fp32", "PartLse": "*fp32", "Indptr": "*i32", "Indices": "*i32",
         "SplitMaxKeys": "*i32", "SplitValues": "*i32", "Mask": "*i64", "qk_scale": "fp32"}
names = list(inspect.signature(_verify_split_kernel.fn).parameters)
out = []
for T, hpb, bn, st in json.loads(sys.argv[1]):
    p = TritonParams(NSPLIT=16, BLOCK_N=bn, HEADS_PER_BLOCK=hpb, NUM_WARPS=8, STAGES=st)
    const = dict(T=T, HEADS_PER_BLOCK=hpb, BLOCK_M=p.block_m(T), BLOCK_N=bn, DV=512, DPE=64, NSPLIT=16,
                 NUM_BUCKETS=0, UPCAST=False)
    assert set(const) <= set(names), ("the kernel's constexprs changed", set(const) - set(names))
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    src = ASTSource(fn=_verify_split_kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = triton.compile(src, target=GPUTarget("cuda", 120, 32), options=dict(num_warps=8, num_stages=st))
    out.append(k.metadata.shared)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_smem():
    """Shared memory of the stage-1 kernel per case, as Triton compiles it for sm_120 (Dk 576)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(CASES)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)))
def test_smem_model_is_what_triton_compiles_for_sm120(i, compiled_smem):
    T, hpb, block_n, stages = CASES[i]
    p = TritonParams(NSPLIT=16, BLOCK_N=block_n, HEADS_PER_BLOCK=hpb, NUM_WARPS=8, STAGES=stages)
    assert p.smem_bytes(T, 576) == compiled_smem[i], CASES[i]


def test_fit_reject_on_sm120():
    be = TritonBackend()
    # T 48: 64 padded rows; 32-key tiles need 110592 B of sm_120's 101376, 16-key tiles 92160
    big = TritonParams(NSPLIT=16, BLOCK_N=32, HEADS_PER_BLOCK=1, NUM_WARPS=8, STAGES=2)
    why = be.fit_reject(big, 48, "sm_120")
    assert why is not None and "110592 B" in why and "sm_120's 101376 B" in why, why
    assert be.fit_reject(TritonParams(NSPLIT=16, BLOCK_N=16, HEADS_PER_BLOCK=1, NUM_WARPS=8, STAGES=2), 48,
                         "sm_120") is None
    assert be.fit_reject(big, 48, "sm_90") is None      # 227 KB
    assert be.fit_reject(big, 48, "cpu") is None        # no limits known: the compile decides
