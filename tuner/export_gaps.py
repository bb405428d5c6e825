"""What `kvtune export` says about trials it cannot choose from: a last sweep that did not
complete, buckets without trials, and buckets whose every config was pruned (where "no config
was correct" would send the reader looking for a wrong kernel instead of the prune reason).
"""
from __future__ import annotations

from pathlib import Path

from kvtune.kernels.tuned import BACKEND_NAMES

from .config import Deployment
from .log import get_logger
from .runlock import unfinished_sweep
from .prunes import all_pruned_note, pruned_summary
from .strategy import BESIDE_SEARCH
from .study import ALL_PRUNED
from .table import read_jsonl

log = get_logger(__name__)
MAX_NAMED = 6   # buckets an error names one by one before it counts the rest


def warn_incomplete(df, dep: Deployment, out_dir: Path) -> None:
    """Say when the last sweep stopped and which buckets have no trials."""
    status = last_sweep_status(out_dir)
    unfinished = unfinished_sweep(out_dir)
    if status and status.startswith(ALL_PRUNED) and not unfinished:
        log.warning("the last sweep into %s ended %r: fix the deployment or the search space (the sweep's summary "
                    "gives the prune reasons), then sweep again into a new --out", out_dir, status)
    elif unfinished or (status and status != "complete"):   # runs.jsonl only has the sweeps that ended
        short = short_studies(df, dep)
        named = ", ".join(f"{be} (tp={tp}, bs={bs}, ctx={c}): {n}" for be, tp, bs, c, n in short[:MAX_NAMED])
        more = f" and {len(short) - MAX_NAMED} more" if len(short) > MAX_NAMED else ""
        log.warning("the last sweep into %s %s: a study it did not start has no entry below, and one it did not "
                    "finish (its search, or the re-measurement and cross-bucket phases after it) is exported from "
                    "the trials it has%s; run the same sweep command again to resume it, then export again",
                    out_dir, unfinished or f"ended {status!r}",
                    f" ({len(short)} with fewer search trials than the deployment's {dep.trials}: {named}{more})"
                    if short else "")
    missing = missing_buckets(df, dep)
    if missing:
        log.warning("%d (backend, tp, batch, context) bucket(s) of %s have no trials, so no entry below covers "
                    "them: %s", len(missing), dep.name,
                    ", ".join(f"{be} (tp={tp}, bs={bs}, ctx={c})" for be, tp, bs, c in missing))


def swept_contexts(df, dep: Deployment, backends, tp, bs) -> list[int]:
    """The context buckets swept at (tp, bs), warning about the deployment's unswept ones and
    each backend's gaps (one config serves every bucket: a gap rules the backend out)."""
    sel = df[(df["tp"] == tp) & (df["bs"] == bs) & (df["phase"] == "search")]
    contexts = sorted(int(c) for c in set(sel["ctx"]))
    if not contexts:
        return contexts
    missing = [c for c in dep.contexts if c not in contexts]
    if missing:
        log.warning("tp=%s bs=%s: context buckets %s were not swept; the entry covers %s only",
                    tp, bs, missing, contexts)
    for b in backends:
        have = {int(c) for c in sel[sel["backend"] == b]["ctx"]}
        gaps = [c for c in contexts if c not in have]
        if have and gaps:
            log.warning("tp=%s bs=%s: %s has no trials at context(s) %s, so it cannot serve this entry (a stopped "
                        "sweep leaves such gaps: run it again to resume)", tp, bs, b, gaps)
    return contexts


def pruned_buckets(df, backends, tp=None, bs=None) -> dict:
    """{(tp, bs, ctx): the prune reasons} of the buckets (at `tp`, `bs` where given) whose every
    search trial of `backends` was pruned: no backend can serve them, whatever export picks."""
    sel = df[(df["phase"] == "search") & df["backend"].isin(list(backends))]
    if tp is not None:
        sel = sel[(sel["tp"] == tp) & (sel["bs"] == bs)]
    out = {}
    for (t, s, c), g in sel.groupby(["tp", "bs", "ctx"]):
        outcomes = {o: list(r["reason"]) for o, r in g.groupby("outcome")}
        if all_pruned_note(outcomes):
            out[(int(t), int(s), int(c))] = outcomes["pruned"]
    return out


def pruned_explanation(pruned: dict) -> str:
    """'every config was pruned at <buckets>: <the commonest reasons>' for `pruned_buckets`'s answer."""
    names = [f"tp={t} bs={s} ctx={c}" for t, s, c in sorted(pruned)]
    where = ", ".join(names[:MAX_NAMED]) + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")
    return f"every config was pruned at {where}: {pruned_summary([r for v in pruned.values() for r in v])}"


def nothing_exported(df, backends) -> str:
    """Why no entry was exported: the buckets whose every config was pruned and why, and the
    (tp, batch) pairs without such a bucket, where no config was correct at every context bucket."""
    pruned = pruned_buckets(df, backends)
    if not pruned:
        return "no config was correct at every bucket"
    search = df[(df["phase"] == "search") & df["backend"].isin(list(backends))]
    pairs = sorted({(int(t), int(s)) for t, s in zip(search["tp"], search["bs"])} - {k[:2] for k in pruned})
    return pruned_explanation(pruned) + ("; " + ", ".join(f"tp={t} bs={s}" for t, s in pairs) +
                                         ": no config was correct at every context bucket" if pairs else "")


def missing_buckets(df, dep: Deployment) -> list[tuple]:
    """(backend, tp, bs, ctx) of the deployment without a search trial, for the exportable
    backends the table holds (a backend this machine skipped has no rows at all)."""
    search = df[df["phase"] == "search"]
    have = {(str(b), int(t), int(s), int(c)) for b, t, s, c in zip(search["backend"], search["tp"], search["bs"],
                                                                   search["ctx"])}
    backends = [b for b in dict.fromkeys(search["backend"].astype(str)) if b in BACKEND_NAMES and b != "reference"]
    return [(be, tp, bs, c) for be in backends for tp in dep.tp for bs in dep.batches for c in dep.contexts
            if (be, tp, bs, c) not in have]


def short_studies(df, dep: Deployment) -> list[tuple]:
    """(backend, tp, bs, ctx, trials) of the studies whose search holds fewer trials that count
    against the budget (as the sweep counts them, `SearchStrategy.counts`: not the cross-bucket
    or ragged ones, not the pruned) than the deployment's `trials`: a sweep stopped inside them,
    or one run with a smaller --trials."""
    if df.empty:
        return []
    search = df[(df["phase"] == "search") & ~df["role"].isin(list(BESIDE_SEARCH)) & (df["outcome"] != "pruned")]
    out = []
    for (be, tp, bs, c), g in search.groupby(["backend", "tp", "bs", "ctx"], sort=True):
        n = g["trial"].nunique()
        if n < dep.trials and str(be) in BACKEND_NAMES and be != "reference":
            out.append((str(be), int(tp), int(bs), int(c), int(n)))
    return out


def last_sweep_status(out_dir: Path) -> str | None:
    """The status of the last `kvtune sweep` run recorded in `<out_dir>/runs.jsonl`, if any."""
    runs = read_jsonl(out_dir / "runs.jsonl")   # a torn line is skipped with a warning naming it
    status = runs[-1].get("status") if runs else None
    return str(status) if status else None
