"""The review's sections: a title, notes, tables and at most one figure each. `SECTIONS` is
what both the notebook and `kvtune report` show, in this order."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pandas as pd

from . import tables
from .data import OUTCOMES, Results, ctx_label, search_trials, study_table
from .figures import fig_history, fig_importance, fig_latency, fig_nsplit, fig_outcomes, fig_speedup
from .studies import history_frame, importance_frame, importance_summary


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
    tab = tables.summary_table(res)
    if tab.empty:
        s.notes.append("No study in the trials table.")
    else:
        nok = study_table(res)
        dead = nok[nok["tuned_us"].isna()]
        if len(dead):
            s.notes.append(f"{len(dead)} of {len(nok)} studies have no ok trial (see 'Failed, wrong and pruned "
                           "trials'): their tuned columns are empty.")
        s.tables.append(("tuned vs default vs floor", tab))
        s.tables.append(("winning parameters per study", tables.best_params_table(res)))
    return s


def section_latency(res: Results) -> Section:
    s = Section("latency", "Latency and % of floor against context length")
    s.figure = fig_latency(res)
    if s.figure is None:
        s.notes.append("Nothing to plot: no study has an ok trial.")
    elif study_table(res)["ctx"].nunique() == 1:
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
        t = tables.nsplit_table(res)
        t.columns = [ctx_label(c) for c in t.columns]
        s.tables.append(("best NSPLIT", t.reset_index()))
    return s


def section_ragged(res: Results) -> Section:
    s = Section("ragged", "NSPLIT on ragged batches")
    t = tables.ragged_table(res)
    if t.empty:
        s.notes.append("No ragged rows: the sweep scores ragged batches at batch buckets above 1 (deployment "
                       "`ragged_spread` > 1).")
        return s
    s.notes.append("At batch buckets above 1 the sweep times each context bucket's NSPLIT candidates also on a "
                   "ragged batch (the bucket's batch size, prefixes spread geometrically over `spread`, mean 3/4 "
                   "of the bound); export serves the NSPLIT whose worse ratio to the best over the two batches "
                   "is least ('served'), which may give up a little on equal requests ('equal µs').")
    s.tables.append(("NSPLIT on the ragged batch and on equal requests", t))
    return s


def section_dispatch(res: Results) -> Section:
    from ..dispatch import DISPATCH_COST_US
    from ..export import NSPLIT_MARGIN
    s = Section("dispatch", "One compile-time config per batch bucket: what a per-context choice would win")
    t = tables.dispatch_table(res)
    if res.tuned is None:
        s.notes.append("No exported YAML in this folder: nothing served to compare.")
        return s
    s.notes.append("One captured graph serves every context of a (tp, batch bucket), so its entry holds one "
                   "compile-time config. Per bucket where the sweep measured another compile-time group faster "
                   "(each judged as the export judges it): the win, and the win net of a per-context dispatch's "
                   f"cost ({DISPATCH_COST_US:g} µs per call: an early-exit split and merge launch, "
                   f"results/serving/dispatch/). 'pays': faster by more than {100 * NSPLIT_MARGIN:g}% (the "
                   "export's noise margin) and by more than that cost. The ragged batch is not weighed here.")
    if t.empty:
        s.notes.append("No bucket has a faster compile-time group than the one served.")
    else:
        s.tables.append(("buckets where another compile-time group measured faster", t))
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
    counts, reasons = tables.problem_trials(res)
    s.figure = fig_outcomes(res)
    trials = search_trials(res.trials)
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
        s.tables.append(("exported buckets vs trials", tables.exported_table(res)))
    return s


def section_provenance(res: Results) -> Section:
    s = Section("provenance", "Provenance and sweep runs")
    s.notes.append("Where the numbers come from: the trials table's provenance columns beside the exported "
                   "YAML's, and every `kvtune sweep` run into this folder (runs.jsonl: command, status, "
                   "wall-clock time).")
    s.tables.append(("provenance", tables.provenance_table(res)))
    runs = tables.runs_table(res)
    if runs.empty:
        s.notes.append("No runs.jsonl in this folder.")
    else:
        s.tables.append(("sweep runs", runs))
    return s


SECTIONS: list[Callable[[Results], Section]] = [
    section_summary, section_latency, section_speedup, section_nsplit, section_ragged, section_dispatch,
    section_history,
    section_importance,
    section_problems, section_export, section_provenance,
]


def build_sections(res: Results) -> list[Section]:
    return [f(res) for f in SECTIONS]
