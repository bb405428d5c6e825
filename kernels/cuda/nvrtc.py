"""NVRTC compilation of `verify.cu` to CUBIN, with an on-disk and an in-process cache.

CUBIN, not PTX: PTX from an NVRTC newer than the driver cannot be loaded, CUBIN for the
exact arch can. Every compiled kernel keeps its resource report (registers, spills, stack,
shared memory), parsed from ptxas' verbose log, so configs can be judged on a machine
without a GPU.

Cache: `$KVTUNE_CACHE_DIR` (default `~/.cache/kvtune/cuda`), one `<name>.cubin` and
`<name>.json` per build, `<name>` readable and built from every template value, the arch,
the NVRTC version and the source hash; built under a file lock and written atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

SOURCE_PATH = Path(__file__).with_name("verify.cu")
#: sources a module may be built from, compiled as one text in this order (verify_wgmma.cu uses
#: verify.cu's arguments, schedule and merge kernel, so it always comes after it)
SOURCE_PARTS = ("verify.cu", "verify_wgmma.cu", "verify_km.cu")
NAMESPACE = "kvtune"


class NvrtcError(RuntimeError):
    """A compile failure; the message holds NVRTC's log."""


class DriverError(RuntimeError):
    """A failed CUDA driver call."""


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel (bytes, except registers)."""

    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    static_smem: int = 0

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass
class CompiledModule:
    """A CUBIN and, per requested name expression, its lowered name and resources."""

    name: str
    arch: str
    cubin: bytes
    lowered: dict[str, str]
    resources: dict[str, KernelResources]
    log: str = ""
    from_cache: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def unreported(self) -> list[str]:
        """The name expressions with no `ptxas -v` report in `log`: their resources read 0, unknown.
        One GPU machine's NVRTC 13.0 printed none for a module whose code (not text) it had just
        compiled in the same process (results/compat/nvrtc-13.0/README.md)."""
        seen = parse_ptxas_log(self.log)
        return [e for e, ln in self.lowered.items() if ln not in seen]


_source_lock = threading.Lock()
_source_cache: dict[str, str] = {}


def kernel_source(parts: tuple[str, ...] = ("verify.cu",)) -> str:
    """The text compiled for a module built from `parts` (names in SOURCE_PARTS, verify.cu first)."""
    if not parts or parts[0] != "verify.cu" or any(p not in SOURCE_PARTS for p in parts):
        raise ValueError(f"parts: expected verify.cu first, then names from {SOURCE_PARTS}; got {parts}")
    with _source_lock:
        if "src" not in _source_cache:
            _source_cache["src"] = SOURCE_PATH.read_text()
        texts = [_source_cache["src"]]
        for name in parts[1:]:
            if name not in _source_cache:
                _source_cache[name] = SOURCE_PATH.with_name(name).read_text()
            texts.append(_source_cache[name])
        return "\n".join(texts)


@contextmanager
def source_override(text: str, part: str = "verify.cu"):
    """Compile `text` in place of the source part `part` inside the block (diagnostics that time
    copies of the source with a stage left out: scripts/time_phases.py). The source hash, so
    every compile-cache name, follows the text: nothing compiled from it is ever served for the
    shipped source. Loaded kernels are the caller's to drop (the backends cache them)."""
    if part not in SOURCE_PARTS:
        raise ValueError(f"part: expected one of {SOURCE_PARTS}, got {part!r}")
    key = "src" if part == "verify.cu" else part
    with _source_lock:
        old = _source_cache.get(key)
        _source_cache[key] = text
    try:
        yield
    finally:
        with _source_lock:
            if old is None:
                _source_cache.pop(key, None)
            else:
                _source_cache[key] = old


def kernel_source_hash(parts: tuple[str, ...] = ("verify.cu",)) -> str:
    """sha256 (first 16 hex digits) of the CUDA source built from `parts`: provenance for
    exported configs (verify.cu alone is the cuda backend's)."""
    return hashlib.sha256(kernel_source(parts).encode()).hexdigest()[:16]


def _nvrtc():
    from cuda.bindings import nvrtc
    return nvrtc


def _check_nvrtc(result, what: str, log: str = ""):
    nvrtc = _nvrtc()
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        msg = nvrtc.nvrtcGetErrorString(err)[1]
        msg = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise NvrtcError(f"{what} failed: {msg}" + (f"\n--- NVRTC log ---\n{log}" if log else ""))
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def nvrtc_version() -> str:
    nvrtc = _nvrtc()
    major, minor = _check_nvrtc(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def supported_archs() -> list[str]:
    nvrtc = _nvrtc()
    n = _check_nvrtc(nvrtc.nvrtcGetNumSupportedArchs(), "nvrtcGetNumSupportedArchs")
    archs = _check_nvrtc(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return [f"sm_{a}" for a in list(archs)[:n]]


def include_dirs() -> list[str]:
    """Where cuda_bf16.h lives: the nvidia-cuda-runtime wheel or the toolkit."""
    dirs = []
    try:
        from cuda import pathfinder
        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            dirs.append(str(d))
    except Exception:  # pathfinder missing or finds nothing: fall back to a toolkit
        pass
    for env in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(env)
        if root and Path(root, "include", "cuda_bf16.h").exists():
            dirs.append(str(Path(root, "include")))
    if Path("/usr/local/cuda/include/cuda_bf16.h").exists():
        dirs.append("/usr/local/cuda/include")
    if not dirs:
        raise NvrtcError("cuda_bf16.h not found: install nvidia-cuda-runtime (cuda.pathfinder "
                         "find_nvidia_header_directory('cudart')) or set CUDA_HOME")
    return dirs


def cache_dir() -> Path:
    d = os.environ.get("KVTUNE_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "kvtune" / "cuda"


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'|Function properties for ([^\s:]+)")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> dict[str, KernelResources]:
    """Per mangled function name, registers / spills / stack / static smem from `ptxas -v`."""
    out: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            current = m.group(1) or m.group(2)
            out.setdefault(current, {})
        if current is None:
            continue
        m = _PTXAS_FRAME.search(line)
        if m:
            out[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_USED.search(line)
        if m:
            out[current]["registers"] = int(m.group(1))
            s = _PTXAS_SMEM.search(line)
            if s:
                out[current]["static_smem"] = int(s.group(1))
    return {k: KernelResources(**v) for k, v in out.items()}


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _compile_uncached(name_exprs: list[str], arch: str, extra_options: list[str],
                      parts: tuple[str, ...] = ("verify.cu",)) -> CompiledModule:
    nvrtc = _nvrtc()
    src = kernel_source(parts).encode()
    # one program of the parts in order: a compile error's line counts from the first part's top
    prog = _check_nvrtc(nvrtc.nvrtcCreateProgram(src, "+".join(parts).encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for e in name_exprs:
            _check_nvrtc(nvrtc.nvrtcAddNameExpression(prog, e.encode()), f"nvrtcAddNameExpression({e})")
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", "-default-device",
                "--extra-device-vectorization"] + [f"-I{d}" for d in include_dirs()] + list(extra_options)
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.decode(errors="replace").rstrip("\x00")
        _check_nvrtc(res, f"compiling {name_exprs} for {arch}", log)
        size = _check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for e in name_exprs:
            ln = _check_nvrtc(nvrtc.nvrtcGetLoweredName(prog, e.encode()), f"nvrtcGetLoweredName({e})")
            lowered[e] = ln.decode() if isinstance(ln, bytes) else str(ln)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    per_func = parse_ptxas_log(log)
    resources = {e: per_func.get(lowered[e], KernelResources()) for e in name_exprs}
    return CompiledModule(name="", arch=arch, cubin=cubin, lowered=lowered, resources=resources, log=log)


_mem_cache: dict[str, CompiledModule] = {}
_mem_lock = threading.Lock()


def compile_module(name: str, name_exprs: list[str], arch: str, extra_options: list[str] = (),
                   parts: tuple[str, ...] = ("verify.cu",)) -> CompiledModule:
    """Compile (or fetch from cache) the CUBIN holding `name_exprs` for `arch` ("sm_90").

    `name` must identify every template value; the arch, NVRTC version and source hash (of
    the text built from `parts`) are appended here. Raises NvrtcError with the log on a compile error.
    """
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch: expected 'sm_XX' (e.g. sm_90, sm_120), got {arch!r}")
    full = f"{name}_{arch}_nvrtc{nvrtc_version()}_{kernel_source_hash(parts)}"
    if extra_options:   # -lineinfo / -G builds must not share a CUBIN with the plain one
        full += "_opt" + hashlib.sha256(" ".join(extra_options).encode()).hexdigest()[:8]
    with _mem_lock:
        if full in _mem_cache:
            return _mem_cache[full]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    cubin_path, meta_path = d / f"{full}.cubin", d / f"{full}.json"
    from filelock import FileLock
    with FileLock(str(d / f"{full}.lock")):
        mod = None
        if cubin_path.exists() and meta_path.exists():
            try:
                meta = json.loads(meta_path.read_text())
                if meta.get("name_exprs") == list(name_exprs):
                    mod = CompiledModule(name=full, arch=arch, cubin=cubin_path.read_bytes(), lowered=meta["lowered"],
                                         resources={k: KernelResources(**v) for k, v in meta["resources"].items()},
                                         log=meta.get("log", ""), from_cache=True)
                    if mod.unreported:   # written before such entries were kept out: its zeros are not ptxas's
                        mod = None
            except (OSError, ValueError, KeyError, TypeError):
                mod = None  # a damaged entry is rebuilt
        if mod is None:
            mod = _compile_uncached(list(name_exprs), arch, list(extra_options), parts)
            mod.name = full
            if mod.unreported:
                # resources of 0 would pass every spill and register check: never cache them for
                # another process; this one sees them as unknown (registers from the driver at launch)
                warnings.warn(f"NVRTC printed no ptxas report for {mod.unreported} in {full}: their registers and "
                              "spills are unknown; the module is not cached on disk", RuntimeWarning, stacklevel=2)
                with _mem_lock:
                    return _mem_cache.setdefault(full, mod)
            _atomic_write(cubin_path, mod.cubin)
            meta = {"name_exprs": list(name_exprs), "lowered": mod.lowered, "arch": arch,
                    "nvrtc": nvrtc_version(), "source_hash": kernel_source_hash(parts),
                    "resources": {k: asdict(v) for k, v in mod.resources.items()}, "log": mod.log}
            _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    with _mem_lock:
        _mem_cache.setdefault(full, mod)
        return _mem_cache[full]


# ---------------------------------------------------------------- driver side

def _driver():
    from cuda.bindings import driver
    return driver


def check_driver(result, what: str):
    """Unpack a cuda.bindings driver result tuple, raising DriverError on failure."""
    drv = _driver()
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)
        desc = drv.cuGetErrorString(err)
        name = name[1].decode() if name[0] == drv.CUresult.CUDA_SUCCESS else str(err)
        desc = desc[1].decode() if desc[0] == drv.CUresult.CUDA_SUCCESS else ""
        raise DriverError(f"{what} failed: {name} ({desc})")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


@dataclass
class LoadedKernel:
    function: object          # CUfunction
    handle: int               # int(CUfunction), for cuLaunchKernel
    resources: KernelResources
    dynamic_smem: int


_loaded: dict[tuple, tuple[object, dict[str, LoadedKernel]]] = {}
_load_lock = threading.Lock()


def _ensure_context(device_index: int):
    """Make the device's primary context (the one torch uses) current on this thread."""
    drv = _driver()
    check_driver(drv.cuInit(0), "cuInit")
    ctx = check_driver(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    dev = check_driver(drv.cuDeviceGet(device_index), "cuDeviceGet")
    if ctx is None or int(ctx) == 0:
        ctx = check_driver(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check_driver(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def load_kernels(mod: CompiledModule, device_index: int, dynamic_smem: dict[str, int]) -> dict[str, LoadedKernel]:
    """Load `mod` on the device (once per context) and raise each kernel's dynamic smem limit."""
    drv = _driver()
    ctx = _ensure_context(device_index)
    key = (int(ctx), mod.name)
    with _load_lock:
        if key in _loaded:
            return _loaded[key][1]
        module = check_driver(drv.cuModuleLoadData(mod.cubin), f"cuModuleLoadData({mod.name})")
        kernels = {}
        for expr, lowered in mod.lowered.items():
            fn = check_driver(drv.cuModuleGetFunction(module, lowered.encode()), f"cuModuleGetFunction({expr})")
            smem = int(dynamic_smem.get(expr, 0))
            if smem > 48 * 1024:
                check_driver(drv.cuFuncSetAttribute(
                    fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                    f"cuFuncSetAttribute(max dynamic smem = {smem}) for {expr}")
            nregs = check_driver(drv.cuFuncGetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn),
                                 "cuFuncGetAttribute(NUM_REGS)")
            res = mod.resources.get(expr, KernelResources())
            if res.registers == 0:  # no ptxas log (e.g. a cached entry built elsewhere): ask the driver
                res = KernelResources(registers=int(nregs))
            kernels[expr] = LoadedKernel(fn, int(fn), res, smem)
        _loaded[key] = (module, kernels)
        return kernels
