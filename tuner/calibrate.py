"""`kvtune calibrate`: measure the local device's ceilings and write a device profile.

Read bandwidth: a large read-only reduction (`sum` over a bf16 tensor many times the L2),
timed with CUDA events. bf16 MMA rate: a large bf16 matrix product (fp32 accumulation).
The best of several repetitions is kept (a ceiling, not a typical value). Arch limits come
from the device properties.
"""
from __future__ import annotations

import time
from pathlib import Path

import yaml

from .config import CONFIG_DIR, DeviceProfile
from .options import positive_int


def _time(fn, reps: int, cuda: bool) -> list[float]:
    import torch
    fn()
    out = []
    for _ in range(reps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return out


def measure_ceilings(device: str = "cuda", read_bytes: int | None = None, mm: int | None = None,
                     reps: int = 10) -> tuple[float, float]:
    """(read GB/s, bf16 TFLOP/s) of `device`."""
    import torch
    cuda = device == "cuda"
    read_bytes = read_bytes or ((4 << 30) if cuda else (256 << 20))
    x = torch.randn(read_bytes // 2, device=device).to(torch.bfloat16)
    t_read = min(_time(lambda: torch.sum(x, dtype=torch.float32), reps, cuda))
    gbps = x.numel() * 2 / t_read / 1e9
    x = None  # free the read buffer before the matmul's operands
    n = mm or (8192 if cuda else 1024)
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    t_mm = min(_time(lambda: torch.matmul(a, b, out=c), reps, cuda))
    tflops = 2 * n ** 3 / t_mm / 1e12
    return gbps, tflops


def calibrate(device: str = "cuda", name: str | None = None, reps: int = 10) -> DeviceProfile:
    import os

    import torch

    from kvtune.kernels.lookup import device_name
    gbps, tflops = measure_ceilings(device, reps=reps)
    stamp = time.strftime("%Y-%m-%d", time.gmtime())
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        arch = f"sm_{p.major}{p.minor}"
        return DeviceProfile(
            name=name or p.name.lower().replace("nvidia ", "").replace(" ", "-"), device_name=p.name, arch=arch,
            sm_count=p.multi_processor_count, l2_bytes=int(getattr(p, "L2_cache_size", 0) or 1),
            smem_per_block_bytes=int(getattr(p, "shared_memory_per_block_optin", 0) or 49152),
            smem_per_sm_bytes=int(getattr(p, "shared_memory_per_multiprocessor", 0) or 49152),
            regs_per_sm=int(getattr(p, "regs_per_multiprocessor", 0) or 65536),
            threads_per_sm=int(getattr(p, "max_threads_per_multi_processor", 0) or 2048),
            read_gbps=round(gbps, 1), bf16_tflops=round(tflops, 1),
            ceilings_source=f"kvtune calibrate on {p.name}, {stamp}: torch.sum over 4 GiB bf16; "
                            f"8192^3 bf16 matmul; best of {reps}")
    return DeviceProfile(
        name=name or "cpu", device_name=device_name("cpu"), arch="cpu",
        sm_count=os.cpu_count() or 1, l2_bytes=1 << 20, smem_per_block_bytes=1 << 20, smem_per_sm_bytes=1 << 20,
        regs_per_sm=65536, threads_per_sm=2048, read_gbps=round(gbps, 2), bf16_tflops=round(tflops, 4),
        ceilings_source=f"kvtune calibrate --device cpu, {stamp}: torch.sum over 256 MiB bf16; 1024^3 bf16 matmul")


def _cmd_calibrate(args) -> int:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch here (calibrate this machine with "
                         "--device cpu, or run on the GPU's machine)")
    prof = calibrate(device, args.name, args.reps)
    dest = Path(args.path) if args.path else CONFIG_DIR / "devices" / f"{prof.name}-calibrated.yaml"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(prof.to_dict(), sort_keys=False))
    print(f"{prof.device_name} ({prof.arch}): read {prof.read_gbps} GB/s, bf16 {prof.bf16_tflops} TFLOP/s "
          f"-> {dest}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure this device's ceilings and write a device profile",
                              description=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"))
    p.add_argument("--name", help="profile name (default: from the device name)")
    p.add_argument("--path", help="output file (default configs/devices/<name>-calibrated.yaml)")
    p.add_argument("--reps", type=positive_int("--reps"), default=10)
    p.set_defaults(func=_cmd_calibrate)
