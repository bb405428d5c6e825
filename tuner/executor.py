"""Where trials run: a trial worker process (restarted after a GPU fault) or this process.

(Not to be confused with the sweep workers of `--workers`, `tuner/workers.py`: each of those
is a whole sweep process, which measures through an executor of this module.)

`execute(request)` is the one function that runs a request (device info, backend info, a
measurement); the worker process loop and the in-process executor both call it, and so
can a distributed worker later. The parent talks to a worker through a pipe: an illegal
address poisons the whole CUDA context, so a fatal error, a crash or a timeout kills the
worker, the trial is recorded as failed with the error, and the next trial gets a fresh
worker (compiled kernels are cached per process and, for Triton, on disk).

On the CPU the Triton kernel runs under its interpreter: TRITON_INTERPRET=1 is set in the
environment before the worker imports triton.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone

_MEASURER = None


def _kernel_hash(be) -> str:
    """The kernel source hash of a backend: `Backend.kernel_hash()`, else
    `kernel_source_hash()` of its module (or of a base class's module)."""
    try:
        h = be.kernel_hash() if callable(getattr(be, "kernel_hash", None)) else None
    except Exception:  # noqa: BLE001
        h = None
    if h:
        return str(h)
    for cls in type(be).__mro__:
        mod = sys.modules.get(cls.__module__)
        fn = getattr(mod, "kernel_source_hash", None)
        if callable(fn):
            try:
                return str(fn())
            except Exception:  # noqa: BLE001
                return ""
    return ""


def _cuda_kernel_hash() -> str:
    try:
        import importlib
        for mod in ("kvtune.kernels.cuda", "kvtune.kernels.cuda.backend", "kvtune.kernels.cuda.nvrtc"):
            fn = getattr(importlib.import_module(mod), "kernel_source_hash", None)
            if callable(fn):
                return str(fn())
    except Exception:  # noqa: BLE001 - the CUDA backend is optional
        pass
    return ""


def _driver_version() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return ""


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc
        err, major, minor = nvrtc.nvrtcVersion()
        return f"{major}.{minor}"
    except Exception:  # noqa: BLE001
        return ""


def device_info(device: str) -> dict:
    """Provenance of measurements taken on `device` in this process."""
    import torch
    import triton

    import kvtune.kernels.triton_kernel as tk
    from kvtune.kernels import __version__ as kv   # also set where kvtune runs from a checkout, uninstalled
    info = {"device_type": device, "torch": torch.__version__, "triton": triton.__version__, "kvtune": kv,
            "nvrtc": _nvrtc_version(), "kernel_hash_triton": tk.kernel_source_hash(),
            "kernel_hash_cuda": _cuda_kernel_hash(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, arch=f"sm_{props.major}{props.minor}",
                    sm_count=props.multi_processor_count, l2_bytes=int(getattr(props, "L2_cache_size", 0)),
                    driver=_driver_version(), cuda=str(torch.version.cuda or ""))
    else:
        from kvtune.kernels.lookup import device_name   # the spelling the runtime compares against
        info.update(device_name=device_name("cpu"), arch="cpu",
                    sm_count=os.cpu_count() or 1, l2_bytes=0, driver="", cuda="",
                    triton_interpret=os.environ.get("TRITON_INTERPRET", ""))
    return info


def backend_info(name: str, spec: dict, device: str) -> dict:
    """Parameter fields, the default for `spec`, whether it runs here, its kernel hash."""
    import dataclasses

    import torch

    from kvtune.kernels import get_backend

    from .measure import ProblemSpec
    try:
        be = get_backend(name)
    except Exception as e:  # noqa: BLE001 - e.g. the CUDA backend not built yet
        return {"unsupported": f"cannot load backend {name!r}: {type(e).__name__}: {e}"}
    why = be.supports(torch.device(device))
    if be.params_type is None:
        return {"unsupported": f"backend {name!r} has no parameters to tune"}
    out = {"unsupported": why, "fields": [f.name for f in dataclasses.fields(be.params_type)],
           "kernel_hash": _kernel_hash(be) or (_cuda_kernel_hash() if name == "cuda" else ""),
           "params_type": be.params_type.__name__}
    if spec is not None:
        d = be.default_params(ProblemSpec(**spec).problem(device))
        out["default"] = dataclasses.asdict(d)
    return out


def execute(req: dict) -> dict:
    """Run one request in this process: {"op": "info" | "backend" | "measure", ...}."""
    global _MEASURER
    op = req["op"]
    if op == "info":
        return device_info(req["device"])
    if op == "backend":
        return backend_info(req["backend"], req.get("spec"), req["device"])
    if op == "measure":
        from .measure import Ceilings, Measurer, MeasureOptions, ProblemSpec
        key = (req["device"], req.get("arch"), req.get("l2_bytes"))
        if _MEASURER is None or _MEASURER[0] != key:
            _MEASURER = (key, Measurer(req["device"], arch=req.get("arch"), l2_bytes=req.get("l2_bytes")))
        ceil = Ceilings(**req["ceilings"]) if req.get("ceilings") else None
        m = _MEASURER[1].measure(req["backend"], req["params"], ProblemSpec(**req["spec"]),
                              MeasureOptions(**req["options"]), ceil)
        return m.to_dict()
    if op == "warm":
        from .measure import ProblemSpec, warm
        return warm(req["backend"], req["params"], ProblemSpec(**req["spec"]), req["device"], req.get("arch"))
    raise ValueError(f"unknown request op {op!r}")


def _prepare_env(device: str) -> None:
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"


def _register(registry: dict) -> None:
    from kvtune.kernels.backends import register_backend
    for name, factory in registry.items():
        register_backend(name, factory)


def _ignore_sigint() -> None:
    """Ctrl-C is the parent's: it records the interruption and stops its workers."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_main(conn, device: str, registry: dict) -> None:
    _ignore_sigint()
    _prepare_env(device)                  # before anything imports triton
    try:
        _register(registry)
    except Exception as e:  # noqa: BLE001
        conn.send({"error": f"worker could not register backends: {type(e).__name__}: {e}"})
        return
    while True:
        try:
            req = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if req is None:
            return
        try:
            res = {"result": execute(req)}
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
        conn.send(res)
        result = res.get("result")
        if isinstance(result, dict) and result.get("fatal"):
            return                        # poisoned CUDA context: let the parent start a new worker


def _string_registry() -> dict:
    """Registered backends that a fresh process can import ("module:attr" entries)."""
    from kvtune.kernels import backends
    reg = getattr(backends, "_REGISTRY", {})
    return {n: s for n, s in reg.items() if isinstance(s, str) and ":" in s}


class WorkerError(RuntimeError):
    pass


class SubprocessExecutor:
    """Runs requests in a spawned worker process; replaces it after a fault or a timeout."""

    def __init__(self, device: str, timeout_s: float = 600.0):
        self.device = device
        self.timeout_s = timeout_s
        self.proc = None
        self.conn = None
        self.starts = 0
        self._ctx = mp.get_context("spawn")

    @property
    def restarts(self) -> int:
        """Worker processes started to replace one that died, hung or hit a fatal error."""
        return max(0, self.starts - 1)

    def _start(self):
        self.starts += 1
        _prepare_env(self.device)         # inherited by the spawned child
        parent, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_worker_main, args=(child, self.device, _string_registry()),
                                      daemon=True, name="kvtune-trial-worker")
        self.proc.start()
        child.close()
        self.conn = parent

    def _kill(self):
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def close(self, force: bool = False):
        if self.proc is not None and self.proc.is_alive() and not force:
            try:
                self.conn.send(None)
                self.proc.join(timeout=10)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def request(self, req: dict, timeout_s: float | None = None) -> dict:
        """The result of `req`; raises WorkerError when the worker dies or times out (it is
        then replaced on the next request)."""
        if self.proc is None or not self.proc.is_alive():
            self._kill()
            self._start()
        timeout = timeout_s or self.timeout_s
        try:
            self.conn.send(req)
            t0 = time.monotonic()
            while not self.conn.poll(1.0):
                if not self.proc.is_alive():
                    code = self.proc.exitcode
                    self._kill()
                    raise WorkerError(f"worker process died (exit code {code})")
                if time.monotonic() - t0 > timeout:
                    self._kill()
                    raise WorkerError(f"timed out after {timeout:.0f} s (worker killed)")
            res = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            code = self.proc.exitcode if self.proc is not None else None
            self._kill()
            raise WorkerError(f"worker process died (exit code {code}): {type(e).__name__}") from None
        if "error" in res:
            raise WorkerError(res["error"])
        result = res["result"]
        if isinstance(result, dict) and result.get("fatal"):
            self._kill()                  # the worker exits on its own; make sure
        return result


class InProcessExecutor:
    """Runs requests in this process (debugging, or tests of backends registered as objects)."""

    def __init__(self, device: str, timeout_s: float | None = None):
        self.device = device
        self.restarts = 0
        if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            if "triton" in sys.modules:
                raise ValueError("--device cpu in-process needs TRITON_INTERPRET=1 set before triton is "
                                 "imported; set it in the environment or use a worker process")
            os.environ["TRITON_INTERPRET"] = "1"

    def request(self, req: dict, timeout_s: float | None = None) -> dict:
        try:
            return execute(req)
        except Exception as e:  # noqa: BLE001
            raise WorkerError(f"{type(e).__name__}: {e}") from e

    def close(self, force: bool = False):
        pass


def _pool_init(device: str, registry: dict) -> None:
    _ignore_sigint()
    _prepare_env(device)
    _register(registry)


class Prefetcher:
    """Compiles configs ahead in a pool of processes while the worker measures.

    The pool only fills the backends' on-disk caches (Triton's, the CUDA backend's NVRTC
    cache): the measuring process then loads instead of compiling. Nothing it does is a
    result; a pool failure (even a crashed process) only costs the head start.
    """

    def __init__(self, device: str, workers: int, arch: str | None = None, timeout_s: float = 300.0):
        self.device = device
        self.workers = max(0, int(workers))
        self.arch = arch
        self.timeout_s = timeout_s
        self.pool = None
        self.futures: dict[str, object] = {}
        self.failures = 0

    def _pool(self):
        if self.pool is None:
            from concurrent.futures import ProcessPoolExecutor
            _prepare_env(self.device)
            self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=mp.get_context("spawn"),
                                            initializer=_pool_init, initargs=(self.device, _string_registry()))
        return self.pool

    @staticmethod
    def key(backend: str, params: dict, spec: dict) -> str:
        import json
        return json.dumps([backend, params, spec], sort_keys=True)

    def submit(self, backend: str, params: dict, spec: dict) -> None:
        if not self.workers:
            return
        k = self.key(backend, params, spec)
        if k in self.futures:
            return
        req = {"op": "warm", "backend": backend, "params": params, "spec": spec, "device": self.device,
               "arch": self.arch}
        try:
            self.futures[k] = self._pool().submit(execute, req)
        except Exception:  # noqa: BLE001 - a broken pool: start a new one next time
            self._reset()

    def wait(self, backend: str, params: dict, spec: dict) -> None:
        """Until the compile of this config (if submitted) is done; errors are ignored."""
        fut = self.futures.pop(self.key(backend, params, spec), None)
        if fut is None:
            return
        try:
            fut.result(timeout=self.timeout_s)
        except Exception:  # noqa: BLE001
            self.failures += 1
            from concurrent.futures.process import BrokenProcessPool
            if isinstance(fut.exception(timeout=0) if fut.done() else None, BrokenProcessPool):
                self._reset()

    def _reset(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = None
        self.futures.clear()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


def make_executor(device: str, isolate: bool = True, timeout_s: float = 600.0):
    return SubprocessExecutor(device, timeout_s) if isolate else InProcessExecutor(device, timeout_s)


__all__ = ["execute", "device_info", "backend_info", "make_executor", "SubprocessExecutor", "InProcessExecutor",
           "WorkerError"]
