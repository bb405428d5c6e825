"""Where the Optuna studies live: one process's storage, and storage several processes share.

`open_storage` serves a single-process sweep: any SQLAlchemy URL (SQLite by default) or
`journal:PATH` for Optuna's journal file. `open_shared_storage` serves worker processes
(`tuner/workers.py`): the journal file on one host, PostgreSQL across hosts, both with
heartbeats, so a trial whose worker died is failed and retried (`RetryStale`).

Heartbeats on the journal: Optuna implements its heartbeat interface for RDB storage only;
`HeartbeatJournalStorage` records a heartbeat as the trial system attribute
`kvtune:heartbeat` and implements that interface, so `optuna.storages.fail_stale_trials`
works on both.
"""
from __future__ import annotations

import inspect
import threading
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend

from .config import ConfigError, redact_url
from .studies_files import journal_path

HEARTBEAT_KEY = "kvtune:heartbeat"


def open_storage(url: str):
    """(storage, url) for one process: an SQLAlchemy URL, or `journal:PATH`."""
    if (journal := journal_path(url)) is not None:
        return JournalStorage(journal_backend(journal)), url
    kw = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    try:
        return optuna.storages.RDBStorage(with_driver(url), engine_kwargs=kw), url
    except Exception as exc:  # SQLAlchemy's URL parse, dialect and connection errors
        raise _unopenable(url, exc, "sqlite:///PATH, postgresql://USER@HOST/DB or journal:PATH") from None


def _unopenable(url: str, exc: Exception, forms: str) -> ConfigError:
    """The error for a --storage that cannot be opened: the URL (password hidden), what failed
    (its first line), and the accepted forms."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    return ConfigError(f"--storage {redact_url(url)}: cannot open it as a study storage ({type(exc).__name__}: "
                       f"{first}); expected {forms}")


def journal_backend(path) -> JournalFileBackend:
    """Optuna's journal file backend at `path` (its folder created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return JournalFileBackend(str(path))


class RetryStale:
    """Optuna's RetryFailedTrialCallback (RetryHeartbeatStaleTrialCallback in optuna >= 4.9):
    a trial failed as stale is enqueued again (WAITING, same params), at most `max_retry`
    times; the retry keeps the trial's role but none of a result it may have half-told."""

    def __init__(self, max_retry: int = 2):
        self.max_retry = max_retry

    def __call__(self, study, trial) -> None:
        history = list(trial.system_attrs.get("retry_history", [])) + [trial.number]
        if len(history) > self.max_retry:
            return
        sysattrs = {"failed_trial": trial.system_attrs.get("failed_trial", trial.number), "retry_history": history}
        study.add_trial(optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING, params=trial.params, distributions=trial.distributions,
            user_attrs={"role": trial.user_attrs.get("role", "search")}, system_attrs=sysattrs))


class HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
    """Optuna's JournalStorage with Optuna's heartbeat interface: a RUNNING trial is stale when
    its last heartbeat (epoch seconds; else its start) is older than the grace period. Clocks:
    the processes sharing a journal file share a host."""

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
        for t in self.get_all_trials(study_id, deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
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


def open_shared_storage(url: str, heartbeat_s: int, grace_s: int, max_retry: int = 2):
    """(storage, url) several processes can share, with heartbeats: `journal:PATH` (one host)
    or an SQLAlchemy URL such as postgresql://user@host:port/db (several hosts). SQLite is refused."""
    cb = RetryStale(max_retry)
    if (journal := journal_path(url)) is not None:
        return HeartbeatJournalStorage(journal_backend(journal), heartbeat_s, grace_s, cb), url
    if url.startswith("sqlite"):
        raise ConfigError(f"--storage {redact_url(url)}: SQLite is not safe for several worker processes; use "
                          "journal:PATH on one host or a PostgreSQL URL for several")
    url = with_driver(url)
    kw = {"heartbeat_interval": heartbeat_s, "grace_period": grace_s}
    params = inspect.signature(optuna.storages.RDBStorage).parameters
    kw["heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params
       else "failed_trial_callback"] = cb
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attempt in range(5):   # workers starting together may race to create the schema
            try:
                return optuna.storages.RDBStorage(url, **kw), url
            except Exception as exc:  # noqa: BLE001
                if attempt == 4:
                    raise _unopenable(url, exc, "postgresql://USER@HOST/DB or journal:PATH") from None
                time.sleep(1 + attempt)


def with_driver(url: str) -> str:
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


class Heartbeats:
    """Records a heartbeat for every trial this process holds, every `interval` seconds, from a
    daemon thread (so a trial keeps beating while its measurement blocks)."""

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
