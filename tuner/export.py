"""`kvtune export DEPLOYMENT`: the trials table -> `<out>/<deployment>/<deployment>.yaml` (--out, default runs/).

Per tp and batch bucket, one backend and one set of compile-time parameters must serve
every context bucket under one CUDA graph, while NSPLIT is chosen per bucket on the device.
So for each backend, configs are grouped by their compile-time part (all parameters but
NSPLIT); a group qualifies when it has a correct measurement at every context bucket, when at no
bucket it is slower than the backend's own default measured there by more than
BUCKET_LOSS_MARGIN (3%) and, where it is slower at some bucket at all, its total over the
buckets is below the default's by more than that, and when, at every bucket whose ragged batch
the sweep timed, the NSPLIT it would serve there is not more than 3% slower on that batch than
the default. The group with the least total latency over the buckets (best NSPLIT per bucket)
wins, across backends (a tie to the default's own group). The default's own group always
qualifies, so an exported group's fastest NSPLIT never loses more than 3% to the default it was
measured against at any bucket, and only to win more than 3% over all of them. Each bucket
then serves `pick_nsplit`'s NSPLIT (equal requests and the bucket's ragged batch; the default's
own NSPLIT unless another beats it by more than NSPLIT_MARGIN). Latencies are the interleaved
re-measurements where they exist, else the search measurement. `params.NSPLIT` is the largest
bucket NSPLIT (the grid size); the file is written and validated with `kvtune.kernels.tuned`.

The serving check is part of the choice: each pick is measured the way serving runs it
(`params.NSPLIT` and a split table, `tuner/serve_check.py`) unless the table already holds
that check; a pick that fails it gives way to the next best. `kvtune export` measures the
checks it lacks on this machine (`--no-check`: only recorded ones count); so does
`kvtune sweep --export`.

A per-context dispatch (`tuner.dispatch.with_dispatch`): on cuda, wgmma and wgmma_km, where
another compile-time group, of the pick's backend or of another of these three, measured faster
at some context buckets by more than NSPLIT_MARGIN and by more than the dispatch's launch cost
(DISPATCH_COST_US, per call), those buckets name that group's params (and its backend, where it
is another) in the YAML and serving launches both configs on every call
(the one holding the batch's bucket runs, the other exits at once). A bucket moves only when
the dispatch's own serving check beats the pick's there by the same margins and, where the sweep
timed the bucket's ragged batch, serves that batch (measured too) within 3% of the default; the
dispatch must also win over all buckets together. Where only some moved buckets pass, the
dispatch of those alone is checked in turn; else the pick serves every bucket alone.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime, timezone
from pathlib import Path
from statistics import median
from typing import NamedTuple

from kvtune.kernels.tuned import BACKEND_NAMES, ContextBucket, SchemaError, TunedDefaults, TunedEntry, dump_tuned

from .config import Deployment, load_deployment
from .export_gaps import nothing_exported, pruned_buckets, pruned_explanation, swept_contexts, warn_incomplete
from .log import get_logger
from .ragged import PHASE as RAGGED_PHASE
from .ragged import ragged_round
from .study import compile_key
from .table import read_trials

log = get_logger(__name__)
MAX_CHECKS = 5   # serving checks measured per (tp, batch bucket) before export stops measuring more


class Bucket(NamedTuple):
    """One context bucket of a pick: the served NSPLIT, its latency on equal requests, the
    default's, the floor, and the latencies on the ragged batch (None where not measured)."""
    nsplit: int | None
    latency: float
    default: float | None
    floor: float | None
    ragged: float | None = None
    default_ragged: float | None = None


def latencies(df):
    """The latency export judges each measured config by: (backend, tp, bs, ctx, params JSON
    with sorted keys) -> (latency_us, role). Latency: the median of the config's interleaved
    re-measurements where it has any, else of its search (and cross-bucket) measurements;
    serving-check and ragged rows never count. Role: "baseline" when the config is the backend's
    default, else its first role by name."""
    ok = df[(df["outcome"] == "ok") & ~df["phase"].isin(["serve", RAGGED_PHASE])]

    def latency(g):
        rem = g[g["phase"] == "remeasure"]["median_us"].astype(float).tolist()
        return median(rem) if rem else median(g[g["phase"] != "remeasure"]["median_us"].astype(float).tolist())
    return _per_config(ok, latency)


def ragged_latencies(df, rnd: str | None) -> dict:
    """(backend, tp, bs, ctx, params JSON) -> (median us on the bucket's ragged batch, role),
    from the ragged rows of round `rnd` (the deployment's spread; None: none count)."""
    sel = df[(df["outcome"] == "ok") & (df["phase"] == RAGGED_PHASE) & (df["round"].astype(str) == str(rnd))]
    return _per_config(sel, lambda g: median(g["median_us"].astype(float).tolist()))


def _per_config(rows, latency) -> dict:
    """(backend, tp, bs, ctx, params JSON with sorted keys) -> (latency(its rows), role): role
    "baseline" when the config is the backend's default, else its first role by name."""
    out = {}
    config = rows["params"].map(lambda p: json.dumps(p, sort_keys=True))
    for key, g in rows.groupby(["backend", "tp", "bs", "ctx", config]):
        roles = set(g["role"].astype(str))
        out[tuple(key[:4]) + (key[4],)] = (latency(g), "baseline" if "baseline" in roles else sorted(roles)[0])
    return out


#: A bucket of the default's own compile-time config leaves the default's NSPLIT only for a pick
#: whose score (below) is better by more than this fraction. A single search measurement can beat
#: the default's interleaved re-measurement by run-to-run noise alone: the kimi-k2-h200 sweep of
#: 2026-12-01 picked NSPLIT 66 at tp 8, batch 1, 4k for 20.30 against 20.44 us (0.7%), and served
#: it at 21.2-21.6 us against the default's 19.9-20.4 (results/kimi-k2-h200/README.md).
NSPLIT_MARGIN = 0.03


#: A compile-time group may serve a (tp, batch) where it is slower than the default at some
#: context bucket by at most this fraction, and only when its total over the buckets is less than
#: the default's by more than it. One compile-time config serves every context under one graph:
#: the kimi-k2-h200 sweep of 2026-12-01 (source 68e1f8ea4f9897c9) measured eight copy lanes at
#: 1.44-1.55x the default at tp 2, batch 16, 64k-128k; without the allowance a loss within the
#: noise at 4k would have kept the default at every bucket.
BUCKET_LOSS_MARGIN = 0.03


def beside_default(fastest: dict, default: dict) -> bool:
    """Whether a group ({ctx: its fastest us}) may stand beside the backend's default ({ctx: us},
    where measured): nowhere slower by more than BUCKET_LOSS_MARGIN, and where slower at all,
    faster over the buckets by more than it."""
    shared = [c for c in fastest if c in default]
    if any(fastest[c] > default[c] * (1 + BUCKET_LOSS_MARGIN) for c in shared):
        return False
    if any(fastest[c] > default[c] for c in shared):
        return sum(fastest[c] for c in shared) * (1 + BUCKET_LOSS_MARGIN) < sum(default[c] for c in shared)
    return True


def pick_nsplit(equal: dict, ragged: dict, keep=None):
    """One compile-time config's NSPLIT at one bucket, from its latencies on equal requests and
    on the ragged batch ({NSPLIT: us}). Score of an NSPLIT: its worse ratio to the best over the
    two batches (equal requests: the best of every NSPLIT; ragged: of those timed), over the NSPLIT
    timed on both; without ragged timings, its ratio on equal requests over every NSPLIT. The least
    score wins, ties to the faster on equal requests; but `keep` (the default's NSPLIT, when this is
    the default's config) stays unless the winner's score is better by more than NSPLIT_MARGIN."""
    best = min(equal, key=lambda n: equal[n])
    both = [n for n in ragged if n in equal]
    if both:
        r0 = min(ragged[n] for n in both)
        score = {n: max(equal[n] / equal[best], ragged[n] / r0) for n in both}
    else:
        score = {n: equal[n] / equal[best] for n in equal}
    pick = min(score, key=lambda n: (score[n], equal[n]))
    if keep in score and score[keep] <= score[pick] * (1 + NSPLIT_MARGIN):
        return keep
    return pick


def choose(df, backends, tp, bs, contexts, exclude=frozenset(), rnd: str | None = None):
    """The winning (backend, compile params, buckets, is_default) or None, with notes. buckets:
    {ctx: Bucket}. `exclude` holds (backend, compile-key JSON) pairs that failed their serving
    check; `rnd` names the ragged rows that count (`tuner.ragged.ragged_round`)."""
    lat = latencies(df)
    rag = ragged_latencies(df, rnd)
    floors = {int(c): float(f) for c, f in df[(df["tp"] == tp) & (df["bs"] == bs) & (df["phase"] != RAGGED_PHASE)]
              [["ctx", "floor_us"]].dropna().drop_duplicates("ctx").itertuples(index=False)}
    best = None
    notes = []
    for be in backends:
        groups: dict[str, dict] = {}      # compile key -> ctx -> {NSPLIT: us}
        default_lat: dict[int, float] = {}
        default_key = None
        default_nsplit: dict[int, int] = {}
        for (b, t, s, ctx, pj), (v, role) in lat.items():
            if (b, t, s) != (be, tp, bs) or ctx not in contexts:
                continue
            p = json.loads(pj)
            ck = compile_key(p)
            groups.setdefault(ck, {}).setdefault(ctx, {})[p.get("NSPLIT")] = v
            if role == "baseline":
                default_lat[ctx] = v
                default_key = ck
                default_nsplit[ctx] = p.get("NSPLIT")
        for ck, g in groups.items():
            if any(c not in g for c in contexts) or (be, ck) in exclude:
                continue
            fastest = {c: min(g[c].values()) for c in contexts}
            if not beside_default(fastest, default_lat):
                continue
            if ck != default_key and _loses_ragged(g, {c: _bucket_ragged(rag, be, tp, bs, c, ck) for c in contexts}):
                continue
            total = sum(fastest.values())
            # a tie goes to the default's own group (then its NSPLIT margin applies too)
            if best is None or total < best[0] or (total == best[0] and ck == default_key):
                best = (total, be, ck, g, default_lat, ck == default_key, default_nsplit)
        if not groups:
            notes.append(f"{be}: no correct measurement at tp={tp} bs={bs}")
    if best is None:
        return None, notes
    total, be, ck, g, dl, is_default, dn = best
    buckets = {}
    for c in contexts:
        ragged, default_ragged = _bucket_ragged(rag, be, tp, bs, c, ck)
        n = pick_nsplit(g[c], ragged, dn.get(c) if is_default else None)
        buckets[c] = Bucket(n, g[c][n], dl.get(c), floors.get(c), ragged.get(n), default_ragged)
    return (be, json.loads(ck), buckets, is_default), notes


def _bucket_ragged(rag: dict, be, tp, bs, ctx, ck) -> tuple[dict, float | None]:
    """On bucket ctx's ragged batch: {NSPLIT: us} of compile-time group ck, and the backend
    default's us (None where not timed)."""
    ragged, default_ragged = {}, None
    for (b, t, s, c, pj), (v, role) in rag.items():
        if (b, t, s, c) != (be, tp, bs, ctx):
            continue
        p = json.loads(pj)
        if compile_key(p) == ck:
            ragged[p.get("NSPLIT")] = v
        if role == "baseline":
            default_ragged = v
    return ragged, default_ragged


def _loses_ragged(equal: dict, ragged: dict) -> bool:
    """Whether a group ({ctx: {NSPLIT: us}} on equal requests; {ctx: (its ragged {NSPLIT: us},
    the default's ragged us)}) would serve some bucket's ragged batch more than
    BUCKET_LOSS_MARGIN slower than the default. The kimi-k2-h200 sweep of 2026-12-01 exported
    ROWS 72 with eight lanes at tp 2, batch 64 (1.09-1.45x the default on equal requests) whose
    4k ragged batch took 565 us against the default's 504."""
    for c, (rg, default) in ragged.items():
        if not rg or default is None:
            continue
        n = pick_nsplit(equal[c], rg)
        if n in rg and rg[n] > default * (1 + BUCKET_LOSS_MARGIN):
            return True
    return False


def served(cparams: dict, buckets: dict, contexts: list[int], T: int, backend: str = "triton", batch: int = 1):
    """The exported params (NSPLIT = the largest bucket's, the grid size), and the split table
    serving uses: [key-count bound per bucket (`split_bounds`), NSPLIT per bucket]."""
    from kvtune.kernels.backends import split_bounds
    params = dict(cparams)
    ns = [buckets[c].nsplit for c in contexts]
    table = None
    if all(n is not None for n in ns):
        params["NSPLIT"] = max(ns)
        table = [split_bounds(backend, contexts, T, batch), [int(n) for n in ns]]
    return params, table


def serve_key(backend: str, params: dict, table, dispatch: list | None = None) -> str:
    """Names one serving check (the `round` of its rows in the trials table); `dispatch`: a
    per-context dispatch's other launches ([params, table] each)."""
    import hashlib
    what = [backend, params, table] + ([dispatch] if dispatch else [])
    return "serve-" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]


def beside_key(pick_key: str, dispatch_key: str = "") -> str:
    """Names the pick's serving check measured again in the call that measures a dispatch (the
    dispatch's serve_key); with no `dispatch_key`, the prefix every such round of the pick has."""
    return f"{pick_key} beside {dispatch_key}"


def _served_rows(df, tp, bs, contexts, key, measure=None) -> tuple[list[dict], bool]:
    """The serving-check rows of `key` at (tp, bs): those the trials table recorded, then, for the
    contexts none covers, `measure(contexts)`'s (`measure` None or False: not measured). Returns
    (rows, whether `measure` ran)."""
    sel = df[(df["phase"] == "serve") & (df["round"].astype(str) == key) & (df["tp"] == tp) & (df["bs"] == bs)]
    rows = sel[["ctx", "outcome", "reason", "median_us"]].to_dict("records")
    unchecked = [c for c in contexts if c not in {int(r["ctx"]) for r in rows}]
    if not unchecked or not measure:
        return rows, False
    return rows + (measure(unchecked) or []), True


def pick_served(df, backends, tp, bs, contexts, T, check=None, rnd: str | None = None, exclude=()):
    """`choose`, skipping configs whose serving check (one graph-capturable launch with the
    split table, at every bucket), or that check measured again beside a dispatch, was recorded
    wrong or failed, and the groups in `exclude` ((backend, compile-params JSON)). `check` (a
    `ServingCheck`) measures a pick no recorded check covers. Returns (pick, notes, {ctx:
    served latency} or None when not checked)."""
    exclude = set(exclude)
    notes = []
    measured = 0
    while True:
        pick, n = choose(df, backends, tp, bs, contexts, frozenset(exclude), rnd)
        notes += n
        if pick is None:
            return None, notes, None
        be, cparams, buckets, _ = pick
        params, table = served(cparams, buckets, contexts, T, be, bs)
        key = serve_key(be, params, table)
        # measured where no recorded check covers a context (one a kill cut short: the rest)
        rows, ran = _served_rows(df, tp, bs, contexts, key, check and measured < MAX_CHECKS and (
            lambda todo: check(be, params, table, tp, bs, todo, key)))
        measured += ran
        again = df[(df["phase"] == "serve") & df["round"].astype(str).str.startswith(beside_key(key)) &
                   (df["tp"] == tp) & (df["bs"] == bs)]
        bad = [r for r in rows + again[["ctx", "outcome", "reason", "median_us"]].to_dict("records")
               if r["outcome"] != "ok"]
        if bad:
            notes.append(f"tp={tp} bs={bs}: {be} {params} failed its serving check ({bad[0]['outcome']}: "
                         f"{bad[0]['reason']}); next best")
            exclude.add((be, json.dumps(cparams, sort_keys=True)))
            continue
        lat = {int(r["ctx"]): float(r["median_us"]) for r in rows} if rows else None
        return pick, notes, lat


def export_deployment(dep: Deployment | str, out: str = "runs", trials_csv: str | None = None,
                      path: str | None = None, quiet: bool = False, check: bool = False,
                      seed: int = 0) -> TunedDefaults:
    """Pick and write the tuned defaults of `dep` from its trials table. `check`: first run the
    serving check of each pick that the table holds no check of (on this machine, which must
    be the one the trials were measured on; `tuner/serve_check.py`). `quiet`: no report
    table on stdout (warnings and notes go to the `kvtune` logger)."""
    dep = dep if isinstance(dep, Deployment) else load_deployment(dep)
    out_dir = Path(out) / dep.name
    table_path = Path(trials_csv) if trials_csv else out_dir / "trials.csv"
    df = exportable(_deployment_trials(table_path, dep))
    backends = [b for b in dict.fromkeys(df["backend"]) if b in BACKEND_NAMES and b != "reference"]
    others = [b for b in dict.fromkeys(df["backend"]) if b not in BACKEND_NAMES]
    if others:
        log.info("note: not exporting backends outside the schema's %s: %s", list(BACKEND_NAMES), others)
    warn_incomplete(df, dep, out_dir)
    checker = None
    if check:
        from .serve_check import ServingCheck
        last = df.iloc[-1]
        search = df[df["phase"] == "search"]
        checker = ServingCheck(dep, table_path, str(last["device"]), str(last["arch"]),
                               _s(search["timing"].iloc[-1]) if len(search) else None, seed)
    try:
        entries, report = _entries(df, dep, backends, checker)
    finally:
        if checker is not None:
            checker.close()
    if not entries:
        raise ValueError(f"{table_path}: nothing to export for {dep.name} ({nothing_exported(df, backends)})")
    tuned = TunedDefaults(deployment=dep.name, model=_model(dep), provenance=_provenance(df, entries),
                          entries=tuple(entries))
    dest = Path(path) if path else out_dir / f"{dep.name}.yaml"
    if dest.is_dir():
        raise ValueError(f"--path {dest}: is a folder; name the YAML file to write")
    try:
        dump_tuned(tuned, dest)   # validates every picked config as the serving loader will
    except SchemaError as exc:
        raise ValueError(f"{table_path}: a picked config would not load at serving time, nothing written: "
                         f"{exc}") from None
    except OSError as exc:   # a parent that is a file, a read-only folder
        blocker = next((p for p in dest.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker else (exc.strerror or str(exc))
        raise ValueError(f"{'--path' if path else '--out'} {path or out}: cannot write {dest}: {why}") from None
    if not quiet:
        import pandas as pd
        table = pd.DataFrame(report)
        unscored = [c for c in ("served_us", "ragged_us", "default_ragged_us") if c in table and table[c].isna().all()]
        print(table.drop(columns=unscored).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
        print(f"exported {dest}")
    return tuned


def _deployment_trials(table_path: Path, dep: Deployment):
    from .forget import model_changes
    df = read_trials(table_path)
    df = df[df["deployment"] == dep.name]
    if df.empty:
        raise ValueError(f"{table_path}: no trials of deployment {dep.name!r}")
    cols = [c for c in ("deployment", "tp", "heads", "T", "tree") if c in df]
    changed = model_changes(df[cols].astype(str).replace("nan", "").to_dict("records"), dep)
    if changed:
        raise ValueError(f"{table_path}: trials of {dep.name} were measured for another model than {dep.source} "
                         f"says now ({'; '.join(changed)}); exporting them would ship the old shape's configs as "
                         f"this model's (sweep again into another --out, or `kvtune forget` the backends first)")
    return df


def exportable(df, warn: bool = True):
    """The rows of a deployment's trials the export judges: the latest device's, and per backend
    its latest kernel source's (`warn`: say what was set aside). The sweep's ragged phase judges
    its picks on the same rows."""
    return _latest_source(_latest_device(df, warn), warn)


def _swept(df):
    """The rows a sweep measured (not the export's serving checks, which run whatever source
    and machine export from), or all rows when there are none."""
    swept = df[df["phase"].astype(str) != "serve"] if "phase" in df else df
    return swept if len(swept) else df


def _latest_device(df, warn: bool = True):
    """Numbers from different machines are not comparable: the trials of the latest one's
    (the device of the last row a sweep measured)."""
    devices = list(dict.fromkeys(zip(df["device"].astype(str), df["arch"].astype(str))))
    if len(devices) <= 1:
        return df
    last = _swept(df).iloc[-1]
    dev, arch = str(last["device"]), str(last["arch"])
    if warn:
        log.warning("the table holds trials from %d devices %s; exporting those of the latest, %s (%s)",
                    len(devices), devices, dev, arch)
    return df[(df["device"].astype(str) == dev) & (df["arch"].astype(str) == arch)]


def _latest_source(df, warn: bool = True):
    """A backend's trials on an older kernel source measured code that no longer runs (and its
    entries would fail the runtime's provenance check): only its latest source's rows count.
    The latest is this checkout's source where the sweep measured rows on it, else the source of
    the last row the sweep measured: never one only the export's serving checks ran (exporting
    a table swept on an older source records its checks under this checkout's source, which
    would then have set every swept row aside)."""
    if "kernel_hash" not in df:
        return df
    keep = []
    for be in dict.fromkeys(df["backend"]):
        rows = df[df["backend"] == be]
        hashes = rows["kernel_hash"].fillna("").astype(str)
        swept = _swept(rows)["kernel_hash"].fillna("").astype(str)
        current = _current_source(be)   # the same rule for the export, the ragged phase and the review
        latest = current if current and (swept == current).any() else swept.iloc[-1]
        if latest and (hashes != latest).any():
            if warn:
                log.warning("%s: %d trial row(s) were measured on another kernel source (%s) than the one exported, "
                            "%s; exporting that one's only (`kvtune forget --backend %s` sets the old ones aside, "
                            "and a sweep then re-tunes it)", be, int((hashes != latest).sum()),
                            sorted(set(hashes[hashes != latest])), latest, be)
            rows = rows[hashes == latest]
        if warn and current and latest and latest != current:
            log.warning("%s: its trials were measured on kernel source %s, this checkout's %s source is %s: the "
                        "runtime refuses the exported entries of %s (provenance) until it is swept again "
                        "(`kvtune sweep ... --retune-stale`)", be, latest, be, current, be)
        keep.append(rows)
    import pandas as pd
    return pd.concat(keep).sort_index()


@functools.lru_cache(maxsize=None)   # the sweep's ragged phase asks per pick; a process runs one source
def _current_source(backend: str) -> str | None:
    """This checkout's kernel source hash of `backend` (None: unknown here, or no kernel)."""
    from kvtune.kernels.lookup import backend_kernel_hash
    try:
        return backend_kernel_hash(backend)
    except (ImportError, ValueError, OSError):
        return None


def _pick_with_dispatch(df, backends, tp, bs, contexts, T, checker, rnd):
    """`pick_served`, then `tuner.dispatch.with_dispatch` on it; a pick that fails when measured
    again beside its dispatch gives way to the next. Returns (pick, its served latency, moves,
    alt, alt_be, the dispatch's served latency), or None where no config can serve."""
    from .dispatch import PickFailedBeside, with_dispatch   # it imports this module
    exclude = set()
    while True:
        pick, notes, served_lat = pick_served(df, backends, tp, bs, contexts, T, checker, rnd, exclude)
        for n in notes:
            log.info("note: %s", n)
        if pick is None:
            return None
        try:
            moves, alt, alt_be, dispatch_lat, notes = with_dispatch(df, pick, tp, bs, contexts, T, served_lat,
                                                                    checker, rnd)
        except PickFailedBeside as e:
            log.info("note: %s", e)
            exclude.add((pick[0], json.dumps(pick[1], sort_keys=True)))
            continue
        for n in notes:
            log.info("note: %s", n)
        return pick, served_lat, moves, alt, alt_be, dispatch_lat


def _entries(df, dep: Deployment, backends, checker):
    """(entries, report rows): per (tp, batch bucket) the served pick."""
    entries, report = [], []
    lat = latencies(df)
    order = list(df.columns[df.columns.get_loc("role") + 1: df.columns.get_loc("params")])
    T = dep.model.draft_tokens
    rnd = ragged_round(dep.ragged_spread) if dep.ragged_spread > 1 else None
    for tp in dep.tp:
        for bs in dep.batches:
            contexts = swept_contexts(df, dep, backends, tp, bs)
            if not contexts:
                continue
            picked = _pick_with_dispatch(df, backends, tp, bs, contexts, T, checker, rnd)
            if picked is None:
                pruned = pruned_buckets(df, backends, tp, bs)
                log.warning("tp=%s bs=%s: no config measured correct at every context bucket %s%s; no entry exported",
                            tp, bs, contexts, f" ({pruned_explanation(pruned)})" if pruned else "")
                continue
            pick, served_lat, moves, alt, alt_be, dispatch_lat = picked
            be, cparams, buckets, is_default = pick
            served_lat = dispatch_lat or served_lat
            params, _ = served(cparams, {c: b for c, b in buckets.items() if c not in moves},
                               [c for c in contexts if c not in moves], T)
            params = {k: params[k] for k in sorted(params, key=lambda k: (order.index(k) if k in order else 99, k))}
            alt = {k: alt[k] for k in sorted(alt, key=lambda k: (order.index(k) if k in order else 99, k))}
            other_be = alt_be if alt_be not in (None, be) else None
            buckets = {**buckets, **moves}
            bl = tuple(ContextBucket(max_context=c, NSPLIT=int(buckets[c].nsplit or 1),
                                     latency_us=_r3(buckets[c].latency), default_latency_us=_r3(buckets[c].default),
                                     floor_us=_r3(buckets[c].floor), ragged_us=_r3(buckets[c].ragged),
                                     default_ragged_us=_r3(buckets[c].default_ragged),
                                     backend=other_be if c in moves else None,
                                     params=dict(alt) if c in moves else None)
                       for c in contexts)
            entries.append(TunedEntry(tp=tp, heads_per_rank=dep.heads(tp), max_batch=bs, backend=be, params=params,
                                      buckets=bl))
            report += [_report_row(b, lat, backends, b.backend or be, tp, bs, served_lat,
                                   is_default and b.params is None,
                                   dict(b.params, NSPLIT=b.NSPLIT) if b.backend else
                                   dict(params, **b.params, NSPLIT=b.NSPLIT) if b.params else params)
                       for b in bl]
    return entries, report


def _report_row(b: ContextBucket, lat, backends, be, tp, bs, served_lat, is_default, params) -> dict:
    others = {f"{ob}_default_us": v for ob in backends if ob != be
              for v in [_default_latency(lat, ob, tp, bs, b.max_context)] if v is not None}
    return {"tp": tp, "bs": bs, "ctx": b.max_context, "backend": be, "NSPLIT": b.NSPLIT, "tuned_us": b.latency_us,
            "served_us": served_lat.get(b.max_context) if served_lat else None,
            "default_us": b.default_latency_us, **others, "floor_us": b.floor_us,
            "pct_floor": 100 * b.floor_us / b.latency_us if b.floor_us else None,
            "speedup": b.default_latency_us / b.latency_us if b.default_latency_us else None,
            "ragged_us": b.ragged_us, "default_ragged_us": b.default_ragged_us,
            "params": "default" if is_default else json.dumps(params, sort_keys=True)}


def _model(dep: Deployment) -> dict:
    m = dep.model
    return {"name": dep.model_name, "num_heads": m.num_heads, "kv_lora_rank": m.kv_lora_rank,
            "qk_rope_head_dim": m.qk_rope_head_dim, "draft_tokens": m.draft_tokens, "sm_scale": float(m.scale)}


def _provenance(df, entries) -> dict:
    """Where the exported backends' trials were measured (the latest row of them)."""
    used = {be for e in entries for be in e.backends()}
    rows = df[df["backend"].isin(list(used))]
    first = rows.iloc[-1]
    khash = {}
    for be in sorted(used):
        h = rows[rows["backend"] == be]["kernel_hash"].dropna()
        khash[be] = str(h.iloc[-1]) if len(h) else ""
    timing = sorted(set(rows["timing"].dropna().astype(str)))
    return {"device_name": str(first["device"]), "arch": str(first["arch"]), "sm_count": int(first["sm_count"]),
            "driver": _s(first["driver"]), "cuda": _s(first["cuda"]), "nvrtc": _s(first["nvrtc"]),
            "torch": _s(first["torch"]), "triton": _s(first["triton"]), "kernel_hash": khash,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "timing": ",".join(timing),
            "kvtune": _s(first["kvtune"])}


def _default_latency(lat, backend, tp, bs, ctx):
    for (b, t, s, c, _), (v, role) in lat.items():
        if (b, t, s, c) == (backend, tp, bs, ctx) and role == "baseline":
            return v
    return None


def _r3(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _s(v) -> str:
    import pandas as pd
    return "" if v is None or pd.isna(v) else str(v)


def _cmd_export(args) -> int:
    export_deployment(args.deployment, out=args.out, trials_csv=args.trials_csv, path=args.path,
                      check=not args.no_check, seed=args.seed)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write the tuned-defaults YAML of a swept deployment",
                              description=__doc__)
    p.add_argument("deployment", help="deployment name or YAML path")
    p.add_argument("--out", default="runs", help="output root (default ./runs; results/ holds the committed "
                   "evidence and is written only when named)")
    p.add_argument("--trials-csv", help="trials table (default <out>/<deployment>/trials.csv)")
    p.add_argument("--path", help="output file (default <out>/<deployment>/<deployment>.yaml)")
    p.add_argument("--no-check", action="store_true",
                   help="do not measure serving checks; use those recorded in the trials table")
    p.add_argument("--seed", type=int, default=0, help="seed of the serving check's inputs")
    p.set_defaults(func=_cmd_export)
