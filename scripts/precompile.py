#!/usr/bin/env python3
"""Compile the NVRTC modules a GPU run will load, in parallel processes, into the compile cache
(`KVTUNE_CACHE_DIR`), so that the run's tests and benchmarks spend device time on the GPU, not
on one NVRTC compile after another (each wgmma module takes 5-30 s on one core).

    python scripts/precompile.py --arch sm_90 --T 1,2,5,9,16,64 --jobs 16

Compiles, per T: the cuda backend's default, the wgmma backend's ROWS 64 and 72 (four copy lanes;
eight too at T 9), and every wgmma_km template config at T 9, its default elsewhere.
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor


def _jobs(ts: list[int]) -> list[tuple]:
    from kvtune.kernels.cuda.params import WgmmaKmParams
    decl = WgmmaKmParams.declaration.params
    out = []
    for T in ts:
        out.append(("cuda", T))
        for rows in (64, 72):
            for lanes in ((4, 8) if T == 9 else (4,)):
                out.append(("wgmma", T, rows, lanes))
        dvs = decl["DV_SPLIT"].legal if T == 9 else (0, decl["DV_SPLIT"].default)
        aligns = decl["SPLIT_ALIGN"].legal if T == 9 else (decl["SPLIT_ALIGN"].default,)
        out += [("wgmma_km", T, dv, al) for dv in dvs for al in aligns]
    return out


def _compile(job: tuple, arch: str) -> str:
    t0 = time.perf_counter()
    if job[0] == "cuda":
        from kvtune.kernels.cuda.backend import CudaBackend, compile_params
        from kvtune.kernels.shapes import VerifyProblem
        T = job[1]
        import torch
        pb = VerifyProblem(B=1, T=T, H=8, Dk=576, Dv=512, device=torch.device("cpu"))
        compile_params(CudaBackend().default_params(pb), T, arch)
    elif job[0] == "wgmma":
        from kvtune.kernels.cuda.wgmma import compile_wgmma
        compile_wgmma(job[1], arch, job[2], job[3])
    else:
        from kvtune.kernels.cuda.wgmma_km import compile_km
        compile_km(job[1], arch, job[2], job[3])
    return f"{job}: {time.perf_counter() - t0:.1f}s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--T", default="9", help="draft-token counts, comma-separated")
    ap.add_argument("--jobs", type=int, default=8)
    a = ap.parse_args(argv)
    jobs = _jobs([int(v) for v in a.T.split(",")])
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.jobs) as ex:
        for line in ex.map(_compile, jobs, [a.arch] * len(jobs)):
            print(line, flush=True)
    print(f"{len(jobs)} modules in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
