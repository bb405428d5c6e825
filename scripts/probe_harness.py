"""What the sm_90a tile-loop probes share (`wgmma_probe.py`, `pingpong_probe.py`,
`rows_in_m_probe.py`): compiling one kernel with NVRTC, loading and launching it (256 threads,
or `threads`, its dynamic shared memory) through the driver, and timing a launch with CUDA events."""
from __future__ import annotations

import ctypes

import torch


def compile_kernel(src: str, name: str, arch: str = "sm_90a") -> tuple[bytes, str]:
    """(cubin, ptxas log) of `src`; the log (registers, spills, wgmma serialization) is printed."""
    from mma_ceiling import nvrtc_cubin
    cubin, log = nvrtc_cubin(src, name, [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v"])
    print(log.strip(), flush=True)
    return cubin, log


class Kernel:
    """Kernel `fn` of `src`, compiled and loaded on the current GPU with `smem` bytes of dynamic
    shared memory. `launch(grid, *args)`: tensors go by their data pointers, ints as int, floats
    as float, ctypes values as they are (e.g. ctypes.c_uint)."""

    def __init__(self, src: str, name: str, fn: str, smem: int, threads: int = 256):
        from cuda.bindings import driver as drv
        from kvtune.kernels.cuda.nvrtc import _ensure_context, check_driver
        self.drv, self.check, self.smem, self.name, self.threads = drv, check_driver, smem, fn, threads
        _ensure_context(torch.cuda.current_device())
        mod = check_driver(drv.cuModuleLoadData(compile_kernel(src, name)[0]), "cuModuleLoadData")
        self.fn = check_driver(drv.cuModuleGetFunction(mod, fn.encode()), fn)
        check_driver(drv.cuFuncSetAttribute(
            self.fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem), "smem")

    def launch(self, grid: int, *args) -> None:
        def c_value(v):
            if isinstance(v, torch.Tensor):
                return ctypes.c_void_p(v.data_ptr())
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return v
            return ctypes.c_int(v) if isinstance(v, int) else ctypes.c_float(v)
        vals = [c_value(v) for v in args]
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        stream = self.drv.CUstream(torch.cuda.current_stream().cuda_stream)
        self.check(self.drv.cuLaunchKernel(self.fn, grid, 1, 1, self.threads, 1, 1, self.smem, stream,
                                           ctypes.addressof(ptrs), 0), f"launch {self.name}")


def median_us(launch, reps: int = 6) -> float:
    """Median time of `launch()` in us over `reps` - 1 runs (the first warms up), CUDA events.

    The GPU is kept busy (about 1 ms of spinning) while the host records the first event and
    enqueues the launch: otherwise the host's launch cost through ctypes (about 35 us) sits
    between the two events and is counted as kernel time."""
    ts = []
    for rep in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record()
        launch()
        b.record()
        b.synchronize()
        if rep:
            ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


def time_modes(launch, modes, flops, iters: int, keys: int) -> list[dict]:
    """One CTA per SM, `iters` tiles of `keys` keys each: per (name, mode) of `modes`, the median
    time of `launch(ctas, mode)` per tile per SM (also per 32 keys) and the TFLOP/s over all SMs of
    `flops(mode)` per tile per CTA."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, mode in modes:
        us = median_us(lambda: launch(sms, mode))
        row = {"what": name} if keys == 32 else {"what": name, f"us_per_{keys}_keys": us / iters}
        rows.append({**row, "us_per_32_keys": us / iters * 32 / keys,
                     "tflops_all_sms": flops(mode) * iters * sms / (us * 1e-6) / 1e12, "iters": iters, "ctas": sms})
    return rows
