"""Two workers that read one snapshot of a study: the later trial yields. A real Optuna study
(in memory) holds the other worker's running trials; the rule under test is
`SharedSweep._ask_batch`'s check after the ask (the batch itself is stood in for: asking is
the sampler's business, tested by the sweep tests)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtune.tuner import study as study_mod
from kvtune.tuner.options import SweepOptions
from kvtune.tuner.strategy import params_key
from kvtune.tuner.workers import SharedSweep

optuna = pytest.importorskip("optuna")
TS = optuna.trial.TrialState
CHOICES = [1, 2, 4, 8]


def _worker(budget):
    sw = object.__new__(SharedSweep)
    sw.optuna, sw.o, sw.trials = optuna, SweepOptions(), budget
    sw.beats = SimpleNamespace(release=lambda _id: None, hold=lambda _id: None)
    return sw


def _running(study, nsplit, role="search", queued=False, params=None):
    """A RUNNING trial holding NSPLIT=nsplit (or `params`, e.g. none yet): asked afresh (its number
    given now), or taken from the queue (numbered when it was queued)."""
    if queued:
        study.enqueue_trial({"NSPLIT": nsplit})
        t = study.ask()
        t.suggest_categorical("NSPLIT", CHOICES)
        t.set_user_attr("role", role)
        return t
    p = {"NSPLIT": nsplit} if params is None else params
    dist = {n: optuna.distributions.CategoricalDistribution(CHOICES) for n in p}
    tid = study._storage.create_new_trial(study._study_id, template_trial=optuna.trial.create_trial(
        state=TS.RUNNING, params=p, distributions=dist, user_attrs={"role": role}))
    return optuna.trial.Trial(study, tid)


@pytest.fixture
def study():
    s = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    for n, role in ((1, "baseline"), (2, "search")):
        s.enqueue_trial({"NSPLIT": n})
        t = s.ask()
        t.suggest_categorical("NSPLIT", CHOICES)
        t.set_user_attr("role", role)
        t.set_user_attr("outcome", "ok")
        s.tell(t, float(n))
    return s


def _check(monkeypatch, study, mine, budget, busy=()):
    """`mine` (a trial this worker holds) through the check, from a snapshot whose running
    configs were `busy`; returns (kept, its trial as stored)."""
    params = dict(mine.params)
    role = study._storage.get_trial(mine._trial_id).user_attrs["role"]
    monkeypatch.setattr(study_mod.StudyLoop, "_ask_batch", lambda self, *a: [(mine, params, role)])
    st = SimpleNamespace(busy={params_key({"NSPLIT": n}): 0 for n in busy})
    kept = _worker(budget)._ask_batch(("triton", 1, 1, 64), SimpleNamespace(grid=None), study, st, 1, None)
    return kept, study._storage.get_trial(mine._trial_id)


def test_the_later_trial_yields_the_last_slot(monkeypatch, study):
    _running(study, 4)                                       # the other worker took the last slot first
    kept, t = _check(monkeypatch, study, _running(study, 8), budget=3)
    assert kept == [] and t.state == TS.FAIL and t.user_attrs.get("released") and "outcome" not in t.user_attrs


def test_with_room_for_both_both_measure(monkeypatch, study):
    _running(study, 4)
    kept, t = _check(monkeypatch, study, _running(study, 8), budget=4)
    assert [p for _, p, _ in kept] == [{"NSPLIT": 8}] and t.state == TS.RUNNING


def test_the_same_config_is_measured_once(monkeypatch, study):
    other = _running(study, 4)
    kept, t = _check(monkeypatch, study, _running(study, 4), budget=8)
    assert kept == [] and t.state == TS.FAIL and t.user_attrs["duplicate_of"] == other.number


def test_a_twin_whose_params_are_half_written_counts(monkeypatch, study):
    """The other worker asked first and has written NSPLIT, not yet BLOCK_N: it may be the same config."""
    _running(study, 4, params={"NSPLIT": 4})
    kept, t = _check(monkeypatch, study, _running(study, 4, params={"NSPLIT": 4, "BLOCK_N": 8}), budget=8)
    assert kept == [] and "duplicate_of" in t.user_attrs
    _running(study, 2, params={"NSPLIT": 2})                 # another config, half written: no twin
    kept, t = _check(monkeypatch, study, _running(study, 8, params={"NSPLIT": 8, "BLOCK_N": 8}), budget=8)
    assert len(kept) == 1


def test_a_twin_the_snapshot_saw_is_left_to_the_measuring_step(monkeypatch, study):
    """_measure_batch tells it a duplicate and queues a repair config, so TPE does not stall."""
    _running(study, 4)
    kept, t = _check(monkeypatch, study, _running(study, 4), budget=8, busy=(4,))
    assert len(kept) == 1 and t.state == TS.RUNNING


def test_a_queued_trial_yields_to_a_higher_numbered_one_that_runs(monkeypatch, study):
    """Queued first (its number then), taken last: every running trial is ahead of it."""
    study.enqueue_trial({"NSPLIT": 8})
    _running(study, 4)                                       # asked afresh meanwhile: a higher number
    mine = study.ask()
    mine.suggest_categorical("NSPLIT", CHOICES)
    mine.set_user_attr("role", "search")
    assert mine.number < max(t.number for t in study.get_trials(states=(TS.RUNNING,)))
    kept, t = _check(monkeypatch, study, mine, budget=3)
    assert kept == [] and t.user_attrs.get("released")


def test_the_baseline_is_kept_whatever_the_budget(monkeypatch, study):
    _running(study, 4)
    kept, t = _check(monkeypatch, study, _running(study, 8, role="baseline"), budget=3)
    assert len(kept) == 1 and t.state == TS.RUNNING


def test_the_earlier_trial_does_not_yield(monkeypatch, study):
    """Both asked from one snapshot: the one numbered first keeps its slot (the other worker's,
    numbered after it, is the one that yields)."""
    mine = _running(study, 8)
    _running(study, 4)
    kept, t = _check(monkeypatch, study, mine, budget=3)
    assert len(kept) == 1 and t.state == TS.RUNNING
