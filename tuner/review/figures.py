"""The review's matplotlib figures; each returns a Figure, or None when it has nothing to plot."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from .data import BACKEND_ORDER, OUTCOMES, STUDY_KEYS, Results, ctx_label, most_common, search_trials, study_table
from .studies import history_frame, importance_frame, importance_summary
from .tables import nsplit_table

OUTCOME_COLORS = {"ok": "#2ca02c", "pruned": "#7f7f7f", "wrong": "#d62728", "failed": "#ff7f0e"}
BACKEND_MARKERS = {"cuda": "o", "triton": "s", "reference": "^"}

def _tp_colors(tps) -> dict:
    cmap = plt.get_cmap("tab10")
    return {tp: cmap(i % 10) for i, tp in enumerate(sorted(tps))}


def _log2_ctx_axis(ax, ctxs) -> None:
    ctxs = sorted(set(int(c) for c in ctxs))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctxs)
    ax.set_xticklabels([ctx_label(c) for c in ctxs])
    ax.minorticks_off()
    if len(ctxs) == 1:  # a single context: give the lone point some room
        ax.set_xlim(ctxs[0] / 2, ctxs[0] * 2)
    ax.set_xlabel("context length (prefix tokens, log scale)")


def fig_latency(res: Results):
    """Latency and % of floor against context (log x): one line per tp and backend; tuned
    solid, default dashed, floor dotted."""
    st = study_table(res)
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
    handles = [Line2D([], [], color=colors[tp], lw=2,
                      label=f"tp {int(tp)} ({_heads(st, tp)} head{'' if _heads(st, tp) == 1 else 's'}/rank)")
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
    return f"{most_common(res.trials.get('device')) or '?'}, {most_common(res.trials.get('timing')) or '?'} timing"


def fig_speedup(res: Results):
    """Left: tuned over default (default latency / tuned latency). Right, when both backends
    were swept: CUDA over Triton (Triton tuned latency / CUDA tuned latency)."""
    st = study_table(res)
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
        ax.set_xticklabels([ctx_label(c) for c in t.columns])
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
    handles = [Line2D([], [], color=ccol[c], lw=2, label=f"context {ctx_label(c)}") for c in ctxs]
    handles.append(Line2D([], [], color="gray", marker="o", ls="none", alpha=0.5, label="one trial (ok)"))
    if multi_bs:
        handles.append(Line2D([], [], color="k", ls="--", label="batch > smallest"))
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle(f"{res.deployment}: optimisation history ({_short_timing(res)})")
    fig.tight_layout()
    return fig

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
    df = search_trials(res.trials)
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
