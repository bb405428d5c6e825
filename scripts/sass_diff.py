#!/usr/bin/env python3
"""Diagnosis (not a test): is a kernel-source edit a no-op for the machine code? Compiles the
CUDA backend's default config (or the wgmma kernel) from the working tree and from a git
revision's `kernels/cuda/verify.cu` / `verify_wgmma.cu`, disassembles both with cuobjdump, and
compares them instruction by instruction with register names left out (two builds that differ only
in register allocation compare equal), then as multisets (the same instructions, some in another
order). No GPU needed.

    python scripts/sass_diff.py --rev HEAD~1 --arch sm_90 --arch sm_120
    python scripts/sass_diff.py --rev HEAD~1 --backend wgmma --T 1 --rows 72
"""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUOBJDUMP = "cuobjdump"


def _cuobjdump() -> str:
    import triton
    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(p) if p.exists() else CUOBJDUMP


def sass(cubin: bytes) -> list[str]:
    """The cubin's instructions, addresses, encodings and register names dropped."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?)\s*;?\s*/\*", line)
        if not m:
            continue
        out.append(re.sub(r"\bU?R\d+\b", "R", m.group(1)))
    return out


def build(args, arch: str) -> bytes:
    from kvtune.kernels import describe_problem, get_backend, make_inputs
    if args.backend == "wgmma":
        from kvtune.kernels.cuda import wgmma
        return wgmma.compile_wgmma(args.T, arch=arch, rows=args.rows).cubin
    from kvtune.kernels.cuda.backend import compile_params
    x = make_inputs(1, args.T, 8, [4096], device="cpu", seed=0)
    p = get_backend("cuda").default_params(describe_problem(*x.args))
    return compile_params(p, args.T, arch).cubin


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the git revision to compare the working tree with")
    ap.add_argument("--backend", choices=("cuda", "wgmma"), default="cuda")
    ap.add_argument("--arch", action="append", default=[], help="sm_XX (repeatable; default sm_90). wgmma: sm_90 only")
    ap.add_argument("--T", type=int, default=9)
    ap.add_argument("--rows", type=int, default=72, help="wgmma: ROWS")
    args = ap.parse_args(argv)
    from kvtune.kernels.cuda import nvrtc
    parts = ("verify.cu", "verify_wgmma.cu") if args.backend == "wgmma" else ("verify.cu",)
    old = {}
    for part in parts:
        r = subprocess.run(["git", "show", f"{args.rev}:kernels/cuda/{part}"], cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"--rev {args.rev}: {r.stderr.strip()}")
        old[part] = r.stdout
    differ = 0
    for arch in args.arch or ["sm_90"]:
        new = sass(build(args, arch))
        with contextlib.ExitStack() as stack:
            for part, text in old.items():
                stack.enter_context(nvrtc.source_override(text, part))
            was = sass(build(args, arch))
        diff = [(i, a, b) for i, (a, b) in enumerate(zip(new, was)) if a != b]
        same_set = sorted(new) == sorted(was)
        differ += not same_set
        order = f"{len(diff)} positions differ" if diff or len(new) != len(was) else "the same"
        print(f"{args.backend} T {args.T} {arch}: {len(new)} instructions here, {len(was)} at {args.rev}: "
              f"{order}, registers aside; " + ("the same multiset" if same_set else "NOT the same multiset"))
        for i, a, b in diff[:20]:
            print(f"  {i}: here {a!r}  at {args.rev} {b!r}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
