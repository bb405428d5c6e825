"""Optimisation histories and parameter importances, from the Optuna storage when there is one
and optuna is installed, else from the trials table."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
from kvtune.kernels.backends import rename_legacy_params

from .data import STUDY_KEYS, Results, search_trials, storage_name


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
        storage = _storage(res)
        rows = []
        for summ in optuna.get_all_study_summaries(storage, include_best_trial=False):
            keys = _study_keys(summ.study_name, res.deployment)
            if keys is None:
                continue
            study = optuna.load_study(study_name=summ.study_name, storage=storage)
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

def _storage(res: Results):
    """The opened storage of `res.storage` (an SQLAlchemy URL or journal:PATH, as the sweep takes
    them); a ConfigError naming it when it cannot be opened."""
    if "optuna_storage" not in res._cache:
        from ..storage import open_storage
        res._cache["optuna_storage"] = open_storage(res.storage)[0]
    return res._cache["optuna_storage"]


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
        source = f"Optuna storage {storage_name(res)}"
    else:
        df = search_trials(res.trials)
        h = df[[*STUDY_KEYS, "trial", "role"]].copy()
        h["latency_us"] = np.where(df["outcome"] == "ok", df["median_us"], np.nan)
        source = "the trials table" + (" (no study storage in this folder)" if not res.storage else
                                       " (optuna is not installed)" if ot is None else
                                       f" (the storage {storage_name(res)} holds no study of {res.deployment})")
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
    if ot is not None and len(ot):
        rows, source = _optuna_importances(res, ot)
        if rows:
            return pd.DataFrame(rows), source
    return (pd.DataFrame(_eta_squared_importances(res), columns=[*STUDY_KEYS, "param", "importance"]),
            "the trials table: share of the variance of log(latency) explained by each parameter alone")


def _optuna_importances(res: Results, ot: pd.DataFrame) -> tuple[list[dict], str]:
    import optuna
    from optuna.importance import get_param_importances
    try:
        import sklearn  # noqa: F401
        evaluator, name = optuna.importance.FanovaImportanceEvaluator(seed=0), "fANOVA"
    except ImportError:
        evaluator, name = optuna.importance.PedAnovaImportanceEvaluator(), "PED-ANOVA"
    rows = []
    for sname, g in ot.groupby("study"):
        done = g[g["state"] == "COMPLETE"]
        if len(done) < 3 or not _varies(done["params"]):
            continue
        study = optuna.load_study(study_name=sname, storage=_storage(res))
        try:
            imp = get_param_importances(study, evaluator=evaluator)
        except Exception:  # noqa: BLE001 - a degenerate study (one distinct value...) has none
            continue
        keys = {k: g[k].iloc[0] for k in STUDY_KEYS}
        imp = rename_legacy_params(keys["backend"], imp)  # a study from before a rename
        rows += [{**keys, "param": p, "importance": float(v)} for p, v in imp.items()]
    return rows, f"optuna.importance ({name}) on the studies in {storage_name(res)}"


def _eta_squared_importances(res: Results) -> list[dict]:
    df = search_trials(res.trials)
    ok = df[(df["outcome"] == "ok") & df["median_us"].notna()]
    rows = []
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
    return rows


def _varies(params: pd.Series) -> bool:
    return len({json.dumps(p, sort_keys=True) for p in params}) > 1

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
