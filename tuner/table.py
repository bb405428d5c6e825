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

A row reaches the file whole or not at all: it is encoded first and written with one
`write` on an O_APPEND descriptor, then fsync'd; a short write (a full disk) is cut back
off before the error is raised. A torn or malformed row that exists anyway (a kill
mid-`write`, a file of an older version, a disk that filled) is set aside when the table is
opened for writing: moved to `trials.csv.torn` with a warning naming the file and line, so
the sweep restores the trial from its study (search and cross-bucket trials carry their
row) or measures it again (re-measurements, serving checks). Readers (`read_trials`) skip
such rows with the same warning and change nothing. `runs.jsonl` gets the same treatment
(`append_line`, `read_jsonl`).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from contextlib import nullcontext
from pathlib import Path

from kvtune.kernels.backends import RENAMED_PARAMS, rename_legacy_params

from .extras import tune_module
from .log import get_logger

log = get_logger(__name__)

LEAD = ["deployment", "study", "phase", "round", "backend", "tp", "heads", "bs", "ctx", "T", "tree", "trial", "role"]
RESULT = ["params", "outcome", "reason", "median_us", "p10_us", "p90_us", "rel_err", "gbps", "tflops", "floor_us",
          "pct_floor", "timing", "launches", "pools", "wall_s"]
PROVENANCE = ["device", "arch", "sm_count", "driver", "cuda", "nvrtc", "torch", "triton", "kernel_hash", "kvtune",
              "date"]


def columns(param_names: list[str]) -> list[str]:
    return LEAD + list(param_names) + RESULT + PROVENANCE


#: the columns every trials table has had: without them a first line is not a header
_CORE = ("study", "phase", "trial", "params")


def row_key(row: dict) -> tuple:
    return (str(row["study"]), str(row["phase"]), str(row["trial"]), str(row.get("round", "")))


# -------------------------------------------------------------------- whole-or-nothing appends
FAULT_ENV = "KVTUNE_FAULT_KILL_AT"
_appends = 0


def _fault_point(path, data: bytes) -> int | None:
    """Test hook (tests/test_fault.py): `KVTUNE_FAULT_KILL_AT=N:MODE[:NAME]` SIGKILLs this
    process at its N-th durable append (to files named NAME only, when given), before the
    write (`before`), after half of the line (`mid`, the torn row a kill inside `write` or a
    full disk can leave) or after the whole line (`after`). Returns how many bytes to write
    first, or None without the hook."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    n, mode, name = (spec.split(":") + ["", ""])[:3]
    if name and Path(path).name != name:
        return None
    global _appends
    _appends += 1
    if _appends != int(n):
        return None
    return {"before": 0, "mid": max(1, len(data) // 2), "after": len(data)}[mode or "mid"]


def _kill_self():
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


def append_line(path: str | os.PathLike, data: bytes) -> None:
    """Append one complete line (ending in b"\n") so that it reaches the file whole or not
    at all: one write() on an O_APPEND descriptor, fsync'd; a short write is cut back off."""
    assert data.endswith(b"\n")
    cut = _fault_point(path, data)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if cut is not None:
            os.write(fd, data[:cut])
            os.fsync(fd)
            _kill_self()
        start = os.fstat(fd).st_size
        try:
            n = os.write(fd, data)
        except OSError:
            os.ftruncate(fd, start)
            raise
        if n != len(data):   # a full disk: leave no partial row behind
            os.ftruncate(fd, start)
            raise OSError(f"{path}: short write ({n} of {len(data)} bytes; disk full?); the row was not written")
        os.fsync(fd)
    finally:
        os.close(fd)


def _lines(text: str):
    """The text's lines, each with its end of line ("\r\n" stays inside a line)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def _set_aside(path: Path, keep: str, bad: list[tuple[int, str, str]]) -> None:
    """Rewrite `path` as `keep` (atomically) after appending the `bad` (line, text, why)
    records to `<path>.torn`, so nothing is destroyed."""
    torn = Path(str(path) + ".torn")
    with torn.open("a", encoding="utf-8", errors="surrogateescape") as f:
        for line, text, why in bad:
            f.write(f"# {path}: {_lines_of(line, text)}: {why}\n{text}")
            if not text.endswith("\n"):
                f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    tmp = Path(str(path) + ".tmp")
    with tmp.open("w", encoding="utf-8", errors="surrogateescape", newline="") as f:
        f.write(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _lines_of(line: int, text: str) -> str:
    """'line N', or 'lines N-M' for a record that took in the lines after it (an unclosed quote
    reads on until the next quote: a good row there goes with it, and is restored or measured again)."""
    n = len(text.splitlines())
    return f"line {line}" if n <= 1 else f"lines {line}-{line + n - 1}"


def _warn_bad(path, bad, action):
    for line, text, why in bad:
        log.warning("%s: %s: %s; %s", path, _lines_of(line, text), why, action)


#: columns whose values, where given, are numbers (a row with another value there is malformed)
NUMERIC_COLUMNS = ("tp", "heads", "bs", "ctx", "T", "trial", "NSPLIT", "VEC", "BLOCK_N", "NUM_WARPS",
                   "HEADS_PER_BLOCK", "STAGES", "CTAS_PER_SM", "ROWS", "COPY_LANES", "median_us", "p10_us",
                   "p90_us", "rel_err", "gbps", "tflops", "floor_us", "pct_floor", "launches", "pools", "wall_s",
                   "sm_count")


def _is_number(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def scan_table(path: str | os.PathLike):
    """Parse a trials table, checking every row. Returns (columns, rows as dicts, bad rows as
    (first line number, text, why), the text of the header and the good rows).

    A row is bad when its last line has no end of line (torn by a crash), when its field
    count differs from the header's, when a NUMERIC_COLUMNS value is not a number, or when its
    `params` is not a JSON object."""
    text = Path(path).read_bytes().decode("utf-8", errors="surrogateescape")
    lines = _lines(text)
    consumed = [0]          # lines the csv reader has pulled so far

    def feed():
        for ln in lines:
            consumed[0] += 1
            yield ln
    reader = csv.reader(feed())
    header = next(reader, None)
    if header is None:
        return [], [], [], ""
    cols = list(header)
    lacks = [c for c in _CORE if c not in cols]
    if lacks:   # a lost header line: the first row would be read (and rewritten) as the column names
        raise ValueError(f"{path}: line 1 is not a trials-table header (it lacks the columns {', '.join(lacks)}): "
                         "the file lost its first line, or is not a kvtune trials table; restore it, or move it "
                         "aside to sweep afresh")
    keep = [ln for ln in lines[:consumed[0]]]
    rows, bad = [], []
    first = consumed[0]
    while True:
        try:
            rec = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            rec, why = None, f"unreadable CSV ({e})"
        chunk = lines[first:consumed[0]]
        line_no = first + 1
        first = consumed[0]
        why = None if rec is not None else why
        if rec is not None:
            if not chunk[-1].endswith("\n"):
                why = "torn row (no end of line: the write was cut short)"
            elif rec == [] or rec == [""]:
                keep += chunk      # a blank line: harmless
                continue
            elif len(rec) != len(cols):
                why = f"malformed row ({len(rec)} fields, the header has {len(cols)})"
            else:
                r = dict(zip(cols, rec))
                p = r.get("params", "")
                nan = next((c for c in NUMERIC_COLUMNS if r.get(c, "") and not _is_number(r[c])), None)
                if nan:
                    why = f"malformed row ({nan} {r[nan]!r} is not a number)"
                elif p:
                    try:
                        ok = isinstance(json.loads(p), dict)
                    except json.JSONDecodeError:
                        ok = False
                    if not ok:
                        why = "malformed row (params is not a JSON object)"
        if why:
            bad.append((line_no, "".join(chunk), why))
            continue
        keep += chunk
        rows.append(dict(zip(cols, rec)))
    return cols, rows, bad, "".join(keep)


def read_jsonl(path: str | os.PathLike, repair: bool = False) -> list[dict]:
    """The JSON objects of a JSON-lines file. A torn or unreadable line is skipped with a
    warning naming the file and line; `repair` also moves it to `<path>.torn`."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_bytes().decode("utf-8", errors="surrogateescape")
    out, keep, bad = [], [], []
    for i, ln in enumerate(_lines(text), 1):
        if not ln.strip():
            keep.append(ln)
            continue
        why = None if ln.endswith("\n") else "torn line (no end of line: the write was cut short)"
        if why is None:
            try:
                obj = json.loads(ln)
                if not isinstance(obj, dict):
                    why = "not a JSON object"
            except json.JSONDecodeError as e:
                why = f"not valid JSON ({e})"
        if why:
            bad.append((i, ln, why))
            continue
        keep.append(ln)
        out.append(obj)
    if bad:
        _warn_bad(path, bad, f"set aside in {path}.torn" if repair else "skipped")
        if repair:
            _set_aside(path, "".join(keep), bad)
    return out


def append_jsonl(path: str | os.PathLike, obj: dict) -> None:
    """Append one JSON object as a line, whole or not at all, after setting aside a torn tail."""
    path = Path(path)
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if torn:
            read_jsonl(path, repair=True)
    append_line(path, (json.dumps(obj) + "\n").encode())


def write_table(path: Path, cols: list[str], rows: list[dict]) -> None:
    """`rows` under the header `cols` (a missing field empty, an extra one dropped), written to a
    temporary file, fsync'd and renamed over `path`: a kill leaves the old table or the new one."""
    tmp = Path(path).with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
            old_cols, rows, bad, keep = scan_table(self.path)
            if bad:
                self._set_aside(bad, keep)
            extra = [c for c in cols if c not in old_cols]
            if not old_cols:
                self._rewrite(cols, [])
            elif extra:  # widen: the old parameter columns stay, the new ones are added
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

    def _set_aside(self, bad, keep):
        _warn_bad(self.path, bad, f"set aside in {self.path}.torn; the sweep restores that trial from its "
                                  "study or measures it again")
        _set_aside(self.path, keep, bad)

    def _repair_tail(self):
        """A row torn by a process killed mid-write (another worker, or an older version) is
        set aside before anything is appended after it."""
        size = self.path.stat().st_size
        if not size:
            return
        with self.path.open("rb") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
        cols, rows, bad, keep = scan_table(self.path)
        self._set_aside(bad, keep)
        self.cols = cols or self.cols
        self.keys = {row_key(r) for r in rows}
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
        write_table(self.path, cols, rows)

    def append(self, row: dict) -> None:
        row = dict(row)
        params = row.get("params")
        if isinstance(params, dict):
            for k, v in params.items():
                row[k] = v
            row["params"] = json.dumps(params, sort_keys=True)
        with self.lock:
            self._repair_tail()
            if self.shared:
                self._catch_up()
                if row_key(row) in self.keys:
                    return                    # another worker wrote it (reconciled from the storage)
            unknown = [k for k in row if k not in self.cols]
            if unknown:
                raise ValueError(f"{self.path}: row has columns the table lacks: {unknown}")
            buf = io.StringIO(newline="")
            csv.DictWriter(buf, fieldnames=self.cols, extrasaction="raise").writerow(
                {k: ("" if v is None else v) for k, v in row.items()})
            append_line(self.path, buf.getvalue().encode())
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
    from filelock import FileLock
    path = Path(path)
    pd = tune_module("pandas", f"reading the trials table {path}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no trials table (run `kvtune sweep` first)")
    lock = Path(str(path) + ".lock")
    # a table that worker processes append to is read between two appends
    with FileLock(str(lock)) if lock.exists() else nullcontext():
        cols, _, bad, keep = scan_table(path)
    if not cols:
        raise ValueError(f"{path}: empty trials table (no header)")
    _warn_bad(path, bad, "skipped (a sweep into this folder sets it aside and runs that trial again)")
    df = pd.read_csv(io.StringIO(keep, newline=""),
                     dtype={"reason": "string", "driver": "string", "cuda": "string", "nvrtc": "string",
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
