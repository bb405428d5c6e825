"""A real CPU sweep SIGKILLed again and again during its writes, resumed each time (issue 14).

Each run is a `kvtune sweep` subprocess with KVTUNE_FAULT_KILL_AT=N:MODE, which makes the
writer SIGKILL its own process at its N-th durable append (trials.csv or runs.jsonl): before
the write, after half of the line (a torn row) or after the whole line. Then the same command
resumes. At the end: every trial that had finished before some kill (told to its study, or
whole in the table) is in the table exactly once, no row is malformed, export succeeds, and
the study database and the table agree. The figures go to the README's Reliability section.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from kvtune.tuner.table import FAULT_ENV, read_jsonl, row_key, scan_table

pytestmark = pytest.mark.slow   # about 100 s on 2 cores; scripts/test.sh runs slow tests too

KILLS = 24
MODES = ("mid", "before", "after")


def _setup(tmp_path):
    dep = {"name": "fault", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
           "device": "cpu", "tp": [8], "contexts": [16, 40, 100], "batches": [1], "backends": ["triton"],
           "trials": 4, "timing": "eager"}
    p = tmp_path / "fault.yaml"
    p.write_text(yaml.safe_dump(dep))
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    (spaces / "triton.yaml").write_text(yaml.safe_dump({
        "backend": "triton",
        "params": {"NSPLIT": [1, 2, 4], "BLOCK_N": [16, 32], "HEADS_PER_BLOCK": [1], "NUM_WARPS": [4],
                   "STAGES": [1]},
        "constraints": [{"name": "no_empty_splits", "expr": "NSPLIT <= max(1, cdiv(keys, BLOCK_N))"}]}))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "kvtune.tuner.cli", "sweep", str(p), "--device", "cpu", "--out", str(out),
           "--space-dir", str(spaces), "--in-process", "--rounds", "1", "--remeasure-top", "1"]
    return p, out, cmd


def _finished_in_studies(out):
    """Key -> row of every trial its study holds as finished with a result."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    url = f"sqlite:///{out / 'fault' / 'studies.db'}"
    if not (out / "fault" / "studies.db").exists():
        return {}
    storage = optuna.storages.RDBStorage(url)
    rows = {}
    TS = optuna.trial.TrialState
    for s in optuna.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        for t in study.get_trials(deepcopy=False, states=(TS.COMPLETE, TS.PRUNED, TS.FAIL)):
            row = t.user_attrs.get("row")
            if row and "duplicate_of" not in t.user_attrs and not t.user_attrs.get("interrupted"):
                rows[row_key(row)] = row
    storage.engine.dispose() if hasattr(storage, "engine") else None
    return rows


def test_sigkill_at_every_kind_of_write_loses_nothing(tmp_path):
    dep, out, cmd = _setup(tmp_path)
    table = out / "fault" / "trials.csv"
    finished: dict = {}        # every trial finished before some kill
    kills, torn_set_aside, mid_in_table, log_kills, torn_log = 0, 0, 0, 0, 0
    for k in range(KILLS):
        mode = MODES[k % len(MODES)]
        n = 1 + (k // len(MODES)) % 2
        env = dict(os.environ, **{FAULT_ENV: f"{n}:{mode}:trials.csv"})
        r = subprocess.run(cmd + ["--no-progress"], env=env, capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            break         # the sweep finished before this kill point (the count is checked below)
        assert r.returncode == -signal.SIGKILL, f"kill {k} ({n}:{mode}) was not reached:\n{r.stderr[-3000:]}"
        kills += 1
        torn_set_aside += r.stderr.count("torn row")
        if mode == "mid" and table.exists() and not table.read_bytes().endswith(b"\n"):
            mid_in_table += 1
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        finished.update(_finished_in_studies(out))
        if table.exists():
            _, rows, _, _ = scan_table(table)
            finished.update({row_key(r): r for r in rows})
    # then at the run log, written once a run has done all its work
    for mode in MODES:
        env = dict(os.environ, **{FAULT_ENV: f"1:{mode}:runs.jsonl"})
        r = subprocess.run(cmd + ["--no-progress"], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
        kills += 1
        log_kills += 1
        torn_set_aside += r.stderr.count("torn row")
        torn_log += r.stderr.count("runs.jsonl: line")
        finished.update(_finished_in_studies(out))
        finished.update({row_key(r): r for r in scan_table(table)[1]})
    # the last run is left alone (and shows its progress, written to a pipe)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in os.environ.items() if k != FAULT_ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    torn_set_aside += r.stderr.count("torn row")
    torn_log += r.stderr.count("runs.jsonl: line")
    assert "\r" not in r.stderr, "progress written to a file is one line per study, not a redrawn bar"

    cols, rows, bad, _ = scan_table(table)
    assert bad == [], bad
    keys = Counter(row_key(r) for r in rows)
    dup = [k for k, c in keys.items() if c > 1]
    assert not dup, f"rows written twice: {dup}"
    lost = [k for k in finished if k not in keys]
    assert not lost, f"finished trials missing from the table: {lost}"
    for r in rows:
        json.loads(r["params"])
        assert r["outcome"] in ("ok", "pruned", "wrong", "failed"), r
    # the study database and the table agree, trial by trial
    studies = _finished_in_studies(out)
    in_table = {row_key(r): r for r in rows if r["phase"] in ("search", "cross")}
    assert set(studies) == set(in_table)
    for k, srow in studies.items():
        trow = in_table[k]
        assert json.loads(trow["params"]) == srow["params"]
        assert trow["outcome"] == srow["outcome"]
        if srow.get("median_us") is not None:
            assert float(trow["median_us"]) == pytest.approx(srow["median_us"], rel=1e-9)
    runs = read_jsonl(out / "fault" / "runs.jsonl")
    assert runs[-1]["status"] == "complete"

    ex = subprocess.run([sys.executable, "-m", "kvtune.tuner.cli", "export", str(dep), "--out", str(out)],
                        capture_output=True, text=True, timeout=600)
    assert ex.returncode == 0, ex.stderr
    assert (out / "fault" / "fault.yaml").is_file()
    aside = (out / "fault" / "trials.csv.torn")
    print(f"\nfault test: {kills} SIGKILLs of a real sweep ({kills - log_kills} at trials.csv appends, "
          f"{log_kills} at the runs.jsonl append; before / mid-row / after the write in turn); "
          f"{mid_in_table} left a torn row in trials.csv and {torn_set_aside} torn rows were set aside on resume "
          f"({aside.stat().st_size if aside.exists() else 0} bytes kept in trials.csv.torn), {torn_log} torn "
          f"runs.jsonl line(s) set aside; {len(finished)} trials finished before some kill, {len(rows)} rows in "
          f"the final table; trials lost: {len(lost)}, written twice: {len(dup)}")
    assert kills >= 20 and mid_in_table >= 1 and torn_set_aside >= mid_in_table and torn_log >= 1
