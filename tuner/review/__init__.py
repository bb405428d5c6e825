"""Review of a sweep's results: the tables and figures of `results/review.ipynb` and `kvtune report`.

Both front ends call the same section builders (`SECTIONS`), so the notebook and the static
HTML page show the same content. A section is a title, a few notes, tables and at most one
matplotlib figure, computed from one results folder::

    results/<deployment>/trials.csv        one row per trial (tuner/table.py)
    results/<deployment>/studies.db        Optuna RDB storage (optional: histories, importances)
    results/<deployment>/<deployment>.yaml the exported defaults (optional; kernels/tuned.py)

The modules, in the order the data flows: `data` (the folder read into `Results`, the
per-study table), `tables` and `studies` (derived tables; histories and importances),
`figures`, `sections` (what is shown), `render` (HTML page, notebook display).

Needs pandas and matplotlib (the `kvtune[review]` extra); optuna is used when installed and a
study storage is present, otherwise the history and the importances come from the trials
table. Nothing here is imported by the kernels, the runtime or `kvtune --help`.
"""
from __future__ import annotations

from .data import Results, load_results, resolve_results_dir
from .figures import fig_history, fig_importance, fig_latency, fig_nsplit, fig_outcomes, fig_speedup
from .render import header_html, section_html, show, table_html, write_report
from .sections import (
    SECTIONS,
    Section,
    build_sections,
    section_dispatch,
    section_export,
    section_history,
    section_importance,
    section_latency,
    section_nsplit,
    section_problems,
    section_ragged,
    section_provenance,
    section_speedup,
    section_summary,
)
from .studies import history_frame, importance_frame, importance_summary
from .tables import (
    best_params_table,
    dispatch_table,
    exported_table,
    nsplit_table,
    problem_trials,
    provenance_table,
    ragged_table,
    runs_table,
    summary_table,
)

__all__ = ["Results", "Section", "SECTIONS", "load_results", "resolve_results_dir", "build_sections", "show",
           "write_report", "header_html", "section_html", "table_html", "summary_table", "best_params_table",
           "problem_trials", "exported_table", "dispatch_table", "provenance_table", "ragged_table", "runs_table",
           "nsplit_table",
           "history_frame", "importance_frame", "importance_summary", "fig_latency", "fig_speedup", "fig_nsplit",
           "fig_history", "fig_importance", "fig_outcomes", "section_summary", "section_latency", "section_speedup",
           "section_nsplit", "section_ragged", "section_history", "section_importance", "section_problems",
           "section_export", "section_provenance", "section_dispatch"]
