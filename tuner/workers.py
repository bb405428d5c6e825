"""Sweeps that outgrow one GPU: worker processes sharing the studies through Optuna storage.

`kvtune sweep DEPLOYMENT --workers N` starts N `kvtune worker` processes, one per visible GPU
(`CUDA_VISIBLE_DEVICES` set per worker; with `--device cpu`, N CPU processes), and
`kvtune worker --storage URL DEPLOYMENT` joins a running sweep from another host. There is
no scheduler: a worker walks the (backend, tp, bs, ctx) studies (each worker starting at
its own offset) and asks a study for trials while the study's counted finished trials plus
those running elsewhere are under the budget (for a grid: while grid points are queued);
it then revisits the studies until none owes a trial and none has a trial running.

Storage: by default Optuna's journal file `results/<deployment>/studies.journal` (safe for
processes on one host, unlike SQLite); any SQLAlchemy URL (PostgreSQL) for several hosts.

Fault tolerance. Every trial a worker holds carries its `worker` (host:pid) and a
heartbeat, every `--heartbeat` seconds, from a thread of the worker: on RDB storage
Optuna's own (`RDBStorage(heartbeat_interval, grace_period, ...)`); on the journal, which
Optuna gives no heartbeat, `HeartbeatJournalStorage` records it as the trial system
attribute `kvtune:heartbeat` and implements Optuna's heartbeat interface, so
`optuna.storages.fail_stale_trials` works on both. A trial whose heartbeat is older than
`--grace` seconds (its worker was killed, or its host lost) is failed by whichever worker
looks next, which also enqueues one retry (`RetryStale`, Optuna's retry callback keeping
only the trial's role: the retry carries no half-told result). A failed-as-stale trial is
never counted (it is in its retry's `retry_history`); a worker that comes back and tells a
trial already failed as stale drops its result. So each finished trial is counted and
written to the trials table once.

The trials table: each worker appends under a file lock (see `tuner/table.py`); rows of
workers on other hosts reach the table from the storage (every finished trial carries its
row), reconciled by the parent. The parent, after its workers exit, measures whatever is
still owed (trials of dead workers once stale) and then runs the cross-bucket,
interleaved re-measurement and serving-check phases once, in the same order as a
single-worker sweep, so the export of the same trials is the same.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path

from .config import ConfigError, Deployment, load_deployment, redact_url
from .sweep import (STUDY_SEP, Sweep, SweepOptions, _nearest, _non_negative, _positive_int, _Stop,  # noqa: F401
                    journal_backend, params_key, study_name)

HEARTBEAT_KEY = "kvtune:heartbeat"


# --------------------------------------------------------------------------- storage
class RetryStale:
    """Optuna's RetryFailedTrialCallback (RetryHeartbeatStaleTrialCallback in optuna >= 4.9):
    a trial failed as stale is enqueued again (WAITING, same params), at most `max_retry`
    times; the retry keeps the trial's role but none of a result it may have half-told."""

    def __init__(self, max_retry: int = 2):
        self.max_retry = max_retry

    def __call__(self, study, trial) -> None:
        import optuna
        history = list(trial.system_attrs.get("retry_history", [])) + [trial.number]
        if len(history) > self.max_retry:
            return
        sysattrs = {"failed_trial": trial.system_attrs.get("failed_trial", trial.number), "retry_history": history}
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING, params=trial.params, distributions=trial.distributions,
            user_attrs={"role": trial.user_attrs.get("role", "search")}, system_attrs=sysattrs))


def _heartbeat_journal_class():
    import optuna
    from optuna.storages._heartbeat import BaseHeartbeat

    class HeartbeatJournalStorage(optuna.storages.JournalStorage, BaseHeartbeat):
        """Optuna's JournalStorage with Optuna's heartbeat interface (which Optuna implements
        for RDB storage only): a heartbeat is the trial system attribute `kvtune:heartbeat`
        (epoch seconds); a RUNNING trial is stale when its last heartbeat (or its start) is
        older than the grace period. Clocks: one host shares the journal file."""

        def __init__(self, backend, heartbeat_interval: int, grace_period: int, callback=None):
            super().__init__(backend)
            self.heartbeat_interval = heartbeat_interval
            self.grace_period = grace_period
            self.callback = callback

        def record_heartbeat(self, trial_id: int) -> None:
            self.set_trial_system_attr(trial_id, HEARTBEAT_KEY, time.time())

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now = time.time()
            stale = []
            for t in self.get_all_trials(study_id, deepcopy=False,
                                         states=(optuna.trial.TrialState.RUNNING,)):
                last = t.system_attrs.get(HEARTBEAT_KEY)
                if last is None:
                    last = t.datetime_start.timestamp() if t.datetime_start else now
                if now - float(last) > self.grace_period:
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return self.heartbeat_interval

        def get_heartbeat_stale_trial_callback(self):
            return self.callback

        def get_failed_trial_callback(self):   # the name before optuna 4.9
            return self.callback

    return HeartbeatJournalStorage


def open_shared_storage(url: str, heartbeat_s: int, grace_s: int, max_retry: int = 2):
    """Storage several processes can share, with heartbeats: `journal:PATH` (one host) or an
    SQLAlchemy URL such as postgresql://user@host:port/db (several hosts). SQLite is refused."""
    import inspect

    import optuna
    cb = RetryStale(max_retry)
    if url.startswith("journal:"):
        path = Path(url[len("journal:"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        return _heartbeat_journal_class()(journal_backend(path), heartbeat_s, grace_s, cb), url
    if url.startswith("sqlite"):
        raise ConfigError(f"--storage {redact_url(url)}: SQLite is not safe for several worker processes; use "
                          "journal:PATH on one host or a PostgreSQL URL for several")
    url = _with_driver(url)
    kw = {"heartbeat_interval": heartbeat_s, "grace_period": grace_s}
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    kw["heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params
       else "failed_trial_callback"] = cb
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attempt in range(5):   # workers starting together may race to create the schema
            try:
                return optuna.storages.RDBStorage(url, **kw), url
            except Exception:  # noqa: BLE001
                if attempt == 4:
                    raise
                time.sleep(1 + attempt)


def _with_driver(url: str) -> str:
    """postgresql:// names no driver: SQLAlchemy 2.1 picks psycopg (3), older ones psycopg2; use
    whichever is installed (psycopg2-binary is in the test extra)."""
    if not url.startswith(("postgresql://", "postgres://")):
        return url
    import importlib.util
    rest = url.split("://", 1)[1]
    for mod, driver in (("psycopg", "psycopg"), ("psycopg2", "psycopg2")):
        if importlib.util.find_spec(mod) is not None:
            return f"postgresql+{driver}://{rest}"
    return url


class _Interrupts:
    """Ctrl-C (SIGINT) in a worker is raised only where it can be cleaned up: while waiting
    for a measurement or sleeping (`interruptible`), else at the next `check`. So a trial is
    never left running by an interruption: the worker fails it and queues it again."""

    def __init__(self):
        self.pending = False
        self.safe = 0
        self.previous = None

    def install(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handler)

    def restore(self):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def _handler(self, signum, frame):
        first = not self.pending
        self.pending = True
        if self.safe and first:
            raise KeyboardInterrupt

    def check(self):
        if self.pending:
            raise KeyboardInterrupt

    class _Safe:
        def __init__(self, owner):
            self.owner = owner

        def __enter__(self):
            self.owner.check()
            self.owner.safe += 1

        def __exit__(self, *exc):
            self.owner.safe = max(0, self.owner.safe - 1)
            return False

    def interruptible(self):
        return self._Safe(self)


class _Heartbeats:
    """Records a heartbeat for every trial this worker holds, every `interval` seconds."""

    def __init__(self, storage, interval: float):
        self.storage, self.interval = storage, interval
        self.held: set[int] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = None

    def hold(self, trial_id: int) -> None:
        self._beat(trial_id)
        with self.lock:
            self.held.add(trial_id)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True, name="kvtune-heartbeat")
            self.thread.start()

    def release(self, trial_id: int) -> None:
        with self.lock:
            self.held.discard(trial_id)

    def _beat(self, trial_id: int) -> None:
        try:
            self.storage.record_heartbeat(trial_id)
        except Exception:  # noqa: BLE001 - finished meanwhile, or a transient storage error
            pass

    def _run(self):
        while not self.stop.wait(self.interval):
            with self.lock:
                ids = list(self.held)
            for tid in ids:
                self._beat(tid)

    def close(self):
        self.stop.set()


# --------------------------------------------------------------------------- the worker
class SharedSweep(Sweep):
    """A sweep whose studies other processes share: the trial loop of a worker (`search`),
    and for the parent of `--workers` the phases after it (`post=True`)."""

    shared = True

    def __init__(self, dep: Deployment, opts: SweepOptions, heartbeat_s: int = 10, grace_s: int = 60,
                 index: int = 0, of: int = 1, post: bool = False):
        self.heartbeat_s, self.grace_s = max(1, int(heartbeat_s)), max(1, int(grace_s))
        super().__init__(dep, dataclasses.replace(opts, reclaim_running=False))
        warnings.filterwarnings("ignore", message=".*[Hh]eartbeat.*")
        self.index, self.of, self.post = index, max(1, of), post
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.beats = _Heartbeats(self.storage, self.heartbeat_s)
        self.intr = _Interrupts()
        self._studies: dict = {}
        self._created: dict = {}
        self._plans: dict = {}
        self._asks: dict = {}
        self._first_seen: dict = {}
        self.dropped = 0
        self.children: list = []

    def _default_storage(self) -> str:
        return f"journal:{self.out_dir / 'studies.journal'}"

    def _open_storage(self):
        return open_shared_storage(self.storage_url, self.heartbeat_s, self.grace_s)

    # -- studies shared with other processes ----------------------------------------------
    def _open_study(self, backend, tp, bs, ctx):
        key = (backend, tp, bs, ctx)
        if key in self._studies:
            return self._studies[key]
        import hashlib
        optuna = self.optuna
        name = study_name(self.dep.name, backend, tp, bs, ctx)
        seed = self.o.seed + int(hashlib.sha256(name.encode()).hexdigest()[:6], 16)
        sampler = self.o.strategy.sampler(optuna, seed + 7919 * self.index, self.trials)
        try:   # whoever creates the study initialises it (baseline, warm starts, grid), once
            study = optuna.create_study(study_name=name, storage=self.storage, sampler=sampler,
                                        direction="minimize", load_if_exists=False)
            self._created[key] = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=name, storage=self.storage, sampler=sampler)
        self._studies[key] = (name, study, seed)
        return self._studies[key]

    def _counted_trials(self, trials):
        TS = self.optuna.trial.TrialState
        retried = {n for t in trials for n in t.system_attrs.get("retry_history", ())}
        return [t for t in trials if t.state in (TS.COMPLETE, TS.PRUNED, TS.FAIL) and "outcome" in t.user_attrs
                and "duplicate_of" not in t.user_attrs and t.number not in retried]

    def _finished(self, study):
        """Finished trials with a result, each once: not a duplicate, and not a trial failed
        as stale (its retry is the one that counts, even if it half-told a result)."""
        return self._counted_trials(study.get_trials(deepcopy=False))

    def _reconcile(self, study, name):
        for t in self._finished(study):
            row = t.user_attrs.get("row")
            if row and not self.table.has(row):
                self.table.append(row)

    def _tell(self, study, trial, m: dict, row: dict):
        try:
            super()._tell(study, trial, m, row)
            told = True
        except self.optuna.exceptions.UpdateFinishedTrialError:
            # failed as stale meanwhile (no heartbeat for the grace period) and retried elsewhere
            self.dropped += 1
            print(f"note: {study.study_name} trial {trial.number} was failed as stale and retried; "
                  "this measurement is dropped", file=sys.stderr)
            told = False
        self.beats.release(trial._trial_id)
        return told

    def _ask_for(self, study, q, dists, role):
        trial, params = super()._ask_for(study, q, dists, role)
        self._hold(trial)
        return trial, params

    def _measure(self, *args, **kw):
        with self.intr.interruptible():
            return super()._measure(*args, **kw)

    def _hold(self, trial):
        self.beats.hold(trial._trial_id)                 # heartbeat first: a held trial always has one
        trial.set_user_attr("worker", self.worker_id)

    def _fail(self, study, trial, retry: bool, **attrs):
        """Fail a trial this worker holds (interrupted): another worker retries it."""
        TS = self.optuna.trial.TrialState
        try:
            for k, v in attrs.items():
                study._storage.set_trial_user_attr(trial._trial_id, k, v)
            study.tell(trial, state=TS.FAIL)
            if retry:
                RetryStale()(study, study._storage.get_trial(trial._trial_id))
        except self.optuna.exceptions.UpdateFinishedTrialError:
            pass
        self.beats.release(trial._trial_id)

    def _fail_stale(self, study):
        """Running trials whose worker stopped beating are failed and retried (Optuna's
        fail_stale_trials); so are trials left running without any heartbeat (a worker killed
        between asking a trial and its first heartbeat) once much older than the grace."""
        optuna = self.optuna
        TS = optuna.trial.TrialState
        optuna.storages.fail_stale_trials(study)
        now = datetime.now()
        for t in study.get_trials(deepcopy=False, states=(TS.RUNNING,)):
            if "worker" in t.user_attrs or t.datetime_start is None:
                continue
            if (now - t.datetime_start).total_seconds() > 5 * self.grace_s + 60:
                try:
                    if study._storage.set_trial_state_values(t._trial_id, state=TS.FAIL):
                        RetryStale()(study, study._storage.get_trial(t._trial_id))
                except optuna.exceptions.UpdateFinishedTrialError:
                    pass

    def _best_params(self, backend, tp, bs, ctx):
        """The best correct config of a neighbouring study so far (a warm start), or None."""
        try:
            sid = self.storage.get_study_id_from_name(study_name(self.dep.name, backend, tp, bs, ctx))
        except KeyError:
            return None
        ok = [t for t in self._counted_trials(self.storage.get_all_trials(sid, deepcopy=False))
              if t.user_attrs.get("outcome") == "ok" and t.value is not None]
        return dict(min(ok, key=lambda t: t.value).params) if ok else None

    def _warm(self, backend, tp, bs, ctx):
        warm = []
        i = self.ctxs.index(ctx)
        prev = self._best_params(backend, tp, bs, self.ctxs[i - 1]) if i > 0 else None
        if prev:
            warm.append(prev)
            if "NSPLIT" in prev:
                warm.append(dict(prev, NSPLIT=_nearest(self.spaces[backend].choices["NSPLIT"],
                                                       prev["NSPLIT"] * ctx / self.ctxs[i - 1])))
        j = self.tps.index(tp)
        prev = self._best_params(backend, self.tps[j - 1], bs, ctx) if j > 0 else None
        if prev:
            warm.append(prev)
        return warm

    # -- one study: ask while it owes trials ----------------------------------------------
    def search_study(self, backend, tp, bs, ctx) -> tuple[bool, bool]:
        """Measure what this study owes; returns (done, worked): done when it owes nothing
        and has no trial running anywhere."""
        TS = self.optuna.trial.TrialState
        key = (backend, tp, bs, ctx)
        if key not in self._plans:
            self._plans[key] = self._study_space(backend, tp, bs, ctx)
        space, spec, default, dists, env, feasible, grid = self._plans[key]
        name, study, seed = self._open_study(backend, tp, bs, ctx)
        ready = "ready" in study.user_attrs
        if not ready:
            first = self._first_seen.setdefault(key, time.time())
            if not self._created.get(key) and time.time() - first < self.grace_s:
                return False, False          # its creator is initialising it
            self._init_study(study, name, space, backend, dists, spec, default, grid, key)
        else:
            self._check_dists(study, name, space, backend, dists, spec)
        rng = random.Random(seed + 104729 * self.index + self._asks.get(key, 0))
        sd = dataclasses.asdict(spec)
        cap = max(4 * self.trials, self.trials + 20) + (len(grid) if grid else 0)
        worked = False
        while True:
            self.intr.check()                  # between trials: nothing held
            self._fail_stale(study)
            trials = study.get_trials(deepcopy=False)
            measured = {params_key(t.params): t for t in self._counted_trials(trials)}
            running = [t for t in trials if t.state == TS.RUNNING]
            waiting = {params_key(t.params) for t in trials if t.state == TS.WAITING}
            if grid is not None:
                owed = len(waiting)
            else:
                counted = sum(1 for t in measured.values() if self.o.strategy.counts(t.user_attrs))
                owed = self.trials - counted - sum(1 for t in running if t.user_attrs.get("role") != "cross")
            if owed <= 0:
                return not running, worked
            if self._asks.get(key, 0) >= cap:
                print(f"note: {name}: search space exhausted (the sampler kept proposing measured configs)",
                      file=sys.stderr)
                return not running, worked
            busy = {params_key(t.params): t.number for t in running if t.params}
            width = min(self.o.strategy.width(self.prefetch.workers, self.trials), owed)
            batch = []
            for _ in range(width):
                if grid is None:
                    self._steer(study, self.o.strategy, self.trials - owed + len(batch), measured, batch, dists,
                                lambda q: not space.violation(q, env), rng, busy)
                trial = study.ask()
                self._asks[key] = self._asks.get(key, 0) + 1
                self._hold(trial)
                params = {n: trial.suggest_categorical(n, dists[n]) for n in dists}
                role = trial.user_attrs.get("role", "search")
                trial.set_user_attr("role", role)
                batch.append((trial, params, role))
                if params_key(params) not in measured and not self._violation(role, space, params, env):
                    self.prefetch.submit(backend, params, sd)

            def repair():
                if grid is None and feasible:
                    todo = [g for g in feasible if params_key(g) not in measured and params_key(g) not in waiting
                            and params_key(g) not in busy]
                    if todo:
                        g = rng.choice(todo)
                        study.enqueue_trial(g, user_attrs={"role": "search"})
                        waiting.add(params_key(g))

            for i, (trial, params, role) in enumerate(batch):
                k = params_key(params)
                retry = "failed_trial" in study._storage.get_trial(trial._trial_id).system_attrs
                if k in measured or (k in busy and grid is None and not retry):
                    # measured already, or being measured by another worker: not counted here
                    repair()
                    src = measured.get(k)
                    try:
                        trial.set_user_attr("duplicate_of", src.number if src else busy[k])
                        if src is not None and src.state == TS.COMPLETE:
                            study.tell(trial, src.value)
                        else:
                            study.tell(trial, state=src.state if src is not None else TS.FAIL)
                    except self.optuna.exceptions.UpdateFinishedTrialError:
                        pass
                    self.beats.release(trial._trial_id)
                    continue
                try:
                    m, _ = self._run_one(backend, trial, params, role, space, env, spec, sd, seed, repair,
                                         guard=self.intr.interruptible)
                except BaseException as e:
                    if isinstance(e, KeyboardInterrupt):   # a second Ctrl-C must not cut the clean-up short
                        signal.signal(signal.SIGINT, signal.SIG_IGN)
                    for t, _, _ in batch[i:]:   # not finished: failed as interrupted, retried elsewhere
                        self._fail(study, t, retry=True, interrupted=True)
                    raise
                row = self._row(backend, tp, bs, ctx, spec, name, trial.number, role, params, m)
                if self._tell(study, trial, m, row):
                    measured[k] = study._storage.get_trial(trial._trial_id)
                worked = True

    def _init_study(self, study, name, space, backend, dists, spec, default, grid, key):
        TS = self.optuna.trial.TrialState
        self._check_dists(study, name, space, backend, dists, spec)
        trials = study.get_trials(deepcopy=False)
        have = {params_key(t.params) for t in self._counted_trials(trials)} | \
            {params_key(t.params) for t in trials if t.state in (TS.WAITING, TS.RUNNING)}

        def enqueue(params, role):
            k = params_key(params)
            if k in have or any(params.get(n) not in dists[n] for n in dists):
                return
            study.enqueue_trial(params, user_attrs={"role": role})
            have.add(k)

        enqueue(default, "baseline")
        for w in self._warm(*key):
            enqueue(w, "warm")
        for g in grid or ():
            enqueue(g, "search")
        study.set_user_attr("ready", self.worker_id)

    def search(self):
        """Visit the studies (from this worker's offset) until none owes a trial or has one
        running anywhere."""
        plan = [(be, tp, bs, ctx) for tp in self.tps for bs in self.bss
                for be in [b for b in self.backends if b in self.spaces] for ctx in self.ctxs]
        start = self.index * len(plan) // self.of
        order = plan[start:] + plan[:start]
        while order:
            states = [self.search_study(*k) for k in order]
            if all(done for done, _ in states):
                return
            if not any(worked for _, worked in states):
                with self.intr.interruptible():
                    time.sleep(min(1.0, self.heartbeat_s / 2))

    # -- the whole run: workers, then (parent) the phases after the search ----------------
    def run(self):
        t0 = self.t0 = time.time()
        status = "complete"
        self.intr.install()
        try:
            if self.children_cmd:
                status = self._run_children()
            if status == "complete":
                self._setup()
                self.search()
                if self.post:
                    self._post()
        except (KeyboardInterrupt, _Stop) as e:
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped ({e})"
            print(f"\nsweep {status}: every finished trial is saved; re-run the same command to resume",
                  file=sys.stderr)
        finally:
            self.intr.restore()
            self._stop_children()
            self.beats.close()
            self.executor.close(force=status != "complete")
            self.prefetch.close()
        self.status = status
        self.wall_s = time.time() - t0
        self._log_run(t0)
        return self.results

    children_cmd: list | None = None

    def _post(self):
        backends = [b for b in self.backends if b in self.spaces]
        for tp in self.tps:
            for bs in self.bss:
                for be in backends:
                    for ctx in self.ctxs:
                        name, study, _ = self._open_study(be, tp, bs, ctx)
                        self._reconcile(study, name)      # rows of workers on other hosts
                    self.cross_measure(be, tp, bs)
                    self.remeasure(be, tp, bs)
                self.serve_check(tp, bs)
        self.results = [self._study_result(be, tp, bs, ctx, *self._open_study(be, tp, bs, ctx)[:2])
                        for tp in self.tps for bs in self.bss for be in backends for ctx in self.ctxs]

    def _run_children(self) -> str:
        n = len(self.children_cmd)
        for i, (cmd, env) in enumerate(self.children_cmd):
            self.children.append(subprocess.Popen(cmd, env=env))
        print(f"sweep {self.dep.name}: {n} worker process(es) {[p.pid for p in self.children]} sharing "
              f"{redact_url(self.storage_url)}", file=sys.stderr, flush=True)
        done = set()
        while len(done) < n:
            for i, p in enumerate(self.children):
                if i not in done and p.poll() is not None:
                    done.add(i)
                    if p.returncode == 130:
                        return "interrupted"
                    if p.returncode != 0:
                        print(f"warning: worker {i} (pid {p.pid}) exited with {p.returncode}; trials it held "
                              f"are retried once stale ({self.grace_s} s)", file=sys.stderr, flush=True)
            with self.intr.interruptible():
                time.sleep(0.5)
        return "complete"

    def _stop_children(self):
        live = [p for p in self.children if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGINT)            # a worker fails (and requeues) what it holds
        for p in live:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _run_record(self, t0) -> dict:
        rec = super()._run_record(t0)
        rec.update(worker=self.worker_id, dropped_stale=self.dropped)
        if self.children:
            rec.update(workers=len(self.children), worker_exit_codes=[p.returncode for p in self.children])
        return rec

    def summary(self) -> str:
        text = super().summary()
        if not self.results:
            return text
        counted = stale = 0
        for _, study, _ in self._studies.values():
            trials = study.get_trials(deepcopy=False)
            counted += len(self._counted_trials(trials))
            stale += len({n for t in trials for n in t.system_attrs.get("retry_history", ())})
        return (f"{text}\n{len(self.children)} worker process(es) shared {redact_url(self.storage_url)}: "
                f"{counted} trials "
                f"counted, {stale} failed as stale and retried (the measurements above are this process's own)")


# --------------------------------------------------------------------------- spawning
def _worker_args(args, dep: Deployment, storage: str, device: str) -> list[str]:
    """The `kvtune worker` command line sharing this run's studies and options."""
    if not Path(str(dep.source)).is_file():
        raise ConfigError(f"deployment {dep.name}: workers need its YAML file (got {dep.source})")
    cmd = [sys.executable, "-m", "kvtune.tuner.cli", "worker", str(dep.source), "--storage", storage,
           "--device", device, "--out", args.out, "--seed", str(args.seed), "--heartbeat", str(args.heartbeat),
           "--grace", str(args.grace), "--trial-timeout", str(args.trial_timeout)]
    for flag, vals in (("--tp", args.tp), ("--ctx", args.ctx), ("--bs", args.bs), ("--backend", args.backend)):
        if vals:
            cmd += [flag, *[str(v) for v in vals]]
    for flag, val in (("--trials", args.trials), ("--timing", args.timing), ("--space-dir", args.space_dir),
                      ("--max-minutes", args.max_minutes), ("--compile-workers", args.compile_workers)):
        if val is not None:
            cmd += [flag, str(val)]
    if getattr(args, "grid", False):
        cmd.append("--grid")
    return cmd


def _slots(device: str, n: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each worker (one GPU each), or None per CPU worker."""
    if n < 1:
        raise ConfigError(f"--workers {n}: at least one worker")
    if device == "cpu":
        return [None] * n
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        ids = [v.strip() for v in vis.split(",") if v.strip()]
    else:
        import torch
        ids = [str(i) for i in range(torch.cuda.device_count())]
    if n > len(ids):
        raise ConfigError(f"--workers {n}: only {len(ids)} GPU(s) visible ({ids}); one worker per GPU")
    return ids[:n]


def launch(args, opts: SweepOptions, workers: int, post: bool) -> SharedSweep:
    """Parent of `workers` worker processes; then mop-up search and (post) the phases after it."""
    dep = load_deployment(args.deployment)
    sw = SharedSweep(dep, opts, args.heartbeat, args.grace, post=post)
    base = _worker_args(args, dep, sw.storage_url, sw.device)
    slots = _slots(sw.device, workers)
    cw = opts.compile_workers
    if cw is None and sw.device == "cuda":  # share the CPU cores among the workers' compile pools
        cw = max(1, min(6, (os.cpu_count() or 2) // (2 * workers) - 1))
    sw.children_cmd = []
    for i, slot in enumerate(slots):
        env = dict(os.environ)
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot
        cmd = base + ["--index", str(i), "--of", str(workers), "--no-progress"]
        if cw is not None and "--compile-workers" not in cmd:
            cmd += ["--compile-workers", str(cw)]
        sw.children_cmd.append((cmd, env))
    sw.run()
    return sw


def _opts(args) -> SweepOptions:
    return SweepOptions(tps=args.tp, ctxs=args.ctx, bss=args.bs, backends=args.backend, trials=args.trials,
                        storage=args.storage, timing=args.timing, seed=args.seed, device=args.device, out=args.out,
                        space_dir=args.space_dir, remeasure_top=getattr(args, "remeasure_top", 3),
                        rounds=getattr(args, "rounds", 3), trial_timeout_s=args.trial_timeout, progress=False,
                        max_minutes=args.max_minutes, compile_workers=args.compile_workers,
                        grid=getattr(args, "grid", False))


def cmd_sweep_workers(args) -> int:
    """`kvtune sweep ... --workers N`."""
    sw = launch(args, _opts(args), args.workers, post=True)
    print(sw.summary())
    print(f"trials: {sw.out_dir / 'trials.csv'}   studies: {redact_url(sw.storage_url)}   workers: {args.workers}")
    if args.export and sw.results and sw.status == "complete":
        from .export import export_deployment
        export_deployment(sw.dep, out=args.out)
    return 130 if sw.status == "interrupted" else 0


def _cmd_worker(args) -> int:
    opts = _opts(args)
    if args.workers:
        sw = launch(args, opts, args.workers, post=False)
    else:
        dep = load_deployment(args.deployment)
        sw = SharedSweep(dep, opts, args.heartbeat, args.grace, index=args.index, of=args.of)
        sw.run()
    print(f"worker {sw.worker_id}: {sw.status}, {sw.measured_now} measurements, {sw.dropped} dropped as stale, "
          f"{sw.wall_s:.1f} s ({redact_url(sw.storage_url)})", file=sys.stderr)
    return 130 if sw.status == "interrupted" else 0


def add_worker_options(p) -> None:
    p.add_argument("--heartbeat", type=int, default=10, help="seconds between a worker's heartbeats (default 10)")
    p.add_argument("--grace", type=int, default=60,
                   help="seconds without a heartbeat before a running trial is failed and retried (default 60)")


def register(subparsers) -> None:
    p = subparsers.add_parser("worker", help="join a sweep: measure trials of its shared studies",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("deployment", help="deployment YAML (or its name under configs/deployments/)")
    p.add_argument("--storage", required=True,
                   help="the sweep's Optuna storage: journal:PATH (one host) or postgresql://... (several)")
    p.add_argument("--workers", type=int, help="start this many worker processes here, one per visible GPU")
    p.add_argument("--tp", type=int, nargs="+")
    p.add_argument("--ctx", type=int, nargs="+")
    p.add_argument("--bs", type=int, nargs="+")
    p.add_argument("--backend", nargs="+")
    p.add_argument("--trials", type=_positive_int("--trials"),
                   help="trial budget per study (default: the deployment's)")
    p.add_argument("--timing", choices=("graph", "eager"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"))
    p.add_argument("--out", default="runs", help="output root (default ./runs)")
    p.add_argument("--space-dir")
    p.add_argument("--trial-timeout", type=float, default=600.0)
    p.add_argument("--compile-workers", type=int)
    p.add_argument("--grid", action="store_true")
    p.add_argument("--max-minutes", type=_non_negative("--max-minutes"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)   # this worker's start offset
    p.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    add_worker_options(p)
    p.set_defaults(func=_cmd_worker)
