"""Review of a sweep's results: the tables and figures of `results/review.ipynb` and `kvtune report`.

Both front ends call the same section builders (`SECTIONS`), so the notebook and the static
HTML page show the same content. A section is a title, a few notes, tables and at most one
matplotlib figure, computed from one results folder::

    results/<deployment>/trials.csv        one row per trial (tuner/table.py)
    results/<deployment>/studies.db        Optuna RDB storage (optional: histories, importances)
    results/<deployment>/<deployment>.yaml the exported defaults (optional; kernels/tuned.py)

Needs pandas and matplotlib (the `kvtune[review]` extra); optuna is used when installed and a
study storage is present, otherwise the history and the importances come from the trials
table. Nothing here is imported by the kernels, the runtime or `kvtune --help`.
"""
from __future__ import annotations

import html
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from kvtune.kernels.backends import rename_legacy_params
from kvtune.kernels.tuned import SchemaError, load_tuned

from .config import REPO_ROOT, ConfigError, load_deployment
from .export import latencies  # the latency of a config exactly as `kvtune export` computes it
from .table import LEAD, PROVENANCE, RESULT, read_jsonl, read_trials

OUTCOMES = ("ok", "pruned", "wrong", "failed")
OUTCOME_COLORS = {"ok": "#2ca02c", "pruned": "#7f7f7f", "wrong": "#d62728", "failed": "#ff7f0e"}
BACKEND_MARKERS = {"cuda": "o", "triton": "s", "reference": "^"}
BACKEND_ORDER = ("cuda", "triton", "reference")
STUDY_KEYS = ["backend", "tp", "bs", "ctx"]


# --------------------------------------------------------------------------- loading
def resolve_results_dir(target: str | os.PathLike) -> Path:
    """A results folder from a folder path, a deployment name or a deployment YAML file.

    Tried in order: `target` as a folder; `runs/<target>` (where `kvtune sweep` writes by
    default), then `results/<target>` (committed evidence), here and in the repository; a
    deployment config (path or name under configs/deployments/) -> the same for its name.
    """
    p = Path(target)
    if p.is_dir():
        return p
    bases = (Path("runs"), Path("results"), REPO_ROOT / "runs", REPO_ROOT / "results")
    for base in bases:
        if (base / str(target)).is_dir():
            return base / str(target)
    try:
        dep = load_deployment(target)
    except ConfigError:
        dep = None
    if dep is not None:
        for base in bases:
            if (base / dep.name).is_dir():
                return base / dep.name
        raise FileNotFoundError(f"deployment {dep.name!r} has no results folder yet (looked for "
                                f"runs/{dep.name}/ and results/{dep.name}/); run `kvtune sweep {target}` first")
    raise FileNotFoundError(f"{target!s}: neither a results folder, nor results/{target}/, nor a deployment")


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
        dev = _mode(df.get("device")) or "unknown device"
        timing = _mode(df.get("timing")) or "?"
        if self.is_cpu:
            return (f"CPU timings ({dev}, Triton interpreter, timing '{timing}'): they test the pipeline, "
                    "they say nothing about GPU performance")
        return f"{dev} ({_mode(df.get('arch')) or '?'}), '{timing}' timing"

    @property
    def time_unit_label(self) -> str:
        return "CPU latency (µs)" if self.is_cpu else "latency (µs)"


def _mode(s) -> str | None:
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
    deployment = _mode(df.get("deployment")) or folder.name
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
    db = folder / "studies.db"
    if storage:
        res.storage = storage
    elif db.is_file():
        res.storage = f"sqlite:///{db.resolve()}"
    return res


# --------------------------------------------------------------------------- derived tables
def _ctx_label(c) -> str:
    c = int(c)
    if c >= 1024 and c % 1024 == 0:
        return f"{c // 1024}k"
    return str(c)


def _studies(res: Results) -> pd.DataFrame:
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
    for key, g in _search(df).groupby(STUDY_KEYS, sort=True):
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


def summary_table(res: Results) -> pd.DataFrame:
    """Per (tp, bs, context): tuned vs default vs floor for each backend (wide table)."""
    st = _studies(res)
    if st.empty:
        return pd.DataFrame()
    exported = {}  # (tp, bs, ctx) -> (backend, NSPLIT, latency) of the exported YAML's bucket
    if res.tuned is not None:
        for e in res.tuned.entries:
            for b in e.buckets:
                exported[(e.tp, e.max_batch, b.max_context)] = (e.backend, b.NSPLIT, b.latency_us)
    rows = []
    for (tp, bs, ctx), g in st.groupby(["tp", "bs", "ctx"], sort=True):
        r = {"tp": int(tp), "heads": int(g["heads"].iloc[0]) if pd.notna(g["heads"].iloc[0]) else None,
             "bs": int(bs), "context": _ctx_label(ctx), "floor µs": g["floor_us"].iloc[0]}
        for _, s in g.iterrows():
            b = s["backend"]
            r[f"{b} default µs"] = s["default_us"]
            r[f"{b} tuned µs"] = s["tuned_us"]
            r[f"{b} tuned % floor"] = s["tuned_pct_floor"]
            r[f"{b} speedup vs default"] = s["speedup_vs_default"]
            r[f"{b} ok/trials"] = f"{s['ok']}/{s['trials']}"
        tuned = g.dropna(subset=["tuned_us"])
        r["best backend"] = tuned.loc[tuned["tuned_us"].idxmin(), "backend"] if len(tuned) else "none (no ok trial)"
        ex = exported.get((int(tp), int(bs), int(ctx)))
        if res.tuned is not None:
            r["exported"] = f"{ex[0]} NSPLIT={ex[1]}" if ex else "not exported"
            r["exported µs"] = ex[2] if ex else np.nan
        rows.append(r)
    return pd.DataFrame(rows)


def best_params_table(res: Results) -> pd.DataFrame:
    """The winning parameters of every study."""
    st = _studies(res)
    if st.empty:
        return pd.DataFrame()
    rows = []
    for _, s in st.iterrows():
        r = {"backend": s["backend"], "tp": int(s["tp"]), "bs": int(s["bs"]), "context": _ctx_label(s["ctx"]),
             "tuned µs": s["tuned_us"]}
        r.update(s["best_params"] or {"(no ok trial)": ""})
        rows.append(r)
    return pd.DataFrame(rows)


def _search(df: pd.DataFrame) -> pd.DataFrame:
    """The trials proper: the search phase (phase 'remeasure' rows re-time trials already counted)."""
    return df[df["phase"].astype(str) != "remeasure"] if "phase" in df else df


def problem_trials(res: Results) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(counts of each outcome per study, the failed/wrong/pruned trials grouped by reason)."""
    df = _search(res.trials)
    counts = df.groupby(STUDY_KEYS)["outcome"].value_counts().unstack(fill_value=0)
    for o in OUTCOMES:
        if o not in counts:
            counts[o] = 0
    counts = counts[list(OUTCOMES)].reset_index()
    counts["ctx"] = counts["ctx"].map(_ctx_label)
    bad = df[df["outcome"] != "ok"]
    if bad.empty:
        return counts, pd.DataFrame(columns=["backend", "outcome", "reason", "trials", "studies", "example params"])
    rows = []
    for (b, o, reason), g in bad.groupby(["backend", "outcome", "reason"], sort=False):
        studies = sorted({f"tp{int(t)}/bs{int(s)}/{_ctx_label(c)}" for t, s, c in zip(g["tp"], g["bs"], g["ctx"])})
        rows.append({"backend": b, "outcome": o, "reason": reason or "(none recorded)", "trials": len(g),
                     "studies": ", ".join(studies[:6]) + (f" (+{len(studies) - 6})" if len(studies) > 6 else ""),
                     "example params": json.dumps(g["params"].iloc[0], sort_keys=True)})
    reasons = pd.DataFrame(rows).sort_values(["outcome", "trials"], ascending=[True, False], ignore_index=True)
    return counts, reasons


def exported_table(res: Results) -> pd.DataFrame:
    """The exported YAML flattened (one row per context bucket), beside the trials it came from:
    the best tuned and default latency of that (backend, tp, batch, context) in the trials table."""
    t = res.tuned
    if t is None:
        return pd.DataFrame()
    st = _studies(res).set_index(STUDY_KEYS) if len(_studies(res)) else None
    rows = []
    for e in t.entries:
        for b in e.buckets:
            r = {"tp": e.tp, "max_batch": e.max_batch, "backend": e.backend, "max context": _ctx_label(b.max_context),
                 "NSPLIT": b.NSPLIT, "yaml latency µs": b.latency_us, "yaml default µs": b.default_latency_us,
                 "yaml floor µs": b.floor_us}
            key = (e.backend, e.tp, e.max_batch, b.max_context)
            if st is not None and key in st.index:
                s = st.loc[key]
                r["trials best µs"] = s["tuned_us"]
                r["trials default µs"] = s["default_us"]
                r["trials best NSPLIT"] = (s["best_params"] or {}).get("NSPLIT")
            r["compile-time params"] = ", ".join(f"{k}={v}" for k, v in e.params.items())
            rows.append(r)
    return pd.DataFrame(rows)


def provenance_table(res: Results) -> pd.DataFrame:
    """Where the numbers come from: the trials' provenance columns and the YAML's provenance."""
    rows = []
    for c in PROVENANCE:
        if c in res.trials:
            vals = sorted({str(v) for v in res.trials[c].dropna() if str(v) != ""})
            rows.append({"key": c, "trials table": "; ".join(vals[:4]) + (" ..." if len(vals) > 4 else "")})
    out = pd.DataFrame(rows, columns=["key", "trials table"])
    if res.tuned is not None:
        prov = res.tuned.provenance
        out["exported YAML"] = [str(prov.get({"device": "device_name"}.get(k, k), "")) for k in out["key"]]
    return out


def runs_table(res: Results) -> pd.DataFrame:
    """The sweep runs recorded in `runs.jsonl` (one JSON object per `kvtune sweep` run)."""
    path = res.folder / "runs.jsonl"
    cols = ["start", "command", "device", "status", "wall_s", "measurements", "studies", "restarts", "skipped"]
    if not path.is_file():
        return pd.DataFrame(columns=cols)
    rows = []
    for r in read_jsonl(path):   # a line cut by a crash mid-write is skipped (named on stderr)
        rows.append({c: (json.dumps(r[c]) if isinstance(r.get(c), (dict, list)) else r.get(c)) for c in cols})
    return pd.DataFrame(rows, columns=cols)


# --------------------------------------------------------------------------- optuna studies
def _load_optuna_trials(res: Results) -> pd.DataFrame | None:
    """Every measured trial of this deployment's studies in the storage: study keys, number,
    value, state, params. Trials that only repeat a measured config (user attribute
    'duplicate_of') or were cut by an interruption are left out, as in the trials table.

    None when there is no storage or optuna is not installed (the H200 machine has none);
    the callers then use the trials table.
    """
    if "optuna" in res._cache:
        return res._cache["optuna"]
    out = None
    # optuna imports tqdm.auto, which warns in a notebook without ipywidgets (noise, not a problem)
    warnings.filterwarnings("ignore", message="IProgress not found")
    try:
        import optuna
    except ImportError:
        optuna = None
    if res.storage and optuna is not None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        rows = []
        for summ in optuna.get_all_study_summaries(res.storage, include_best_trial=False):
            keys = _study_keys(summ.study_name, res.deployment)
            if keys is None:
                continue
            study = optuna.load_study(study_name=summ.study_name, storage=res.storage)
            for t in study.get_trials(deepcopy=False):
                ua = t.user_attrs
                if "duplicate_of" in ua or ua.get("interrupted") or t.state.name in ("RUNNING", "WAITING"):
                    continue
                rows.append({**keys, "study": summ.study_name, "trial": t.number, "value": t.value,
                             "state": t.state.name, "outcome": ua.get("outcome", ""), "role": ua.get("role", ""),
                             "params": rename_legacy_params(keys["backend"], dict(t.params))})
        out = pd.DataFrame(rows)
    res._cache["optuna"] = out
    return out


def _storage_name(res: Results) -> str:
    db = res.folder / "studies.db"
    return f"{res.folder.name}/studies.db" if res.storage == f"sqlite:///{db.resolve()}" else str(res.storage)


def _study_keys(name: str, deployment: str) -> dict | None:
    """(backend, tp, bs, ctx) of a study named `deployment|backend|tpN|bsN|ctxN` (sweep.study_name);
    None for a study of another deployment sharing the storage."""
    parts = name.split("|")
    if len(parts) != 5 or parts[0] != deployment:
        return None
    _, backend, tp, bs, ctx = parts
    try:
        return {"backend": backend, "tp": int(tp.removeprefix("tp")), "bs": int(bs.removeprefix("bs")),
                "ctx": int(ctx.removeprefix("ctx"))}
    except ValueError:
        return None


def history_frame(res: Results) -> tuple[pd.DataFrame, str]:
    """Per trial, in order: its latency (NaN if not ok) and the study's best so far.

    From the Optuna storage when present, else from the trials table (search phase).
    """
    ot = _load_optuna_trials(res)
    if ot is not None and len(ot):
        h = ot.copy()
        h["latency_us"] = np.where(h["state"] == "COMPLETE", h["value"], np.nan)
        source = f"Optuna storage {_storage_name(res)}"
    else:
        df = _search(res.trials)
        h = df[[*STUDY_KEYS, "trial", "role"]].copy()
        h["latency_us"] = np.where(df["outcome"] == "ok", df["median_us"], np.nan)
        source = "the trials table" + (" (no studies.db in this folder)" if not res.storage else
                                       " (optuna is not installed)")
    h["latency_us"] = pd.to_numeric(h["latency_us"], errors="coerce")  # all-None (no ok trial) is object dtype
    h = h.sort_values([*STUDY_KEYS, "trial"], ignore_index=True)
    # the best so far carries over the trials that produced no latency (pruned, wrong, failed)
    h["best_so_far_us"] = h.groupby(STUDY_KEYS)["latency_us"].cummin()
    h["best_so_far_us"] = h.groupby(STUDY_KEYS)["best_so_far_us"].ffill()
    return h, source


def importance_frame(res: Results) -> tuple[pd.DataFrame, str]:
    """Parameter importance per study, long format (backend, tp, bs, ctx, param, importance).

    With the study storage: `optuna.importance.get_param_importances` (fANOVA when scikit-learn
    is installed, else PED-ANOVA) on each study with enough finished trials. Without it: the
    share of the variance of log(latency) explained by each parameter alone (eta squared)
    over the ok trials of each study, normalised to sum to 1.
    """
    ot = _load_optuna_trials(res)
    rows = []
    if ot is not None and len(ot):
        import optuna
        from optuna.importance import get_param_importances
        try:
            import sklearn  # noqa: F401
            evaluator, name = optuna.importance.FanovaImportanceEvaluator(seed=0), "fANOVA"
        except ImportError:
            evaluator, name = optuna.importance.PedAnovaImportanceEvaluator(), "PED-ANOVA"
        for sname, g in ot.groupby("study"):
            done = g[g["state"] == "COMPLETE"]
            if len(done) < 3 or not _varies(done["params"]):
                continue
            study = optuna.load_study(study_name=sname, storage=res.storage)
            try:
                imp = get_param_importances(study, evaluator=evaluator)
            except Exception:  # noqa: BLE001 - a degenerate study (one distinct value...) has none
                continue
            keys = {k: g[k].iloc[0] for k in STUDY_KEYS}
            imp = rename_legacy_params(keys["backend"], imp)  # a study from before a rename
            rows += [{**keys, "param": p, "importance": float(v)} for p, v in imp.items()]
        source = f"optuna.importance ({name}) on the studies in {_storage_name(res)}"
        if rows:
            return pd.DataFrame(rows), source
    df = _search(res.trials)
    ok = df[(df["outcome"] == "ok") & df["median_us"].notna()]
    for key, g in ok.groupby(STUDY_KEYS):
        y = np.log(g["median_us"].to_numpy(float))
        total = ((y - y.mean()) ** 2).sum()
        if len(g) < 3 or total <= 0:
            continue
        eta = {}
        for p in res.param_names:
            x = g[p]
            if x.isna().all() or x.nunique() < 2:
                continue
            grp = pd.Series(y, index=g.index).groupby(x)
            eta[p] = float((grp.count() * (grp.mean() - y.mean()) ** 2).sum() / total)
        s = sum(eta.values())
        if s > 0:
            rows += [{**dict(zip(STUDY_KEYS, key)), "param": p, "importance": v / s} for p, v in eta.items()]
    return (pd.DataFrame(rows, columns=[*STUDY_KEYS, "param", "importance"]),
            "the trials table: share of the variance of log(latency) explained by each parameter alone")


def _varies(params: pd.Series) -> bool:
    return len({json.dumps(p, sort_keys=True) for p in params}) > 1


# --------------------------------------------------------------------------- figures
def _tp_colors(tps) -> dict:
    cmap = plt.get_cmap("tab10")
    return {tp: cmap(i % 10) for i, tp in enumerate(sorted(tps))}


def _log2_ctx_axis(ax, ctxs) -> None:
    ctxs = sorted(set(int(c) for c in ctxs))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctxs)
    ax.set_xticklabels([_ctx_label(c) for c in ctxs])
    ax.minorticks_off()
    if len(ctxs) == 1:  # a single context: give the lone point some room
        ax.set_xlim(ctxs[0] / 2, ctxs[0] * 2)
    ax.set_xlabel("context length (prefix tokens, log scale)")


def fig_latency(res: Results):
    """Latency and % of floor against context (log x): one line per tp and backend; tuned
    solid, default dashed, floor dotted."""
    st = _studies(res)
    if st.empty or st["tuned_us"].notna().sum() == 0:
        return None
    bss = sorted(st["bs"].unique())
    colors = _tp_colors(st["tp"].unique())
    fig, axes = plt.subplots(len(bss), 2, figsize=(12, 4.2 * len(bss)), squeeze=False)
    for row, bs in enumerate(bss):
        sb = st[st["bs"] == bs]
        ax_l, ax_p = axes[row]
        for (tp, be), g in sb.groupby(["tp", "backend"]):
            g = g.sort_values("ctx")
            c, m = colors[tp], BACKEND_MARKERS.get(be, "D")
            ax_l.plot(g["ctx"], g["tuned_us"], color=c, marker=m, ls="-")
            ax_l.plot(g["ctx"], g["default_us"], color=c, marker=m, ls="--", alpha=0.6, mfc="none")
            ax_p.plot(g["ctx"], g["tuned_pct_floor"], color=c, marker=m, ls="-")
            ax_p.plot(g["ctx"], g["default_pct_floor"], color=c, marker=m, ls="--", alpha=0.6, mfc="none")
        for tp, g in sb.groupby("tp"):
            f = g.groupby("ctx")["floor_us"].first().sort_index()
            ax_l.plot(f.index, f.values, color=colors[tp], ls=":", lw=1.5, marker="_", ms=14)  # marker: one context
        for ax in (ax_l, ax_p):
            _log2_ctx_axis(ax, sb["ctx"])
            ax.grid(True, which="major", alpha=0.3)
        ax_l.set_yscale("log")
        ax_l.set_ylabel(res.time_unit_label + ", log scale")
        ax_l.set_title(f"latency per launch, batch {bs}")
        ax_p.set_ylabel("% of floor (floor / latency x 100)")
        ax_p.set_title(f"% of the roofline floor, batch {bs}")
        ax_p.set_ylim(bottom=0)
    handles = [Line2D([], [], color=colors[tp], lw=2, label=f"tp {int(tp)} ({_heads(st, tp)} head{'' if _heads(st, tp) == 1 else 's'}/rank)")
               for tp in sorted(colors)]
    handles += [Line2D([], [], color="k", marker=BACKEND_MARKERS.get(b, "D"), ls="none", label=b)
                for b in res.backends]
    handles += [Line2D([], [], color="k", ls="-", label="tuned"),
                Line2D([], [], color="k", ls="--", alpha=0.6, label="default config"),
                Line2D([], [], color="k", ls=":", marker="_", ms=14, label="floor")]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(f"{res.deployment}: {_short_timing(res)}")
    fig.tight_layout()
    return fig


def _heads(st, tp):
    h = st.loc[st["tp"] == tp, "heads"].dropna()
    return int(h.iloc[0]) if len(h) else "?"


def _short_timing(res: Results) -> str:
    if res.is_cpu:
        return "CPU timings (Triton interpreter), not GPU performance"
    return f"{_mode(res.trials.get('device')) or '?'}, {_mode(res.trials.get('timing')) or '?'} timing"


def fig_speedup(res: Results):
    """Left: tuned over default (default latency / tuned latency). Right, when both backends
    were swept: CUDA over Triton (Triton tuned latency / CUDA tuned latency)."""
    st = _studies(res)
    if st.empty or st["speedup_vs_default"].notna().sum() == 0:
        return None
    both = {"cuda", "triton"} <= set(st["backend"])
    colors = _tp_colors(st["tp"].unique())
    bss = sorted(st["bs"].unique())
    fig, axes = plt.subplots(len(bss), 2 if both else 1, figsize=(12 if both else 7.5, 4.2 * len(bss)),
                             squeeze=False)
    for row, bs in enumerate(bss):
        sb = st[st["bs"] == bs]
        ax = axes[row][0]
        for (tp, be), g in sb.groupby(["tp", "backend"]):
            g = g.sort_values("ctx")
            ax.plot(g["ctx"], g["speedup_vs_default"], color=colors[tp], marker=BACKEND_MARKERS.get(be, "D"))
        ax.axhline(1.0, color="k", lw=1, alpha=0.5)
        _log2_ctx_axis(ax, sb["ctx"])
        ax.set_ylabel("speedup over the default config (x)")
        ax.set_title(f"tuned vs default, batch {bs}")
        ax.grid(True, alpha=0.3)
        if both:
            ax = axes[row][1]
            w = sb.pivot_table(index=["tp", "ctx"], columns="backend", values="tuned_us").reset_index()
            w["x"] = w["triton"] / w["cuda"]
            for tp, g in w.groupby("tp"):
                g = g.sort_values("ctx")
                ax.plot(g["ctx"], g["x"], color=colors[tp], marker="o")
            ax.axhline(1.0, color="k", lw=1, alpha=0.5)
            _log2_ctx_axis(ax, sb["ctx"])
            ax.set_ylabel("CUDA speedup over Triton (x, both tuned)")
            ax.set_title(f"CUDA vs Triton, batch {bs} (> 1: CUDA faster)")
            ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=colors[tp], lw=2, label=f"tp {int(tp)}") for tp in sorted(colors)]
    handles += [Line2D([], [], color="k", marker=BACKEND_MARKERS.get(b, "D"), ls="none", label=b)
                for b in res.backends]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(f"{res.deployment}: {_short_timing(res)}")
    fig.tight_layout()
    return fig


def nsplit_table(res: Results) -> pd.DataFrame:
    """Best NSPLIT per backend, (tp, bs) row and context column."""
    st = _studies(res)
    if st.empty or "NSPLIT" not in res.param_names:
        return pd.DataFrame()
    st = st.assign(NSPLIT=[(p or {}).get("NSPLIT", np.nan) for p in st["best_params"]])
    return st.pivot_table(index=["backend", "tp", "bs"], columns="ctx", values="NSPLIT", aggfunc="first")


def fig_nsplit(res: Results):
    """Heatmap of the winning NSPLIT by tp (rows) and context (columns), one panel per backend."""
    tab = nsplit_table(res)
    if tab.empty or tab.notna().sum().sum() == 0:
        return None
    backends = [b for b in res.backends if b in tab.index.get_level_values(0)]
    ncols = len(tab.columns)
    nrows = max(len(tab.loc[b]) for b in backends)
    fig, axes = plt.subplots(1, len(backends), figsize=(max(4.5, 1.0 * ncols + 2.5) * len(backends),
                                                        1.0 + 0.6 * nrows + 1.2), squeeze=False)
    # one colour scale for all panels, over the NSPLIT values the sweep tried
    tried = res.trials["NSPLIT"].dropna()
    vmax = max(2.0, float(tried.max()) if len(tried) else np.nanmax(tab.to_numpy(float)))
    lmax = math.log2(vmax)
    for ax, b in zip(axes[0], backends):
        t = tab.loc[b]
        data = np.log2(t.to_numpy(float))
        im = ax.imshow(data, cmap="viridis", aspect="auto", vmin=0, vmax=lmax)
        for (i, j), v in np.ndenumerate(t.to_numpy(float)):
            txt = "-" if np.isnan(v) else str(int(v))
            light = not np.isnan(v) and math.log2(v) < 0.6 * lmax  # white text on the dark end
            ax.text(j, i, txt, ha="center", va="center", color="white" if light else "black", fontsize=10)
        ax.set_xticks(range(ncols))
        ax.set_xticklabels([_ctx_label(c) for c in t.columns])
        ax.set_yticks(range(len(t)))
        ax.set_yticklabels([f"tp {int(tp)}, bs {int(bs)}" for tp, bs in t.index])
        ax.set_xlabel("context length (prefix tokens)")
        ax.set_ylabel("tensor-parallel degree, batch")
        ax.set_title(f"{b}: best NSPLIT ('-': no ok trial)")
        cb = fig.colorbar(im, ax=ax, fraction=0.05)
        ticks = list(range(int(lmax) + 1))
        cb.set_ticks(ticks)
        cb.set_ticklabels([str(2 ** k) for k in ticks])
        cb.set_label("NSPLIT (log colour scale)")
    fig.tight_layout()
    return fig


def fig_history(res: Results):
    """Best latency so far against trial number, relative to the study's default config:
    one panel per (backend, tp), one line per context."""
    h, _ = history_frame(res)
    if h.empty or h["latency_us"].notna().sum() == 0:
        return None
    # relative to the study's baseline (default config) measurement in the same search, else
    # to its first ok latency (a study whose default failed)
    okh = h.dropna(subset=["latency_us"])
    first = okh.groupby(STUDY_KEYS)["latency_us"].first()
    ref = okh[okh["role"] == "baseline"].groupby(STUDY_KEYS)["latency_us"].first()
    base = ref.reindex(first.index).fillna(first)
    h = h.join(base.rename("base_us"), on=STUDY_KEYS)
    h["rel"] = 100.0 * h["best_so_far_us"] / h["base_us"]
    h["trial_rel"] = 100.0 * h["latency_us"] / h["base_us"]
    panels = sorted({(b, tp) for b, tp in zip(h["backend"], h["tp"])},
                    key=lambda k: (BACKEND_ORDER.index(k[0]) if k[0] in BACKEND_ORDER else 9, k[1]))
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols + 1.5, 3.4 * nrows), squeeze=False,
                             sharey=True)
    ctxs = sorted(h["ctx"].unique())
    cmap = plt.get_cmap("viridis")
    ccol = {c: cmap(i / max(1, len(ctxs) - 1) * 0.9) for i, c in enumerate(ctxs)}
    multi_bs = h["bs"].nunique() > 1
    for ax, (b, tp) in zip(axes.flat, panels):
        g = h[(h["backend"] == b) & (h["tp"] == tp)]
        for (bs, ctx), s in g.groupby(["bs", "ctx"]):
            ls = "-" if bs == min(h["bs"]) else "--"
            ax.step(s["trial"], s["rel"], where="post", color=ccol[ctx], ls=ls, lw=1.6)
            ax.scatter(s["trial"], s["trial_rel"], color=ccol[ctx], s=10, alpha=0.35)
        ax.axhline(100, color="k", lw=0.8, alpha=0.5)
        ax.set_title(f"{b}, tp {int(tp)}")
        ax.set_xlabel("trial number")
        ax.grid(True, alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("best latency so far\n(% of the default config's)")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    top = np.nanpercentile(h["trial_rel"], 95) if h["trial_rel"].notna().any() else 150
    axes[0, 0].set_ylim(0, max(110, min(top * 1.1, 400)))
    handles = [Line2D([], [], color=ccol[c], lw=2, label=f"context {_ctx_label(c)}") for c in ctxs]
    handles.append(Line2D([], [], color="gray", marker="o", ls="none", alpha=0.5, label="one trial (ok)"))
    if multi_bs:
        handles.append(Line2D([], [], color="k", ls="--", label="batch > smallest"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(f"{res.deployment}: optimisation history ({_short_timing(res)})")
    fig.tight_layout()
    return fig


def importance_summary(imp: pd.DataFrame) -> pd.DataFrame:
    """Per (backend, param): mean, min and max importance over the backend's studies. A
    parameter absent from a study's importances had none there (it did not vary): it counts
    as 0 in the mean."""
    rows = []
    for b, gb in imp.groupby("backend"):
        nst = gb.groupby(STUDY_KEYS).ngroups
        for p, g in gb.groupby("param"):
            v = g["importance"].to_numpy(float)
            rows.append({"backend": b, "param": p, "mean": v.sum() / nst, "min": v.min() if len(v) == nst else 0.0,
                         "max": v.max(), "studies": nst})
    return pd.DataFrame(rows, columns=["backend", "param", "mean", "min", "max", "studies"])


def fig_importance(res: Results):
    """Mean parameter importance per backend over its studies (bars: mean; whiskers: min-max)."""
    imp, source = importance_frame(res)
    if imp.empty:
        return None
    backends = [b for b in res.backends if b in set(imp["backend"])]
    fig, axes = plt.subplots(1, len(backends), figsize=(5.5 * len(backends), 0.5 + 0.45 * imp["param"].nunique()
                                                        + 1.2), squeeze=False)
    summ = importance_summary(imp)
    for ax, b in zip(axes[0], backends):
        agg = summ[summ["backend"] == b].set_index("param").sort_values("mean")
        nst = int(agg["studies"].iloc[0])
        y = np.arange(len(agg))
        ax.barh(y, agg["mean"], color="#1f77b4",
                xerr=[agg["mean"] - agg["min"].clip(upper=agg["mean"]), (agg["max"] - agg["mean"]).clip(lower=0)],
                capsize=3, ecolor="0.4")
        ax.set_yticks(y)
        ax.set_yticklabels(agg.index)
        ax.set_xlim(0, 1)
        ax.set_xlabel("importance (fraction, sums to 1 per study)")
        ax.set_title(f"{b}: mean over {nst} stud{'y' if nst == 1 else 'ies'}")
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("parameter importance (bars: mean over the studies; whiskers: min to max)")
    fig.tight_layout()
    return fig


def fig_outcomes(res: Results):
    """Trials per outcome, per backend and tp (stacked bars)."""
    df = _search(res.trials)
    if df.empty:
        return None
    c = df.groupby(["backend", "tp"])["outcome"].value_counts().unstack(fill_value=0)
    c = c.reindex(columns=[o for o in OUTCOMES if o in c.columns])
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(c) + 3), 3.8))
    bottom = np.zeros(len(c))
    for o in c.columns:
        ax.bar(range(len(c)), c[o], bottom=bottom, color=OUTCOME_COLORS.get(o, "k"), label=o)
        bottom += c[o].to_numpy()
    ax.set_xticks(range(len(c)))
    ax.set_xticklabels([f"{b}\ntp {int(tp)}" for b, tp in c.index])
    ax.set_ylabel("trials (all contexts and batches)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # trial counts are whole numbers
    ax.set_title("trial outcomes")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- sections
@dataclass
class Section:
    key: str                    # file-name-safe: the PNG is <key>.png
    title: str
    notes: list[str] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figure: object | None = None  # matplotlib Figure
    code: str | None = None     # text shown beside the first table (the exported YAML)


def section_summary(res: Results) -> Section:
    s = Section("summary", "Tuned vs default vs floor")
    s.notes.append(f"Timings: {res.timing_label}.")
    s.notes.append("Per (tp, batch, context) and backend: the untuned default config, the fastest correct "
                   "config found (re-measured against the default where the sweep did so) and the floor "
                   "max(bytes / read bandwidth, flops / MMA rate) of the device profile; "
                   "% floor = floor / latency x 100.")
    tab = summary_table(res)
    if tab.empty:
        s.notes.append("No study in the trials table.")
    else:
        nok = _studies(res)
        dead = nok[nok["tuned_us"].isna()]
        if len(dead):
            s.notes.append(f"{len(dead)} of {len(nok)} studies have no ok trial (see 'Failed, wrong and pruned "
                           "trials'): their tuned columns are empty.")
        s.tables.append(("tuned vs default vs floor", tab))
        s.tables.append(("winning parameters per study", best_params_table(res)))
    return s


def section_latency(res: Results) -> Section:
    s = Section("latency", "Latency and % of floor against context length")
    s.figure = fig_latency(res)
    if s.figure is None:
        s.notes.append("Nothing to plot: no study has an ok trial.")
    elif _studies(res)["ctx"].nunique() == 1:
        s.notes.append("Only one context length was swept: one point per line.")
    return s


def section_speedup(res: Results) -> Section:
    s = Section("speedup", "Speedups: tuned over default, CUDA over Triton")
    s.figure = fig_speedup(res)
    have = set(res.backends)
    if not {"cuda", "triton"} <= have:
        s.notes.append(f"Only {', '.join(sorted(have)) or 'no backend'} in this sweep: no CUDA vs Triton comparison.")
    if s.figure is None:
        s.notes.append("Nothing to plot: no study has both a default and a tuned latency.")
    return s


def section_nsplit(res: Results) -> Section:
    s = Section("nsplit", "Best NSPLIT by tp and context")
    s.figure = fig_nsplit(res)
    if s.figure is None:
        s.notes.append("No winning config with an NSPLIT parameter.")
    else:
        t = nsplit_table(res)
        t.columns = [_ctx_label(c) for c in t.columns]
        s.tables.append(("best NSPLIT", t.reset_index()))
    return s


def section_history(res: Results) -> Section:
    s = Section("history", "Optimisation history")
    _, source = history_frame(res)
    s.notes.append(f"Source: {source}. Steps: the best latency so far; dots: each ok trial; 100 % = the "
                   "default config.")
    s.figure = fig_history(res)
    if s.figure is None:
        s.notes.append("No study has an ok trial: no history to plot.")
    return s


def section_importance(res: Results) -> Section:
    s = Section("importance", "Parameter importance")
    imp, source = importance_frame(res)
    s.notes.append(f"Source: {source}.")
    s.figure = fig_importance(res)
    if s.figure is None:
        s.notes.append("Not enough ok trials with varying parameters in any study (3 or more needed).")
    else:
        s.tables.append(("importance per backend over its studies (0 where a parameter did not vary)",
                         importance_summary(imp)))
    return s


def section_problems(res: Results) -> Section:
    s = Section("outcomes", "Failed, wrong and pruned trials")
    counts, reasons = problem_trials(res)
    s.figure = fig_outcomes(res)
    trials = _search(res.trials)
    n = {o: int((trials["outcome"] == o).sum()) for o in OUTCOMES}
    s.notes.append(", ".join(f"{v} {k}" for k, v in n.items()) + f" of {len(trials)} trials (re-measurements of "
                   "finalists not counted). 'wrong' failed the "
                   "correctness gate against the fp32 oracle and is never exported; 'pruned' was rejected "
                   "before any GPU time; 'failed' raised (compile or launch error).")
    s.tables.append(("failed, wrong and pruned trials by reason", reasons))
    s.tables.append(("outcomes per study", counts))
    return s


def section_export(res: Results) -> Section:
    s = Section("export", "The exported YAML and the table it came from")
    if res.tuned_path is None:
        s.notes.append(f"No exported YAML in {res.folder} (run `kvtune export`).")
        return s
    s.code = res.tuned_text
    if res.tuned_error:
        s.notes.append(f"The YAML does not load: {res.tuned_error}")
    else:
        s.notes.append(f"{res.tuned_path.name}: one row per context bucket, beside the best and default "
                       "latency of the same (backend, tp, batch, context) in the trials table.")
        s.tables.append(("exported buckets vs trials", exported_table(res)))
    return s


def section_provenance(res: Results) -> Section:
    s = Section("provenance", "Provenance and sweep runs")
    s.notes.append("Where the numbers come from: the trials table's provenance columns beside the exported "
                   "YAML's, and every `kvtune sweep` run into this folder (runs.jsonl: command, status, "
                   "wall-clock time).")
    s.tables.append(("provenance", provenance_table(res)))
    runs = runs_table(res)
    if runs.empty:
        s.notes.append("No runs.jsonl in this folder.")
    else:
        s.tables.append(("sweep runs", runs))
    return s


SECTIONS: list[Callable[[Results], Section]] = [
    section_summary, section_latency, section_speedup, section_nsplit, section_history, section_importance,
    section_problems, section_export, section_provenance,
]


def build_sections(res: Results) -> list[Section]:
    return [f(res) for f in SECTIONS]


# --------------------------------------------------------------------------- rendering
def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table_html(df: pd.DataFrame) -> str:
    if df is None or df.empty:
        return "<p><em>(empty)</em></p>"
    return df.to_html(index=False, na_rep="", float_format=_fmt, classes="kv", border=0, escape=True)


def section_html(sec: Section, img_src: str | None = None, part: str = "all") -> str:
    """The section's HTML. Used by both the static page and the notebook, so both show the
    same text and tables. part: 'all'; 'head' (title and notes) or 'body' (tables and the
    YAML), between which the notebook shows the figure inline; img_src: the figure's PNG."""
    parts = []
    if part in ("all", "head"):
        parts.append(f'<h2 id="{sec.key}">{html.escape(sec.title)}</h2>')
        parts += [f"<p>{html.escape(n)}</p>" for n in sec.notes]
    if img_src and part == "all":
        parts.append(f'<img src="{html.escape(img_src)}" alt="{html.escape(sec.title)}">')
    if part in ("all", "body"):
        tables = list(sec.tables)
        if sec.code is not None:  # the YAML beside the table it came from
            first = tables.pop(0) if tables else None
            side = f"<h4>{html.escape(first[0])}</h4>{table_html(first[1])}" if first else ""
            parts.append('<div class="side"><div class="code"><h4>exported YAML</h4><pre>'
                         f'{html.escape(sec.code)}</pre></div><div class="tab">{side}</div></div>')
        for cap, df in tables:
            parts.append(f"<h4>{html.escape(cap)}</h4>{table_html(df)}")
    return "\n".join(parts)


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }
table.kv { border-collapse: collapse; font-size: 12px; margin-bottom: 1em; }
table.kv th, table.kv td { padding: 2px 8px; border-bottom: 1px solid #ddd; text-align: right; }
table.kv th { background: #f3f3f3; }
img { max-width: 100%; border: 1px solid #eee; }
.side { display: flex; gap: 2em; align-items: flex-start; }
.side .code { flex: 0 0 auto; max-width: 45%; }
.side .tab { flex: 1 1 auto; overflow-x: auto; }
pre { background: #f7f7f7; padding: 0.8em; font-size: 11px; overflow-x: auto; }
.warn { background: #fff3cd; padding: 0.5em 1em; }
"""
NOTEBOOK_CSS = ".side { display: flex; gap: 2em; align-items: flex-start; } .side pre { font-size: 11px; }"


def header_html(res: Results) -> str:
    warn = (f'<p class="warn">{html.escape(res.timing_label)}.</p>' if res.is_cpu else
            f"<p>Timings: {html.escape(res.timing_label)}.</p>")
    return (f"<h1>kvtune review: {html.escape(res.deployment)}</h1>"
            f"<p>Results folder: <code>{html.escape(str(res.folder))}</code>; {len(res.trials)} trial rows; "
            f"backends: {html.escape(', '.join(res.backends))}; study storage: "
            f"{html.escape(_storage_name(res)) if res.storage else 'none'}; exported YAML: "
            f"{html.escape(res.tuned_path.name) if res.tuned_path else 'none'}.</p>{warn}")


def show(sec: Section) -> None:
    """Display a section in a notebook: the report's HTML, the figure inline between."""
    from IPython.display import HTML, display
    display(HTML(section_html(sec, part="head")))
    if sec.figure is not None:
        display(sec.figure)
        plt.close(sec.figure)  # displayed once, not again by the inline backend at cell end
    body = section_html(sec, part="body")
    if body:
        display(HTML(f"<style>{NOTEBOOK_CSS}</style>{body}"))


def write_report(target: str | os.PathLike, out: str | os.PathLike | None = None, dpi: int = 110,
                 storage: str | None = None) -> Path:
    """Write `index.html` and one PNG per figure into `out` (default: <results>/report/)."""
    res = load_results(target, storage)
    out = Path(out) if out is not None else res.folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    body = [header_html(res), "<ul>"]
    secs = build_sections(res)
    body += [f'<li><a href="#{s.key}">{html.escape(s.title)}</a></li>' for s in secs] + ["</ul>"]
    for s in secs:
        img = None
        if s.figure is not None:
            img = f"{s.key}.png"
            s.figure.savefig(out / img, dpi=dpi, bbox_inches="tight")
            plt.close(s.figure)
        body.append(section_html(s, img))
    page = (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>kvtune review: "
            f"{html.escape(res.deployment)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")
    (out / "index.html").write_text(page)
    return out / "index.html"


__all__ = ["Results", "Section", "SECTIONS", "load_results", "resolve_results_dir", "build_sections", "show",
           "write_report", "summary_table", "problem_trials", "exported_table", "history_frame",
           "importance_frame", "fig_latency", "fig_speedup", "fig_nsplit", "fig_history", "fig_importance",
           "fig_outcomes"]
