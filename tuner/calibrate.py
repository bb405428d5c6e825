"""`kvtune calibrate`: measure the local device's ceilings and write a device profile.

Read bandwidth: a large read-only reduction (`sum` over a bf16 tensor many times the L2),
timed with CUDA events. bf16 MMA rate: a large bf16 matrix product (fp32 accumulation).
The best of several repetitions is kept (a ceiling, not a typical value). Arch limits come
from the device properties.
"""
from __future__ import annotations

import dataclasses
import math
import time
from fractions import Fraction
from pathlib import Path

import yaml

from .config import CONFIG_DIR, DeviceProfile, load_deployment, read_yaml
from .options import positive_int
from .space import SPACE_DIR


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


def rescaled_nsplit(choice: int, base_sms: int, sms: int) -> int:
    """An NSPLIT choice made for a GPU of `base_sms` SMs, for one of `sms`: the same fraction of
    the SMs, rounded down (a split over the SM count is a second wave). A choice within 5% of a
    fraction p/q with q <= 8 (the spaces' eighths, thirds, halves, ...: 188 / 8 = 23.5 -> 23)
    keeps that fraction exactly, so 23 of 188 becomes 170 // 8 = 21, not 20."""
    f = Fraction(choice, base_sms)
    near = f.limit_denominator(8)
    if near and abs(near - f) <= f / 20:
        f = near
    return max(1, math.floor(f * sms))


def write_rescaled_spaces(src: Path, dest: Path, base_sms: int, sms: int) -> Path:
    """Each `<backend>.yaml` of the search-space folder `src` written to `dest`; for the backends
    whose NSPLIT counts the splits of a whole batch per head group (`nsplit_per_batch`: about one
    CTA per SM), its NSPLIT choices rescaled from `base_sms` to `sms` SMs (`rescaled_nsplit`,
    duplicates dropped). Triton's NSPLIT, splits per request, is kept."""
    from kvtune.kernels.params import nsplit_per_batch   # the declarations: no torch, no NVRTC
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.glob("*.yaml")):
        doc = read_yaml(path)
        nsplit = (doc.get("params") or {}).get("NSPLIT")
        per_batch = nsplit_per_batch(str(doc.get("backend")))
        if per_batch and isinstance(nsplit, dict) and isinstance(nsplit.get("choices"), list):
            nsplit["choices"] = sorted({rescaled_nsplit(int(c), base_sms, sms) for c in nsplit["choices"]})
        (dest / path.name).write_text(f"# {path}, NSPLIT's choices rescaled from {base_sms} to {sms} SMs by "
                                      "kvtune calibrate\n" + yaml.safe_dump(doc, sort_keys=False))
    return dest


def deployment_for_gpu(device_name: str, family: str = "kimi-k2", out_dir: str | Path = "runs/configs",
                       profile=None) -> Path:
    """The deployment file a sweep on the GPU `device_name` should use: the shipped
    `configs/deployments/<family>-*.yaml` whose device profile names that GPU, else one written
    for it under `out_dir` (`devices/<name>.yaml` from `profile()`, by default `calibrate("cuda")`,
    and `deployments/<family>-<name>.yaml` with the buckets of the shipped deployment of the
    family whose device's shared memory per block is nearest this GPU's without exceeding it, so
    its search space fits: 99 KB parts get the sm_120 space, not the H200's pruned). A deployment
    written there before for this GPU is reused; a profile name that a shipped profile or
    deployment already uses gets `-local`. Raises ValueError when the family has no shipped
    deployment."""
    shipped = [load_deployment(p) for p in sorted((CONFIG_DIR / "deployments").glob(f"{family}-*.yaml"))]
    if not shipped:
        raise ValueError(f"family: no deployment {family}-*.yaml in {CONFIG_DIR / 'deployments'}")
    out = Path(out_dir)
    # a deployment written here before for this GPU is reused: its profile's ceilings are the
    # floors of the trials a resumed sweep already holds
    written = [load_deployment(p) for p in sorted((out / "deployments").glob(f"{family}-*.yaml"))]
    for dep in shipped + written:
        if dep.device.device_name == device_name:
            return Path(dep.source)
    prof = profile() if profile is not None else calibrate("cuda")
    if prof.device_name != device_name:
        raise ValueError(f"profile: measured {prof.device_name!r}, asked for {device_name!r}")
    if f"{family}-{prof.name}" in {d.name for d in shipped} or (CONFIG_DIR / "devices" / f"{prof.name}.yaml").exists():
        # another GPU's shipped name ("NVIDIA H100" slugs to h100): never file these timings under it
        prof = dataclasses.replace(prof, name=f"{prof.name}-local")
    # the nearest shared memory per block, preferring a base whose configs fit this GPU's
    base = min(shipped, key=lambda d: (d.device.smem_per_block_bytes > prof.smem_per_block_bytes,
                                       abs(d.device.smem_per_block_bytes - prof.smem_per_block_bytes),
                                       d.device.arch != prof.arch, d.name))
    (out / "devices").mkdir(parents=True, exist_ok=True)
    (out / "deployments").mkdir(parents=True, exist_ok=True)
    (out / "devices" / f"{prof.name}.yaml").write_text(yaml.safe_dump(prof.to_dict(), sort_keys=False))
    doc = read_yaml(Path(base.source))
    doc.update(name=f"{family}-{prof.name}", device=prof.name,
               description=f"{base.name}'s buckets on {prof.device_name} (written by kvtune calibrate)")
    if prof.sm_count != base.device.sm_count:
        # the base's NSPLIT choices are fractions of its SM count: the same fractions of this one
        spaces = write_rescaled_spaces(Path(base.space_dir or SPACE_DIR), out / "search_spaces" / prof.name,
                                       base.device.sm_count, prof.sm_count)
        doc["search_spaces"] = str(Path("..") / spaces.relative_to(out))
    path = out / "deployments" / f"{family}-{prof.name}.yaml"
    path.write_text(f"# {base.name}'s buckets for {prof.device_name}, whose ceilings `kvtune calibrate` measured "
                    f"into ../devices/{prof.name}.yaml\n" + yaml.safe_dump(doc, sort_keys=False))
    return path


def _cmd_calibrate(args) -> int:
    import torch
    if args.deployment_for:
        if not torch.cuda.is_available():
            raise ValueError("--deployment-for: no CUDA GPU is visible to torch here")
        from kvtune.kernels.lookup import device_name   # the spelling a device profile's device_name takes
        print(deployment_for_gpu(device_name("cuda"), args.deployment_for, args.out_dir,
                                 lambda: calibrate("cuda", args.name, args.reps)))
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch here (calibrate this machine with "
                         "--device cpu, or run on the GPU's machine)")
    # checked before the measurement, not after it
    if args.path and Path(args.path).is_dir():
        raise ValueError(f"--path {args.path}: is a folder")
    if args.out_dir and Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise ValueError(f"--out-dir {args.out_dir}: is a file")
    prof = calibrate(device, args.name, args.reps)
    # under --out-dir (git-ignored runs/configs), named as the profile inside names itself
    dest = Path(args.path) if args.path else Path(args.out_dir) / "devices" / f"{prof.name}.yaml"
    if not args.path and dest.exists():   # its ceilings may be the floors of a run's recorded trials
        raise ValueError(f"{dest}: a device profile of that name exists (measured now: read {prof.read_gbps} GB/s, "
                         f"bf16 {prof.bf16_tflops} TFLOP/s); pass --path {dest} to replace it, or --name for another")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(prof.to_dict(), sort_keys=False))
    print(f"{prof.device_name} ({prof.arch}): read {prof.read_gbps} GB/s, bf16 {prof.bf16_tflops} TFLOP/s "
          f"-> {dest} (a deployment takes it as `device: {dest}`)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure this device's ceilings and write a device profile",
                              description=__doc__)
    p.add_argument("--device", choices=("cuda", "cpu"))
    p.add_argument("--name", help="profile name (default: from the device name)")
    p.add_argument("--path", help="output file (default <--out-dir>/devices/<name>.yaml)")
    p.add_argument("--reps", type=positive_int("--reps"), default=10)
    p.add_argument("--deployment-for", metavar="FAMILY",
                   help="print the deployment file to sweep this GPU with: the shipped FAMILY-*.yaml (e.g. kimi-k2) "
                        "whose device profile names this GPU, else one for it written under --out-dir after "
                        "measuring its ceilings")
    p.add_argument("--out-dir", default="runs/configs",
                   help="where the profile (devices/) and --deployment-for's deployment (deployments/) are written "
                        "(default runs/configs, git-ignored)")
    p.set_defaults(func=_cmd_calibrate)
