#!/bin/bash
# One GPU session for the CUDA backend (issue 3): environment, a smoke check, the mma.sync /
# ldmatrix ceilings, the benchmark, a gather diagnosis (DIAG_S=0 skips it), the GPU tests, then racecheck/memcheck on small shapes. Run from the repo
# root; everything lands in $1 (default $OUT).
set -u
OUT=${1:-$OUT}
mkdir -p "$OUT"
. scripts/device_env.sh tree
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, cuda.bindings; from kvtune.kernels.cuda.nvrtc import nvrtc_version, kernel_source_hash; \
print('torch', torch.__version__, 'triton', triton.__version__, 'cuda-bindings', cuda.bindings.__version__, \
'nvrtc', nvrtc_version(), 'source', kernel_source_hash())"; } > "$OUT/env.txt" 2>&1

cat > /tmp/smoke.py <<'PYEOF'
import sys, torch
from kvtune.kernels import make_inputs, reference_attention, rel_error, verify_attention
for (B, T, H, prefix, tree) in [(1, 9, 8, [54], "chain"), (2, 9, 8, [300, 7], "random"), (1, 1, 8, [97], "chain")]:
    x = make_inputs(B, T, H, prefix, tree=tree, device="cuda")
    ref, ref_lse = reference_attention(*x.args)
    o, lse = verify_attention(*x.args, backend="cuda", return_lse=True)
    torch.cuda.synchronize()
    print(B, T, H, prefix, tree, "rel err", rel_error(o, ref), "lse max diff",
          (lse - ref_lse)[torch.isfinite(ref_lse)].abs().max().item(), flush=True)
PYEOF
timeout 120 $PY /tmp/smoke.py > "$OUT/smoke.log" 2>&1
echo "smoke rc=$?" >> "$OUT/smoke.log"
# the ceilings of mma.sync / ldmatrix (the only tensor-core path the one source may use); CEIL_S=0 skips
[ "${CEIL_S:-60}" != 0 ] && { timeout ${CEIL_S:-60} $PY scripts/mma_ceiling.py --out "$OUT" > "$OUT/ceilings.log" 2>&1; echo "ceilings rc=$?" >> "$OUT/ceilings.log"; }
timeout ${BENCH_S:-200} $PY scripts/bench_verify.py --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/bench.log"

# -- diagnosis: random-row gather bandwidth (torch) and the kernel on random vs sorted slots
cat > /tmp/diag.py <<'PYEOF'
import torch
from kvtune.kernels import make_inputs, verify_attention
from kvtune.kernels.cuda.backend import CudaBackend
from kvtune.kernels.api import describe_problem
def t_us(fn, n=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        s.record(); g.replay(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1e3 / n)
    return sorted(ts)[2]
pool = torch.randn(400_000, 576, device="cuda").to(torch.bfloat16)
for order in ("random", "sorted"):
    idx = torch.randperm(400_000, device="cuda")[:131072]
    if order == "sorted": idx = idx.sort().values
    us = t_us(lambda: torch.index_select(pool, 0, idx))
    print(f"torch gather 131072 rows x 1152 B, {order}: {us:.1f} us, {2 * 131072 * 1152 / us / 1e3:.0f} GB/s (read+write)")
del pool
for H in (8, 64):
    x = make_inputs(1, 9, H, 131072, device="cuda", seed=3)
    be = CudaBackend(); p = be.default_params(describe_problem(*x.args))
    out = torch.empty(9, H, 512, dtype=torch.bfloat16, device="cuda")
    for order in ("random", "sorted"):
        if order == "sorted": x.kv_indices[:-9] = x.kv_indices[:-9].sort().values
        us = t_us(lambda: verify_attention(*x.args, backend="cuda", params=p, out=out, check_values_=False))
        print(f"cuda default H={H} prefix 131072 slots {order}: {us:.1f} us  ({p})")
PYEOF
[ "${DIAG_S:-90}" != 0 ] && { timeout ${DIAG_S:-90} $PY /tmp/diag.py > "$OUT/diag.log" 2>&1; echo "diag rc=$?" >> "$OUT/diag.log"; }

timeout ${PYTEST_S:-150} $PY -m pytest -q -p no:cacheprovider tests/test_cuda_gpu.py tests/test_contract.py \
  -k "test_cuda_gpu or cuda" -o addopts="" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.log"

{ timeout ${SAN_S:-60} compute-sanitizer --tool racecheck --racecheck-report hazard $PY /tmp/smoke.py 2>&1 | tail -40
  echo "racecheck rc=${PIPESTATUS[0]}"
  timeout ${SAN_S:-60} compute-sanitizer --tool memcheck $PY /tmp/smoke.py 2>&1 | tail -40
  echo "memcheck rc=${PIPESTATUS[0]}"; } > "$OUT/sanitizer.log" 2>&1

