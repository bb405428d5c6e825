"""Sweeps that outgrow one GPU: worker processes sharing the studies through Optuna storage.

`kvtune sweep DEPLOYMENT --workers N` starts N `kvtune worker` processes, one per visible GPU
(`CUDA_VISIBLE_DEVICES` set per worker; with `--device cpu`, N CPU processes), and
`kvtune worker --storage URL DEPLOYMENT` joins a running sweep from another host. There is
no scheduler: a worker walks the (backend, tp, bs, ctx) studies (each worker starting at
its own offset) and runs the sweep's own study loop (`tuner/study.py`) on each: it asks a
study for trials while the study's counted finished trials plus those running elsewhere are
under the budget (for a grid: while grid points are queued); it then revisits the studies
until none owes a trial and none has a trial running. What this module adds is what
differs: the processes, the shared storage, heartbeats and interruptions.

Storage (`tuner/storage.py`): by default Optuna's journal file
`<out>/<deployment>/studies.journal` (safe for processes on one host, unlike SQLite); any
SQLAlchemy URL (PostgreSQL) for several hosts. A study is seeded (baseline, warm starts,
grid) once, by the worker that creates it; the others wait for it (up to `--grace`).

Fault tolerance. Every trial a worker holds carries its `worker` (host:pid) and a
heartbeat, every `--heartbeat` seconds, from a thread of the worker. A trial whose heartbeat
is older than `--grace` seconds (its worker was killed, or its host lost) is failed by
whichever worker looks next, which also enqueues one retry (`RetryStale`: the retry carries
the trial's role but no half-told result). A failed-as-stale trial is never counted (it is
in its retry's `retry_history`); a worker that comes back and tells a trial already failed
as stale drops its result. So each finished trial is counted and written to the trials
table once.

The trials table: each worker appends under a file lock (see `tuner/table.py`); rows of
workers on other hosts reach the table from the storage (every finished trial carries its
row), reconciled by the parent. The parent shows the progress it reads from the storage,
and, after its workers exit, measures whatever is still owed (trials of dead workers once
stale) and then runs the cross-bucket and interleaved re-measurement phases once, in the
same order as a single-process sweep, so the export of the same trials is the same.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from datetime import datetime

from .config import ConfigError, Deployment, redact_url
from .log import get_logger
from .options import SweepOptions
from .progress import Progress
from .studies_files import folder_storages, journal_url
from .strategy import BESIDE_SEARCH, params_key
from .study import STUDY_SEP, is_retry, study_name
from .sweep import Sweep

log = get_logger(__name__)


class Interrupts:
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


def _die_with_parent(parent: int):
    """A child's pre-exec hook (Linux): SIGTERM when the parent sweep dies, SIGKILL included, so
    no orphaned worker goes on measuring beside the next run's (two processes on one GPU would
    skew both's timings). The worker takes SIGTERM as an interrupt: its held trials are failed
    as interrupted and queued again."""
    def hook():
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):   # not Linux: the parent's own exit paths stop its workers
            return
        if os.getppid() != parent:   # the parent died before the hook ran
            os._exit(1)
    return hook


class SharedSweep(Sweep):
    """A sweep whose studies other processes share: a worker's search (`search`), and for the
    parent of `--workers` its children, their progress, and the phases after the search
    (`post=True`)."""

    shared = True
    children_cmd: list | None = None   # [(argv, env)] of the worker processes to start (the parent)

    def __init__(self, dep: Deployment, opts: SweepOptions, heartbeat_s: int = 10, grace_s: int = 60,
                 index: int = 0, of: int = 1, post: bool = False):
        from .storage import Heartbeats
        self.heartbeat_s, self.grace_s = int(heartbeat_s), int(grace_s)
        if self.heartbeat_s < 1:
            raise ConfigError(f"--heartbeat {heartbeat_s}: expected a positive number of seconds")
        if self.grace_s <= self.heartbeat_s:   # every live trial would be failed as stale between two beats
            raise ConfigError(f"--grace {grace_s}: must exceed --heartbeat {heartbeat_s} (a trial is failed as "
                              "stale after --grace seconds without a heartbeat; give it several)")
        super().__init__(dep, dataclasses.replace(opts, reclaim_running=False))
        warnings.filterwarnings("ignore", message=".*[Hh]eartbeat.*")
        self.index, self.of, self.post = index, max(1, of), post
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.beats = Heartbeats(self.storage, self.heartbeat_s)
        self.intr = Interrupts()
        self._created: dict = {}
        self._storage_checked: set = set()
        self._first_seen: dict = {}
        self.dropped = 0
        self.children: list = []

    def _default_storage(self) -> str:
        db, journal = folder_storages(self.out_dir)
        table = self.out_dir / "trials.csv"
        if db.is_file() and not journal.is_file() and table.is_file() and len(table.read_bytes().splitlines()) > 1:
            # SQLite is not safe for several processes, and a new journal would lack those studies
            raise ConfigError(f"{db}: this folder's studies were swept without --workers (SQLite, one process); "
                              "resume it without --workers, or sweep with --workers into a new --out")
        return journal_url(journal)

    def _open_storage(self):
        from .storage import open_shared_storage
        return open_shared_storage(self.storage_url, self.heartbeat_s, self.grace_s)

    # -- the study loop's hooks -----------------------------------------------------------
    def _open_study(self, backend, tp, bs, ctx):
        """(name, study, seed); whoever creates the study seeds it (`_prepare`), once."""
        key = (backend, tp, bs, ctx)
        if key in self._studies:
            return self._studies[key]
        optuna = self.optuna
        name = study_name(self.dep.name, *key)
        seed = self._seed(name)
        sampler = self.o.strategy.sampler(optuna, seed + 7919 * self.index, self.trials)
        try:
            study = optuna.create_study(study_name=name, storage=self.storage, sampler=sampler,
                                        direction="minimize", load_if_exists=False)
            self._created[key] = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=name, storage=self.storage, sampler=sampler)
        self._studies[key] = (name, study, seed)
        return self._studies[key]

    def _prepare(self, key, plan, name, study) -> bool:
        if key not in self._storage_checked:   # once per study and process: the table only grows
            self._check_storage_holds_table(study, name)
            self._storage_checked.add(key)
        if "ready" in study.user_attrs:
            self._check_dists(study, name, plan)
            self._check_joined(study, name, plan)
            return True
        first = self._first_seen.setdefault(key, time.time())
        if not self._created.get(key) and time.time() - first < self.grace_s:
            return False          # its creator is seeding it
        self._check_dists(study, name, plan)
        self._enqueue_start(study, plan, key)
        study.set_user_attr("ready", self.worker_id)
        return True

    def _own_studies(self) -> list:
        """The storage's studies of this deployment (a PostgreSQL database may hold others')."""
        return [s for s in self.storage.get_all_studies() if s.study_name.startswith(self.dep.name + STUDY_SEP)]

    def await_sweep(self, wait_s: float) -> None:
        """A worker started by hand joins a running sweep: wait up to `wait_s` (`--wait`) for the storage to
        hold a study of this deployment (the sweep's own workers create them as they start), then
        refuse. A mistyped URL or database would otherwise start a sweep of its own there."""
        deadline, said = time.time() + wait_s, False
        while not self._own_studies():
            if time.time() >= deadline:
                raise ConfigError(f"--storage {redact_url(self.storage_url)}: no sweep of {self.dep.name} there after "
                                  f"{wait_s:.0f} s; a worker joins a sweep (`kvtune sweep {self.dep.source} --workers "
                                  "N --storage URL` on one host starts it), it does not start one")
            if not said:
                log.info("waiting up to %.0f s for the sweep of %s to create its studies in %s", wait_s,
                         self.dep.name, redact_url(self.storage_url))
                said = True
            time.sleep(min(1.0, wait_s / 10))

    def _check_joined(self, study, name, plan) -> None:
        """A worker joining a study measures the problem it was created for: another model shape
        (draft tokens, heads, tree) would put other numbers into its trials. (Another --trials is
        not refused: a resume may widen the budget, and every process of it passes the new one.)"""
        ua, mine = study.user_attrs, json.loads(json.dumps(dataclasses.asdict(plan.spec)))   # as stored
        made = ua.get("spec") or {}
        diff = [f"{k} {made[k]!r} (here {mine[k]!r})" for k in made if k in mine and made[k] != mine[k]]
        if diff:
            raise ConfigError(f"study {name!r} in {redact_url(self.storage_url)} was created for {', '.join(diff)}: "
                              "a worker joins with the sweep's own deployment file")

    def _before_batch(self, study) -> None:
        self.intr.check()                  # between batches: nothing held
        self._fail_stale(study)

    def _ask_batch(self, key, plan, study, st, owed: int, rng) -> list:
        """The batch asked from the snapshot `st`, then checked against the study as it is now:
        two workers that read one snapshot could both fill its last slot, or both propose one
        config. Trial numbers are handed out atomically, so the higher-numbered trial yields:
        released unmeasured when the running trials numbered below it fill the budget, told as a
        duplicate when one of them holds (or, its params half written, may hold) its config. A
        trial taken from the queue got its number when it was queued, so for it every running
        trial is ahead (both may yield; the loop asks again). The baseline and retries are kept;
        twins the snapshot saw are left to _measure_batch, which queues a repair config."""
        batch = super()._ask_batch(key, plan, study, st, owed, rng)
        if plan.grid is not None or not batch:
            return batch
        now, mine = self._state(study), {t.number for t, _, _ in batch}
        kept = []
        for trial, params, role in batch:
            attrs = study._storage.get_trial(trial._trial_id).system_attrs
            queued = "fixed_params" in attrs
            ahead = [t for t in now.running if t.number != trial.number and (queued or t.number < trial.number)]
            # a twin inside this batch is told a duplicate of the measured one by _measure_batch
            twins = (t for t in ahead if t.number not in mine and t.params and params_key(params) not in st.busy
                     and all(params.get(n) == v for n, v in t.params.items()))
            if role == "baseline" or is_retry(attrs):
                kept.append((trial, params, role))
            elif now.counted + sum(1 for t in ahead if t.user_attrs.get("role") not in BESIDE_SEARCH) >= self.trials:
                self._fail(study, trial, retry=False, released=True)
            elif (twin := next(twins, None)) is not None:
                self._tell_duplicate(study, trial, None, twin.number)
            else:
                kept.append((trial, params, role))
        return kept

    def _hold(self, trial) -> None:
        self.beats.hold(trial._trial_id)                 # heartbeat first: a held trial always has one
        trial.set_user_attr("worker", self.worker_id)

    def _release(self, trial) -> None:
        self.beats.release(trial._trial_id)

    def _interruptible(self):
        return self.intr.interruptible()

    def _tell(self, study, trial, m: dict, row: dict) -> bool:
        try:
            return super()._tell(study, trial, m, row)
        except self.optuna.exceptions.UpdateFinishedTrialError:
            # failed as stale meanwhile (no heartbeat for the grace period) and retried elsewhere
            self.dropped += 1
            log.info("note: %s trial %s was failed as stale and retried; this measurement is dropped",
                     study.study_name, trial.number)
            self._release(trial)
            return False

    def _abandon(self, study, trials) -> None:
        """Trials of a batch left unfinished: failed as interrupted and queued again, for
        another worker or the next run."""
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):   # a second Ctrl-C must not cut this short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for t in trials:
            self._fail(study, t, retry=True, interrupted=True)

    def _fail(self, study, trial, retry: bool, **attrs):
        """Fail a trial this worker holds; with `retry`, another worker retries it."""
        from .storage import RetryStale
        TS = self.optuna.trial.TrialState
        try:
            for k, v in attrs.items():
                study._storage.set_trial_user_attr(trial._trial_id, k, v)
            study.tell(trial, state=TS.FAIL)
            if retry:
                RetryStale()(study, study._storage.get_trial(trial._trial_id))
        except self.optuna.exceptions.UpdateFinishedTrialError:
            pass
        self._release(trial)

    def _fail_stale(self, study):
        """Running trials whose worker stopped beating are failed and retried (Optuna's
        fail_stale_trials); so are trials left running without any heartbeat (a worker killed
        between asking a trial and its first heartbeat) once much older than the grace."""
        from .storage import RetryStale
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

    # -- the whole run: workers, then (parent) the phases after the search ----------------
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

    def _work(self) -> str:
        self.intr.install()
        if self.children_cmd:
            if self.device == "cuda":
                self._check_gpus_named()   # before N children each fail on it
            status = self._run_children()
            if status != "complete":
                return status
            self.intr.check()   # a Ctrl-C after the last child ended, before any phase of the parent's
        self._setup()
        self.search()
        if self.post:
            self._post()
        self.intr.check()
        return "complete"

    def _measure(self, backend, params, spec, seed, extra: dict | None = None) -> dict:
        # Interrupts' handler only records a Ctrl-C outside `interruptible`, so the phases after
        # the search (cross, re-measure, ragged: measurements that hold no trial) take it here,
        # as a single-process sweep's `stops.check` does
        self.intr.check()
        return super()._measure(backend, params, spec, seed, extra)

    def _post(self):
        backends = [b for b in self.backends if b in self.spaces]
        for tp in self.tps:
            for bs in self.bss:
                for be in backends:
                    for ctx in self.ctxs:
                        self._reconcile(self._open_study(be, tp, bs, ctx)[1])   # rows of workers on other hosts
                    self.after_search(be, tp, bs)
        self.results = [self._study_result(be, tp, bs, ctx)
                        for tp in self.tps for bs in self.bss for be in backends for ctx in self.ctxs]

    def _close(self, status: str) -> None:
        self.intr.restore()
        self._stop_children()
        self.beats.close()
        super()._close(status)

    # -- the parent's children ------------------------------------------------------------
    def _check_gpus_named(self) -> None:
        """Every visible GPU is the one the deployment's device profile names (or --other-device):
        the check each worker's set-up makes, made once before any is started."""
        import torch

        from kvtune.kernels.lookup import device_arch, device_name   # the spellings provenance records

        from .sweep import check_device_name
        for i in range(torch.cuda.device_count()):
            gpu = f"cuda:{i}"
            check_device_name(self.dep, {"device_name": device_name(gpu), "arch": device_arch(gpu)},
                              self.o.other_device)

    def _run_children(self) -> str:
        n = len(self.children_cmd)
        for cmd, env in self.children_cmd:
            self.children.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent(os.getpid())))
        log.info("sweep %s: %d worker process(es) %s sharing %s", self.dep.name, n,
                 [p.pid for p in self.children], redact_url(self.storage_url))
        if self.o.progress:
            self.bar = Progress(len(self.backends) * len(self.tps) * len(self.bss) * len(self.ctxs) * self.trials)
        reported: set = set()
        done, polled = set(), 0.0
        while len(done) < n:
            for i, p in enumerate(self.children):
                if i not in done and p.poll() is not None:
                    done.add(i)
                    if p.returncode == 130:
                        return "interrupted"
                    if p.returncode != 0:
                        log.warning("worker %d (pid %d) exited with %d; trials it held are retried once stale "
                                    "(%d s)", i, p.pid, p.returncode, self.grace_s)
            if self.bar is not None and time.time() - polled > 2:
                self._poll_progress(reported)
                polled = time.time()
            with self.intr.interruptible():
                time.sleep(0.5)
        if self.bar is not None:
            self._poll_progress(reported, final=True)
            self.bar.close()
            self.bar = None
        return "complete"

    def _poll_progress(self, reported: set, final: bool = False) -> None:
        """The workers' progress as the storage shows it: counted trials of every study, and a
        study's best once it has its budget (with --grid, whose size only the workers know: at the end)."""
        TS = self.optuna.trial.TrialState
        total, finished = 0, []
        for s in self._own_studies():
            counted = [t for t in self._counted(self.storage.get_all_trials(s._study_id, deepcopy=False))
                       if self.o.strategy.counts(t.user_attrs)]
            total += len(counted) if self.o.grid else min(len(counted), self.trials)   # --grid: every config
            ok = [t for t in counted if t.state == TS.COMPLETE]
            if ok and s.study_name not in reported and (final or not self.o.grid and len(counted) >= self.trials):
                reported.add(s.study_name)
                finished.append((s.study_name, min(ok, key=lambda t: t.value)))
        if total > self.bar.total:   # --grid sweeps more configs per study than --trials
            self.bar.expect(total - self.bar.total)
        self.bar.update(max(0, total - self.bar.n))
        for name, best in finished:
            self.bar.best(" ".join(name.split(STUDY_SEP)[1:]), best.value, best.user_attrs.get("pct_floor"))

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
            counted += len(self._counted(trials))
            stale += len({n for t in trials for n in t.system_attrs.get("retry_history", ())})
        return (f"{text}\n{len(self.children)} worker process(es) shared {redact_url(self.storage_url)}: "
                f"{counted} trials counted, {stale} failed as stale and retried (the measurements above are this "
                "process's own)")
