"""Bad input to `kvtune sweep` / `export` is a clear error naming it, never a run recorded as
complete; the default output folder is not the committed evidence; storage passwords are
never printed or recorded (issue 14, cases 2, 3, 6 and 8)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from kvtune.tuner.cli import build_parser, main
from kvtune.tuner.config import ConfigError, load_deployment, redact_argv, redact_url
from kvtune.tuner.sweep import Sweep, SweepOptions

REPO = Path(__file__).resolve().parents[1]


def _dep(tmp_path, **over):
    doc = {"name": "tiny", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
           "device": "cpu", "tp": [8], "contexts": [64], "batches": [1], "backends": ["triton"], "trials": 2,
           "timing": "eager"}
    doc.update(over)
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


# ------------------------------------------------------------------ case 3: typos and bad numbers
def test_backend_typo_on_the_command_line_is_an_error(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(out), "--backend", "tritn",
               "--no-progress", "--in-process"])
    err = capsys.readouterr().err
    assert rc == 2 and "--backend: unknown backend 'tritn'" in err and "triton" in err
    assert not (out / "tiny" / "runs.jsonl").exists(), "nothing is recorded, least of all as complete"


def test_backend_typo_in_the_deployment_is_an_error_naming_the_file(tmp_path, capsys):
    dep = _dep(tmp_path, backends=["tritn"])
    rc = main(["sweep", str(dep), "--device", "cpu", "--out", str(tmp_path / "out"), "--no-progress",
               "--in-process"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{dep}: backends: unknown backend 'tritn'" in err


@pytest.mark.parametrize("argv, msg", [
    (["--trials", "0"], "argument --trials: expected a positive integer, got 0"),
    (["--trials", "-3"], "argument --trials: expected a positive integer, got -3"),
    (["--max-minutes", "-1"], "argument --max-minutes: expected a finite number of minutes >= 0, got -1"),
    (["--max-minutes", "nan"], "argument --max-minutes: expected a finite number of minutes >= 0, got nan"),
    (["--trial-timeout", "nan"], "argument --trial-timeout: expected a finite number of seconds > 0, got nan"),
    (["--trial-timeout", "-5"], "argument --trial-timeout: expected a finite number of seconds > 0, got -5"),
    (["--compile-workers", "-3"], "argument --compile-workers: expected an integer >= 0, got -3"),
    (["--workers", "0"], "argument --workers: expected a positive integer, got 0"),   # before any storage
    (["--workers", "-1"], "argument --workers: expected a positive integer, got -1"),
    (["--heartbeat", "0"], "argument --heartbeat: expected a positive integer, got 0"),
    (["--grace", "-5"], "argument --grace: expected a positive integer, got -5"),
])
@pytest.mark.parametrize("cmd", ["sweep", "worker"])
def test_bad_numbers_are_errors(tmp_path, capsys, argv, msg, cmd):
    extra = ["--storage", "journal:" + str(tmp_path / "j")] if cmd == "worker" else []
    with pytest.raises(SystemExit) as e:
        main([cmd, str(_dep(tmp_path)), "--device", "cpu", "--out", str(tmp_path / "out"), *extra, *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, msg", [
    (["sweep", "DEP", "--rounds", "-1"], "argument --rounds: expected an integer >= 0, got -1"),
    (["sweep", "DEP", "--remeasure-top", "-1"], "argument --remeasure-top: expected an integer >= 0, got -1"),
    (["compile-check", "--arch", "sm_120", "--T", "0"], "argument --T: expected draft tokens in 1..64, got 0"),
    (["compile-check", "--arch", "sm_120", "--T", "100"], "argument --T: expected draft tokens in 1..64, got 100"),
    (["compile-check", "--arch", "sm_120", "--heads", "0"], "argument --heads: expected a positive integer, got 0"),
    (["compile-check", "--arch", "sm_120", "--jobs", "0"], "argument --jobs: expected a positive integer, got 0"),
    (["calibrate", "--device", "cpu", "--reps", "0"], "argument --reps: expected a positive integer, got 0"),
])
def test_other_commands_check_their_numbers(tmp_path, capsys, argv, msg):
    """A value that would divide by zero, do nothing or fail later is refused by argparse."""
    argv = [str(_dep(tmp_path)) if a == "DEP" else a for a in argv]
    dest = {"sweep": ["--out", str(tmp_path / "out")], "calibrate": ["--path", str(tmp_path / "out")]}
    with pytest.raises(SystemExit) as e:
        main(argv + dest.get(argv[0], []))
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("workers", [[], ["--workers", "1"]])
def test_a_worker_pointed_at_no_journal_does_not_start_a_sweep(tmp_path, capsys, workers):
    """`kvtune worker --storage journal:<a mistyped path>` used to start a sweep of its own and
    report it complete; the journal of the sweep it joins exists (its parent opened it). With
    --workers it is refused at once too, leaving no empty journal at the typo."""
    rc = main(["worker", str(_dep(tmp_path)), "--device", "cpu", "--out", str(tmp_path / "out"),
               "--storage", f"journal:{tmp_path / 'typo.journal'}", *workers])
    assert rc != 0
    assert "typo.journal: no such journal file; a worker joins" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "typo.journal").exists()


def test_paths_that_are_the_wrong_kind_are_named(tmp_path, capsys):
    """--out a file, export --path a folder: errors naming the flag (were NotADirectoryError /
    IsADirectoryError tracebacks, the latter leaving a stray <path>.tmp file behind)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(afile), "--no-progress"]) != 0
    assert f"--out {afile}: {afile} is a file, not a folder" in capsys.readouterr().err
    committed = REPO / "results" / "cpu-tiny"
    assert main(["export", "cpu-tiny", "--out", str(committed.parent), "--path", str(tmp_path), "--no-check"]) != 0
    assert f"--path {tmp_path}: is a folder" in capsys.readouterr().err
    assert not (tmp_path.parent / (tmp_path.name + ".tmp")).exists()
    # a file further up: the flag, the folder it could not make or write and the file in the way
    # (were a bare "[Errno 20] Not a directory" and "[Errno 17] File exists")
    deeper = afile / "x"
    assert main(["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(deeper), "--no-progress"]) == 2
    assert f"--out {deeper}: cannot make the folder {deeper / 'tiny'}: Not a directory" in capsys.readouterr().err
    assert main(["export", "cpu-tiny", "--out", str(committed.parent), "--path", str(deeper / "t.yaml"),
                 "--no-check"]) == 2
    assert f"--path {deeper / 't.yaml'}: cannot write {deeper / 't.yaml'}: {afile} is a file, not a folder" \
        in capsys.readouterr().err


@pytest.mark.parametrize("opts, msg", [
    ({"trials": 0}, "--trials: expected a positive integer, got 0"),
    ({"trials": -3}, "--trials: expected a positive integer, got -3"),
    ({"max_minutes": -1.0}, "--max-minutes: expected a finite number of minutes >= 0, got -1.0"),
    ({"backends": ["tritn"]}, "--backend: unknown backend 'tritn'"),
])
def test_python_api_checks_the_same(tmp_path, opts, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Sweep(load_deployment(_dep(tmp_path)), SweepOptions(device="cpu", out=str(tmp_path / "out"), **opts))


def test_a_refused_selection_leaves_no_output_folder(tmp_path):
    dep = load_deployment(_dep(tmp_path))
    with pytest.raises(ConfigError, match=re.escape("--tp: [3] not in the deployment")):
        Sweep(dep, SweepOptions(device="cpu", out=str(tmp_path / "out"), tps=[3]))
    assert not (tmp_path / "out" / dep.name).exists()


def test_a_sweep_with_nothing_to_run_is_not_complete(tmp_path, capsys):
    """Every backend skipped (the CUDA backend on a machine without a GPU): exit 1, not 'complete'."""
    out = tmp_path / "out"
    rc = main(["sweep", str(_dep(tmp_path, backends=["cuda"])), "--device", "cpu", "--out", str(out),
               "--no-progress", "--in-process"])
    err = capsys.readouterr().err
    assert rc == 1 and "no study ran" in err
    run = json.loads((out / "tiny" / "runs.jsonl").read_text().splitlines()[-1])
    assert run["status"] != "complete" and run["skipped"]["cuda"]


# ------------------------------------------------------------------ case 2: the default --out
def _readme_commands():
    text = (REPO / "README.md").read_text() + (REPO / "scripts" / "tune.sh").read_text()
    cmds = []
    for line in text.replace("\\\n", " ").splitlines():
        m = re.match(r"\s*(?:[A-Z_]+=\S+ )*(kvtune (sweep|export|worker|report|forget)\b[^#`]*)", line)
        if m and "$" not in m.group(1):
            cmds.append(shlex.split(m.group(1))[1:])
    return cmds


def test_no_readme_command_writes_into_committed_results_by_default():
    cmds = _readme_commands()
    assert sum(c[0] == "sweep" for c in cmds) >= 4 and any(c[0] == "export" for c in cmds)
    parser = build_parser()
    for argv in cmds:
        args = parser.parse_args(argv)
        if args.command in ("sweep", "export", "worker", "forget"):
            assert Path(args.out).parts[0] == "runs", argv
    assert any(c[0] == "forget" for c in cmds)
    for cmd in ("sweep", "worker", "export", "forget"):
        extra = {"worker": ["--storage", "journal:x"], "forget": ["--backend", "wgmma"]}.get(cmd, [])
        assert parser.parse_args([cmd, "d", *extra]).out == "runs"
    assert SweepOptions().out == "runs"


def test_report_of_committed_results_writes_elsewhere(tmp_path, monkeypatch, capsys):
    """`kvtune report kimi-k2-h200` (a README command): the committed report stays as is."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    committed = REPO / "results" / "cpu-tiny" / "report"
    before = {p: p.read_bytes() for p in committed.rglob("*")} if committed.exists() else {}
    assert main(["report", "cpu-tiny"]) == 0
    assert (tmp_path / "runs" / "cpu-tiny" / "report" / "index.html").is_file()
    after = {p: p.read_bytes() for p in committed.rglob("*")} if committed.exists() else {}
    assert before == after
    assert "holds committed files" in capsys.readouterr().out


# ------------------------------------------------------------------ case 8: credentials
URL = "postgresql://kvtune:s3cr3t-pw@db.example:5432/kvtune"


def test_redact_url():
    assert "s3cr3t-pw" not in redact_url(URL) and redact_url(URL).startswith("postgresql://kvtune:***@db.example")
    assert redact_url("postgresql://kvtune@db.example/kvtune") == "postgresql://kvtune@db.example/kvtune"
    assert redact_url("sqlite:///runs/x/studies.db") == "sqlite:///runs/x/studies.db"
    assert redact_url("journal:runs/x/studies.journal") == "journal:runs/x/studies.journal"
    assert "pw" not in redact_url("weird+scheme://u:pw@host:notaport/x")
    argv = ["kvtune", "sweep", "d.yaml", "--storage", URL, f"--storage={URL}"]
    red = " ".join(redact_argv(argv))
    assert "s3cr3t-pw" not in red and red.count("kvtune:***@db.example") == 2


def test_run_record_hides_the_password(tmp_path, monkeypatch, capsys):
    """A command line that names a storage URL with a password (here overridden by a later
    --storage, so the sweep runs without a server): runs.jsonl and the output show it redacted.
    The record's storage field with a password is checked against a real server in
    test_tuner_workers.py (PostgreSQL)."""
    argv = ["sweep", str(_dep(tmp_path)), "--device", "cpu", "--out", str(tmp_path / "out"), "--storage", URL,
            "--storage", f"journal:{tmp_path / 'studies.journal'}", "--max-minutes", "1e-6", "--in-process",
            "--no-progress"]
    monkeypatch.setattr("sys.argv", ["kvtune", *argv])
    main(argv)
    out = capsys.readouterr()
    text = (tmp_path / "out" / "tiny" / "runs.jsonl").read_text()
    rec = json.loads(text.splitlines()[-1])
    assert "s3cr3t-pw" not in text + out.out + out.err
    assert "--storage postgresql://kvtune:***@db.example" in rec["command"]


def test_no_storage_url_is_printed_unredacted():
    """Every f-string of the tuner that shows a storage URL goes through redact_url."""
    bad = []
    for f in (REPO / "tuner").rglob("*.py"):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"\{[\w.]*(storage_url|url)\}", line):
                bad.append(f"{f.name}:{i}: {line.strip()}")
    assert not bad, bad


def test_a_gpu_sized_deployment_on_the_cpu_warns(tmp_path, capsys):
    dep = REPO / "configs" / "deployments" / "kimi-k2-h200.yaml"
    main(["sweep", str(dep), "--device", "cpu", "--out", str(tmp_path), "--max-minutes", "0", "--in-process",
          "--no-progress", "--tp", "8", "--ctx", "131072", "--backend", "triton"])
    err = capsys.readouterr().err
    assert "warning: deployment kimi-k2-h200" in err and "is sized for NVIDIA H200 (sm_90)" in err
    assert "cpu-tiny" in err


def test_a_missing_deployment_is_named_as_given(tmp_path, capsys):
    """A path that is not a file says so (no '.yaml.yaml' guess); a bare name that is no shipped
    deployment lists the shipped ones."""
    missing = tmp_path / "nonexist.yaml"
    assert main(["sweep", str(missing), "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert f"deployment '{missing}': no such file" in capsys.readouterr().err
    assert main(["sweep", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    assert f"deployment '{tmp_path}': a folder" in capsys.readouterr().err
    assert main(["sweep", "kimi-k2-h300", "--device", "cpu", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "deployment 'kimi-k2-h300' not found" in err and "kimi-k2-h200, kimi-k2-rtx-pro-6000" in err
    assert not (tmp_path / "out").exists()


def test_a_mistyped_option_is_named_by_its_subcommand_with_the_nearest_one(capsys):
    """`kvtune sweep DEP --trails 3`: the sweep's usage (not the top level's), the argument, and
    the option meant."""
    with pytest.raises(SystemExit) as e:
        main(["sweep", "cpu-tiny", "--trails", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: kvtune sweep ")
    assert "kvtune sweep: error: unrecognized arguments: --trails 3; --trails: did you mean --trials?" in err
    with pytest.raises(SystemExit):
        main(["export", "cpu-tiny", "extra"])
    err = capsys.readouterr().err
    assert err.startswith("usage: kvtune export ") and "unrecognized arguments: extra" in err and "did you" not in err


def test_an_abbreviated_option_is_not_taken_for_the_full_one(capsys):
    """`kvtune sweep DEP --trial 3`: argparse would read --trials; the CLI names it instead, so a
    script's abbreviation never changes meaning when a new option shares its prefix."""
    with pytest.raises(SystemExit) as e:
        main(["sweep", "cpu-tiny", "--trial", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "unrecognized arguments: --trial 3; --trial: did you mean --trials?" in err
