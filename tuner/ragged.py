"""The ragged phase of a sweep: each batch bucket's NSPLIT also scored on a ragged batch.

A serving batch mixes short and long requests. On equal requests, NSPLIT trades the split
launch's fixed cost against parallelism, and several values land within a few percent of
each other; on a ragged batch the same values differ by up to 1.5x (measured: tp 4, 64
requests of 1k-8k keys, NSPLIT 66 -> 132: 793 -> 511 us, for 2% on 64 x 4k), because with
about one split per request the longest request's split sets the time while the other SMs
idle. So after the search of a (backend, tp, batch bucket > 1), each context bucket's
NSPLIT candidates are timed on the bucket's ragged batch (`tuner.measure.ragged_prefixes`:
`batch` prefixes spread geometrically over the deployment's `ragged_spread`, mean 3/4 of
the bucket, so that its total keys select this bucket's NSPLIT on the device), timed as
serving runs it (the split table of the config's best NSPLIT per bucket, the candidate at
this one: CUDA picks the bucket by the batch's keys, Triton by each request's), and the
export picks per bucket the NSPLIT whose worse ratio to the best, over the two batches, is
least (`tuner.export.pick_nsplit`).

Candidates, per compile-time config the export may serve (its pick on the table so far, and
the backend's default): its best NSPLIT on equal requests, the runner-up, twice the best
(more, shorter splits: what evens out a ragged batch) and the legal values next to the best
(the search samples NSPLIT sparsely per config), those not yet measured timed on equal requests
first as a trial of the bucket's study (role `ragged`, not counted against its budget); and
the default itself, which the export reports beside the pick. "Twice" is the least legal
value of at least twice the best (`nsplit_candidates`). Ragged rows go to the trials
table as phase `ragged`, trial = the trial of the same config on equal requests, round
`x<spread>`; a resumed sweep measures only the rows missing.
"""
from __future__ import annotations

import json

from .log import get_logger
from .space import problem_env
from .strategy import params_key
from .study import compile_key

log = get_logger(__name__)

PHASE = "ragged"
ROLE = "ragged"
MAX_CANDIDATES = 5


def ragged_round(spread: float) -> str:
    """The `round` of a ragged row: the spread it was measured at (rows of another spread never count)."""
    return f"x{spread:g}"


def nsplit_candidates(measured: dict[int, float], legal, choices=()) -> list[int]:
    """NSPLIT values to time on the ragged batch, from one compile-time config's latencies on
    equal requests ({NSPLIT: us}): the best, the runner-up, and the least legal value of at
    least twice the best among `choices` (the space's NSPLIT values) and 2 x best itself. Not
    2 x best alone: a space of [.., 26, 33, 44, 66, ..] has no 52. Measured on the H100
    (kimi-k2-h100, tp 4, batch 64 x 16k): eight lanes won on equal requests at NSPLIT 26 (771 us)
    and lost the ragged batch there (1308 against the default's 670), and its NSPLIT 66, which
    serves 1.13x faster than the export's pick, was never timed on it.

    Then the legal values next to the best, below and above it (among `choices` and the values
    measured): a search of a few trials samples NSPLIT sparsely per compile-time config. Measured
    on the H100 (tp 4, batch 64 x 4k, eight lanes, ROWS 72): the search timed NSPLIT 44, 88 (2 x
    44) and 132, the export served 132 (235.3 us), and 66, never timed there, served 220.4 us, and
    ragged64 212.1 against 227.7 (results/serving/h100/tp4-h100-yaml/ at commit e503b53)."""
    ranked = sorted(measured, key=lambda n: measured[n])
    out = ranked[:2]
    if ranked:
        best = ranked[0]
        up = sorted({n for n in (*choices, 2 * best) if n >= 2 * best})
        out += [n for n in up if legal(n)][:1]
        grid = sorted({*choices, *measured})
        i = grid.index(best)
        below = [n for n in reversed(grid[:i]) if legal(n)][:1]
        above = [n for n in grid[i + 1:] if legal(n)][:1]
        out += below + above
    return list(dict.fromkeys(out))[:MAX_CANDIDATES]


def served_groups(df, backend, tp, bs, ctxs, pick: str | None, rnd: str | None = None) -> dict:
    """{compile key: {ctx: {NSPLIT: us}}} of the configs the export may serve at (backend, tp,
    bs): `pick` (the export's choice on the table so far, `ragged_pick`), the groups an earlier
    pick timed on the ragged batches of round `rnd` (so that a sweep resumed under a changed
    candidate rule times their new candidates too: the kimi-k2-h100 sweep passed over eight lanes
    at tp 4 batch 64 after timing NSPLIT 26 and 16 on the ragged batch, and a resume that timed
    only the pick left their NSPLIT 66 untimed), and the backend's default."""
    from .export import latencies, ragged_latencies   # the export imports this module
    keys = [pick] if pick else []
    for (b, t, s, ctx, pj) in ragged_latencies(df, rnd) if rnd else ():
        ck = compile_key(json.loads(pj))
        if (b, t, s) == (backend, tp, bs) and ctx in ctxs and ck not in keys:
            keys.append(ck)
    out: dict = {}
    for (b, t, s, ctx, pj), (v, role) in latencies(df).items():
        if (b, t, s) != (backend, tp, bs) or ctx not in ctxs:
            continue
        p = json.loads(pj)
        ck = compile_key(p)
        if role == "baseline" and ck not in keys:
            keys.append(ck)
        out.setdefault(ck, {}).setdefault(ctx, {})[p.get("NSPLIT")] = v
    return {ck: out[ck] for ck in keys if ck in out}


#: Picks of one (backend, tp, bs) timed on the ragged batches at most: the export passes over a
#: group that serves a ragged batch more than 3% slower than the default (`tuner.export`), so the
#: group that takes its place is timed there too, and so on.
RAGGED_PICKS = 3


def ragged_applies(sweep, backend, bs) -> bool:
    """Whether the ragged phase times anything at (backend, bs): a batch bucket above 1, a
    spread above 1, NSPLIT in the space, and a trials table."""
    return bool(sweep.ragged) and bs >= 2 and sweep.dep.ragged_spread > 1 and \
        "NSPLIT" in sweep.spaces[backend].names and sweep.table.path.is_file()


def deployment_trials(sweep):
    """The trials table so far as the export judges it (`ragged_applies` says the file exists):
    this deployment's rows of the latest device and of each backend's latest kernel source
    (`tuner.export.exportable`), so the sweep never times a pick the export could not serve."""
    from .export import exportable   # the export imports this module
    from .table import read_trials
    df = read_trials(sweep.table.path)
    return exportable(df[df["deployment"] == sweep.dep.name], warn=False)


def ragged_pick(sweep, backend, tp, bs, df) -> str | None:
    """The compile key the export would serve at (backend, tp, bs) from `df` (`deployment_trials`),
    judged as the export judges it (`tuner.export.pick_served`: this deployment's ragged rows
    counted, a group whose recorded serving check failed passed over; no check measured here),
    or None."""
    from .export import pick_served   # the export imports this module
    pick, _, _ = pick_served(df, [backend], tp, bs, list(sweep.ctxs), sweep.dep.model.draft_tokens,
                             rnd=ragged_round(sweep.dep.ragged_spread))
    return compile_key(pick[1]) if pick else None


def measure_ragged(sweep, backend, tp, bs, df, pick: str | None) -> bool:
    """The ragged phase of one (backend, tp, bs) of `sweep` (a `tuner.sweep.Sweep`, where
    `ragged_applies`) for `pick` and the default, from `df` (`deployment_trials`); True when it
    measured a new config on equal requests (to be re-measured against the default)."""
    spread = sweep.dep.ragged_spread
    space = sweep.spaces[backend]
    from kvtune.kernels.backends import split_bounds

    rnd = ragged_round(spread)
    groups = served_groups(df, backend, tp, bs, sweep.ctxs, pick, rnd)
    bounds = split_bounds(backend, list(sweep.ctxs), sweep.dep.model.draft_tokens, bs)
    new = False
    for ctx in sweep.ctxs:
        name, study, seed = sweep._open_study(backend, tp, bs, ctx)
        spec = sweep.runner.spec(tp, bs, ctx)
        ragged = spec.ragged(spread)
        env = problem_env(spec.draft_tokens, spec.heads, bs, ctx, spec.Dk, spec.kv_lora_rank, sweep.dep.device)
        dists = {n: tuple(v) for n, v in study.user_attrs["dists"].items()}
        trials = {params_key(t.params): t for t in sweep._finished(study)}
        todo = []   # (params, trial or None: measure it on equal requests first, split table)
        for ck, by_ctx in groups.items():
            equal = by_ctx.get(ctx)
            if not equal:
                continue
            base = json.loads(ck)

            def trial_of(n, base=base):   # this config's finished trial at this bucket, or None
                return trials.get(params_key(dict(base, NSPLIT=n)))

            def legal(n, base=base, equal=equal):
                q = dict(base, NSPLIT=n)
                earlier = trial_of(n)
                # untried, or pruned by a constraint the search space no longer has
                fresh = earlier is None or bool(earlier.user_attrs.get("constraint"))
                return n in equal or (n in dists["NSPLIT"] and not space.violation(q, env) and fresh)

            cands = nsplit_candidates(equal, legal, dists["NSPLIT"])
            cands += [n for n in equal if n not in cands and trial_of(n) is not None
                      and trial_of(n).user_attrs.get("role") == "baseline"]
            for n in cands:
                # as serving runs it: the split table of the group's best NSPLIT per bucket, n at
                # this one (CUDA picks a bucket by the batch's keys, Triton by each request's)
                values = [n if c == ctx or not by_ctx.get(c) else min(by_ctx[c], key=by_ctx[c].get)
                          for c in sweep.ctxs]
                todo.append((dict(base, NSPLIT=n), trial_of(n) if n in equal else None, [bounds, values]))
        # equal requests first, then the ragged batch: the measurer builds each shape's inputs once
        measured = []
        for p, t, table in todo:
            if t is None:
                t, new = _measure_equal(sweep, backend, tp, bs, ctx, (name, study, seed), p), True
            measured.append((p, t, table))
        for params, trial, table in measured:
            if trial is None:
                continue
            probe = {"study": name, "phase": PHASE, "trial": trial.number, "round": rnd}
            if sweep.table.has(probe):
                continue
            launch = dict(params, NSPLIT=max(table[1]))   # the grid: the table's largest NSPLIT
            m = sweep._measure(backend, launch, ragged, seed + 7919 + trial.number, extra={"split_table": table})
            sweep.table.append(sweep.runner.row(backend, tp, bs, ctx, ragged, name, trial.number,
                                                trial.user_attrs.get("role", "search"), params, m,
                                                phase=PHASE, rnd=rnd))
            sweep._progress(m, count=False, best=False)
    return new


def _measure_equal(sweep, backend, tp, bs, ctx, opened, params):
    """A trial of `params` on the bucket's equal requests (role `ragged`): the finished trial, or
    None when it did not measure correct."""
    trial, m = sweep.measure_trial(backend, tp, bs, ctx, opened, params, ROLE)
    if m["outcome"] != "ok":
        log.info("note: %s: %s measured %s on equal requests (%s); not scored on the ragged batch", opened[0],
                 params, m["outcome"], m.get("reason"))
        return None
    return next(t for t in opened[1].get_trials(deepcopy=False) if t.number == trial.number)
