"""Two workers that read one snapshot of a study: the higher-numbered trial yields. A real
Optuna study (in memory) holds the other worker's running trials; the rule under test is
`SharedSweep._ask_batch`'s check after the ask (the batch itself is stood in for: asking is
the sampler's business, tested by the sweep tests)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtune.tuner import study as study_mod
from kvtune.tuner.options import SweepOptions
from kvtune.tuner.workers import SharedSweep

optuna = pytest.importorskip("optuna")
TS = optuna.trial.TrialState
DISTS = {"NSPLIT": [1, 2, 4, 8]}


def _worker(budget):
    sw = object.__new__(SharedSweep)
    sw.optuna, sw.o, sw.trials = optuna, SweepOptions(), budget
    sw.beats = SimpleNamespace(release=lambda _id: None, hold=lambda _id: None)
    return sw


def _finished(study, nsplit, role="search"):
    t = study.ask()
    t.suggest_categorical("NSPLIT", DISTS["NSPLIT"])   # enqueued below: its value is nsplit
    t.set_user_attr("role", role)
    t.set_user_attr("outcome", "ok")
    study.tell(t, float(nsplit))


def _running(study, nsplit, role="search"):
    study.enqueue_trial({"NSPLIT": nsplit})
    t = study.ask()
    t.suggest_categorical("NSPLIT", DISTS["NSPLIT"])
    t.set_user_attr("role", role)
    return t


@pytest.fixture
def study():
    s = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    for n, role in ((1, "baseline"), (2, "search")):
        s.enqueue_trial({"NSPLIT": n})
        _finished(s, n, role)
    return s


def _ask_after(monkeypatch, study, mine_nsplit, budget, role="search"):
    """This worker's batch of one, asked after the other worker's running trials, through the
    check; returns (kept, its trial as stored)."""
    mine = _running(study, mine_nsplit, role)
    monkeypatch.setattr(study_mod.StudyLoop, "_ask_batch",
                        lambda self, *a: [(mine, {"NSPLIT": mine_nsplit}, role)])
    plan = SimpleNamespace(grid=None)
    kept = _worker(budget)._ask_batch(("triton", 1, 1, 64), plan, study, None, 1, None)
    return kept, study._storage.get_trial(mine._trial_id)


def test_the_later_trial_yields_the_last_slot(monkeypatch, study):
    _running(study, 4)                                       # the other worker took the last slot first
    kept, t = _ask_after(monkeypatch, study, 8, budget=3)
    assert kept == [] and t.state == TS.FAIL and t.user_attrs.get("released") and "outcome" not in t.user_attrs


def test_with_room_for_both_both_measure(monkeypatch, study):
    _running(study, 4)
    kept, t = _ask_after(monkeypatch, study, 8, budget=4)
    assert [p for _, p, _ in kept] == [{"NSPLIT": 8}] and t.state == TS.RUNNING


def test_the_same_config_is_measured_once(monkeypatch, study):
    other = _running(study, 4)
    kept, t = _ask_after(monkeypatch, study, 4, budget=8)
    assert kept == [] and t.state == TS.FAIL and t.user_attrs["duplicate_of"] == other.number


def test_the_baseline_is_kept_whatever_the_budget(monkeypatch, study):
    _running(study, 4)
    kept, t = _ask_after(monkeypatch, study, 8, budget=3, role="baseline")
    assert len(kept) == 1 and t.state == TS.RUNNING


def test_the_earlier_trial_does_not_yield(monkeypatch, study):
    """Both trials from one snapshot: the one numbered first keeps its slot (the other
    worker's, numbered after it, is the one that yields)."""
    mine = _running(study, 8)
    _running(study, 4)                                       # the other worker's, asked after mine
    monkeypatch.setattr(study_mod.StudyLoop, "_ask_batch", lambda self, *a: [(mine, {"NSPLIT": 8}, "search")])
    kept = _worker(3)._ask_batch(("triton", 1, 1, 64), SimpleNamespace(grid=None), study, None, 1, None)
    assert len(kept) == 1 and study._storage.get_trial(mine._trial_id).state == TS.RUNNING
