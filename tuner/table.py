"""The trials table: `results/<deployment>/trials.csv`, one row per measured trial.

Rows are appended and flushed to disk as each trial finishes, so an interrupted sweep
loses nothing it finished. The Optuna study is the source of truth (every finished
trial carries its row as a user attribute); at start-up rows the table lacks are written
back from the studies. Parameters get one column each (the dataclass field names, the
union over the backends); `params` holds them as JSON too. Tables written before a
parameter was renamed (`kernels.backends.RENAMED_PARAMS`) keep their old columns on disk;
`read_trials` gives them the current names.

Several worker processes of one sweep (`shared=True`) append to one table: each append
holds a file lock (`trials.csv.lock`), first reads the rows the others appended since,
and skips a row whose key (study, phase, trial, round) is there already, so a row is
written once however many processes reconcile it.
"""
from __future__ import annotations

import csv
import io
import json
import os
from contextlib import nullcontext
from pathlib import Path

from kvtune.kernels.backends import RENAMED_PARAMS, rename_legacy_params

LEAD = ["deployment", "study", "phase", "round", "backend", "tp", "heads", "bs", "ctx", "T", "tree", "trial", "role"]
RESULT = ["params", "outcome", "reason", "median_us", "p10_us", "p90_us", "rel_err", "gbps", "tflops", "floor_us",
          "pct_floor", "timing", "launches", "pools", "wall_s"]
PROVENANCE = ["device", "arch", "sm_count", "driver", "cuda", "nvrtc", "torch", "triton", "kernel_hash", "kvtune",
              "date"]


def columns(param_names: list[str]) -> list[str]:
    return LEAD + list(param_names) + RESULT + PROVENANCE


def row_key(row: dict) -> tuple:
    return (str(row["study"]), str(row["phase"]), str(row["trial"]), str(row.get("round", "")))


class TrialsTable:
    """Append-only CSV of trials (header widened in place when new parameters appear)."""

    def __init__(self, path: str | os.PathLike, param_names: list[str], shared: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.shared = shared
        if shared:
            from filelock import FileLock
            self.lock = FileLock(str(self.path) + ".lock")
        else:
            self.lock = nullcontext()
        with self.lock:
            self._load(param_names)

    def _load(self, param_names):
        cols = columns(param_names)
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                old_cols = list(reader.fieldnames or [])
                rows = list(reader)
            extra = [c for c in cols if c not in old_cols]
            if extra:  # widen: the old parameter columns stay, the new ones are added
                params = [c for c in old_cols if c not in LEAD + RESULT + PROVENANCE] + \
                    [c for c in param_names if c not in old_cols]
                cols = columns(params)
                self._rewrite(cols, rows)
            else:
                cols = old_cols
            self.keys = {row_key(r) for r in rows}
        else:
            self._rewrite(cols, [])
            self.keys = set()
        self.cols = cols
        self._mark()

    def _mark(self):
        st = self.path.stat()
        self._seen = (st.st_ino, st.st_size)

    def _catch_up(self):
        """Keys of the rows other processes appended since this one last looked."""
        st = self.path.stat()
        ino, size = self._seen
        if st.st_ino != ino or st.st_size < size:      # rewritten (widened) by another process
            with self.path.open(newline="") as f:
                reader = csv.DictReader(f)
                self.cols = list(reader.fieldnames or self.cols)
                self.keys = {row_key(r) for r in reader}
        elif st.st_size > size:
            with self.path.open("rb") as f:
                f.seek(size)
                tail = f.read().decode()
            self.keys |= {row_key(r) for r in csv.DictReader(io.StringIO(tail, newline=""), fieldnames=self.cols)}
        self._seen = (st.st_ino, st.st_size)

    def _rewrite(self, cols, rows):
        tmp = self.path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            for r in rows:
                w.writerow(r)
        os.replace(tmp, self.path)

    def append(self, row: dict) -> None:
        row = dict(row)
        params = row.get("params")
        if isinstance(params, dict):
            for k, v in params.items():
                row[k] = v
            row["params"] = json.dumps(params, sort_keys=True)
        with self.lock:
            if self.shared:
                self._catch_up()
                if row_key(row) in self.keys:
                    return                    # another worker wrote it (reconciled from the storage)
            unknown = [k for k in row if k not in self.cols]
            if unknown:
                raise ValueError(f"{self.path}: row has columns the table lacks: {unknown}")
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.cols, extrasaction="raise").writerow(
                    {k: ("" if v is None else v) for k, v in row.items()})
                f.flush()
                os.fsync(f.fileno())
            self.keys.add(row_key(row))
            if self.shared:
                self._mark()

    def has(self, row: dict) -> bool:
        if self.shared and row_key(row) not in self.keys:
            with self.lock:
                self._catch_up()
        return row_key(row) in self.keys


def read_trials(path: str | os.PathLike):
    """The table as a pandas DataFrame (params parsed back into dicts in column `params`)."""
    import pandas as pd
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no trials table (run `kvtune sweep` first)")
    lock = Path(str(path) + ".lock")
    if lock.exists():   # a table that worker processes append to: read it between two appends
        from filelock import FileLock
        with FileLock(str(lock)):
            text = path.read_text()
        path = io.StringIO(text)
    df = pd.read_csv(path, dtype={"reason": "string", "driver": "string", "cuda": "string", "nvrtc": "string",
                                  "kernel_hash": "string", "torch": "string", "triton": "string",
                                  "kvtune": "string", "round": "string"}, keep_default_na=True)
    df["params"] = [json.loads(p) if isinstance(p, str) and p else {} for p in df["params"]]
    return current_param_names(df)


def current_param_names(df):
    """`df` with the parameters a backend has renamed under their current names: for that
    backend's rows an old column's values move into the current column (created in the old
    one's place if missing; a value already there wins), the old column goes once no other
    backend's row uses it, and the `params` dicts are renamed alike."""
    for backend, renamed in RENAMED_PARAMS.items():
        rows = df["backend"] == backend
        for old, new in renamed.items():
            if old not in df.columns:
                continue
            moved = df[old].where(rows)
            if new in df.columns:
                df[new] = df[new].fillna(moved)
            else:
                df.insert(df.columns.get_loc(old), new, moved)
            if df[old].where(~rows).isna().all():
                df = df.drop(columns=old)
    df["params"] = [rename_legacy_params(b, p) for b, p in zip(df["backend"], df["params"])]
    return df
