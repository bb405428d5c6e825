"""One Optuna study per (deployment, backend, tp, bs, ctx), and the one loop that asks its
trials, measures them and tells the results: the single-process sweep and each worker of
`--workers` run this same loop (`StudyLoop.search_study`).

A study measures, in order: the backend's default (the baseline, trial 0 of a fresh
study), the bucket's winner among trials set aside before a re-tune (`tuner/priors.py`), the
neighbouring buckets' best configs (warm starts), then what TPE proposes, with
every second config after TPE's random start a one-step neighbour of the best so far
(`tuner/strategy.py`). A space no larger than the trial budget is swept whole as a grid
(its infeasible points recorded as pruned); a larger one whose feasible part fits the
budget, that part. A config breaking a search-space constraint is pruned without touching
the device. Compiling overlaps measuring: the study is asked for several configs at once
(constant liar; `SearchStrategy.width`), compiled ahead by a pool of processes, and
measured in order.

What differs between one process and several sharing the studies is a handful of hooks
that `tuner/workers.py` overrides: how a study is opened and seeded (by whichever worker
creates it), what runs before each batch (failing trials whose worker stopped beating),
holding and releasing a trial (heartbeats), and what an interrupted trial becomes
(queued again for another worker instead of failed).
"""
from __future__ import annotations

import hashlib
import random
from contextlib import nullcontext
from dataclasses import asdict, dataclass

from kvtune.kernels import get_backend, params_from_dict

from .config import ConfigError, redact_url
from .log import get_logger
from .prunes import all_pruned_note, outcomes
from .space import SearchSpace, problem_env
from .strategy import BESIDE_SEARCH, local_proposal, params_key

log = get_logger(__name__)
STUDY_SEP = "|"
#: how a sweep's status begins when at some bucket no study measured anything, every config pruned
ALL_PRUNED = "every config pruned"


def study_name(dep: str, backend: str, tp: int, bs: int, ctx: int) -> str:
    return STUDY_SEP.join((dep, backend, f"tp{tp}", f"bs{bs}", f"ctx{ctx}"))


def compile_key(params: dict) -> str:
    """The compile-time part of a config: everything but NSPLIT (free per context bucket)."""
    return params_key({k: v for k, v in params.items() if k != "NSPLIT"})


def _queued_key(trial) -> str:
    """The params key of a queued (WAITING) trial: Optuna keeps an enqueued config in the
    system attribute `fixed_params` until the trial is asked (its `params` are empty)."""
    return params_key(trial.system_attrs.get("fixed_params", trial.params))


def is_retry(system_attrs: dict) -> bool:
    """Whether a trial (its system attributes) is the retry of one failed as stale (`RetryStale`)."""
    return "failed_trial" in system_attrs


def nearest(choices, x):
    return min(choices, key=lambda c: (abs(c - x), c))


@dataclass
class StudyResult:
    backend: str
    tp: int
    bs: int
    ctx: int
    name: str
    counts: dict
    default_us: float | None = None
    best_us: float | None = None
    best_params: dict | None = None
    floor_us: float | None = None
    note: str = ""

    @property
    def all_pruned(self) -> bool:
        """Nothing was measured because every config tried was pruned."""
        return bool(self.counts.get("pruned")) and not any(n for o, n in self.counts.items() if o != "pruned")


def dead_buckets(results) -> list[tuple[int, int, int]]:
    """(tp, bs, ctx) of the buckets where every backend's study (`StudyResult`s) had every config
    pruned: nothing there can be served. A backend pruned out where another measured is a choice
    the export makes, not a gap."""
    by: dict = {}
    for r in results:
        by.setdefault((r.tp, r.bs, r.ctx), []).append(r.all_pruned)
    return sorted(k for k, v in by.items() if all(v))


@dataclass
class StudyPlan:
    """What a study searches: its space, problem, the backend's default for it, the choices
    per parameter (the space's, widened by the default), the constraint environment, the
    feasible configs (None when too many to list), the grid swept whole (None: TPE), and the
    deployment's arch, which the backend's resource model judges configs against."""
    space: SearchSpace
    spec: object
    default: dict
    dists: dict
    env: dict
    feasible: list | None
    grid: list | None
    backend: str = ""
    arch: str = ""

    def violation(self, params: dict) -> str | None:
        """Why `params` is out of this study before any compile: a space constraint it breaks, or
        the backend's own verdict that it cannot fit the arch (`Backend.fit_reject`: shared
        memory, threads); None when it is in."""
        why = self.space.violation(params, self.env)
        if why or not self.backend:
            return why
        be = get_backend(self.backend)
        return be.fit_reject(params_from_dict(be.params_type, dict(params)), self.spec.draft_tokens, self.arch,
                             Dk=self.spec.Dk)

    def admits(self, params: dict) -> bool:
        """Whether every parameter of `params` takes one of this study's choices (a warm start
        from another space may not)."""
        return all(params.get(n) in self.dists[n] for n in self.dists)


@dataclass
class _State:
    """A study's trials as the loop sees them before a batch (params keys)."""
    measured: dict     # key -> its counted finished trial
    running: list      # trials running (in another process, for workers)
    waiting: set       # keys of queued configs
    busy: dict         # key -> number of a running trial
    counted: int       # finished trials that count against the budget
    running_search: int   # running trials that will (all but those beside the search: BESIDE_SEARCH)
    retries: int = 0   # queued retries of trials failed as stale: owed whatever the budget says


class StudyLoop:
    """The search of the studies. Expects of its subclass (`tuner.sweep.Sweep`): `optuna`,
    `o` (SweepOptions), `dep`, `trials`, `ctxs`, `tps`, `spaces`, `runner`, `storage`,
    `storage_url`, `table`, and `_measure(backend, params, spec, seed)` and `_progress(m)`."""

    index = 0          # this process's worker index (offsets its samplers and random choices)
    priors: dict = {}  # (backend, heads, bs, ctx, T, tree) -> a set-aside winner (tuner/priors.py)

    def _init_loop(self):
        self._studies: dict = {}
        self._plans: dict = {}
        self._asks: dict = {}
        self._notes: dict = {}

    # -- opening a study ------------------------------------------------------------------
    def _plan(self, key) -> StudyPlan:
        if key not in self._plans:
            self._plans[key] = self._study_plan(*key)
        return self._plans[key]

    def _study_plan(self, backend, tp, bs, ctx) -> StudyPlan:
        space: SearchSpace = self.spaces[backend]
        spec = self.runner.spec(tp, bs, ctx)
        default = self.runner.default_params(backend, spec)
        dists = space.distributions(extra=default)
        env = problem_env(spec.draft_tokens, spec.heads, bs, ctx, spec.Dk, spec.kv_lora_rank, self.dep.device)
        full = None
        if space.size(default) <= max(self.trials, 50000):
            full = space.grid(default)
        plan = StudyPlan(space, spec, default, dists, env, None, None, backend, self.dep.device.arch)
        plan.feasible = [g for g in full if not plan.violation(g)] if full is not None else None
        plan.grid = full if full is not None and len(full) <= self.trials else \
            plan.feasible if plan.feasible is not None and (len(plan.feasible) <= self.trials or self.o.grid) else None
        if plan.feasible is not None and len(full) > 1 and all(params_key(g) == params_key(default)
                                                               for g in plan.feasible):
            # a complete study of the default alone would read as "tuned: nothing beats it"
            key = (backend, tp, bs, ctx)
            self._notes[key] = (f"{space.source}: its constraints leave no config to search but the default "
                                f"({len(full)} in the space)")
            log.warning("note: %s: %s", study_name(self.dep.name, *key), self._notes[key])
        return plan

    def _seed(self, name: str) -> int:
        return self.o.seed + int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)

    def _open_study(self, backend, tp, bs, ctx):
        """(name, study, seed) of a study, created when new (single process)."""
        key = (backend, tp, bs, ctx)
        if key not in self._studies:
            name = study_name(self.dep.name, backend, tp, bs, ctx)
            seed = self._seed(name)
            sampler = self.o.strategy.sampler(self.optuna, seed, self.trials)
            study = self.optuna.create_study(study_name=name, storage=self.storage, sampler=sampler,
                                             direction="minimize", load_if_exists=True)
            self._studies[key] = (name, study, seed)
        return self._studies[key]

    def _prepare(self, key, plan: StudyPlan, name, study) -> bool:
        """Make the study ready to search; False when it is not ready yet (workers: another
        process is seeding it). One process: trials an interrupted run left RUNNING are failed
        (uncounted), the table gets the rows it lacks, and the start configs are queued."""
        if self.o.reclaim_running:
            TS = self.optuna.trial.TrialState
            for t in study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
                study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
                study.tell(t.number, state=TS.FAIL)
        self._check_dists(study, name, plan)
        self._check_storage_holds_table(study, name)
        self._reconcile(study)
        self._enqueue_start(study, plan, key)
        return True

    def _check_dists(self, study, name, plan: StudyPlan):
        stored = study.user_attrs.get("dists")
        if stored is None:
            study.set_user_attr("dists", {n: list(v) for n, v in plan.dists.items()})
            study.set_user_attr("spec", asdict(plan.spec))
        elif {n: tuple(v) for n, v in stored.items()} != plan.dists:
            raise ConfigError(f"{plan.space.source}: the search space of {plan.space.backend} changed since study "
                              f"{name!r} was created in {redact_url(self.storage_url)}; sweep into a new "
                              "--out, or delete it")

    def _check_storage_holds_table(self, study, name):
        """Every search row of the table is a trial of the study: rows the storage lacks mean its
        studies were deleted or another storage was opened, and searching on would number new
        trials over the recorded ones (duplicate rows, two sweeps mixed in one export)."""
        # the table's keys before the study's trials: a row is appended only after its trial was
        # told, so another process's trial in this snapshot of the table is in the study after it
        rows = {int(k[2]) for k in list(self.table.keys) if k[0] == name and k[1] == "search" and k[2].isdigit()}
        lost = sorted(rows - {t.number for t in study.get_trials(deepcopy=False)})
        if lost:
            raise ConfigError(
                f"{self.table.path}: holds {len(lost)} trial(s) of study {name!r} (trial {lost[0]}, ...) that the "
                f"study storage {redact_url(self.storage_url)} lacks: its studies were deleted, or this sweep opened "
                "another storage than the one that recorded them (a --workers sweep keeps them in studies.journal). "
                "Pass that storage with --storage, or move the trials table aside to sweep afresh")

    def _enqueue_start(self, study, plan: StudyPlan, key):
        """Queue the baseline, the warm starts and the grid, each unless measured, queued or
        running already."""
        TS = self.optuna.trial.TrialState
        trials = study.get_trials(deepcopy=False)
        have = {params_key(t.params) for t in self._counted(trials)} | \
            {_queued_key(t) for t in trials if t.state == TS.WAITING} | \
            {params_key(t.params) for t in trials if t.state == TS.RUNNING}

        def enqueue(params, role):
            k = params_key(params)
            if k in have or not plan.admits(params):
                return
            study.enqueue_trial(params, user_attrs={"role": role})
            have.add(k)

        enqueue(plan.default, "baseline")
        prior = self._prior(plan, *key)
        if prior is not None:
            enqueue(prior, "prior")
        for w in self._warm(*key):
            enqueue(w, "warm")
        for g in plan.grid or ():
            enqueue(g, "search")

    def _prior(self, plan: StudyPlan, backend, tp, bs, ctx) -> dict | None:
        """This bucket's winner among the trials set aside before a re-tune (`tuner/priors.py`),
        in this study's parameters, or None: none set aside, or one the study cannot measure. A
        parameter the space no longer has is left out; one it has gained, or a value outside its
        choices, constraints or the arch's limits, skips the prior (set aside on another source,
        the winner may predate the space)."""
        spec = plan.spec
        found = self.priors.get((backend, spec.heads, bs, ctx, spec.draft_tokens, spec.tree))
        if found is None:
            return None
        prior = {k: v for k, v in found.items() if k in plan.dists}
        if not plan.admits(prior) or plan.violation(prior) is not None:
            log.info("%s: the winner set aside for this bucket, %s, is not in this study's space; not measured "
                     "first", study_name(self.dep.name, backend, tp, bs, ctx), found)
            return None
        return prior

    def _warm(self, backend, tp, bs, ctx) -> list[dict]:
        """Warm starts: the best of the previous context bucket (and the same with NSPLIT scaled
        to this context), and the best of the previous tp degree."""
        warm = []
        i = self.ctxs.index(ctx)
        prev = self._search_best(backend, tp, bs, self.ctxs[i - 1]) if i > 0 else None
        if prev:
            warm.append(prev)
            if "NSPLIT" in prev:
                warm.append(dict(prev, NSPLIT=nearest(self.spaces[backend].choices["NSPLIT"],
                                                      prev["NSPLIT"] * ctx / self.ctxs[i - 1])))
        j = self.tps.index(tp)
        prev = self._search_best(backend, self.tps[j - 1], bs, ctx) if j > 0 else None
        if prev:
            warm.append(prev)
        return warm

    def _search_best(self, backend, tp, bs, ctx) -> dict | None:
        """The best correct config a study's search found so far, or None. Cross-bucket trials
        do not count: a warm start must not depend on whether that phase has run yet."""
        try:
            sid = self.storage.get_study_id_from_name(study_name(self.dep.name, backend, tp, bs, ctx))
        except KeyError:
            return None
        ok = [t for t in self._counted(self.storage.get_all_trials(sid, deepcopy=False))
              if t.user_attrs.get("outcome") == "ok" and t.value is not None
              and t.user_attrs.get("role") not in BESIDE_SEARCH]
        return dict(min(ok, key=lambda t: t.value).params) if ok else None

    # -- the trials a study counts --------------------------------------------------------
    def _counted(self, trials):
        """Finished trials with a result, each once: not a duplicate of another, and not a
        trial failed as stale (its retry is the one that counts, even if it half-told a result)."""
        TS = self.optuna.trial.TrialState
        retried = {n for t in trials for n in t.system_attrs.get("retry_history", ())}
        return [t for t in trials if t.state in (TS.COMPLETE, TS.PRUNED, TS.FAIL) and "outcome" in t.user_attrs
                and "duplicate_of" not in t.user_attrs and t.number not in retried]

    def _finished(self, study):
        return self._counted(study.get_trials(deepcopy=False))

    def _reconcile(self, study):
        """Rows of counted trials the table lacks (killed between tell and append, or told by a
        worker on another host)."""
        for t in self._finished(study):
            row = t.user_attrs.get("row")
            if row and not self.table.has(row):
                self.table.append(row)

    def _state(self, study) -> _State:
        TS = self.optuna.trial.TrialState
        trials = study.get_trials(deepcopy=False)
        running = [t for t in trials if t.state == TS.RUNNING]
        measured = {params_key(t.params): t for t in self._counted(trials)}
        return _State(measured=measured, running=running,
                      waiting={_queued_key(t) for t in trials if t.state == TS.WAITING},
                      busy={params_key(t.params): t.number for t in running if t.params},
                      counted=sum(1 for t in measured.values() if self.o.strategy.counts(t.user_attrs)),
                      running_search=sum(1 for t in running if t.user_attrs.get("role") not in BESIDE_SEARCH),
                      retries=sum(1 for t in trials if t.state == TS.WAITING and t.system_attrs.get("retry_history")))

    def _owed(self, plan: StudyPlan, st: _State) -> int:
        """Configs the study still owes: the queued grid points; else the budget less the
        counted and running trials, at least the queued retries, and at least the baseline until
        it is measured."""
        if plan.grid is not None:
            return len(st.waiting)
        owed = self.trials - st.counted - st.running_search
        base = params_key(plan.default)
        # a retry is measured even when the budget filled up while its trial hung (a killed
        # worker's trial only fails as stale after the grace period): its config is not lost
        return max(owed, st.retries, 0 if base in st.measured or base in st.busy else 1)

    # -- the loop -------------------------------------------------------------------------
    def search_study(self, backend, tp, bs, ctx) -> tuple[bool, bool]:
        """Measure what this study owes; returns (done, worked): done when it owes nothing and
        has no trial running anywhere, worked when this process measured something."""
        key = (backend, tp, bs, ctx)
        plan = self._plan(key)
        name, study, seed = self._open_study(*key)
        if not self._prepare(key, plan, name, study):
            return False, False
        rng = random.Random(seed + 104729 * self.index + self._asks.get(key, 0))
        cap = max(4 * self.trials, self.trials + 20) + (len(plan.grid) if plan.grid else 0)
        worked = False
        while True:
            self._before_batch(study)
            st = self._state(study)
            owed = self._owed(plan, st)
            if owed <= 0:
                return not st.running, worked
            if self._asks.get(key, 0) >= cap:
                # pruned configs do not count against the budget: a study whose every config is pruned
                # asks until the cap, and the reason is the prunes, not the sampler
                self._notes[key] = all_pruned_note(outcomes(st.measured.values())) or \
                    "search space exhausted (the sampler kept proposing measured configs)"
                log.info("note: %s: %s", name, self._notes[key])
                return not st.running, worked
            self._requeue_baseline(plan, study, st)
            batch = self._ask_batch(key, plan, study, st, min(owed, cap - self._asks.get(key, 0)), rng)
            self._prefetch(backend, plan, st, batch)
            worked = self._measure_batch(key, plan, name, study, seed, st, batch, rng) or worked

    def _requeue_baseline(self, plan: StudyPlan, study, st: _State) -> None:
        """Queue the baseline again while it is neither measured, queued nor running: a trial
        given up after failing as stale too often would otherwise leave the study owing it for
        good (`_owed`), with no default to judge against and its budget overrun by proposals."""
        base = params_key(plan.default)
        if base in st.measured or base in st.waiting or base in st.busy or not plan.admits(plan.default):
            return
        study.enqueue_trial(plan.default, user_attrs={"role": "baseline"})
        st.waiting.add(base)

    def _ask_batch(self, key, plan: StudyPlan, study, st: _State, owed: int, rng) -> list:
        """Ask for up to one config per compile worker (`SearchStrategy.width`): [(trial,
        params, role)]. Their compiles start once the batch is settled (`_prefetch`)."""
        strategy = self.o.strategy
        batch = []
        for _ in range(min(owed, strategy.width(self.runner.prefetch.workers, self.trials))):
            if plan.grid is None:
                self._steer(study, st.counted + st.running_search + len(batch), st, batch, plan, rng)
            trial = study.ask()
            self._asks[key] = self._asks.get(key, 0) + 1
            self._hold(trial)
            params = {n: trial.suggest_categorical(n, plan.dists[n]) for n in plan.dists}
            role = trial.user_attrs.get("role", "search")
            trial.set_user_attr("role", role)
            batch.append((trial, params, role))
        return batch

    def _prefetch(self, backend, plan: StudyPlan, st: _State, batch) -> None:
        """Start compiling the batch's configs that will be measured (not one measured already,
        or breaking a constraint; workers have dropped the trials that yielded by now)."""
        for _, params, role in batch:
            if params_key(params) not in st.measured and not self._violation(role, plan, params):
                self.runner.prefetch.submit(backend, params, asdict(plan.spec))

    def _measure_batch(self, key, plan: StudyPlan, name, study, seed, st: _State, batch, rng) -> bool:
        """Measure a batch in order and tell each result; a config measured already (or, for
        workers, being measured elsewhere) is told as a duplicate of that trial. True when
        something was measured (or pruned) here."""
        backend, tp, bs, ctx = key
        worked = False

        def repair():
            """After a wasted proposal (measured already, or infeasible) a random feasible config
            not measured yet is asked next, so a small space cannot stall TPE."""
            if plan.grid is None and plan.feasible:
                todo = [g for g in plan.feasible if params_key(g) not in st.measured
                        and params_key(g) not in st.waiting and params_key(g) not in st.busy]
                if todo:
                    g = rng.choice(todo)
                    study.enqueue_trial(g, user_attrs={"role": "search"})
                    st.waiting.add(params_key(g))

        for i, (trial, params, role) in enumerate(batch):
            k = params_key(params)
            if k in st.measured or (k in st.busy and plan.grid is None and not self._is_retry(study, trial)):
                repair()
                self._tell_duplicate(study, trial, st.measured.get(k), st.busy.get(k))
                continue
            st.waiting.discard(k)
            try:
                m, why = self._run_one(backend, trial, params, role, plan, seed, repair)
            except BaseException:
                self._abandon(study, [t for t, _, _ in batch[i:]])
                raise
            row = self.runner.row(backend, tp, bs, ctx, plan.spec, name, trial.number, role, params, m)
            if self._tell(study, trial, m, row):
                st.measured[k] = study._storage.get_trial(trial._trial_id)
            if not why:
                self._progress(m)
            worked = True
        return worked

    def _tell_duplicate(self, study, trial, src, busy_number):
        """Tell `trial` as a duplicate of `src` (its finished trial), or of the trial numbered
        `busy_number` running elsewhere (told failed: the other one counts)."""
        TS = self.optuna.trial.TrialState
        try:
            trial.set_user_attr("duplicate_of", src.number if src is not None else busy_number)
            if src is not None and src.state == TS.COMPLETE:
                study.tell(trial, src.value)
            else:
                study.tell(trial, state=src.state if src is not None else TS.FAIL)
        except self.optuna.exceptions.UpdateFinishedTrialError:
            pass
        self._release(trial)

    @staticmethod
    def _violation(role, plan: StudyPlan, params):
        """The search-space constraint `params` break (or the arch it cannot fit), or None; the
        baseline and cross-bucket configs are measured whatever the constraints say (the runner
        still refuses what cannot run)."""
        return None if role == "baseline" or role in BESIDE_SEARCH else plan.violation(params)

    def _run_one(self, backend, trial, params, role, plan: StudyPlan, seed, repair):
        """One batch member's outcome and the constraint that pruned it (or None): pruned
        without device time, else measured once its ahead-of-time compile is done."""
        why = self._violation(role, plan, params)
        if why:
            trial.set_user_attr("constraint", True)
            repair()
            return {"outcome": "pruned", "reason": why, "timing": self.runner.timing}, why
        with self._interruptible():
            self.runner.prefetch.wait(backend, params, asdict(plan.spec))
            return self._measure(backend, params, plan.spec, seed + trial.number), None

    def _steer(self, study, n_search, st: _State, batch, plan: StudyPlan, rng):
        """Queue the next config when the strategy picks it rather than TPE (a neighbour of the
        best so far), unless configs are queued already."""
        TS = self.optuna.trial.TrialState
        if not self.o.strategy.is_local(n_search, self.trials):
            return
        if study.get_trials(deepcopy=False, states=(TS.WAITING,)):
            return
        ranked = [dict(t.params) for t in sorted((t for t in st.measured.values() if t.state == TS.COMPLETE),
                                                 key=lambda t: t.value)]
        taken = set(st.measured) | set(st.busy) | {params_key(p) for _, p, _ in batch}
        q = local_proposal(ranked, plan.dists, taken, lambda q: not plan.violation(q), rng)
        if q is not None:
            study.enqueue_trial(q, user_attrs={"role": "search", "via": "local"})

    def _tell(self, study, trial, m: dict, row: dict) -> bool:
        """Tell a measurement to its study and append its row to the table; True when told."""
        TS = self.optuna.trial.TrialState
        for k in ("outcome", "reason", "median_us", "pct_floor"):
            trial.set_user_attr(k, m.get(k))
        trial.set_user_attr("row", row)
        if m["outcome"] == "ok":
            study.tell(trial, m["median_us"])
        else:
            study.tell(trial, state=TS.PRUNED if m["outcome"] == "pruned" else TS.FAIL)
        self.table.append(row)
        self._release(trial)
        return True

    def _ask_for(self, study, q: dict, dists: dict, role: str):
        """A new trial of `study` with exactly the params `q` (configs left queued by an
        earlier, interrupted run are released unmeasured on the way)."""
        TS = self.optuna.trial.TrialState
        study.enqueue_trial(q, user_attrs={"role": role})
        while True:
            trial = study.ask()
            params = {n: trial.suggest_categorical(n, dists[n]) for n in dists}
            if params_key(params) == params_key(q):
                self._hold(trial)
                return trial, params
            trial.set_user_attr("released", True)
            study.tell(trial, state=TS.FAIL)

    def _interrupted(self, study, trial):
        """A trial this process holds, not finished: failed, marked interrupted, not counted."""
        TS = self.optuna.trial.TrialState
        study._storage.set_trial_user_attr(trial._trial_id, "interrupted", True)
        study.tell(trial, state=TS.FAIL)
        self._release(trial)

    def _study_result(self, backend, tp, bs, ctx) -> StudyResult:
        name, study, _ = self._open_study(backend, tp, bs, ctx)
        counts = {o: 0 for o in ("ok", "pruned", "wrong", "failed")}
        best, base, floor = None, None, None
        # the search's own trials: the phases after it add cross-bucket trials to the study, and a
        # resumed sweep would count them where an uninterrupted one had not yet
        finished = [t for t in self._finished(study) if t.user_attrs.get("role") not in BESIDE_SEARCH]
        for t in finished:
            counts[t.user_attrs["outcome"]] = counts.get(t.user_attrs["outcome"], 0) + 1
            row = t.user_attrs.get("row") or {}
            floor = row.get("floor_us") or floor
            if t.user_attrs["outcome"] == "ok":
                if best is None or t.value < best.value:
                    best = t
                if t.user_attrs.get("role") == "baseline":
                    base = t
        note = all_pruned_note(outcomes(finished)) or self._notes.get((backend, tp, bs, ctx), "")
        return StudyResult(backend, tp, bs, ctx, name, counts, default_us=base.value if base else None,
                           best_us=best.value if best else None, best_params=dict(best.params) if best else None,
                           floor_us=floor, note=note)

    # -- hooks: one process (tuner/workers.py overrides them) -----------------------------
    def _before_batch(self, study) -> None:
        pass

    def _hold(self, trial) -> None:
        pass

    def _release(self, trial) -> None:
        pass

    def _is_retry(self, study, trial) -> bool:
        return is_retry(study._storage.get_trial(trial._trial_id).system_attrs)

    def _interruptible(self):
        return nullcontext()

    def _abandon(self, study, trials) -> None:
        """Trials of a batch left unfinished by an exception (Ctrl-C, a limit)."""
        for t in trials:
            self._interrupted(study, t)
