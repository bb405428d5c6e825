"""One run folder, one sweep: a second sweep into it is refused while the first runs, a killed
sweep is told from a finished one, the studies' storage is the folder's own, and a trials table
that lost its header line is refused rather than rewritten under a row (CPU, no kernel runs)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import yaml
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
    --workers; a folder a one-process sweep wrote (studies.db and trials) is refused by
    --workers, whose new journal would lack every study."""
    out = tmp_path / "out"
    (out / "tiny").mkdir(parents=True)
    (out / "tiny" / "studies.journal").write_text("")
    sw = Sweep(load_deployment(str(_dep(tmp_path))), SweepOptions(device="cpu", out=str(out), progress=False))
    assert sw.storage_url == f"journal:{out / 'tiny' / 'studies.journal'}"
    other = tmp_path / "other"
    (other / "tiny").mkdir(parents=True)
    (other / "tiny" / "studies.db").write_bytes(b"")
    (other / "tiny" / "trials.csv").write_text('study,phase,trial,params\ntiny|triton|tp8|bs1|ctx64,search,0,"{}"\n')
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


def test_the_lock_is_emptied_when_a_sweep_fails(tmp_path):
    """An error (here: a table without its header) ends the sweep, not the folder: the lock is
    emptied, so export does not call it killed and the next sweep is not refused as a second."""
    out = tmp_path / "out"
    (out / "tiny").mkdir(parents=True)
    (out / "tiny" / "trials.csv").write_text("not,a,header\n")
    for _ in range(2):   # the second meets the same error, not "another kvtune sweep"
        with pytest.raises(ValueError, match="line 1 is not a trials-table header"):
            run_sweep(str(_dep(tmp_path)), SweepOptions(device="cpu", out=str(out), progress=False, isolate=False))
        assert unfinished_sweep(out / "tiny") is None


def test_workers_refuse_a_storage_that_lacks_the_tables_trials(tmp_path, capsys):
    """The journal of a --workers sweep deleted: the table's trials are in no study, and the
    workers stop with the table named instead of numbering new trials over them."""
    out = tmp_path / "out"
    argv = ["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(out), "--no-progress", "--trials", "1",
            "--rounds", "0", "--workers", "1"]
    assert main(argv) == 0
    table = out / "tiny" / "trials.csv"
    rows = table.read_text()
    (out / "tiny" / "studies.journal").unlink()
    assert main(argv) != 0
    captured = capsys.readouterr()
    assert "that the study storage journal:" in captured.err + captured.out
    assert table.read_text() == rows


def test_a_limit_inside_the_first_study_saves_and_exits_0(tmp_path, caplog):
    out = tmp_path / "out"
    argv = ["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(out), "--no-progress", "--in-process",
            "--max-measurements", "1"]
    assert main(argv) == 0
    assert "no study finished before the sweep stopped (measurement limit); its 1 measurement(s) are saved: re-run" \
        in caplog.text
    run = json.loads((out / "tiny" / "runs.jsonl").read_text().splitlines()[-1])
    assert run["measurements"] == 1 and run["status"].startswith("stopped")
    assert (read_trials(out / "tiny" / "trials.csv")["outcome"] == "ok").sum() == 1   # saved for the resume


def test_os_errors_are_one_line_errors(tmp_path, capsys):
    """A path that is a file where a folder is needed: the CLI names it (exit 2), no traceback;
    calibrate checks --path before it measures."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["export", "cpu-tiny", "--out", "results", "--no-check", "--path", str(afile / "x.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("kvtune export: error: ") and "afile" in err[-1] and "Traceback" not in "".join(err)
    assert main(["calibrate", "--device", "cpu", "--path", str(tmp_path)]) == 2
    assert f"--path {tmp_path}: is a folder" in capsys.readouterr().err


def test_a_grace_no_longer_than_the_heartbeat_is_refused(tmp_path, capsys):
    """Every live trial would be failed as stale between two heartbeats (and its retries given up)."""
    rc = main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(tmp_path / "out"), "--no-progress",
               "--workers", "1", "--heartbeat", "5", "--grace", "5"])
    assert rc == 2 and "--grace 5: must exceed --heartbeat 5" in capsys.readouterr().err


def test_a_worker_of_another_model_shape_is_refused(tmp_path, capsys):
    """A worker whose deployment file has the sweep's name but other draft tokens would put
    another problem's numbers into the shared studies; it is refused, naming the difference."""
    out = tmp_path / "out"
    assert main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(out), "--no-progress", "--trials", "1",
                 "--rounds", "0", "--workers", "1"]) == 0
    other = tmp_path / "other"
    other.mkdir()
    doc = yaml.safe_load(_dep(other).read_text())
    doc["model"]["draft_tokens"] = 2
    (other / "tiny.yaml").write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    rc = main(["worker", str(other / "tiny.yaml"), "--device", "cpu", "--out", str(tmp_path / "joiner"),
               "--no-progress", "--trials", "1", "--storage", f"journal:{out / 'tiny' / 'studies.journal'}"])
    assert rc == 2 and "was created for draft_tokens 4 (here 2)" in capsys.readouterr().err


def test_a_worker_finding_no_sweep_in_its_storage_does_not_start_one(tmp_path, capsys):
    """A journal that exists but holds no study of the worker's deployment (another deployment's,
    or a sweep that never started): the worker waits --wait seconds for the sweep's studies, then
    is refused, measuring nothing."""
    out = tmp_path / "out"
    assert main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(out), "--no-progress", "--trials", "1",
                 "--rounds", "0", "--workers", "1"]) == 0
    journal = out / "tiny" / "studies.journal"
    other = tmp_path / "other"
    other.mkdir()
    doc = yaml.safe_load(_dep(other).read_text())
    doc["name"] = "tiny2"
    (other / "tiny2.yaml").write_text(yaml.safe_dump(doc))
    before = journal.read_bytes()
    capsys.readouterr()
    rc = main(["worker", str(other / "tiny2.yaml"), "--device", "cpu", "--out", str(tmp_path / "joiner"),
               "--no-progress", "--wait", "2", "--storage", f"journal:{journal}"])
    assert rc == 2 and "no sweep of tiny2 there after 2 s; a worker joins a sweep" in capsys.readouterr().err
    assert journal.read_bytes() == before and not (tmp_path / "joiner" / "tiny2" / "trials.csv").exists()


def test_workers_grid_progress_counts_every_config(tmp_path, capsys):
    """`--workers` with `--grid`: the parent's progress counts each study's every config, not at
    most --trials of them, and its total grows to match."""
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    (spaces / "triton.yaml").write_text(yaml.safe_dump({
        "backend": "triton", "params": {"NSPLIT": [1, 2], "BLOCK_N": [32], "HEADS_PER_BLOCK": [1],
                                        "NUM_WARPS": [4], "STAGES": [1, 2]}}))
    rc = main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(tmp_path / "out"), "--trials", "1",
               "--grid", "--rounds", "0", "--remeasure-top", "0", "--workers", "1", "--space-dir", str(spaces)])
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = [tuple(map(int, m)) for m in re.findall(r"^\[(\d+)/(\d+) trials\]", err, re.M)]
    assert lines and all(n <= total for n, total in lines) and lines[-1][0] == lines[-1][1] >= 4, err
