"""`kvtune forget DEPLOYMENT --backend B`: set a backend's tuning aside so the next sweep starts it
over, e.g. after its kernel source changed (its trials were measured on code that no longer runs).

The backend's Optuna studies are deleted from the study storage (a resumed sweep would otherwise
find them finished), and its rows move from `trials.csv` to `trials.forgotten.csv` beside it
(appended: nothing measured is lost, and export no longer reads them). The other backends' rows
and studies are untouched. `--tp`, `--bs` and `--ctx` narrow it to those buckets (e.g. after a
change of the ragged phase's rules, or to re-tune the buckets a new workload serves most); each
given filter must match, and a value the deployment does not sweep is an error. Stop any sweep
writing into the folder first.
"""
from __future__ import annotations

from pathlib import Path

from .config import load_deployment
from .studies_files import folder_storages, missing_storage_file, present_storages
from .study import STUDY_SEP
from .table import _set_aside, _warn_bad, row_key, scan_table, write_table

def forget_backend(deployment: str, backends: list[str], out: str = "runs", storage: str | None = None,
                   tp=None, bs=None, ctx=None) -> dict:
    """Move `backends`' rows of `<out>/<deployment>/trials.csv` to `trials.forgotten.csv` and
    delete their studies; `tp`, `bs`, `ctx` (lists of ints, None: all) keep it to those buckets.
    Returns {"rows": rows moved, "studies": studies deleted, "dir": the folder}."""
    from kvtune.kernels.tuned import BACKEND_NAMES
    unknown = [b for b in backends if b not in BACKEND_NAMES]
    if unknown:
        raise ValueError(f"--backend {' '.join(unknown)}: not a backend (known: {', '.join(BACKEND_NAMES)})")
    dep = load_deployment(deployment)
    only = _bucket_filter(dep, tp=tp, bs=bs, ctx=ctx)
    out_dir = Path(out) / dep.name
    table = out_dir / "trials.csv"
    if not table.is_file():
        raise FileNotFoundError(f"{table}: no trials table (is --out the folder the sweep wrote into?)")
    # every storage opened, and its studies to delete listed, before any row moves: a storage
    # that cannot be opened would otherwise leave the rows forgotten and the studies finished,
    # and the next sweep would resume them instead of re-tuning
    doomed = [_matching_studies(url, dep.name, backends, only) for url in _study_storages(out_dir, storage)]
    cols, rows, bad, keep_text = scan_table(table)
    if bad:   # as a sweep would: kept in trials.csv.torn, out of the way of the rewrite below
        _warn_bad(table, bad, f"set aside in {table}.torn")
        _set_aside(table, keep_text, bad)
    if "backend" not in cols:
        raise ValueError(f"{table}: no 'backend' column in its header")
    named = [r["backend"] in backends and _in(only, r) for r in rows]
    gone = [r for r, n in zip(rows, named) if n]
    keep = [r for r, n in zip(rows, named) if not n]
    if gone:
        _append_rows(out_dir / "trials.forgotten.csv", cols, gone)
        write_table(table, cols, keep)
    import optuna
    for st, names in doomed:
        for name in names:
            optuna.delete_study(study_name=name, storage=st)
    return {"rows": len(gone), "studies": sum(len(names) for _, names in doomed), "dir": out_dir}


def _bucket_filter(dep, **given) -> dict[str, set[int]]:
    """{"tp" | "bs" | "ctx": the values kept} for each filter given; a value the deployment does not
    sweep is an error naming the option (it would forget nothing, and the next sweep resume)."""
    swept = {"tp": dep.tp, "bs": dep.batches, "ctx": dep.contexts}
    only = {}
    for key, vals in given.items():
        if vals is None:
            continue
        bad = [v for v in vals if v not in swept[key]]
        if bad:
            raise ValueError(f"--{key} {' '.join(map(str, bad))}: not swept by {dep.name} "
                             f"({key} buckets: {', '.join(map(str, swept[key]))})")
        only[key] = set(vals)
    return only


def _in(only: dict, row: dict) -> bool:
    """Whether a trials-table row (or a study's {tp, bs, ctx}) is in the buckets `only` keeps."""
    try:
        return all(int(float(row[k])) in v for k, v in only.items())
    except (KeyError, TypeError, ValueError):
        return False   # a row without the bucket is not one of the buckets named


def model_changes(rows, dep) -> list[str]:
    """How `rows` (trials-table rows as dicts; the deployment's own) were measured for another model
    than `dep` says now: "tp 8: heads 2 (now 8)", "T 4 (now 6)", "tree chain (now random)", each
    with its row count. The studies are named by deployment, backend and bucket only, so a
    deployment edited in place would resume (and export) trials of the old shape as the new one's.
    Rows without the column (older tables) are not judged."""
    T, tree = dep.model.draft_tokens, dep.tree
    seen: dict[str, int] = {}
    for r in rows:
        if r.get("deployment") not in (None, "", dep.name):
            continue
        found = []
        try:
            tp = int(float(r["tp"])) if str(r.get("tp", "")).strip() else None
            if tp and str(r.get("heads", "")).strip() and int(float(r["heads"])) != dep.heads(tp):
                found.append(f"tp {tp}: heads {int(float(r['heads']))} (now {dep.heads(tp)})")
            if str(r.get("T", "")).strip() and int(float(r["T"])) != T:
                found.append(f"T {int(float(r['T']))} (now {T})")
        except (TypeError, ValueError, ZeroDivisionError):
            continue   # a malformed number is the table's readers' to report
        if str(r.get("tree", "")).strip() and str(r["tree"]) != tree:
            found.append(f"tree {r['tree']} (now {tree})")
        for f in found:
            seen[f] = seen.get(f, 0) + 1
    return [f"{k}: {n} row(s)" for k, n in seen.items()]


def stale_sources(table: Path, current: dict[str, str | None]) -> dict[str, tuple[int, list[str], str]]:
    """Per backend of `current` (name -> its kernel source hash now): (rows, [their other hashes],
    the current hash) when rows of `table` were measured on another source. Backends without a
    hash (none known, or a replay's) are never stale."""
    if not Path(table).is_file():
        return {}
    _, rows, _, _ = scan_table(table)
    out = {}
    for be, cur in current.items():
        if not cur or cur == "replay":
            continue
        other = [r.get("kernel_hash") for r in rows if r.get("backend") == be and r.get("kernel_hash") not in
                 (cur, "", None)]
        if other:
            out[be] = (len(other), sorted(set(other)), cur)
    return out


def _append_rows(path: Path, cols: list[str], rows: list[dict]) -> None:
    if path.is_file() and path.stat().st_size:
        old_cols, old, bad, keep_text = scan_table(path)
        if bad:
            _warn_bad(path, bad, f"set aside in {path}.torn")
            _set_aside(path, keep_text, bad)
        cols = old_cols + [c for c in cols if c not in old_cols]
        have = {row_key(r) for r in old}   # a forget killed before its table rewrite, run again
        rows = old + [r for r in rows if row_key(r) not in have]
    write_table(path, cols, rows)


def _study_storages(out_dir: Path, storage: str | None) -> list[str]:
    """The study storages a sweep into `out_dir` used: `storage` (which must exist when it is a
    file: a mistyped path would delete nothing and the next sweep would resume), else those of the
    defaults present, the single process's studies.db and the workers' studies.journal."""
    if storage:
        if missing_storage_file(storage) is not None:
            db, journal = folder_storages(out_dir)
            raise FileNotFoundError(f"--storage {storage}: no such file; name the storage the sweep used "
                                    f"(default {db}, or {journal} with --workers)")
        return [storage]
    return present_storages(out_dir)


def _matching_studies(url: str, dep: str, backends: list[str], only: dict) -> tuple:
    """(the opened storage at `url`, the names of its studies of `dep`'s `backends` in the
    buckets `only` keeps). Opening it raises the storage's own error, naming --storage."""
    import optuna
    from .storage import open_storage
    st, _ = open_storage(url)
    names = []
    for s in optuna.get_all_study_summaries(st, include_best_trial=False):
        parts = s.study_name.split(STUDY_SEP)   # dep | backend | tp8 | bs1 | ctx4096
        bucket = {k: p[len(k):] for k, p in zip(("tp", "bs", "ctx"), parts[2:]) if p.startswith(k)}
        if len(parts) >= 2 and parts[0] == dep and parts[1] in backends and _in(only, bucket):
            names.append(s.study_name)
    return st, names


def _cmd_forget(args) -> int:
    got = forget_backend(args.deployment, args.backend, out=args.out, storage=args.storage, tp=args.tp, bs=args.bs,
                         ctx=args.ctx)
    where = "".join(f" --{k} {' '.join(map(str, v))}" for k, v in (("tp", args.tp), ("bs", args.bs), ("ctx", args.ctx))
                    if v)
    print(f"forgot {', '.join(args.backend)}{where} in {got['dir']}: {got['rows']} trial row(s) moved to "
          f"trials.forgotten.csv, {got['studies']} stud{'y' if got['studies'] == 1 else 'ies'} deleted")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("forget", help="set a backend's trials and studies aside so the next sweep re-tunes it",
                              description=__doc__)
    p.add_argument("deployment", help="deployment name or YAML path")
    p.add_argument("--backend", nargs="+", required=True, help="the backend(s) to forget, e.g. wgmma")
    p.add_argument("--out", default="runs", help="the sweep's output root (default ./runs)")
    p.add_argument("--storage", help="Optuna storage URL, when not <out>/<deployment>/studies.db")
    p.add_argument("--tp", type=int, nargs="+", help="only these tp degrees")
    p.add_argument("--bs", type=int, nargs="+", help="only these batch buckets")
    p.add_argument("--ctx", type=int, nargs="+", help="only these context buckets")
    p.set_defaults(func=_cmd_forget)
