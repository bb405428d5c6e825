"""`kvtune forget` and export's rule that a backend's rows on an older kernel source do not count,
on a copy of the committed kimi-k2-h200 sweep (real H200 rows of two backends)."""
import csv
import logging
import shutil
from pathlib import Path

import optuna
import pytest
import yaml

from kvtune.tuner.cli import main
from kvtune.tuner.export import export_deployment

ROOT = Path(__file__).parents[1]
SWEEP = ROOT / "results" / "kimi-k2-h200"
DEP = ROOT / "configs" / "deployments" / "kimi-k2-h200.yaml"


@pytest.fixture
def out(tmp_path):
    shutil.copytree(SWEEP, tmp_path / "kimi-k2-h200", ignore=shutil.ignore_patterns("report", "logs"))
    return tmp_path


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _studies(out):
    return {s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{out / 'kimi-k2-h200' / 'studies.db'}")}


def _study_backends(out):
    return {name.split("|")[1] for name in _studies(out)}


def test_forget_moves_one_backends_rows_and_deletes_its_studies(out, capsys):
    before = _rows(out / "kimi-k2-h200" / "trials.csv")
    n_wgmma = sum(r["backend"] == "wgmma" for r in before)
    assert n_wgmma and _study_backends(out) == {"cuda", "wgmma"}
    assert main(["forget", str(DEP), "--backend", "wgmma", "--out", str(out)]) == 0
    assert f"{n_wgmma} trial row(s) moved" in capsys.readouterr().out
    after = _rows(out / "kimi-k2-h200" / "trials.csv")
    gone = _rows(out / "kimi-k2-h200" / "trials.forgotten.csv")
    assert after == [r for r in before if r["backend"] != "wgmma"]
    assert gone == [r for r in before if r["backend"] == "wgmma"]
    assert _study_backends(out) == {"cuda"}
    tuned = export_deployment(str(DEP), out=str(out), path=str(out / "after.yaml"), quiet=True)
    assert {e.backend for e in tuned.entries} == {"cuda"}
    assert set(tuned.provenance["kernel_hash"]) == {"cuda"}
    # again: nothing left to move, and the forgotten rows are not duplicated
    assert main(["forget", str(DEP), "--backend", "wgmma", "--out", str(out)]) == 0
    assert "0 trial row(s) moved" in capsys.readouterr().out
    assert len(_rows(out / "kimi-k2-h200" / "trials.forgotten.csv")) == n_wgmma


def test_forget_only_the_buckets_named(out, capsys):
    """--tp 4 --bs 64 --ctx 16384 65536: those two studies of wgmma and their rows (every phase:
    search, re-measurement, ragged, the export's serving checks), nothing else."""
    before, studies = _rows(out / "kimi-k2-h200" / "trials.csv"), _studies(out)

    def named(r):
        return r["backend"] == "wgmma" and (r["tp"], r["bs"]) == ("4", "64") and r["ctx"] in ("16384", "65536")
    n = sum(map(named, before))
    assert n and len({r["phase"] for r in before if named(r)}) >= 3
    assert main(["forget", str(DEP), "--backend", "wgmma", "--tp", "4", "--bs", "64", "--ctx", "16384", "65536",
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"{n} trial row(s) moved" in said and "2 studies deleted" in said
    assert _rows(out / "kimi-k2-h200" / "trials.csv") == [r for r in before if not named(r)]
    assert _rows(out / "kimi-k2-h200" / "trials.forgotten.csv") == [r for r in before if named(r)]
    assert studies - _studies(out) == {f"kimi-k2-h200|wgmma|tp4|bs64|ctx{c}" for c in (16384, 65536)}


@pytest.mark.parametrize("argv, says", [
    (["--backend", "wgmm"], "--backend wgmm: not a backend"),
    (["--backend", "wgmma", "--out", "/nonexistent-kvtune"], "trials.csv: no trials table"),
    (["--backend", "wgmma", "--tp", "3"], "--tp 3: not swept by kimi-k2-h200 (tp buckets: 1, 2, 4, 8)"),
    (["--backend", "wgmma", "--ctx", "4096", "5000"], "--ctx 5000: not swept by kimi-k2-h200"),
])
def test_forget_names_what_is_wrong(out, capsys, argv, says):
    argv = ["forget", str(DEP), *argv] + ([] if "--out" in argv else ["--out", str(out)])
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_export_ignores_rows_measured_on_an_older_kernel_source(out, caplog):
    """Rows of an older wgmma source, 10x faster than the real ones and appended before them,
    would win every wgmma bucket if they counted: the export must equal the one without them."""
    table = out / "kimi-k2-h200" / "trials.csv"
    rows = _rows(table)
    fake = []
    for r in rows:
        if r["backend"] == "wgmma":
            f = dict(r, kernel_hash="0000000000000000", params=r["params"].replace('"NSPLIT": ', '"NSPLIT": 1'))
            if f["median_us"]:
                f["median_us"] = str(float(f["median_us"]) / 10)
            fake.append(f)
    clean = export_deployment(str(DEP), out=str(out), path=str(out / "clean.yaml"), quiet=True)
    with table.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(fake + rows)
    with caplog.at_level(logging.WARNING, logger="kvtune"):
        mixed = export_deployment(str(DEP), out=str(out), path=str(out / "mixed.yaml"), quiet=True)
    assert "another kernel source" in caplog.text and "0000000000000000" in caplog.text
    assert _strip(out / "mixed.yaml") == _strip(out / "clean.yaml")
    assert mixed.provenance["kernel_hash"] == clean.provenance["kernel_hash"]


def _strip(path):
    return {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "provenance"}


@pytest.mark.parametrize("tail", ["a serving check", "a swept row"])
def test_the_last_row_of_another_source_does_not_set_the_sweep_aside(out, tail):
    """The exported source is this checkout's where the sweep measured it: a last row of another
    source (a serving check an export ran on another checkout, or a row appended after the
    sweep) must not make every swept row count as stale."""
    table = out / "kimi-k2-h200" / "trials.csv"
    rows = _rows(table)
    clean = export_deployment(str(DEP), out=str(out), path=str(out / "clean.yaml"), quiet=True, check=False)
    last = next(r for r in reversed(rows) if r["backend"] == "wgmma" and r["phase"] == "search")
    extra = dict(last, kernel_hash="0000000000000000", median_us=str(float(last["median_us"]) / 10))
    if tail == "a serving check":
        extra.update(phase="serve", round="export:tp8:bs1")
    with table.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows + [extra])
    mixed = export_deployment(str(DEP), out=str(out), path=str(out / "mixed.yaml"), quiet=True, check=False)
    assert _strip(out / "mixed.yaml") == _strip(out / "clean.yaml")
    assert mixed.provenance["kernel_hash"] == clean.provenance["kernel_hash"]


def test_a_sweep_over_trials_of_another_kernel_source_says_how_to_re_tune(tmp_path):
    """Resuming would skip the finished studies of the old source: the sweep refuses and names
    `kvtune forget`; with --retune-stale it sets the old rows aside itself and tunes the current
    source from scratch."""
    from kvtune.tuner.config import ConfigError
    from kvtune.tuner.sweep import SweepOptions, run_sweep

    dep = tmp_path / "stale.yaml"
    dep.write_text(yaml.safe_dump({
        "name": "stale", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
        "device": "cpu", "tp": [8], "contexts": [64], "batches": [1], "backends": ["triton"], "trials": 2,
        "timing": "eager"}))
    out = tmp_path / "results"
    kw = dict(device="cpu", out=str(out), rounds=0, progress=False)
    assert run_sweep(dep, SweepOptions(**kw)).status == "complete"
    table = out / "stale" / "trials.csv"
    rows = _rows(table)
    current = {r["kernel_hash"] for r in rows}
    assert len(current) == 1 and "" not in current
    with table.open("w", newline="") as fh:   # as if the kernel source had changed since
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(dict(r, kernel_hash="0000000000000000") for r in rows)
    with pytest.raises(ConfigError, match=r"kvtune forget .*stale\.yaml --backend triton.*--retune-stale"):
        run_sweep(dep, SweepOptions(**kw))
    assert _rows(table)[0]["kernel_hash"] == "0000000000000000"   # the refusal changed nothing
    again = run_sweep(dep, SweepOptions(retune_stale=True, **kw))   # what scripts/tune.sh passes
    assert again.status == "complete" and again.measured_now >= 2
    assert {r["kernel_hash"] for r in _rows(table)} == current
    assert {r["kernel_hash"] for r in _rows(out / "stale" / "trials.forgotten.csv")} == {"0000000000000000"}


def test_forget_sets_a_torn_row_aside_and_a_rerun_adds_no_duplicate(out, capsys):
    table = out / "kimi-k2-h200" / "trials.csv"
    rows = _rows(table)
    with table.open("a") as fh:
        fh.write("kimi-k2-h200,torn-row-cut-mid")   # a row without its end, as a kill leaves it
    # as if a first forget had been killed after archiving the rows, before rewriting the table
    wg = [r for r in rows if r["backend"] == "wgmma"]
    with (out / "kimi-k2-h200" / "trials.forgotten.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(wg[:5])
    assert main(["forget", str(DEP), "--backend", "wgmma", "--out", str(out)]) == 0
    assert _rows(table) == [r for r in rows if r["backend"] != "wgmma"]
    assert _rows(out / "kimi-k2-h200" / "trials.forgotten.csv") == wg
    assert "torn-row-cut-mid" in (out / "kimi-k2-h200" / "trials.csv.torn").read_text()


def test_export_refuses_trials_of_another_model(out, tmp_path):
    """The deployment edited in place (T 9 -> 8): its study names do not hold the model's shape,
    so the old rows would be exported as the new model's. Export refuses, naming what changed."""
    doc = yaml.safe_load(DEP.read_text())
    doc["model"]["draft_tokens"] = 8
    edited = tmp_path / "kimi-k2-h200.yaml"
    edited.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=r"measured for another model .*T 9 \(now 8\): \d+ row"):
        export_deployment(str(edited), out=str(out), path=str(tmp_path / "x.yaml"), quiet=True)
    assert not (tmp_path / "x.yaml").exists()


def test_a_sweep_over_trials_of_another_model_refuses_or_retunes(tmp_path):
    """A resumed sweep whose deployment now says other heads: refused, naming the change and
    `kvtune forget`; with --retune-stale every backend's rows are set aside and tuned again."""
    from kvtune.tuner.config import ConfigError
    from kvtune.tuner.sweep import SweepOptions, run_sweep

    doc = {"name": "shape", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
           "device": "cpu", "tp": [8], "contexts": [64], "batches": [1], "backends": ["triton"], "trials": 2,
           "timing": "eager"}
    dep = tmp_path / "shape.yaml"
    dep.write_text(yaml.safe_dump(doc))
    out = tmp_path / "results"
    kw = dict(device="cpu", out=str(out), rounds=0, progress=False)
    assert run_sweep(dep, SweepOptions(**kw)).status == "complete"
    doc["model"]["num_heads"] = 16
    dep.write_text(yaml.safe_dump(doc))
    table = out / "shape" / "trials.csv"
    before = table.read_text()
    with pytest.raises(ConfigError, match=r"another model .*tp 8: heads 1 \(now 2\).*kvtune forget"):
        run_sweep(dep, SweepOptions(**kw))
    assert table.read_text() == before   # the refusal changed nothing
    again = run_sweep(dep, SweepOptions(retune_stale=True, **kw))
    assert again.status == "complete" and again.measured_now >= 2
    assert {r["heads"] for r in _rows(table)} == {"2"}
    assert {r["heads"] for r in _rows(out / "shape" / "trials.forgotten.csv")} == {"1"}


def test_export_writes_no_yaml_the_runtime_would_refuse(out, tmp_path):
    """Rows whose params the backend does not declare (a hand edit, an older kvtune): the pick
    is validated as the serving loader validates it, and nothing is written."""
    table = out / "kimi-k2-h200" / "trials.csv"
    rows = _rows(table)
    with table.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(dict(r, params=r["params"].replace("{", '{"BOGUS": 7, ', 1)) if r["backend"] == "wgmma" else r
                    for r in rows)
    dest = tmp_path / "x.yaml"
    with pytest.raises(ValueError, match=r"trials.csv: a picked config would not load .*unknown parameter.*BOGUS"):
        export_deployment(str(DEP), out=str(out), path=str(dest), quiet=True)
    assert not dest.exists()


def _cpu_tiny(tmp_path):
    d = tmp_path / "cpu-tiny"
    d.mkdir()
    shutil.copy(ROOT / "results" / "cpu-tiny" / "trials.csv", d / "trials.csv")
    return d


def test_forget_finds_the_workers_journal(tmp_path):
    """A --workers sweep keeps its studies in studies.journal: forget deletes them there (it
    looked in studies.db only, so the next sweep resumed the finished studies)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from kvtune.tuner.forget import forget_backend
    d = _cpu_tiny(tmp_path)
    st = JournalStorage(JournalFileBackend(str(d / "studies.journal")))
    for name in ("cpu-tiny|triton|tp8|bs1|ctx64", "cpu-tiny|cuda|tp8|bs1|ctx64", "other|triton|tp8|bs1|ctx64"):
        optuna.create_study(study_name=name, storage=st)
    got = forget_backend("cpu-tiny", ["triton"], out=str(tmp_path))
    assert got["studies"] == 1 and got["rows"] > 0
    left = {s.study_name for s in optuna.get_all_study_summaries(st)}
    assert left == {"cpu-tiny|cuda|tp8|bs1|ctx64", "other|triton|tp8|bs1|ctx64"}


def test_forget_refuses_a_storage_file_that_is_not_there(tmp_path):
    """A mistyped --storage path would delete no study: refused before any row moves."""
    from kvtune.tuner.forget import forget_backend
    d = _cpu_tiny(tmp_path)
    before = (d / "trials.csv").read_text()
    for url in (f"sqlite:///{d / 'typo.db'}", f"journal:{d / 'typo.journal'}"):
        with pytest.raises(FileNotFoundError, match=r"--storage .*typo.*: no such file"):
            forget_backend("cpu-tiny", ["triton"], out=str(tmp_path), storage=url)
    assert (d / "trials.csv").read_text() == before and not (d / "trials.forgotten.csv").exists()


@pytest.mark.parametrize("url", ["bogus://x", "/a/plain/path.db", "sqlite:////nonexistent-dir/x/studies.db"])
def test_a_storage_url_that_cannot_be_opened_is_named(url):
    from kvtune.tuner.config import ConfigError
    from kvtune.tuner.storage import open_storage
    with pytest.raises(ConfigError, match=r"--storage .*: cannot open it as a study storage .*expected sqlite:///PATH"):
        open_storage(url)


def test_a_storage_that_cannot_be_opened_moves_no_row(out, capsys):
    """The rows move only once every storage opened: forgetting the rows but not the studies
    would make the next sweep resume the finished studies instead of re-tuning."""
    table = out / "kimi-k2-h200" / "trials.csv"
    before = table.read_bytes()
    argv = ["forget", str(DEP), "--backend", "wgmma", "--tp", "8", "--out", str(out), "--storage", "nonsense"]
    assert main(argv) == 2
    assert "--storage nonsense: cannot open it as a study storage" in capsys.readouterr().err
    assert table.read_bytes() == before
    assert not (out / "kimi-k2-h200" / "trials.forgotten.csv").exists()
