"""One run folder, one sweep: a second sweep into it is refused while the first runs, a killed
sweep is told from a finished one, the studies' storage is the folder's own, and a trials table
that lost its header line is refused rather than rewritten under a row (CPU, no kernel runs)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pandas as pd
import pytest
from test_cli_input import _dep  # the one-study CPU deployment

from kvtune.tuner.cli import main
from kvtune.tuner.config import ConfigError, load_deployment
from kvtune.tuner.export_gaps import warn_incomplete
from kvtune.tuner.runlock import RunLock, unfinished_sweep
from kvtune.tuner.sweep import Sweep, SweepOptions, run_sweep
from kvtune.tuner.table import TrialsTable, read_trials


def test_a_second_sweep_into_a_running_folder_is_refused(tmp_path):
    folder = tmp_path / "out" / "tiny"
    folder.mkdir(parents=True)
    first = RunLock(folder)
    first.acquire("kvtune sweep first")
    assert unfinished_sweep(folder).startswith("is running now (pid ")
    with pytest.raises(ConfigError, match=r"another kvtune sweep is writing this folder \(pid \d+.*kvtune sweep first"):
        run_sweep(str(_dep(tmp_path)), SweepOptions(device="cpu", out=str(tmp_path / "out"), progress=False))
    assert not (folder / "trials.csv").exists(), "the refused sweep touched the table"
    first.release()
    assert unfinished_sweep(folder) is None
    sw = run_sweep(str(_dep(tmp_path)), SweepOptions(device="cpu", out=str(tmp_path / "out"), progress=False,
                                                     isolate=False, max_measurements=1))
    assert sw.status.startswith("stopped") and unfinished_sweep(folder) is None   # it ended: the lock is empty


def test_a_killed_sweep_is_told_apart_and_does_not_block_the_next(tmp_path, caplog):
    """SIGKILL skips every `finally`: the lock file keeps the dead sweep's pid, the kernel drops
    its flock; export says the last sweep was killed, and the next sweep takes the folder."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    code = textwrap.dedent(f"""
        import os, signal
        from kvtune.tuner.runlock import RunLock
        RunLock({str(folder)!r}).acquire("kvtune sweep doomed")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert unfinished_sweep(folder).startswith("was killed before it recorded its end (pid ")
    no_rows = pd.DataFrame(columns=["backend", "tp", "bs", "ctx", "phase"])
    warn_incomplete(no_rows, load_deployment(str(_dep(tmp_path))), folder)
    assert "was killed before it recorded its end" in caplog.text
    lock = RunLock(folder)
    lock.acquire("kvtune sweep next")
    lock.release()
    assert unfinished_sweep(folder) is None


def test_the_folders_own_storage_is_resumed(tmp_path, capsys):
    """A folder a `--workers` sweep wrote (studies.journal) resumes from its journal without
    --workers; a folder a one-process sweep wrote (studies.db) is refused by --workers, whose
    new journal would lack every study."""
    out = tmp_path / "out"
    (out / "tiny").mkdir(parents=True)
    (out / "tiny" / "studies.journal").write_text("")
    sw = Sweep(load_deployment(str(_dep(tmp_path))), SweepOptions(device="cpu", out=str(out), progress=False))
    assert sw.storage_url == f"journal:{out / 'tiny' / 'studies.journal'}"
    other = tmp_path / "other"
    (other / "tiny").mkdir(parents=True)
    (other / "tiny" / "studies.db").write_bytes(b"")
    rc = main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(other), "--workers", "1",
               "--no-progress"])
    assert rc == 2
    assert "studies.db: this folder's studies were swept without --workers" in capsys.readouterr().err


def test_a_table_without_its_header_is_refused_not_rewritten(tmp_path):
    path = tmp_path / "trials.csv"
    rows = 'tiny,tiny|triton|tp8|bs1|ctx64,search,,triton,8,1,1,64,4,random,0,baseline,"{""NSPLIT"": 1}",ok\n'
    path.write_text(rows)
    with pytest.raises(ValueError, match=r"trials.csv: line 1 is not a trials-table header \(it lacks the columns "
                                         r"study, phase, trial, params\)"):
        read_trials(path)
    with pytest.raises(ValueError, match="line 1 is not a trials-table header"):
        TrialsTable(path, ["NSPLIT"])
    assert path.read_text() == rows
