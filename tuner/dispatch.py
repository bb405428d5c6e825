"""What one compile-time config per (tp, batch bucket) leaves on the table, and the per-context
dispatch that takes it back.

The runtime serves every context of a (tp, batch bucket) from one captured CUDA graph, so an
entry holds one compile-time config (NSPLIT alone varies per context bucket, on the device). A
per-context choice of compile-time config would launch every config of the entry on each call,
all but one exiting at once: `scripts/bench_dispatch.py` measured that early exit at 2.7-2.9 us
per call on the H200 (results/serving/dispatch/). Whether it pays is a question of the sweep's
own numbers: per context bucket, the served config's latency against the fastest other
compile-time group the sweep measured there, each judged as `kvtune export` judges it
(`tuner.export.latencies`: interleaved re-measurements where there are any).

The other group may be another backend's: every backend whose NSPLIT counts the batch's splits
(cuda, wgmma, wgmma_km) leaves a launch idle on the split table's 0, so a bucket of a wgmma entry
may be served by wgmma_km's kernel (results/kernel/wgmma-km/: faster at 64k-128k, slower at 4k).

`context_alternatives` lists, per exported bucket, that fastest other group and what a dispatch
to it would net. A bucket "pays" when the group is faster by more than the export's noise margin
(`tuner.export.NSPLIT_MARGIN`) and by more than the dispatch's launch cost. The ragged batch is
not weighed here: an alternative is timed on it only if it was the export's pick at some point.
"""
from __future__ import annotations

import json

from kvtune.kernels.tuned import BACKEND_NAMES

from .export import BUCKET_LOSS_MARGIN, NSPLIT_MARGIN, _served_rows, exportable, latencies, serve_key
from .study import compile_key

#: what a per-context dispatch adds to every call of an entry, per compile-time config beyond the
#: first: one early-exit split launch and one early-exit merge launch inside the graph. Measured
#: 2.71-2.93 us on the H200 at batch 1, H 8, 4k-128k (results/serving/dispatch/dispatch.csv).
#: A wgmma_km launch beside wgmma chains instead (one merge; results/serving/dispatch-chain/):
#: 0.7-4.2 us idle behind a serving wgmma, 2.7-10.6 us behind an idle one, so the same estimate
#: stands for the trials' first cut and the dispatch's own check measures what it really costs.
DISPATCH_COST_US = 2.9


def _dispatchable(backend: str) -> bool:
    """Whether `backend`'s launches can share an entry's buckets (its NSPLIT counts the batch's
    splits, so a split table's 0 leaves it idle)."""
    from kvtune.kernels.params import nsplit_per_batch
    return backend in BACKEND_NAMES and nsplit_per_batch(backend)


def context_alternatives(df, tuned) -> list[dict]:
    """One row per bucket of `tuned` (a `kernels.tuned.TunedDefaults`) from `df` (its trials
    table, `read_trials`; the rows the export judges: `tuner.export.exportable`): the served
    backend, compile-time config and latency, the fastest other compile-time group measured at
    that (tp, batch, context), of the served backend or, where it can share the entry
    (`_dispatchable`), of another (`alt_backend`), with its NSPLIT and latency, the win (us, %),
    the win net of DISPATCH_COST_US, and whether it pays. Buckets without another group
    measured there have None in the alternative's columns."""
    lat = latencies(exportable(df, warn=False))
    best: dict = {}   # (tp, bs, ctx) -> {(backend, compile key): (us, NSPLIT)}
    for (be, tp, bs, ctx, pj), (us, _) in lat.items():
        p = json.loads(pj)
        group = best.setdefault((int(tp), int(bs), int(ctx)), {})
        k = (be, compile_key(p))
        if k not in group or us < group[k][0]:
            group[k] = (us, p.get("NSPLIT"))
    rows = []
    for e in tuned.entries:
        for b in e.buckets:
            be, cp = e.served_by(b)
            served_key = compile_key(cp)
            others = {k: v for k, v in best.get((e.tp, e.max_batch, b.max_context), {}).items()
                      if k != (be, served_key) and (k[0] == be or (_dispatchable(k[0]) and _dispatchable(be)))}
            row = {"tp": e.tp, "batch": e.max_batch, "ctx": b.max_context, "backend": be,
                   "served": served_key, "served_NSPLIT": b.NSPLIT, "served_us": b.latency_us,
                   "alt_backend": None, "alternative": None, "alt_NSPLIT": None, "alt_us": None, "win_us": None,
                   "win_pct": None, "net_us": None, "pays": False}
            if others and b.latency_us:
                k = min(others, key=lambda k: others[k][0])
                us, nsplit = others[k]
                win = b.latency_us - us
                row.update(alt_backend=k[0], alternative=k[1], alt_NSPLIT=nsplit, alt_us=us, win_us=win,
                           win_pct=100 * win / b.latency_us, net_us=win - DISPATCH_COST_US,
                           pays=win > DISPATCH_COST_US and us * (1 + NSPLIT_MARGIN) < b.latency_us)
            rows.append(row)
    return rows


def dispatch_moves(df, backend: str, tp: int, bs: int, contexts: list[int], cparams: dict, buckets: dict,
                   rnd: str | None) -> tuple[dict, dict, str | None]:
    """The buckets a per-context dispatch would move off the export's pick (`backend`, compile
    params `cparams`, its `buckets` {ctx: `export.Bucket`}) on the trials alone: the one other
    compile-time group, of `backend` or of another backend that can share the entry
    (`_dispatchable`), with the largest total win, at the buckets where its NSPLIT
    (`export.pick_nsplit`, ragged batch counted) beats the pick's latency by more than
    NSPLIT_MARGIN and by more than DISPATCH_COST_US and does not serve the bucket's ragged batch
    more than BUCKET_LOSS_MARGIN slower than the pick's default (where timed); the group must win
    more over those buckets than the dispatch costs over all of them, and leave the pick one
    bucket at least. Returns ({ctx: Bucket} to move, the group's compile params, its backend), or
    ({}, {}, None)."""
    from .export import Bucket, _bucket_ragged, _loses_ragged, pick_nsplit, ragged_latencies
    if not _dispatchable(backend):   # a per-request NSPLIT cannot leave a launch idle
        return {}, {}, None
    lat = latencies(df)
    rag = ragged_latencies(df, rnd)
    mine = (backend, compile_key(cparams))
    groups: dict[tuple, dict] = {}
    for (be, t, s, ctx, pj), (us, _) in lat.items():
        p = json.loads(pj)
        k = (be, compile_key(p))
        if (t, s) == (tp, bs) and ctx in contexts and k != mine and (be == backend or _dispatchable(be)):
            groups.setdefault(k, {}).setdefault(ctx, {})[p.get("NSPLIT")] = us
    best: tuple = (0.0, {}, {}, None)
    for (be, ck), g in sorted(groups.items()):
        moves = {}
        for c, equal in g.items():
            ragged = _bucket_ragged(rag, be, tp, bs, c, ck)[0]
            default_ragged = _bucket_ragged(rag, backend, tp, bs, c, ck)[1]   # the pick's default's, as export judges
            n = pick_nsplit(equal, ragged)
            us, have = equal[n], buckets[c].latency
            slower_ragged = _loses_ragged({c: equal}, {c: (ragged, default_ragged)})   # the export's ragged rule
            if us * (1 + NSPLIT_MARGIN) < have and have - us > DISPATCH_COST_US and not slower_ragged:
                moves[c] = Bucket(n, us, buckets[c].default, buckets[c].floor, ragged.get(n), default_ragged)
        win = sum(buckets[c].latency - b.latency for c, b in moves.items()) - DISPATCH_COST_US * len(contexts)
        if moves and len(moves) < len(contexts) and win > best[0]:
            best = (win, moves, json.loads(ck), be)
    return best[1], best[2], best[3]


def dispatch_tables(backend: str, cparams: dict, buckets: dict, moves: dict, alt: dict, contexts: list[int], T: int,
                    batch: int, alt_backend: str | None = None):
    """The launches of a dispatch as the serving check measures them: (the pick's params, its
    split table [bounds, NSPLIT per bucket, 0 at the moved buckets], [[the moved group's params,
    its table] + [its backend, where not `backend`]]). NSPLIT of each params: the largest of its
    buckets' (its grid)."""
    from kvtune.kernels.backends import split_bounds
    bounds = split_bounds(backend, contexts, T, batch)
    own = [0 if c in moves else int(buckets[c].nsplit) for c in contexts]
    other = [int(moves[c].nsplit) if c in moves else 0 for c in contexts]
    launch = [dict(alt, NSPLIT=max(other)), [bounds, other]]
    if alt_backend is not None and alt_backend != backend:
        launch.append(alt_backend)
    return dict(cparams, NSPLIT=max(own)), [bounds, own], [launch]


def with_dispatch(df, pick, tp, bs, contexts, T, served_lat, check=None, rnd: str | None = None):
    """A per-context dispatch of a served pick, where it pays: the buckets `tuner.dispatch.
    dispatch_moves` finds on the trials, kept only when the dispatch, measured the way serving
    runs it (every config launched, `check` unless recorded), is faster than the pick's own
    serving check (`served_lat`) at every moved bucket by more than NSPLIT_MARGIN and by more
    than DISPATCH_COST_US, and faster over all buckets together (the other buckets pay its idle
    launches). Where the sweep timed the bucket's ragged batch (`rnd`), the dispatch is also
    measured on each moved bucket's ragged batch (`check.ragged`) and must not serve it more than
    BUCKET_LOSS_MARGIN slower than the default did: the sweep's ragged phase never timed the
    other group there. Where only some moved buckets pass, the dispatch of those alone is checked
    in turn: what ships is always what its own check measured. Returns ({ctx: Bucket} moved,
    their compile params, their backend, {ctx: served latency} of the dispatch, notes); nothing
    moved: ({}, {}, None, None, notes)."""
    be, cparams, buckets, _ = pick
    moves, alt, alt_be = dispatch_moves(df, be, tp, bs, contexts, cparams, buckets, rnd)
    if not moves or served_lat is None or set(contexts) - set(served_lat):
        return {}, {}, None, None, []   # no move, or the pick's own check is incomplete: nothing to compare with
    notes = []
    while True:
        launches = dispatch_tables(be, cparams, buckets, moves, alt, contexts, T, bs, alt_be)
        dkey = serve_key(be, *launches)
        own = _pick_beside(df, pick, tp, bs, contexts, T, dkey, check) or served_lat
        lat, ragged, what, failed = _dispatch_served(df, pick, tp, bs, contexts, moves, alt, alt_be, launches, dkey,
                                                     check, rnd)
        if lat is None:
            return {}, {}, None, None, notes + [f"{what}: no dispatch, its serving check {failed}"]
        passed = {c: b for c, b in moves.items()
                  if lat[c] * (1 + NSPLIT_MARGIN) < own[c] and own[c] - lat[c] > DISPATCH_COST_US
                  and (b.default_ragged is None or
                       ragged.get(c, float("inf")) <= b.default_ragged * (1 + BUCKET_LOSS_MARGIN))}
        kept = len(passed) == len(moves) and sum(own[c] - lat[c] for c in contexts) > 0
        notes.append(f"{what}: " + ("a per-context dispatch, served " if kept else "no dispatch, served it measured ") +
                     ", ".join(f"{c}: {lat[c]:.1f} vs {own[c]:.1f} us" for c in contexts) +
                     (" (the pick measured beside it)" if own is not served_lat else "") +
                     "".join(f"; ragged at {c}: " + (f"{ragged[c]:.1f}" if c in ragged else "not measured") +
                             f" vs the default's {b.default_ragged:.1f} us"
                             for c, b in moves.items() if b.default_ragged is not None))
        if kept:
            return moves, alt, alt_be, lat, notes
        if not passed or len(passed) == len(moves):   # a smaller dispatch gains less for the same idle launches
            return {}, {}, None, None, notes
        moves = passed


def _pick_beside(df, pick, tp, bs, contexts, T, dkey, check):
    """The pick's own serving check timed in the same call as the dispatch's ({ctx: us}), or None
    where the recorded checks suffice. A dispatch check measured now against a pick check that a
    table recorded a session earlier compares two machines (up to 11% apart at 64k-128k on the
    H200: results/kernel/wgmma-km/README.md), so where the dispatch still has to be measured the
    pick is measured again first, under a round of its own (`export.beside_key`; `dkey`: the
    dispatch's serve_key) that a later export reads back. Raises PickFailedBeside where that check came back wrong or
    failed at some bucket: the pick does not ship (`tuner.export.pick_served` then skips it,
    here and in any later export from the table)."""
    from .export import beside_key, served
    be, cparams, buckets, _ = pick
    params, table = served(cparams, buckets, contexts, T, be, bs)
    key = beside_key(serve_key(be, params, table), dkey)
    recorded = {int(r["ctx"]) for r in _served_rows(df, tp, bs, contexts, dkey)[0]}
    paired, _ = _served_rows(df, tp, bs, contexts, key, check and not set(contexts) <= recorded and (
        lambda todo: check(be, params, table, tp, bs, todo, key)))
    bad = [r for r in paired if r["outcome"] != "ok"]
    if bad:
        raise PickFailedBeside(f"tp={tp} bs={bs}: {be} {params} failed its serving check measured again beside "
                               f"the dispatch ({bad[0]['outcome']}: {bad[0]['reason']}); next best")
    lat = {int(r["ctx"]): float(r["median_us"]) for r in paired}
    return lat if not set(contexts) - set(lat) else None


class PickFailedBeside(Exception):
    """The served pick, measured again beside a dispatch, came back wrong or failed."""


def _dispatch_served(df, pick, tp, bs, contexts, moves, alt, alt_be, launches, key, check, rnd):
    """The dispatch of `moves` to the group `alt` (of backend `alt_be`) beside `pick` (its
    `dispatch_tables`, `launches`; their serve_key, `key`), recorded or measured by `check`:
    its served latency {ctx: us} on equal requests (None where some bucket has none); on the
    ragged batch of each moved bucket the sweep timed one at (round `rnd`; `check.ragged`), {ctx:
    us}; what it is, and why its check is missing."""
    be, cparams, _, _ = pick
    params, table, others = launches

    def served(ctxs, key, measure):
        rows, _ = _served_rows(df, tp, bs, ctxs, key, measure and (
            lambda todo: measure(be, params, table, tp, bs, todo, key, dispatch=others)))
        return rows, {int(r["ctx"]): float(r["median_us"]) for r in rows if r["outcome"] == "ok"}

    rows, lat = served(contexts, key, check)
    what = f"tp={tp} bs={bs}: {alt_be} {alt} at context(s) {sorted(moves)} beside {be} {cparams}"
    bad = [r for r in rows if r["outcome"] != "ok"]
    failed = f"failed ({bad[0]['outcome']}: {bad[0]['reason']})" if bad else "was not measured"
    if set(contexts) - set(lat):
        return None, {}, what, failed
    todo = [c for c, b in moves.items() if b.default_ragged is not None]
    ragged = served(todo, f"{key} ragged {rnd}", getattr(check, "ragged", None))[1] if todo and rnd else {}
    return lat, ragged, what, failed
