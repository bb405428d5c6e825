"""Loading a results folder (`Results`) and the per-study table every view of the review reads.

A study is one (backend, tp, batch, context) of a sweep; a config's latency is the one
`kvtune export` uses (the re-measured median where the sweep re-measured, else the search one).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from kvtune.kernels.tuned import SchemaError, load_tuned

from ..config import REPO_ROOT, ConfigError, load_deployment, redact_url
from ..export import latencies  # the latency of a config exactly as `kvtune export` computes it
from ..studies_files import STUDIES_DB, missing_storage_file, present_storages, sqlite_url
from ..table import LEAD, PROVENANCE, RESULT, read_trials

OUTCOMES = ("ok", "pruned", "wrong", "failed")
BACKEND_ORDER = ("cuda", "triton", "reference")
STUDY_KEYS = ["backend", "tp", "bs", "ctx"]

def resolve_results_dir(target: str | os.PathLike) -> Path:
    """A results folder from a folder path, a deployment name or a deployment YAML file.

    Tried in order: `target` as a folder, here and then from the repository root (the
    notebook's kernel starts in results/, so "results/<name>" is the repository's);
    `runs/<target>` (where `kvtune sweep` writes by default), then `results/<target>`
    (committed evidence), here and in the repository; a deployment config (path or name under
    configs/deployments/) -> the same for its name.
    """
    p = Path(target)
    for folder in (p, REPO_ROOT / p):   # an absolute p is itself joined to the root
        if folder.is_dir():
            return folder
    bases = (Path("runs"), Path("results"), REPO_ROOT / "runs", REPO_ROOT / "results")
    for base in bases:
        if (base / str(target)).is_dir():
            return base / str(target)
    try:
        dep = load_deployment(target)
    except ConfigError:
        if p.is_file():   # a deployment file that does not load: its error says why, not "neither"
            raise
        dep = None
    if dep is not None:
        for base in bases:
            if (base / dep.name).is_dir():
                return base / dep.name
        raise FileNotFoundError(f"deployment {dep.name!r} has no results folder yet (looked for "
                                f"{_places(bases, dep.name)}); run `kvtune sweep {target}` first")
    looked = _places((Path(), REPO_ROOT) + bases, target)
    raise FileNotFoundError(f"{target!s}: neither a results folder (looked for {looked}) "
                            f"nor a deployment (a YAML file, or a name under {REPO_ROOT / 'configs' / 'deployments'}/)")


def _places(bases, name) -> str:
    """The folders `resolve_results_dir` looked in for `name`, each once (here may be the repository)."""
    seen = {}
    for base in bases:
        seen.setdefault((base / str(name)).resolve(), f"{base / str(name)}/")
    return ", ".join(seen.values())


@dataclass
class Results:
    """Everything the review reads from one results folder."""

    folder: Path
    deployment: str
    trials: pd.DataFrame                 # read_trials(); numeric columns coerced
    param_names: list[str]               # parameter columns (union over the backends)
    tuned: object | None = None          # kernels.tuned.TunedDefaults
    tuned_path: Path | None = None
    tuned_text: str | None = None
    tuned_error: str | None = None       # why the exported YAML could not be loaded
    storage: str | None = None           # SQLAlchemy URL of the Optuna storage, if present
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def is_cpu(self) -> bool:
        arch = self.trials.get("arch", pd.Series(dtype=str)).dropna().astype(str)
        timing = self.trials.get("timing", pd.Series(dtype=str)).dropna().astype(str)
        return bool((len(arch) and (arch == "cpu").all()) or (len(timing) and timing.str.startswith("cpu").all()))

    @property
    def backends(self) -> list[str]:
        present = set(self.trials["backend"].dropna().astype(str))
        return [b for b in BACKEND_ORDER if b in present] + sorted(present - set(BACKEND_ORDER))

    @property
    def timing_label(self) -> str:
        """What the numbers are: 'CPU timings' on a CPU sweep, else the device and timing mode."""
        df = self.trials
        dev = most_common(df.get("device")) or "unknown device"
        timing = most_common(df.get("timing")) or "?"
        if self.is_cpu:
            return (f"CPU timings ({dev}, Triton interpreter, timing '{timing}'): they test the pipeline, "
                    "they say nothing about GPU performance")
        return f"{dev} ({most_common(df.get('arch')) or '?'}), '{timing}' timing"

    @property
    def time_unit_label(self) -> str:
        return "CPU latency (µs)" if self.is_cpu else "latency (µs)"


def most_common(s) -> str | None:
    if s is None:
        return None
    s = s.dropna().astype(str)
    s = s[s != ""]
    return None if s.empty else str(s.mode().iloc[0])


def load_results(target: str | os.PathLike, storage: str | None = None) -> Results:
    """Read a results folder (see `resolve_results_dir` for what `target` may be).

    storage: the Optuna storage URL when the sweep did not use the folder's studies.db
    (e.g. `kvtune sweep --storage postgresql://...`)."""
    folder = resolve_results_dir(target)
    trials_path = folder / "trials.csv"
    df = read_trials(trials_path)
    if df.empty:
        raise ValueError(f"{trials_path}: no trial rows yet (only the header): nothing to review")
    known = set(LEAD) | set(RESULT) | set(PROVENANCE)
    params = [c for c in df.columns if c not in known]
    for c in ("tp", "heads", "bs", "ctx", "T", "trial", *params):
        if c in df:
            df[c] = pd.to_numeric(df[c], errors="coerce")
    for c in ("median_us", "p10_us", "p90_us", "gbps", "tflops", "floor_us", "pct_floor", "rel_err", "wall_s"):
        if c in df:
            df[c] = pd.to_numeric(df[c], errors="coerce")
    df["outcome"] = df["outcome"].astype(str)
    df["reason"] = df["reason"].fillna("").astype(str)
    deployment = most_common(df.get("deployment")) or folder.name
    res = Results(folder=folder, deployment=deployment, trials=df, param_names=params)
    ymls = [folder / f"{deployment}.yaml"] + sorted(p for p in folder.glob("*.yaml") if p.stem != deployment)
    for y in ymls:
        if y.is_file():
            res.tuned_path = y
            res.tuned_text = y.read_text()
            try:
                res.tuned = load_tuned(y, legacy_names=True)  # committed evidence may predate a rename
            except SchemaError as e:
                res.tuned_error = str(e)
            break
    if storage:
        if missing_storage_file(storage) is not None:   # opening it would create an empty one: nothing to review
            raise ConfigError(f"--storage {storage}: no such file")
        res.storage = storage
    else:   # studies.db, else a --workers sweep's studies.journal
        res.storage = next(iter(present_storages(folder.resolve())), None)
    return res

def ctx_label(c) -> str:
    c = int(c)
    if c >= 1024 and c % 1024 == 0:
        return f"{c // 1024}k"
    return str(c)


def study_table(res: Results) -> pd.DataFrame:
    """One row per study (backend, tp, bs, ctx): default, best tuned, floor, outcome counts.

    A config's latency is the one `kvtune export` uses (`export.latencies`): the median of
    its interleaved re-measurements where the sweep took them, else of its search
    measurements. 'default' is the backend's untuned default config (role 'baseline', trial
    0 of every study); 'tuned' is the fastest correct config of the study.
    """
    if "studies" in res._cache:
        return res._cache["studies"]
    df = res.trials
    lat = latencies(df[df["outcome"] == "ok"]) if (df["outcome"] == "ok").any() else {}
    per: dict = {}
    for (b, tp, bs, ctx, pj), (v, role) in lat.items():
        per.setdefault((b, tp, bs, ctx), []).append((v, json.loads(pj), role))
    rows = []
    for key, g in search_trials(df).groupby(STUDY_KEYS, sort=True):
        cands = per.get(key, [])
        best = min(cands, key=lambda c: c[0]) if cands else None
        default = [c[0] for c in cands if c[2] == "baseline"]
        floor = g["floor_us"].dropna()
        counts = g["outcome"].value_counts()
        r = dict(zip(STUDY_KEYS, key))
        r.update(heads=_first(g["heads"]), floor_us=float(floor.iloc[0]) if len(floor) else np.nan,
                 default_us=default[0] if default else np.nan, tuned_us=best[0] if best else np.nan,
                 best_params=best[1] if best else {}, trials=int(counts.sum()),
                 **{o: int(counts.get(o, 0)) for o in OUTCOMES})
        rows.append(r)
    out = pd.DataFrame(rows, columns=[*STUDY_KEYS, "heads", "floor_us", "default_us", "tuned_us", "best_params",
                                      "trials", *OUTCOMES])
    out["tuned_pct_floor"] = 100.0 * out["floor_us"] / out["tuned_us"]
    out["default_pct_floor"] = 100.0 * out["floor_us"] / out["default_us"]
    out["speedup_vs_default"] = out["default_us"] / out["tuned_us"]
    res._cache["studies"] = out
    return out


def _first(s):
    s = s.dropna()
    return s.iloc[0] if len(s) else np.nan

def search_trials(df: pd.DataFrame) -> pd.DataFrame:
    """The trials proper: the search phase (phase 'remeasure' rows re-time trials already
    counted; phase 'ragged' rows time them on another batch, the bucket's ragged one)."""
    return df[~df["phase"].astype(str).isin(["remeasure", "ragged"])] if "phase" in df else df

def storage_name(res: Results) -> str:
    """The study storage as the review names it: `<folder>/studies.db`, else its URL (password hidden)."""
    if res.storage == sqlite_url(res.folder.resolve() / STUDIES_DB):
        return f"{res.folder.name}/{STUDIES_DB}"
    return redact_url(str(res.storage))
