"""The search strategy, replayed offline against the committed exhaustive grid of the H200
(tp 8, reduced spaces, every config measured): the real `Sweep` runs with each measurement
looked up in `results/tpe-vs-grid/before/grid/kimi-k2-h200/trials.csv`. No GPU, no timing."""
from __future__ import annotations

import contextlib
import json
import io
import math
import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
from kvtune.tuner.replay import replay
from kvtune.tuner.strategy import (
    DEFAULT,
    SearchStrategy,
    local_proposal,
    neighbours,
    params_key,
)
from kvtune.tuner.sweep import SweepOptions

pytest.importorskip("optuna")

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "results/tpe-vs-grid/before/grid/kimi-k2-h200/trials.csv"
SPACES = ROOT / "results/tpe-vs-grid/spaces"
DEPLOYMENT = ROOT / "configs/deployments/kimi-k2-h200.yaml"
# the sweep before the replay (issue 4): TPE alone, asked in two batches, pruned configs counted
BEFORE = SearchStrategy(local_every=0, count_pruned=True, rounds=2)


def _replay(strategy, seeds, trials, backends):
    # the grid was measured at batch 1 only; the deployment sweeps more batch buckets
    opts = SweepOptions(tps=[8], ctxs=[4096, 65536], bss=[1], backends=backends, strategy=strategy)
    with contextlib.redirect_stderr(io.StringIO()):
        return replay(DEPLOYMENT, GRID, SPACES, seeds, trials, opts)


def test_neighbours_step_one_choice_of_one_parameter():
    dists = {"NSPLIT": (16, 32, 64), "BLOCK_N": (32, 64), "STAGES": (2,)}
    got = {params_key(q) for q in neighbours({"NSPLIT": 32, "BLOCK_N": 32, "STAGES": 2}, dists)}
    assert got == {params_key(q) for q in ({"NSPLIT": 16, "BLOCK_N": 32, "STAGES": 2},
                                           {"NSPLIT": 64, "BLOCK_N": 32, "STAGES": 2},
                                           {"NSPLIT": 32, "BLOCK_N": 64, "STAGES": 2})}
    best, second = {"NSPLIT": 16, "BLOCK_N": 32, "STAGES": 2}, {"NSPLIT": 64, "BLOCK_N": 64, "STAGES": 2}
    taken = {params_key(q) for q in [best, second, *neighbours(best, dists)]}
    # the best's neighbours all tried: a neighbour of the runner-up, feasible only
    q = local_proposal([best, second], dists, taken, lambda q: q["NSPLIT"] != 32, random.Random(0))
    assert q == {"NSPLIT": 64, "BLOCK_N": 32, "STAGES": 2}
    assert local_proposal([best], dists, taken, lambda q: True, random.Random(0)) is None


def test_budget_counts_measured_configs_only():
    s = DEFAULT
    assert s.counts({"role": "search", "outcome": "ok"}) and s.counts({"role": "warm", "outcome": "wrong"})
    assert not s.counts({"role": "search", "outcome": "pruned"})          # pruned before the GPU ran it
    assert not s.counts({"role": "cross", "outcome": "ok"})
    assert not s.counts({"role": "search", "outcome": "pruned", "constraint": True})
    assert replace(s, count_pruned=True).counts({"role": "search", "outcome": "pruned"})
    assert s.width(6, 12) == 2 and s.width(6, 24) == 4 and s.width(1, 24) == 1 and BEFORE.width(6, 12) == 6


def test_replay_measures_the_budget_on_the_gpu_and_no_more():
    """CUDA at 4k/64k: 12 of the 32 grid configs are pruned before running (spills, shared
    memory); each study measures exactly its budget, the pruned ones on top."""
    df = _replay(DEFAULT, [0, 1], 12, ["cuda"])
    assert len(df) == 4
    assert (df["configs"] > df["measured"]).all()                         # some proposals were pruned
    assert (df["measured"] <= 12 + 1).all() and (df["measured"] >= 12).all()   # + at most one cross-bucket trial


def _random_sampling(latencies, k: int, tol_pct: float = 3.0) -> tuple[float, float]:
    """k configs drawn at random (uniformly, without repeats) from a grid of measured latencies:
    the expected gap (%) of their best to the grid's best, and the chance one is within tol_pct.
    Exact: the i-th fastest config is the best drawn with probability C(N-1-i, k-1) / C(N, k)."""
    lat = sorted(latencies)
    n = len(lat)
    gaps = [100.0 * (x / lat[0] - 1) for x in lat]
    mean_gap = sum(g * math.comb(n - 1 - i, k - 1) for i, g in enumerate(gaps)) / math.comb(n, k)
    near = sum(g <= tol_pct for g in gaps)
    return mean_gap, 1 - math.comb(n - near, k) / math.comb(n, k)


def test_replay_triton_beats_random_sampling():
    """Triton at 4k (one config of the 48 within 3% of the best) and 64k, at the deployment's
    budget (24) and the GPU comparison's (12), over 20 seeds: the search's mean gap to the grid's
    best is at most half of what as many configs drawn at random give, and it lands within 3% at
    least as often; random sampling worked out exactly from the grid here. The search before the
    replay (TPE alone) does no better than random at 4k with 12 trials, so the check can fail."""
    import pandas as pd
    grid = pd.read_csv(GRID)
    grid = grid[(grid["phase"] == "search") & (grid["outcome"] == "ok") & (grid["backend"] == "triton")
                & (grid["tp"] == 8) & (grid["bs"] == 1)]
    seeds = list(range(20))

    def beats_random(df, budget):
        for ctx, g in df.groupby("ctx"):
            mean_gap, p_near = _random_sampling(grid[grid["ctx"] == ctx]["median_us"], budget)
            assert len(g) == len(seeds)
            if not (g["gap_pct"].mean() <= mean_gap / 2 and (g["gap_pct"] <= 3).mean() >= p_near):
                return False
        return True

    for budget in (24, 12):
        df = _replay(DEFAULT, seeds, budget, ["triton"])
        assert sorted(df["ctx"].unique()) == [4096, 65536]
        assert beats_random(df, budget), df.groupby("ctx")["gap_pct"].describe()
    assert not beats_random(_replay(BEFORE, seeds, 12, ["triton"]), 12)


def test_a_study_whose_search_found_nothing_is_a_miss(monkeypatch):
    """A seed whose search measured no correct config in a study is a row (gap None) that
    counts against the within-tolerance fraction; it used to be dropped, which overstated it."""
    from kvtune.tuner import replay as rp
    real = rp.GridTable.measure

    def measure(self, backend, params, spec):
        if spec["context"] == 4096:
            return {"outcome": "failed", "reason": "test: every config fails at 4k", "timing": "replay"}
        return real(self, backend, params, spec)

    monkeypatch.setattr(rp.GridTable, "measure", measure)
    df = _replay(DEFAULT, [0], 6, ["triton"])
    assert sorted(df["ctx"]) == [4096, 65536], df
    s = rp.summarize(df).set_index("ctx")
    assert s.loc[4096, "seeds"] == 1 and s.loc[4096, "within_3pct"] == 0
    assert s.loc[65536, "within_3pct"] == 1


def test_cross_phase_times_each_winning_group_at_every_buckets_best_nsplit(tmp_path):
    """After the search, each compile-time group that placed in some bucket's top two (or is
    the default) is measured at every other bucket with that bucket's best NSPLIT, even where
    the search had met the group there at another NSPLIT only (then the export could not
    compare it with the default on equal terms). The expectation is read off the trials table
    the sweep wrote and the grid; CUDA at tp 8, 4k and 64k, a budget of 5, eight seeds (the case
    arises at four of them)."""
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.replay import GridTable, ReplaySweep, space_fields
    from kvtune.tuner.table import read_trials

    grid = read_trials(GRID)
    grid = grid[(grid["phase"] == "search") & (grid["outcome"] == "ok") & (grid["backend"] == "cuda")
                & (grid["tp"] == 8) & (grid["bs"] == 1)]

    def compile_part(p):
        return json.dumps({k: v for k, v in p.items() if k != "NSPLIT"}, sort_keys=True)

    in_grid = {(int(c), json.dumps(p, sort_keys=True)) for c, p in zip(grid["ctx"], grid["params"])}
    met_elsewhere = 0
    for seed in range(8):
        o = SweepOptions(tps=[8], ctxs=[4096, 65536], bss=[1], backends=["cuda"], strategy=DEFAULT, seed=seed,
                         trials=5, space_dir=str(SPACES), out=str(tmp_path / f"s{seed}"))
        sw = ReplaySweep(load_deployment(DEPLOYMENT), o, GridTable(GRID), space_fields(SPACES, ["cuda"]))
        with contextlib.redirect_stderr(io.StringIO()):
            sw.run()
        df = read_trials(sw.out_dir / "trials.csv")
        df = df[df["phase"] == "search"]
        searched = df[(df["role"] != "cross") & (df["outcome"] == "ok")].sort_values("median_us", kind="stable")
        best, groups = {}, set()
        for ctx, g in searched.groupby("ctx"):
            best[int(ctx)] = g.iloc[0]["params"]["NSPLIT"]
            groups |= {compile_part(p) for p in list(g["params"][:2]) + list(g[g["role"] == "baseline"]["params"])}
        timed = {(int(c), json.dumps(p, sort_keys=True)) for c, p in zip(df["ctx"], df["params"])}
        for ctx, n in best.items():
            for ck in groups:
                want = json.dumps({**json.loads(ck), "NSPLIT": n}, sort_keys=True)
                if (ctx, want) in in_grid:
                    assert (ctx, want) in timed, (seed, ctx, want)
                    mine = searched[(searched["ctx"] == ctx) & (searched["params"].map(compile_part) == ck)]
                    met_elsewhere += len(mine) > 0 and all(p["NSPLIT"] != n for p in mine["params"])
    assert met_elsewhere, "no seed met a group at another NSPLIT only: the case the check is for never arose"


def test_grid_sweep_progress_counts_the_grid(tmp_path):
    """`--grid` sweeps every feasible config, more than `--trials`: the progress total grows with
    each study's grid, so a line never reads more trials done than planned."""
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.replay import GridTable, ReplaySweep, space_fields
    opts = SweepOptions(tps=[8], ctxs=[4096, 65536], bss=[1], backends=["cuda"], trials=2, grid=True,
                        space_dir=str(SPACES), out=str(tmp_path))
    sw = ReplaySweep(load_deployment(DEPLOYMENT), opts, GridTable(GRID), space_fields(SPACES, ["cuda"]))
    sw.o = replace(sw.o, progress=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        sw.run()
    lines = [tuple(map(int, m)) for m in re.findall(r"^\[(\d+)/(\d+) trials\]", err.getvalue(), re.M)]
    assert len(lines) == 2, err.getvalue()                # one per study (two context buckets)
    assert all(n <= total for n, total in lines) and lines[-1][1] > 2 * 2, lines


def test_a_baseline_given_up_is_queued_again(tmp_path):
    """The baseline's queued trial failed for good (a retry given up after its workers died): the
    study queues it again and measures it, rather than owing it forever and asking past its budget."""
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.replay import GridTable, ReplaySweep, space_fields
    from kvtune.tuner.table import read_trials

    class BaselineGivenUp(ReplaySweep):
        def _enqueue_start(self, study, plan, key):
            super()._enqueue_start(study, plan, key)
            TS = self.optuna.trial.TrialState
            for t in study.get_trials(deepcopy=False, states=(TS.WAITING,)):
                if t.user_attrs.get("role") == "baseline":
                    study._storage.set_trial_state_values(t._trial_id, TS.FAIL)

    opts = SweepOptions(tps=[8], ctxs=[4096], bss=[1], backends=["cuda"], trials=3, space_dir=str(SPACES),
                        out=str(tmp_path))
    sw = BaselineGivenUp(load_deployment(DEPLOYMENT), opts, GridTable(GRID), space_fields(SPACES, ["cuda"]))
    with contextlib.redirect_stderr(io.StringIO()):
        sw.run()
    assert sw.status == "complete", sw.status
    df = read_trials(sw.out_dir / "trials.csv")
    search = df[df["phase"] == "search"]
    assert (search["role"] == "baseline").sum() == 1, search[["role", "outcome"]]
    measured = search[search["outcome"] != "pruned"]
    assert len(measured) <= 3 + 1, measured[["role", "outcome"]]          # the budget, + a cross-bucket trial
