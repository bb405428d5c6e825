#!/usr/bin/env bash
# compute-sanitizer racecheck + memcheck of the CUDA kernel on small odd shapes (device tool,
# repository root). Logs to $OUT/sanitizer.log.
set -u
OUT=${OUT:?}
. scripts/device_env.sh tree
cat > /tmp/san.py <<'PYEOF'
import torch
from kvtune.kernels import SplitTable, make_inputs, reference_attention, rel_error, verify_attention
for (B, T, H, prefix, tree) in [(1, 9, 8, [54], "chain"), (3, 1, 8, [97, 1, 7], "chain"),
                                (2, 16, 16, [300, 5], "random"), (1, 2, 64, [1000], "random")]:
    x = make_inputs(B, T, H, prefix, tree=tree, device="cuda", seed=B * 100 + T)
    ref, _ = reference_attention(*x.args)
    o = verify_attention(*x.args, backend="cuda")
    st = SplitTable.build([64, 512], [1, 4], "cuda")
    o2 = verify_attention(*x.args, backend="cuda", split_table=st)
    torch.cuda.synchronize()
    print(B, T, H, prefix, tree, "rel err", round(rel_error(o, ref), 5), round(rel_error(o2, ref), 5), flush=True)
PYEOF
{ python3 /tmp/san.py; echo "plain rc=$?"
  timeout ${SAN_S:-150} compute-sanitizer --tool racecheck --racecheck-report hazard python3 /tmp/san.py 2>&1 | grep -v "Host Frame" | tail -25
  echo "racecheck rc=${PIPESTATUS[0]}"
  [ "${MEMCHECK:-1}" = 1 ] && timeout ${SAN_S:-150} compute-sanitizer --tool memcheck python3 /tmp/san.py 2>&1 | grep -v "Host Frame" | tail -25
  echo "memcheck rc=${PIPESTATUS[0]}"
  python3 -c "from kvtune.kernels.cuda.nvrtc import kernel_source_hash; print('cuda source', kernel_source_hash())"
} > $OUT/sanitizer.log 2>&1
cat $OUT/sanitizer.log | tail -40
