"""Measuring configs of one deployment on this machine, for the sweep and the export's serving check.

A `Runner` holds the trial worker (`tuner/executor.py`: a process replaced after a GPU fault, or
this process), the pool compiling configs ahead, the device's and backends' provenance, and
turns one measurement into one row of the trials table (`tuner/table.py`).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict

from .config import ConfigError, Deployment
from .executor import Prefetcher, WorkerError, make_executor
from .log import get_logger

log = get_logger(__name__)


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


class Runner:
    """Measurements on `device` ("cuda" or "cpu", the Triton interpreter): `setup` first, then
    `measure` and `row`; `close` at the end."""

    def __init__(self, dep: Deployment, device: str | None = None, timing: str | None = None,
                 isolate: bool = True, trial_timeout_s: float = 600.0, compile_workers: int | None = None,
                 measure_overrides: dict | None = None):
        self.dep = dep
        self.device = device or default_device()
        if self.device == "cuda" and default_device() != "cuda":
            raise ConfigError("--device cuda: no CUDA GPU is visible here; use --device cpu (Triton interpreter)")
        self.timing = "cpu-eager" if self.device == "cpu" else (timing or dep.timing)
        self.overrides = measure_overrides or {}
        self.executor = make_executor(self.device, isolate, trial_timeout_s)
        if compile_workers is None:  # compiling is only worth a pool on the GPU (the interpreter compiles nothing)
            compile_workers = 0 if self.device == "cpu" else max(1, min(6, (os.cpu_count() or 2) // 2 - 1))
        self.prefetch = Prefetcher(self.device, compile_workers)
        self.info: dict = {}
        self.binfo: dict = {}
        self.skipped: dict[str, str] = {}

    def setup(self, backends) -> dict:
        """Device provenance, then each backend's info ({backend: info}); a backend that cannot
        run here is skipped with its reason (`skipped`)."""
        if not self.info:
            self.info = self.executor.request({"op": "info", "device": self.device})
        self.prefetch.arch = self.info["arch"] if self.device == "cuda" else None
        for be in backends:
            bi = self.executor.request({"op": "backend", "backend": be, "spec": None, "device": self.device})
            if bi.get("unsupported"):
                self.skipped[be] = bi["unsupported"]
                log.info("skipping backend %s: %s", be, bi["unsupported"])
                continue
            self.binfo[be] = bi
        return self.binfo

    def spec(self, tp, bs, ctx):
        """The problem of one (tp, batch, context) bucket of the deployment."""
        from .measure import ProblemSpec
        m = self.dep.model
        return ProblemSpec(heads=self.dep.heads(tp), batch=bs, context=ctx, draft_tokens=m.draft_tokens,
                           tree=self.dep.tree, kv_lora_rank=m.kv_lora_rank, rope_dim=m.qk_rope_head_dim,
                           sm_scale=m.scale)

    def default_params(self, backend, spec) -> dict:
        return self.executor.request({"op": "backend", "backend": backend, "spec": asdict(spec),
                                      "device": self.device})["default"]

    def _options(self, seed, extra):
        opts = {"timing": self.timing, "workspace_budget_bytes": self.dep.workspace_budget_bytes, "seed": seed}
        if self.device == "cpu":
            opts.update(warmup=0, cpu_reps=3)
        opts.update(self.overrides)
        return {**opts, **(extra or {})}

    def measure(self, backend, params, spec, seed, extra: dict | None = None) -> dict:
        """One measurement (`tuner.measure.Measurement.to_dict()`); a worker that dies or times
        out is a `failed` result with the reason, not an exception."""
        prof = self.dep.device
        cuda = self.device == "cuda"
        req = {"op": "measure", "device": self.device, "backend": backend, "params": params, "spec": asdict(spec),
               "options": self._options(seed, extra), "arch": self.info["arch"] if cuda else None,
               "l2_bytes": self.info.get("l2_bytes") or prof.l2_bytes if cuda else None,
               "ceilings": {"read_gbps": prof.read_gbps, "bf16_tflops": prof.bf16_tflops}}
        try:
            return self.executor.request(req)
        except WorkerError as e:
            from .measure import Ceilings
            return {"outcome": "failed", "reason": str(e), "timing": self.timing,
                    "floor_us": Ceilings(prof.read_gbps, prof.bf16_tflops).floor_us(spec)}

    def row(self, backend, tp, bs, ctx, spec, study, trial, role, params, m, phase="search", rnd="") -> dict:
        """The trials-table row of measurement `m` (columns: `tuner/table.py`)."""
        i = self.info
        row = {"deployment": self.dep.name, "study": study, "phase": phase, "round": rnd, "backend": backend,
               "tp": tp, "heads": spec.heads, "bs": bs, "ctx": ctx, "T": spec.draft_tokens, "tree": spec.tree,
               "trial": trial, "role": role, "params": params}
        for k in ("outcome", "reason", "median_us", "p10_us", "p90_us", "rel_err", "gbps", "tflops", "floor_us",
                  "pct_floor", "timing", "launches", "pools", "wall_s"):
            v = m.get(k)
            # significant digits, not decimals: CPU-interpreter GB/s and small errors are << 1e-4
            row[k] = float(f"{v:.6g}") if isinstance(v, float) else v
        row.update(device=i["device_name"], arch=i["arch"], sm_count=i["sm_count"], driver=i["driver"],
                   cuda=i["cuda"], nvrtc=i["nvrtc"], torch=i["torch"], triton=i["triton"],
                   kernel_hash=self.binfo[backend].get("kernel_hash", ""), kvtune=i["kvtune"],
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        return row

    def close(self, force: bool = False) -> None:
        self.executor.close(force=force)
        self.prefetch.close()
