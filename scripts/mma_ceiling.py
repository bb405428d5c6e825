#!/usr/bin/env python3
"""Benchmark (not a test): the ceilings of the sm_80-class instructions the CUDA kernel uses.

The verify kernel may only use mma.sync / ldmatrix / cp.async (one source for sm_80 ..
sm_120), so its attainable speed is bounded by those instructions' throughput on the local
GPU, not by the wgmma peak a cuBLAS matmul reaches. This measures, per SM and in total:

- mma.sync m16n8k16 bf16 -> fp32: every warp runs CHAINS independent accumulators;
- ldmatrix.x4 from shared memory: conflict-free addresses, every warp of the SM loading;

and prints the per-key cost of the verify kernel's work at H*T = 72 query rows (QK^T over
576 + PV over 512 columns) against the per-key HBM time. Writes ceilings.json under --out.

    python scripts/mma_ceiling.py --out $OUT      # on a GPU; or: bash scripts/gpu_evidence.sh limits
"""
from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch

SRC = r"""
typedef unsigned int u32;
extern "C" __global__ void mma_peak(float* out, int iters) {
  u32 a0 = threadIdx.x, a1 = a0 * 3u, a2 = a0 * 5u, a3 = a0 * 7u, b0 = a0 ^ 0x3f803f80u, b1 = b0 + 1u;
  float c[CHAINS][4];
#pragma unroll
  for (int j = 0; j < CHAINS; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < CHAINS; ++j)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};\n" : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < CHAINS; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  if (s == 1234.5f) out[threadIdx.x] = s;   // never true; keeps the chains alive
}
extern "C" __global__ void ldmatrix_peak(u32* out, int iters) {
  __shared__ __align__(16) unsigned short buf[32 * 1168 / 2];   // 32 rows, 1168-byte pitch as in verify.cu
  for (int i = threadIdx.x; i < 32 * 584; i += blockDim.x) buf[i] = (unsigned short)i;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 base = (u32)__cvta_generic_to_shared(buf) + ((lane & 15) * 1168 + (lane >> 4) * 16);
  u32 acc = 0;
  for (int i = 0; i < iters; ++i) {
    u32 r0, r1, r2, r3;
    const u32 addr = base + (((i + warp) & 1) * 16 * 1168) + ((i * 32) & 1023);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
    acc ^= r0 ^ r1 ^ r2 ^ r3;
  }
  if (acc == 0x12345678u) out[threadIdx.x] = acc;
}
"""


def nvrtc_cubin(src: str, name: str, options: list[str]) -> tuple[bytes, str]:
    """(CUBIN, NVRTC log) of a standalone CUDA source; RuntimeError with the log if it fails.
    For the scripts' own probe kernels (the shipped kernel compiles through kvtune's nvrtc)."""
    from cuda.bindings import nvrtc
    prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], [])[1]
    try:
        rc = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])[0]
        log = b" " * nvrtc.nvrtcGetProgramLogSize(prog)[1]
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.decode(errors="replace").rstrip("\x00")
        if rc != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(log)
        cubin = b" " * nvrtc.nvrtcGetCUBINSize(prog)[1]
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_and_load(arch: str, chains: int):
    from cuda.bindings import driver as drv
    from kvtune.kernels.cuda.nvrtc import check_driver, _ensure_context
    cubin, _ = nvrtc_cubin(SRC, "ceiling.cu", [f"--gpu-architecture={arch}", f"-DCHAINS={chains}"])
    _ensure_context(torch.cuda.current_device())
    mod = check_driver(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
    return {k: check_driver(drv.cuModuleGetFunction(mod, k.encode()), k) for k in ("mma_peak", "ldmatrix_peak")}


def time_launch(fn, grid, block, iters, reps=5) -> float:
    from cuda.bindings import driver as drv
    from kvtune.kernels.cuda.nvrtc import check_driver
    out = torch.zeros(1024, device="cuda", dtype=torch.float32)
    args = (ctypes.c_void_p * 2)()
    p_out, p_it = ctypes.c_void_p(out.data_ptr()), ctypes.c_int(iters)
    args[0], args[1] = ctypes.addressof(p_out), ctypes.addressof(p_it)
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for i in range(reps + 1):
        s.record()
        check_driver(drv.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(args), 0), "launch")
        e.record()
        e.synchronize()
        if i:
            ts.append(s.elapsed_time(e) * 1e-3)
    return sorted(ts)[len(ts) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--read-gbps", type=float, default=4189.0, help="HBM read ceiling for the per-key comparison")
    a = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    arch = f"sm_{props.major}{props.minor}"
    res = {"device": props.name, "arch": arch, "sms": sms, "mma": [], "ldmatrix": []}
    for chains in (4, 8):
        fns = compile_and_load(arch, chains)
        for warps in (4, 8, 16):
            it = 4096
            t = time_launch(fns["mma_peak"], sms * 2, warps * 32, it)
            flops = sms * 2 * warps * it * chains * 2 * 16 * 8 * 16
            res["mma"].append({"chains": chains, "warps_per_block": warps, "blocks_per_sm": 2,
                               "tflops": flops / t / 1e12})
        if chains == 8:
            for warps in (4, 8, 16):
                it = 8192
                t = time_launch(fns["ldmatrix_peak"], sms, warps * 32, it)
                nbytes = sms * warps * it * 512
                res["ldmatrix"].append({"warps_per_block": warps, "bytes_per_clk_sm": None,
                                        "tbps": nbytes / t / 1e12})
    clk = props.clock_rate * 1e3 if hasattr(props, "clock_rate") else None
    mma = max(r["tflops"] for r in res["mma"])
    ldm = max(r["tbps"] for r in res["ldmatrix"])
    rows = 72
    flop_per_key = 2 * rows * (576 + 512)
    key_ns_hbm = 1152 / a.read_gbps
    key_ns_mma = flop_per_key / mma / 1e3
    res.update(mma_tflops=mma, ldmatrix_tbps=ldm, read_gbps=a.read_gbps, per_key_ns_hbm=key_ns_hbm,
               per_key_ns_mma=key_ns_mma, clock_hz=clk)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "ceilings.json").write_text(json.dumps(res, indent=1))
    for r in res["mma"]:
        print(f"mma.sync m16n8k16 bf16: {r['chains']} chains/warp, {r['warps_per_block']} warps x 2 blocks/SM: "
              f"{r['tflops']:.0f} TFLOP/s")
    for r in res["ldmatrix"]:
        print(f"ldmatrix.x4: {r['warps_per_block']} warps/SM: {r['tbps']:.1f} TB/s "
              f"({r['tbps'] * 1e12 / sms / 1e9:.0f} GB/s per SM)")
    print(f"per key at 72 rows: HBM {key_ns_hbm * 1e3:.0f} ps (all SMs), mma.sync {key_ns_mma * 1e3:.0f} ps "
          f"-> mma.sync time is {100 * key_ns_mma / key_ns_hbm:.0f}% of the HBM time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
