"""`<out>/<deployment>/sweep.lock`: one sweep at a time per run folder, and a trace of a sweep
that was killed; `StorageLock`: one sweep at a time per deployment in a PostgreSQL storage.

A sweep holds an exclusive `flock` on the file while it runs and writes its pid, start and
command into it; it empties the file when it ends, however it ends (an error included) short
of SIGKILL or a power cut. So a second sweep into the folder is refused while the first runs (two would fail
each other's running trials), and `kvtune export` can tell a sweep that never recorded its end
(`runs.jsonl` is written at the end) from one that finished. The kernel drops the lock when the
process dies, so a killed sweep never blocks the next one.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from .config import ConfigError, redact_url
from .log import get_logger

log = get_logger(__name__)

NAME = "sweep.lock"
LOCK_CLASS = 0x6B767475   # "kvtu": the first key of kvtune's advisory locks in a shared PostgreSQL


def _holder(f) -> dict:
    f.seek(0)
    try:
        return json.loads(f.read() or "{}")
    except json.JSONDecodeError:
        return {}


class RunLock:
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / NAME
        self._f = None

    def acquire(self, command: str) -> None:
        f = self.path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not isinstance(e, BlockingIOError):   # a filesystem without flock (NFS without lockd, ...)
                f.close()
                log.warning("%s: cannot lock (%s); sweeping without the one-sweep-per-folder guard", self.path, e)
                return
            h = _holder(f)
            f.close()
            raise ConfigError(f"{self.path.parent}: another kvtune sweep is writing this folder (pid "
                              f"{h.get('pid', '?')}, started {h.get('start', '?')}: {h.get('command', '?')}); wait "
                              "for it or stop it, or sweep into another --out") from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "start": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "command": command}))
        f.flush()
        self._f = f

    def release(self) -> None:
        if self._f is not None:
            self._f.truncate(0)
            self._f.close()   # closing drops the flock
            self._f = None


def unfinished_sweep(out_dir: Path) -> str | None:
    """How the folder's last sweep left it, when it did not end cleanly: 'running now (...)' or
    'was killed (...)'; None when no sweep is running and the last one ended."""
    path = Path(out_dir) / NAME
    if not path.is_file() or not path.stat().st_size:
        return None
    with path.open("r") as f:
        h = _holder(f)
        who = f"pid {h.get('pid', '?')}, started {h.get('start', '?')}"
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"is running now ({who})"
        except OSError:   # no flock on this filesystem: a running sweep cannot be told from a killed one
            return f"did not record its end, or is running now ({who})"
    return f"was killed before it recorded its end ({who})"


class StorageLock:
    """One sweep of a deployment per PostgreSQL storage, whatever host it runs on: a session-level
    advisory lock held on a connection of its own for the sweep's life. Two sweeps sharing the
    studies would each run the phases after the search and export over the other (workers join
    with `kvtune worker`, which takes no lock). The server drops the lock when the connection
    ends, so a killed sweep never blocks the next. Other storages: no-op (journal and SQLite
    live in the run folder, which `RunLock` guards)."""

    def __init__(self, storage, url: str, deployment: str):
        self.engine = getattr(storage, "engine", None)
        self.url, self.deployment = url, deployment
        # the two-int4 form of the advisory lock: kvtune's class, and the deployment name's hash;
        # written into the statement as literals (both ints of ours), no bound parameters
        h = hashlib.blake2b(f"kvtune sweep {deployment}".encode(), digest_size=4).digest()
        self.key = (LOCK_CLASS, int.from_bytes(h, "big", signed=True))
        self._conn = None

    def acquire(self) -> None:
        if self.engine is None or self.engine.dialect.name != "postgresql":
            return
        import sqlalchemy as sa
        # autocommit: never idle in a transaction, and SQLAlchemy 1.4's legacy connections have no commit()
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        got = conn.execute(sa.text("SELECT pg_try_advisory_lock(%d, %d)" % self.key)).scalar()
        if not got:
            conn.close()
            raise ConfigError(f"--storage {redact_url(self.url)}: another kvtune sweep of {self.deployment} is "
                              "running on this storage (on some host); join it with `kvtune worker`, or wait for it "
                              "to end")
        self._conn = conn   # checked out of the pool for the sweep's life: the lock is this session's

    def release(self) -> None:
        if self._conn is not None:
            try:
                import sqlalchemy as sa
                self._conn.execute(sa.text("SELECT pg_advisory_unlock(%d, %d)" % self.key))
            except Exception as e:  # noqa: BLE001 - a lost connection: the server dropped the lock with it
                log.warning("--storage %s: the one-sweep lock's connection was lost (%s); the server dropped the "
                            "lock then, so another sweep could have started since", redact_url(self.url),
                            type(e).__name__)
            finally:
                self._conn.close()
                self._conn = None
