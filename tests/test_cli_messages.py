"""What the commands say when something is missing: the tune extra (pandas) for `kvtune
export` and `kvtune sweep`, a results folder for `kvtune report`; and `kvtune export --help`
names the output folder the command really writes."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from kvtune.tuner.cli import build_parser, main
from kvtune.tuner.config import REPO_ROOT
from kvtune.tuner.extras import TUNE_EXTRA
from kvtune.tuner.review.data import resolve_results_dir


def _without_pandas(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """`kvtune ARGV` in a fresh interpreter where importing pandas fails as if not installed
    (as tests/test_report.py takes the review extra away)."""
    code = ("import sys\n"
            "sys.modules['pandas'] = None\n"
            "from kvtune.tuner.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd)


def _dep(tmp_path):
    doc = {"name": "tiny", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
           "device": "cpu", "tp": [8], "contexts": [64], "batches": [1], "backends": ["triton"], "trials": 2,
           "timing": "eager"}
    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_export_and_sweep_without_pandas_name_the_extra(tmp_path):
    dep, out = _dep(tmp_path), tmp_path / "out"
    table = out / "tiny" / "trials.csv"
    table.parent.mkdir(parents=True)
    table.write_text("deployment,backend\n")
    r = _without_pandas(["export", str(dep), "--out", str(out)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kvtune export: error: reading the trials table {table} needs pandas"), r.stderr
    assert TUNE_EXTRA in r.stderr

    # the sweep says so before it measures anything (its summary and ragged phase read the table)
    out2 = tmp_path / "out2"
    r = _without_pandas(["sweep", str(dep), "--device", "cpu", "--out", str(out2), "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "kvtune sweep: error: kvtune sweep needs pandas" in r.stderr and TUNE_EXTRA in r.stderr, r.stderr
    assert not (out2 / "tiny" / "trials.csv").exists()


def test_export_help_names_the_real_default_output(capsys):
    default = build_parser().parse_args(["export", "x"]).out
    with pytest.raises(SystemExit) as e:
        main(["export", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())   # argparse re-wraps the description
    assert f"default {default}/" in text
    assert "results/<deployment>/<deployment>.yaml" not in text


def test_report_of_nothing_lists_every_place_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        resolve_results_dir("nosuch")
    for place in ("runs/nosuch/", "results/nosuch/", f"{REPO_ROOT / 'runs' / 'nosuch'}/",
                  f"{REPO_ROOT / 'results' / 'nosuch'}/"):
        assert place in str(e.value), (place, str(e.value))

    dep = tmp_path / "never-swept.yaml"
    dep.write_text(_dep(tmp_path).read_text().replace("name: tiny\n", "name: never-swept\n"))
    with pytest.raises(FileNotFoundError) as e:
        resolve_results_dir(str(dep))
    assert "deployment 'never-swept' has no results folder yet" in str(e.value)
    for place in ("runs/never-swept/", "results/never-swept/", f"{REPO_ROOT / 'runs' / 'never-swept'}/",
                  f"{REPO_ROOT / 'results' / 'never-swept'}/"):
        assert place in str(e.value), (place, str(e.value))


def test_a_repository_relative_results_folder_is_found_from_another_folder(monkeypatch):
    # the review notebook's kernel starts in results/: "results/<name>" is the repository's folder
    monkeypatch.chdir(REPO_ROOT / "results")
    assert resolve_results_dir("results/cpu-tiny").resolve() == (REPO_ROOT / "results" / "cpu-tiny").resolve()
    assert resolve_results_dir("cpu-tiny").resolve() == (REPO_ROOT / "results" / "cpu-tiny").resolve()


def test_kvtune_without_a_command_is_a_usage_error(capsys):
    """Plain `kvtune` prints the commands on stderr and fails, as argparse's own usage errors do:
    a script that lost its subcommand does not pass as a success."""
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "sweep" in err and "export" in err


def test_a_second_ctrl_c_while_the_command_exits_prints_no_traceback(tmp_path):
    """`kvtune` (cli.entry) ignores SIGINT once `main` has returned: a second Ctrl-C, or the
    process-group copy `timeout -s INT` sends, landing in the interpreter's exit handlers
    (torch's among them) would otherwise print a KeyboardInterrupt traceback after the command
    said 'interrupted'. The signal here is sent from an exit handler, where it lands for real."""
    code = ("import atexit, os, signal\n"
            "from kvtune.tuner import cli\n"
            "cli.main = lambda argv=None: 130\n"
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
            "cli.entry()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 130 and "KeyboardInterrupt" not in done.stderr and "Traceback" not in done.stderr
