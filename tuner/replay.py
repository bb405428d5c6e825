"""Replay the sweep's search against a table of measured latencies, offline (no GPU).

An exhaustive grid sweep (`kvtune sweep --grid`) measured every config of a space; this
module runs the real `Sweep` (its sampler, enqueued baseline and warm starts, grid policy,
repair of wasted proposals, cross-bucket phase) with the measurement replaced by a look-up
in that table: a config's latency is its grid-measured median, its outcome the grid's
outcome, and a config the grid never measured is pruned. Running it over many seeds shows
how often the search, with a given budget, finds a config within a tolerance of the grid's
best, which one GPU comparison (`scripts/compare_tpe_grid.py`) cannot show.

A replay is a replay of GPU-measured latencies, not a new GPU measurement: it has no timing
noise between trials (each config always "measures" the same); like any sweep, it runs no
serving check (that is the export's).
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import replace
from pathlib import Path

from .config import load_deployment, read_yaml
from .options import SweepOptions
from .strategy import params_key
from .study import ALL_PRUNED
from .sweep import Sweep
from .table import read_trials

KEYS = ["backend", "tp", "bs", "ctx"]


class GridTable:
    """Measured search-phase trials of a trials table, by (backend, heads, bs, ctx, config)
    (parameters under their current names: `read_trials` translates renamed ones)."""

    def __init__(self, path):
        df = read_trials(path)
        s = df[df["phase"] == "search"]
        self.path = str(path)
        self.rows: dict = {}
        self.default: dict = {}
        self.info: dict = {}
        for r in s.to_dict("records"):
            p = r["params"]
            key = (r["backend"], int(r["heads"]), int(r["bs"]), int(r["ctx"]))
            self.rows[key + (params_key(p),)] = r
            if r["role"] == "baseline":
                self.default[key] = p
            self.info.setdefault("device_name", r["device"])
            self.info.setdefault("arch", r["arch"])

    def best(self):
        """Best ok median per (backend, tp, bs, ctx)."""
        return best_by_study(read_trials(self.path))

    def measure(self, backend: str, params: dict, spec: dict) -> dict:
        r = self.rows.get((backend, spec["heads"], spec["batch"], spec["context"], params_key(params)))
        if r is None:
            return {"outcome": "pruned", "reason": "not in the grid table", "timing": "replay"}
        out = {k: r[k] for k in ("outcome", "median_us", "p10_us", "p90_us", "floor_us", "pct_floor")}
        out["reason"] = r["reason"] if isinstance(r["reason"], str) else None
        out["timing"] = "replay"
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


class _TableExecutor:
    """The trial worker's requests answered from a GridTable."""

    restarts = 0

    def __init__(self, grid: GridTable, fields: dict):
        self.grid, self.fields = grid, fields
        self.measurements = 0

    def request(self, req: dict, timeout_s=None) -> dict:
        op = req["op"]
        if op == "info":
            return {"device_type": "replay", "device_name": f"replay of {self.grid.info.get('device_name')}",
                    "arch": self.grid.info.get("arch"), "sm_count": 0, "l2_bytes": 0, "driver": "", "cuda": "",
                    "nvrtc": "", "torch": "", "triton": "", "kvtune": ""}
        if op == "backend":
            be = req["backend"]
            if be not in self.fields:
                return {"unsupported": f"no search space for {be} in the replay"}
            out = {"unsupported": None, "fields": self.fields[be], "kernel_hash": "replay"}
            if req.get("spec") is not None:
                sp = req["spec"]
                key = (be, sp["heads"], sp["batch"], sp["context"])
                if key not in self.grid.default:
                    raise KeyError(f"{self.grid.path}: no baseline row for {key}")
                out["default"] = self.grid.default[key]
            return out
        if op == "measure":
            self.measurements += 1
            return self.grid.measure(req["backend"], req["params"], req["spec"])
        raise ValueError(f"unknown request op {op!r}")

    def close(self, force: bool = False):
        pass


class _NoCompile:
    """The compile pool's surface: `workers` sets how many configs TPE is asked for at once."""

    def __init__(self, workers: int):
        self.workers, self.arch = workers, None

    def submit(self, *a):
        pass

    def wait(self, *a):
        pass

    def close(self):
        pass


# compile workers of the GPU sweeps replayed (16-core H200 host: min(6, 16 // 2 - 1)); TPE is
# asked for that many configs at a time, so the replay asks in the same batches
GPU_COMPILE_WORKERS = 6


class ReplaySweep(Sweep):
    """A Sweep whose measurements are look-ups in a GridTable, its studies in memory."""

    ragged = False   # the grid measured equal requests only: no ragged phase to replay

    def __init__(self, dep, opts: SweepOptions, grid: GridTable, fields: dict):
        workers = GPU_COMPILE_WORKERS if opts.compile_workers is None else opts.compile_workers
        super().__init__(dep, replace(opts, device="cpu", isolate=False, compile_workers=0, progress=False,
                                      rounds=0))
        self.runner.executor = _TableExecutor(grid, fields)
        self.runner.prefetch = _NoCompile(workers)

    def _default_storage(self) -> str:
        return "memory"

    def _open_storage(self):
        return self.optuna.storages.InMemoryStorage(), "memory"

    def _log_run(self, t0):
        pass


def best_by_study(df):
    """Best correct search-phase median per (backend, tp, bs, ctx), as compare_tpe_grid.py takes it."""
    s = df[(df["phase"] == "search") & (df["outcome"] == "ok")]
    return s.groupby(KEYS)["median_us"].min()


def space_fields(space_dir, backends) -> dict:
    """Parameter names per backend, in the order of the space files."""
    out = {}
    for be in backends:
        p = Path(space_dir) / f"{be}.yaml"
        if p.is_file():
            out[be] = list(read_yaml(p)["params"])
    return out


def replay(deployment, grid_csv, space_dir, seeds, trials=None, opts: SweepOptions | None = None, **kw):
    """Run the sweep once per seed against `grid_csv`; one row per (seed, study): the best
    search-phase latency found, the grid's best, the gap in percent, the configs tried and
    those measured (not pruned before running)."""
    import pandas as pd
    dep = deployment if not isinstance(deployment, (str, Path)) else load_deployment(deployment)
    grid = GridTable(grid_csv)
    gbest = grid.best()
    base = opts or SweepOptions(**kw)
    fields = space_fields(space_dir, base.backends or dep.backends)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtune-replay-") as tmp:
        for seed in seeds:
            o = replace(base, seed=seed, trials=trials or base.trials, space_dir=str(space_dir),
                        out=str(Path(tmp) / f"s{seed}"))
            sw = ReplaySweep(dep, o, grid, fields)
            sw.run()
            # a study whose every config is pruned is a row below (a miss), not a failed seed
            if sw.status != "complete" and not sw.status.startswith(ALL_PRUNED):
                raise RuntimeError(f"replay seed {seed}: sweep {sw.status}")
            df = read_trials(sw.out_dir / "trials.csv")
            found = best_by_study(df)
            search = df[df["phase"] == "search"]
            n = search.groupby(KEYS).size()
            gpu = search[search["outcome"] != "pruned"].groupby(KEYS).size()
            # every study the sweep searched: one whose search found no correct config is a
            # row too (best_us and gap_pct None), a miss for summarize, not a dropped seed
            for key in n.index:
                us, g = found.get(key), gbest.get(key)
                rows.append(dict(zip(KEYS, key), seed=seed, trials=sw.trials, best_us=us, grid_us=g,
                                 gap_pct=100 * (us / g - 1) if us is not None and g else None,
                                 configs=int(n.get(key, 0)), measured=int(gpu.get(key, 0))))
    return pd.DataFrame(rows)


def summarize(df, tolerance_pct: float = 3.0):
    """Per (study, budget): mean / median / p90 / worst gap over the seeds that found a correct
    config, and the fraction of all seeds within tolerance (a seed that found none is a miss)."""
    import pandas as pd
    df = df.assign(gap_pct=pd.to_numeric(df["gap_pct"]))   # None (found nothing) -> NaN, never <= tolerance
    g = df.groupby(KEYS + ["trials"])["gap_pct"]
    out = g.agg(seeds="size", mean="mean", median="median", p90=lambda x: x.quantile(0.9), worst="max")
    out[f"within_{tolerance_pct:g}pct"] = g.apply(lambda x: float((x <= tolerance_pct).mean()))
    out["configs"] = df.groupby(KEYS + ["trials"])["configs"].mean()      # incl. pruned before measuring
    out["measured"] = df.groupby(KEYS + ["trials"])["measured"].mean()    # what would run on the GPU
    return out.reset_index()


__all__ = ["GridTable", "ReplaySweep", "best_by_study", "replay", "summarize"]
