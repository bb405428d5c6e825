"""The review's tables, one row per study, bucket, reason or run (pandas DataFrames)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from ..table import PROVENANCE, read_jsonl
from .data import OUTCOMES, STUDY_KEYS, Results, ctx_label, search_trials, study_table


def summary_table(res: Results) -> pd.DataFrame:
    """Per (tp, bs, context): tuned vs default vs floor for each backend (wide table)."""
    st = study_table(res)
    if st.empty:
        return pd.DataFrame()
    exported = {}  # (tp, bs, ctx) -> (backend, NSPLIT, latency) of the exported YAML's bucket
    if res.tuned is not None:
        for e in res.tuned.entries:
            for b in e.buckets:
                # a per-context dispatch's bucket names its own backend and compile-time params
                own = "".join(f" {k}={v}" for k, v in (b.params or {}).items())
                exported[(e.tp, e.max_batch, b.max_context)] = (e.served_by(b)[0], f"{b.NSPLIT}{own}", b.latency_us)
    rows = []
    for (tp, bs, ctx), g in st.groupby(["tp", "bs", "ctx"], sort=True):
        r = {"tp": int(tp), "heads": int(g["heads"].iloc[0]) if pd.notna(g["heads"].iloc[0]) else None,
             "bs": int(bs), "context": ctx_label(ctx), "floor µs": g["floor_us"].iloc[0]}
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
    st = study_table(res)
    if st.empty:
        return pd.DataFrame()
    rows = []
    for _, s in st.iterrows():
        r = {"backend": s["backend"], "tp": int(s["tp"]), "bs": int(s["bs"]), "context": ctx_label(s["ctx"]),
             "tuned µs": s["tuned_us"]}
        r.update(s["best_params"] or {"(no ok trial)": ""})
        rows.append(r)
    return pd.DataFrame(rows)

def problem_trials(res: Results) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(counts of each outcome per study, the failed/wrong/pruned trials grouped by reason)."""
    df = search_trials(res.trials)
    counts = df.groupby(STUDY_KEYS)["outcome"].value_counts().unstack(fill_value=0)
    for o in OUTCOMES:
        if o not in counts:
            counts[o] = 0
    counts = counts[list(OUTCOMES)].reset_index()
    counts["ctx"] = counts["ctx"].map(ctx_label)
    bad = df[df["outcome"] != "ok"]
    if bad.empty:
        return counts, pd.DataFrame(columns=["backend", "outcome", "reason", "trials", "studies", "example params"])
    rows = []
    for (b, o, reason), g in bad.groupby(["backend", "outcome", "reason"], sort=False):
        studies = sorted({f"tp{int(t)}/bs{int(s)}/{ctx_label(c)}" for t, s, c in zip(g["tp"], g["bs"], g["ctx"])})
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
    st = study_table(res).set_index(STUDY_KEYS) if len(study_table(res)) else None
    rows = []
    for e in t.entries:
        for b in e.buckets:
            be, cp = e.served_by(b)   # a per-context dispatch's bucket: its own backend and params
            r = {"tp": e.tp, "max_batch": e.max_batch, "backend": be, "max context": ctx_label(b.max_context),
                 "NSPLIT": b.NSPLIT, "yaml latency µs": b.latency_us, "yaml default µs": b.default_latency_us,
                 "yaml floor µs": b.floor_us}
            key = (be, e.tp, e.max_batch, b.max_context)
            if st is not None and key in st.index:
                s = st.loc[key]
                r["trials best µs"] = s["tuned_us"]
                r["trials default µs"] = s["default_us"]
                r["trials best NSPLIT"] = (s["best_params"] or {}).get("NSPLIT")
            r["compile-time params"] = ", ".join(f"{k}={v}" for k, v in sorted(cp.items()))
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

def nsplit_table(res: Results) -> pd.DataFrame:
    """Best NSPLIT per backend, (tp, bs) row and context column."""
    st = study_table(res)
    if st.empty or "NSPLIT" not in res.param_names:
        return pd.DataFrame()
    st = st.assign(NSPLIT=[(p or {}).get("NSPLIT", np.nan) for p in st["best_params"]])
    return st.pivot_table(index=["backend", "tp", "bs"], columns="ctx", values="NSPLIT", aggfunc="first")


def ragged_table(res: Results) -> pd.DataFrame:
    """The sweep's ragged phase: per (backend, tp, batch, context) and NSPLIT timed on the
    bucket's ragged batch, its median there and on equal requests (the latency export uses),
    whether it is the default config, and whether the exported YAML serves it."""
    from ..export import latencies, ragged_latencies
    from ..study import compile_key
    df = res.trials
    if "phase" not in df or not (df["phase"].astype(str) == "ragged").any():
        return pd.DataFrame()
    rounds = sorted(set(df[df["phase"].astype(str) == "ragged"]["round"].astype(str)))
    equal = latencies(df[df["outcome"] == "ok"])
    served = {}
    if res.tuned is not None:
        for e in res.tuned.entries:
            for b in e.buckets:
                be, cp = e.served_by(b)   # a per-context dispatch's bucket: its own backend and params
                served[(be, e.tp, e.max_batch, b.max_context)] = (compile_key(cp), b.NSPLIT)
    rows = []
    for rnd in rounds:
        for (be, tp, bs, ctx, pj), (us, role) in sorted(ragged_latencies(df, rnd).items()):
            p = json.loads(pj)
            cp = compile_key(p)
            eq = equal.get((be, tp, bs, ctx, pj))
            rows.append({"backend": be, "tp": tp, "bs": bs, "ctx": ctx_label(ctx), "spread": rnd,
                         "NSPLIT": p.get("NSPLIT"), "default": role == "baseline",
                         "served": served.get((be, tp, bs, ctx)) == (cp, p.get("NSPLIT")),
                         "ragged µs": us, "equal µs": eq[0] if eq else np.nan,
                         "compile-time params": ", ".join(f"{k}={v}" for k, v in sorted(p.items()) if k != "NSPLIT")})
    return pd.DataFrame(rows)


def dispatch_table(res: Results) -> pd.DataFrame:
    """Per exported bucket: the fastest other compile-time group the sweep measured there and
    what a per-context dispatch to it would net (`tuner.dispatch.context_alternatives`); only the
    buckets where another group was faster."""
    from ..dispatch import context_alternatives
    if res.tuned is None:
        return pd.DataFrame()

    def shown(ck):
        return ", ".join(f"{k}={v}" for k, v in json.loads(ck).items()) if ck else ""
    rows = [r for r in context_alternatives(res.trials, res.tuned) if r["win_us"] is not None and r["win_us"] > 0]
    return pd.DataFrame([{"backend": r["backend"], "tp": r["tp"], "batch": r["batch"],
                          "max context": ctx_label(r["ctx"]), "served": shown(r["served"]),
                          "NSPLIT": r["served_NSPLIT"], "served µs": r["served_us"],
                          "faster group": (f"{r['alt_backend']}: " if r["alt_backend"] != r["backend"] else "")
                          + shown(r["alternative"]), "its NSPLIT": r["alt_NSPLIT"],
                          "its µs": r["alt_us"], "win %": r["win_pct"], "net µs": r["net_us"],
                          "pays": r["pays"]} for r in rows])
