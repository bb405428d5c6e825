"""What `kvtune export` must choose, worked out by brute force from a trials table with plain
pandas, from the rule the README states: per tp and batch bucket, one backend and one set of
compile-time parameters (every parameter but NSPLIT) that has a correct measurement at every
context bucket and is slower than that backend's default at no bucket by more than 3%, and,
where slower at any, faster over all buckets together by more than 3%, and (unless it is the
default's own group) whose NSPLIT served on each bucket's ragged batch, where timed, is not more
than 3% slower there than the default; the least total latency over the buckets (fastest NSPLIT
per bucket) wins. Each bucket then serves the
fastest NSPLIT, unless the group's NSPLIT were also timed on the bucket's ragged batch (phase
`ragged`): then, of those timed on both batches, the one whose worse ratio to the best (equal
requests: the best of every NSPLIT; ragged: of those timed) is least, ties to the faster on
equal requests. In the default's own compile-time group a bucket serves the default's NSPLIT
unless that winner's score (worse ratio, or ratio on equal requests) is better by more than 3%.
A config's latency is the median of its interleaved re-measurements where the
sweep took them, else of its search measurements. A config whose serving check (phase
`serve`) was not ok is not served.

Nothing here imports kvtune: the tests compare the export against this, not against itself.
Tables from one device only (the tests' sweeps).
"""
from __future__ import annotations

import json

import pandas as pd

# the YAML rounds latencies to 3 decimals
TOL_US = 1e-3
# the README's margins: before a bucket of the default's config leaves the default's NSPLIT, and
# what a group may lose to the default at a bucket (and must win over all buckets) to serve
MARGIN = 0.03


def _key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


def _compile_part(params: dict) -> str:
    return _key({k: v for k, v in params.items() if k != "NSPLIT"})


def config_latencies(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per (backend, tp, bs, ctx, config) measured ok: its latency, whether it is the
    backend's default (role baseline) and its compile-time part. `trials` as pd.read_csv gives it."""
    ok = trials[(trials["outcome"] == "ok") & trials["phase"].isin(["search", "remeasure"])].copy()
    ok["params"] = [p if isinstance(p, dict) else json.loads(p) for p in ok["params"]]
    ok["config"] = ok["params"].map(_key)
    rows = []
    for (be, tp, bs, ctx, config), g in ok.groupby(["backend", "tp", "bs", "ctx", "config"]):
        again = g[g["phase"] == "remeasure"]["median_us"].astype(float)
        lat = float(again.median()) if len(again) else float(g["median_us"].astype(float).median())
        p = json.loads(config)
        rows.append({"backend": be, "tp": int(tp), "bs": int(bs), "ctx": int(ctx), "config": config,
                     "compile": _compile_part(p), "NSPLIT": p.get("NSPLIT"), "latency_us": lat,
                     "default": bool((g["role"] == "baseline").any())})
    return pd.DataFrame(rows, columns=["backend", "tp", "bs", "ctx", "config", "compile", "NSPLIT", "latency_us",
                                       "default"])


def eligible_groups(trials: pd.DataFrame, tp: int, bs: int, rnd: str | None = None) -> dict:
    """(backend, compile-time part) -> {ctx: (NSPLIT, latency)} with the fastest NSPLIT per
    context, for every group that may serve (tp, bs): correct at each context bucket swept there,
    within 3% of its backend's default everywhere (and 3% faster in total where slower at any
    bucket), within 3% of the default on each ragged batch timed (`rnd`: the ragged rows that
    count) at the NSPLIT it would serve there, serving check not failed."""
    search = trials[(trials["phase"] == "search") & (trials["tp"] == tp) & (trials["bs"] == bs)]
    contexts = sorted({int(c) for c in search["ctx"]})
    lat = config_latencies(trials)
    lat = lat[(lat["tp"] == tp) & (lat["bs"] == bs)]
    serve = trials[(trials["phase"] == "serve") & (trials["tp"] == tp) & (trials["bs"] == bs)]
    serve = serve[serve["role"].astype(str) != "dispatch"]   # a dispatch's check judges the dispatch only
    unserved = {(b, _compile_part(p if isinstance(p, dict) else json.loads(p)))
                for b, p, o in zip(serve["backend"], serve["params"], serve["outcome"]) if o != "ok"}
    out = {}
    for (be, comp), g in lat.groupby(["backend", "compile"]):
        if (be, comp) in unserved or set(contexts) - set(g["ctx"]):
            continue
        default = lat[(lat["backend"] == be) & lat["default"]].set_index("ctx")["latency_us"]
        best = {}
        for ctx in contexts:
            r = g[g["ctx"] == ctx].sort_values("latency_us").iloc[0]
            best[ctx] = (r["NSPLIT"], r["latency_us"])
        shared = [ctx for ctx in contexts if ctx in default.index]
        ratio = [best[ctx][1] / default[ctx] for ctx in shared]
        if not (all(r <= 1 for r in ratio) or (max(ratio) <= 1 + MARGIN and sum(
                best[ctx][1] for ctx in shared) * (1 + MARGIN) < sum(default[ctx] for ctx in shared))):
            continue
        if not g["default"].any() and _slower_ragged(trials, lat, be, comp, tp, bs, contexts, rnd):
            continue
        out[(be, comp)] = best
    return out


def _slower_ragged(trials, lat, be, comp, tp, bs, contexts, rnd) -> bool:
    """Whether group (be, comp) would serve some bucket's ragged batch more than 3% slower than
    the default's ragged time there (where both were timed)."""
    at = lat[(lat["backend"] == be) & (lat["tp"] == tp) & (lat["bs"] == bs)]
    for ctx in contexts:
        rows = ragged_rows(trials, be, tp, bs, ctx, rnd)
        base = rows[rows["role"] == "baseline"]["median_us"].astype(float)
        n, ragged = served_nsplit(trials, at, be, comp, tp, bs, ctx, rnd)
        if ragged is not None and not base.empty and ragged > float(base.median()) * (1 + MARGIN):
            return True
    return False


def ragged_rows(trials: pd.DataFrame, backend: str, tp: int, bs: int, ctx: int, rnd: str | None):
    """The ok ragged-batch rows of one bucket (of spread round `rnd`; None: any)."""
    rows = trials[(trials["phase"] == "ragged") & (trials["outcome"] == "ok") & (trials["backend"] == backend)
                  & (trials["tp"] == tp) & (trials["bs"] == bs) & (trials["ctx"] == ctx)]
    return rows if rnd is None else rows[rows["round"].astype(str) == rnd]


def served_nsplit(trials: pd.DataFrame, at: pd.DataFrame, backend: str, comp: str, tp: int, bs: int, ctx: int,
                  rnd: str | None = None):
    """(NSPLIT, ragged us or None) a bucket serves for group (backend, comp); `at`: that
    group's `config_latencies` rows at (tp, bs)."""
    mine = at[(at["compile"] == comp) & (at["ctx"] == ctx)]
    equal = dict(zip(mine["NSPLIT"], mine["latency_us"]))
    default = at[at["default"] & (at["compile"] == comp) & (at["ctx"] == ctx)]["NSPLIT"].tolist()
    rows = ragged_rows(trials, backend, tp, bs, ctx, rnd)
    ragged: dict = {}
    for p, us in zip(rows["params"], rows["median_us"].astype(float)):
        p = p if isinstance(p, dict) else json.loads(p)
        if _compile_part(p) == comp:
            ragged.setdefault(p.get("NSPLIT"), []).append(us)
    ragged = {n: float(pd.Series(v).median()) for n, v in ragged.items()}
    both = [n for n in ragged if n in equal]
    e0 = min(equal.values())
    if both:
        r0 = min(ragged[n] for n in both)
        score = {n: max(equal[n] / e0, ragged[n] / r0) for n in both}
    else:
        score = {n: equal[n] / e0 for n in equal}
    n = sorted(score, key=lambda n: (score[n], equal[n]))[0]
    if default and default[0] in score and score[default[0]] <= score[n] * (1 + MARGIN):
        n = default[0]
    return n, (ragged[n] if both else None)


def check_export(tuned: dict, trials: pd.DataFrame, rnd: str | None = None) -> None:
    """Asserts that the exported YAML (`tuned`, as yaml.safe_load reads it) is the brute-force
    choice of `trials` (pd.read_csv of trials.csv) at every (tp, batch) it covers, and covers every
    (tp, batch) that has a config to serve."""
    if rnd is None:   # the export counts its deployment's round only: a table of one round is that one
        rounds = set(trials[trials["phase"] == "ragged"]["round"].astype(str))
        assert len(rounds) <= 1, f"ragged rows of several rounds {sorted(rounds)}: pass the deployment's (ragged_round)"
        rnd = rounds.pop() if rounds else None
    entries = {(e["tp"], e["max_batch"]): e for e in tuned["entries"]}
    swept = trials[trials["phase"] == "search"][["tp", "bs"]].drop_duplicates()
    lat = config_latencies(trials)
    for tp, bs in zip(swept["tp"].astype(int), swept["bs"].astype(int)):
        groups = eligible_groups(trials, tp, bs, rnd)
        assert ((tp, bs) in entries) == bool(groups), f"tp={tp} bs={bs}: {len(groups)} groups could serve"
        if not groups:
            continue
        e = entries[(tp, bs)]
        buckets = {b["max_context"]: b for b in e["buckets"]}
        best_total = min(sum(lt for _, lt in g.values()) for g in groups.values())
        comp = _compile_part(e["params"])
        assert (e["backend"], comp) in groups, f"tp={tp} bs={bs}: {e['backend']} {comp} may not serve"
        mine = groups[(e["backend"], comp)]
        assert sorted(buckets) == sorted(mine)
        got_total = sum(lt for _, lt in mine.values())
        assert abs(got_total - best_total) <= TOL_US * len(buckets), (tp, bs, got_total, best_total)
        own = [b for b in buckets.values() if "params" not in b]
        assert own and e["params"]["NSPLIT"] == max(b["NSPLIT"] for b in own), "NSPLIT is the grid size"
        if len(own) < len(buckets):
            check_dispatch(e, trials)
        at = lat[(lat["backend"] == e["backend"]) & (lat["tp"] == tp) & (lat["bs"] == bs)]
        for ctx, b in buckets.items():
            n, ragged = served_nsplit(trials, at, e["backend"], comp, tp, bs, ctx, rnd)
            if "params" in b:
                _check_moved(trials, at, e, comp, tp, bs, ctx, b, n, rnd)
                continue
            assert b["NSPLIT"] == n, (tp, bs, ctx, b, n)
            assert (b.get("ragged_us") is None) == (ragged is None), (tp, bs, ctx, b)
            if ragged is not None:
                assert abs(b["ragged_us"] - ragged) <= TOL_US, (tp, bs, ctx, b, ragged)
            rows = ragged_rows(trials, e["backend"], tp, bs, ctx, rnd)
            base = rows[rows["role"] == "baseline"]["median_us"].astype(float)
            assert (b.get("default_ragged_us") is None) == base.empty, (tp, bs, ctx, b)
            if not base.empty:
                assert abs(b["default_ragged_us"] - float(base.median())) <= TOL_US, (tp, bs, ctx, b)
            config = _key({**json.loads(comp), "NSPLIT": b["NSPLIT"]})
            measured = at[(at["ctx"] == ctx) & (at["config"] == config)]["latency_us"]
            assert len(measured) and abs(measured.iloc[0] - b["latency_us"]) <= TOL_US, (tp, bs, ctx, config)
            default = at[(at["ctx"] == ctx) & at["default"]]["latency_us"]
            if len(default):
                assert abs(b["default_latency_us"] - default.iloc[0]) <= TOL_US, (tp, bs, ctx, b)


# the README's per-context dispatch: a bucket moves to another compile-time config only when that
# config beats the served one there by more than 3% and by more than the dispatch's launches
# cost per call (2.9 us), and the dispatch passed its own serving check
DISPATCH_COST_US = 2.9


# the backends whose NSPLIT counts the batch's splits: only they can leave a launch idle
DISPATCH_BACKENDS = ("cuda", "wgmma", "wgmma_km")


def _moved_group(e: dict, comp: str, b: dict) -> tuple[str, str]:
    """(backend, compile-time part) of a moved bucket: its own backend's params in full where it
    names one, else the entry's params with the bucket's over them."""
    if "backend" in b:
        return b["backend"], _compile_part(b["params"])
    return e["backend"], _compile_part({**json.loads(comp), **b["params"]})


def _check_moved(trials, at, e, comp, tp, bs, ctx, b, n, rnd) -> None:
    """A bucket a per-context dispatch serves with its own compile-time params (`b["params"]`,
    of its own `b["backend"]` where it names one): the alternative group's NSPLIT (chosen as for
    any group), its measured latency, faster than the entry's own config there by more than 3%
    and the dispatch's cost."""
    for be in (e["backend"], b.get("backend", e["backend"])):
        assert be in DISPATCH_BACKENDS, f"{be} cannot serve a per-context dispatch"
    alt_be, alt = _moved_group(e, comp, b)
    assert (alt_be, alt) != (e["backend"], comp), (tp, bs, ctx, b)
    mine_at = at
    if alt_be != e["backend"]:
        lat = config_latencies(trials)
        at = lat[(lat["backend"] == alt_be) & (lat["tp"] == tp) & (lat["bs"] == bs)]
    n_alt, ragged = served_nsplit(trials, at, alt_be, alt, tp, bs, ctx, rnd)
    assert b["NSPLIT"] == n_alt, (tp, bs, ctx, b, n_alt)
    assert (b.get("ragged_us") is None) == (ragged is None), (tp, bs, ctx, b)
    config = _key({**json.loads(alt), "NSPLIT": b["NSPLIT"]})
    measured = at[(at["ctx"] == ctx) & (at["config"] == config)]["latency_us"]
    assert len(measured) and abs(measured.iloc[0] - b["latency_us"]) <= TOL_US, (tp, bs, ctx, config)
    mine = mine_at[(mine_at["ctx"] == ctx) & (mine_at["config"] == _key({**json.loads(comp), "NSPLIT": n}))][
        "latency_us"]
    assert len(mine), (tp, bs, ctx, "the entry's own config at its NSPLIT was measured")
    have = float(mine.iloc[0])
    assert b["latency_us"] * (1 + MARGIN) < have + TOL_US and have - b["latency_us"] > DISPATCH_COST_US - TOL_US, \
        (tp, bs, ctx, b["latency_us"], have)


def _served_rounds(trials, tp, bs, role, backend, comp=None) -> list[dict]:
    """{ctx: median us} of each serving check of (tp, bs) with `role` that is ok at every context
    swept there (`comp`: only checks of that compile-time part)."""
    contexts = {int(c) for c in trials[(trials["phase"] == "search") & (trials["tp"] == tp)
                                       & (trials["bs"] == bs)]["ctx"]}
    rows = trials[(trials["phase"] == "serve") & (trials["role"].astype(str) == role) & (trials["tp"] == tp)
                  & (trials["bs"] == bs) & (trials["backend"] == backend)]
    out = []
    for _, g in rows.groupby(rows["round"].astype(str)):
        if comp is not None and any(_compile_part(p if isinstance(p, dict) else json.loads(p)) != comp
                                    for p in g["params"]):
            continue
        ok = g[g["outcome"] == "ok"]
        lat = {int(c): float(us) for c, us in zip(ok["ctx"], ok["median_us"])}
        if set(lat) >= contexts and (g["outcome"] == "ok").all():
            out.append(lat)
    return out


def check_dispatch(e: dict, trials: pd.DataFrame) -> None:
    """An entry with moved buckets: one alternative group; a dispatch check ok at every context
    that beats one of the entry's own serving checks at every moved bucket by more than 3% and the
    dispatch's cost, and over all contexts together; and where the sweep timed a moved bucket's
    ragged batch (the bucket names default_ragged_us), a dispatch check on that batch within 3%
    of the default's time there."""
    moved = {b["max_context"]: b for b in e["buckets"] if "params" in b}
    comp = _compile_part(e["params"])
    alts = {_moved_group(e, comp, b) for b in moved.values()}
    assert len(alts) == 1, (e["tp"], e["max_batch"], alts)
    tp, bs = e["tp"], e["max_batch"]
    dispatch = _served_rounds(trials, tp, bs, "dispatch", e["backend"])
    own = _served_rounds(trials, tp, bs, "export", e["backend"], comp)
    assert any(all(d[c] * (1 + MARGIN) < o[c] and o[c] - d[c] > DISPATCH_COST_US for c in moved)
               and sum(o[c] - d[c] for c in o) > 0 for d in dispatch for o in own), (tp, bs, "dispatch beat its pick")
    rag = trials[(trials["phase"] == "serve") & (trials["role"].astype(str) == "dispatch") & (trials["tp"] == tp)
                 & (trials["bs"] == bs) & trials["round"].astype(str).str.contains(" ragged x")
                 & (trials["outcome"] == "ok")]
    for c, b in moved.items():
        if b.get("default_ragged_us") is not None:
            got = rag[rag["ctx"] == c]["median_us"]
            assert len(got) and got.min() <= b["default_ragged_us"] * (1 + MARGIN) + TOL_US, (tp, bs, c, "ragged")
