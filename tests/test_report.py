"""The review: `kvtune report` and results/review.ipynb on real sweep output (CPU).

Inputs: the committed CPU sweep (results/cpu-tiny, produced by `kvtune sweep ... --device cpu`
and `kvtune export`), a tiny real sweep run here into tmp_path (one tp, one context: it has
an Optuna storage, which the committed folder lacks since *.db is not committed), a real
sweep whose every config is pruned (a workspace budget nothing fits), and the committed H200
results when the lead has committed them (skipped otherwise).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="needs the review extra (pip install 'kvtune[review]')")
pytest.importorskip("nbclient", reason="needs the review extra (pip install 'kvtune[review]')")
pytest.importorskip("optuna", reason="the tiny sweeps need the tune extra")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from kvtune.tuner import review as rv  # noqa: E402
from kvtune.tuner.cli import main as kvtune_main  # noqa: E402
from kvtune.tuner.config import REPO_ROOT  # noqa: E402

RESULTS = REPO_ROOT / "results"
NOTEBOOK = RESULTS / "review.ipynb"
CPU_TINY = RESULTS / "cpu-tiny"
H200_DEPLOYMENTS = ("kimi-k2-h200", "deepseek-v3-h200")
ALL_PLOTS = {"latency", "speedup", "nsplit", "history", "importance", "outcomes"}


def _write_deployment(path: Path, name: str, **over) -> Path:
    """A tiny CPU deployment (the shipped cpu-tiny model, smaller grid) as a YAML file."""
    import yaml
    d = yaml.safe_load((REPO_ROOT / "configs/deployments/cpu-tiny.yaml").read_text())
    d.update(name=name, device=str(REPO_ROOT / "configs/devices/cpu.yaml"), tp=[8], contexts=[64], trials=3)
    d.update(over)
    path.write_text(yaml.safe_dump(d))
    return path


def _sweep(tmp: Path, name: str, export: bool, status: str = "complete", **over) -> Path:
    from kvtune.tuner.export import export_deployment
    from kvtune.tuner.sweep import SweepOptions, run_sweep
    dep = _write_deployment(tmp / f"{name}.yaml", name, **over)
    sw = run_sweep(dep, SweepOptions(device="cpu", out=str(tmp / "results"), rounds=1, remeasure_top=1,
                                     progress=False))
    assert sw.status == status
    if export:
        export_deployment(dep, out=str(tmp / "results"), quiet=True)
    return tmp / "results" / name


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """A real one-tp, one-context sweep with its Optuna storage and exported YAML."""
    return _sweep(tmp_path_factory.mktemp("swept"), "tiny-one-ctx", export=True)


@pytest.fixture(scope="module")
def all_pruned(tmp_path_factory) -> Path:
    """A real sweep where every config (the default too) is pruned: its split-K workspace is
    over a budget of 1 byte. Nothing can be exported."""
    return _sweep(tmp_path_factory.mktemp("pruned"), "tiny-all-pruned", export=False, workspace_budget_mb=1e-6,
                  status="every config pruned at 1 of 1 (tp, batch, context) buckets")


@pytest.fixture
def cpu_tiny_no_db(tmp_path) -> Path:
    """The committed CPU results without a study storage (as in a fresh clone)."""
    dst = tmp_path / "cpu-tiny"
    shutil.copytree(CPU_TINY, dst, ignore=shutil.ignore_patterns("*.db", "report"))
    return dst


def _h200_folders() -> list[Path]:
    return [RESULTS / d for d in H200_DEPLOYMENTS if (RESULTS / d / "trials.csv").is_file()]


def _report(folder: Path, out: Path) -> tuple[str, set[str]]:
    """Run `kvtune report` and check the page: every PNG it references exists and is a
    non-empty PNG, and every PNG written is referenced. Returns (html, plot names)."""
    assert kvtune_main(["report", str(folder), "--out", str(out)]) == 0
    page = (out / "index.html").read_text()
    refs = set(re.findall(r'<img src="([^"]+)"', page))
    written = {p.name for p in out.glob("*.png")}
    assert refs == written, f"referenced {sorted(refs)} but wrote {sorted(written)}"
    for name in written:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, f"{name} is not a real plot"
    return page, {Path(n).stem for n in written}


def _run_notebook(folder: Path, tmp_path: Path, via: str = "env"):
    """Execute results/review.ipynb headless on `folder`; any cell error fails the test. via:
    'env' (KVTUNE_RESULTS, as CI runs it) or 'parameters' (a cell setting RESULTS after the cell
    tagged `parameters`, as papermill injects one)."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(NOTEBOOK, as_version=4)
    old = os.environ.pop("KVTUNE_RESULTS", None)
    if via == "env":
        os.environ["KVTUNE_RESULTS"] = str(folder)  # the kernel inherits the environment
    else:
        (i,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        nb.cells.insert(i + 1, nbformat.v4.new_code_cell(f"RESULTS = {str(folder)!r}"))
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        if old is None:
            os.environ.pop("KVTUNE_RESULTS", None)
        else:
            os.environ["KVTUNE_RESULTS"] = old
    return nb


def _outputs_text(nb) -> str:
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            parts.append(json.dumps(o.get("data", {}).get("text/html", "")))
            parts.append(str(o.get("text", "")))
    return "\n".join(parts)


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def _section_ids(html: str) -> list[str]:
    return re.findall(r'<h2 id="([^"]+)"', html)


def _notebook_html(nb) -> str:
    return "\n".join("".join(o.get("data", {}).get("text/html", "")) for c in nb.cells for o in c.get("outputs", []))


# --------------------------------------------------------------------------- the report
def test_report_committed_cpu_sweep(tmp_path):
    assert (CPU_TINY / "trials.csv").is_file(), "results/cpu-tiny is the committed CPU sweep"
    page, plots = _report(CPU_TINY, tmp_path / "report")
    assert plots == ALL_PLOTS
    assert "CPU timings" in page
    assert "Only triton in this sweep" in page  # one backend: no CUDA vs Triton panel, and it says so
    assert "cpu-tiny.yaml" in page and "schema_version: 1" in page


def test_report_without_study_storage(cpu_tiny_no_db, tmp_path):
    page, plots = _report(cpu_tiny_no_db, tmp_path / "report")
    assert plots == ALL_PLOTS  # history and importance fall back to the trials table
    assert "Source: the trials table" in page


def test_report_single_context_with_storage(swept, tmp_path):
    assert (swept / "studies.db").is_file()
    page, plots = _report(swept, tmp_path / "report")
    assert plots == ALL_PLOTS
    assert "Optuna storage" in page and "Only one context length was swept" in page


def test_report_storage_elsewhere(swept, tmp_path):
    """A sweep whose studies live in another storage (`--storage URL`): the report reads them there."""
    folder = tmp_path / swept.name
    shutil.copytree(swept, folder, ignore=shutil.ignore_patterns("*.db", "report"))
    shutil.copy(swept / "studies.db", tmp_path / "elsewhere.db")
    assert kvtune_main(["report", str(folder), "--out", str(tmp_path / "r"),
                        "--storage", f"sqlite:///{tmp_path / 'elsewhere.db'}"]) == 0
    page = (tmp_path / "r" / "index.html").read_text()
    assert "Source: Optuna storage sqlite:///" in page and "elsewhere.db" in page


def test_report_storage_that_is_not_there_or_not_a_storage(swept, tmp_path, capsys):
    """A --storage naming no file is an error (opening it would create an empty one and review
    nothing, as if the sweep had no studies); an unopenable URL is one too, naming it."""
    missing = tmp_path / "nope.db"
    assert kvtune_main(["report", str(swept), "--out", str(tmp_path / "r"), "--storage", f"sqlite:///{missing}"]) == 2
    assert f"--storage sqlite:///{missing}: no such file" in capsys.readouterr().err
    assert not missing.exists()
    assert kvtune_main(["report", str(swept), "--out", str(tmp_path / "r"), "--storage", "bogus://x"]) == 2
    assert "--storage bogus://x: cannot open it as a study storage" in capsys.readouterr().err


def test_report_out_that_is_a_file(swept, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    assert kvtune_main(["report", str(swept), "--out", str(a_file)]) == 2
    assert f"--out {a_file}: a file, not a folder" in capsys.readouterr().err
    assert a_file.read_text() == "kept"


def test_report_names_the_error_of_a_deployment_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    assert kvtune_main(["report", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "not valid YAML" in err and "neither a results folder" not in err


def test_report_all_pruned(all_pruned, tmp_path):
    page, plots = _report(all_pruned, tmp_path / "report")
    assert plots == {"outcomes"}  # nothing else has a number to plot; no empty axes are written
    assert "have no ok trial" in page and "No exported YAML" in page
    assert "workspace" in page  # the reason of the pruning is shown


def test_report_default_output_and_deployment_name(swept, monkeypatch):
    """`kvtune report NAME` finds results/NAME under the working directory and writes
    into <results>/report by default."""
    monkeypatch.chdir(swept.parent.parent)
    assert kvtune_main(["report", swept.name]) == 0
    assert (swept / "report" / "index.html").is_file()


def test_report_missing_folder_is_a_clear_error(tmp_path, capsys):
    assert kvtune_main(["report", str(tmp_path / "nope")]) == 2
    assert "neither a results folder" in capsys.readouterr().err


def test_export_section_shows_the_yaml_beside_its_trials():
    """The 'exported buckets vs trials' table of the committed CPU sweep: each bucket's YAML
    numbers as the YAML file holds them, beside the fastest and the default latency of that
    (backend, tp, batch, context) worked out from trials.csv here (re-measured median where the
    sweep re-measured); and the YAML is the brute-force choice of that table."""
    import pandas as pd
    import yaml
    from export_oracle import check_export, config_latencies
    trials = pd.read_csv(CPU_TINY / "trials.csv")
    tuned = yaml.safe_load((CPU_TINY / "cpu-tiny.yaml").read_text())
    check_export(tuned, trials)
    lat = config_latencies(trials)
    want = []
    for e in tuned["entries"]:
        for b in e["buckets"]:
            study = lat[(lat["backend"] == e["backend"]) & (lat["tp"] == e["tp"]) & (lat["bs"] == e["max_batch"])
                        & (lat["ctx"] == b["max_context"])]
            want.append([e["tp"], e["backend"], b["NSPLIT"], b["latency_us"], b["default_latency_us"], b["floor_us"],
                         study["latency_us"].min(), study[study["default"]]["latency_us"].iloc[0]])
    ex = rv.exported_table(rv.load_results(CPU_TINY))
    got = ex[["tp", "backend", "NSPLIT", "yaml latency µs", "yaml default µs", "yaml floor µs", "trials best µs",
              "trials default µs"]].values.tolist()
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g[:3] == w[:3] and g[3:] == pytest.approx(w[3:], rel=1e-9), (g, w)


def test_evidence_from_before_the_triton_rename_reads_with_the_current_names(tmp_path):
    """Committed tables and exports predate Triton's BLOCK_H/num_warps/num_stages becoming
    HEADS_PER_BLOCK/NUM_WARPS/STAGES; they stay as written and are read with the new names:
    an old column's triton values move into the new column (beside CUDA's values there, and
    under triton values a resumed sweep wrote there already), and the params dicts alike."""
    from kvtune.tuner.table import columns, read_trials
    res = rv.load_results(CPU_TINY)
    assert {"HEADS_PER_BLOCK", "NUM_WARPS", "STAGES"} <= set(res.param_names)
    assert not {"BLOCK_H", "num_warps", "num_stages"} & set(res.param_names)
    assert res.tuned_error is None and all("HEADS_PER_BLOCK" in e.params for e in res.tuned.entries)

    old, new = ["BLOCK_H", "num_warps", "num_stages"], ["HEADS_PER_BLOCK", "NUM_WARPS", "STAGES"]
    path = tmp_path / "trials.csv"
    rows = [("triton", {"BLOCK_H": 2, "num_warps": 4, "num_stages": 1}),
            ("cuda", {"HEADS_PER_BLOCK": 8, "NUM_WARPS": 16, "STAGES": 2}),
            ("triton", {"HEADS_PER_BLOCK": 4, "NUM_WARPS": 8, "STAGES": 3})]
    import csv
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns(["NSPLIT", *old, *new]), restval="")
        w.writeheader()
        for i, (be, p) in enumerate(rows):
            w.writerow({"study": "s", "phase": "search", "trial": i, "backend": be, "NSPLIT": 4, **p,
                        "params": json.dumps({"NSPLIT": 4, **p})})
    df = read_trials(path)
    assert not set(old) & set(df.columns)
    assert df[new].astype(int).values.tolist() == [[2, 4, 1], [8, 16, 2], [4, 8, 3]]
    assert [sorted(p) for p in df["params"]] == [sorted(["NSPLIT", *new])] * 3


def test_two_backends_draw_the_cuda_vs_triton_panel(cpu_tiny_no_db, tmp_path):
    """Code path of a sweep with both backends (the CPU cannot run the CUDA backend): the
    committed triton rows relabelled as a second backend, 2x faster. Only the plotting is
    under test here; the numbers mean nothing."""
    import pandas as pd
    df = pd.read_csv(cpu_tiny_no_db / "trials.csv")
    other = df.assign(backend="cuda", median_us=df["median_us"] / 2)
    pd.concat([df, other]).to_csv(cpu_tiny_no_db / "trials.csv", index=False)
    res = rv.load_results(cpu_tiny_no_db)
    fig = rv.fig_speedup(res)
    assert len(fig.axes) == 2 and "CUDA" in fig.axes[1].get_ylabel()
    ratio = fig.axes[1].lines[0].get_ydata()
    assert ratio == pytest.approx([2.0] * len(ratio), rel=1e-6)
    summ = rv.summary_table(res)
    assert (summ["best backend"] == "cuda").all()


# --------------------------------------------------------------------------- the notebook
def test_notebook_committed_cpu_sweep(tmp_path):
    """The notebook shows the report's sections, in the same order, and its figures."""
    nb = _run_notebook(CPU_TINY, tmp_path)
    text = _outputs_text(nb)
    assert "CPU timings" in text and "cpu-tiny" in text
    assert _images(nb) == len(ALL_PLOTS)
    page, _ = _report(CPU_TINY, tmp_path / "report")
    assert _section_ids(_notebook_html(nb)) == _section_ids(page) and len(_section_ids(page)) >= len(ALL_PLOTS)


def test_notebook_single_context_with_storage(swept, tmp_path):
    """Pointed at the folder through its `parameters` cell (papermill's way), not the environment."""
    nb = _run_notebook(swept, tmp_path, via="parameters")
    assert "Optuna storage" in _outputs_text(nb)
    assert _images(nb) == len(ALL_PLOTS)


def test_notebook_all_pruned(all_pruned, tmp_path):
    nb = _run_notebook(all_pruned, tmp_path)
    assert _images(nb) == 1


@pytest.mark.parametrize("folder", _h200_folders() or [None], ids=lambda p: p.name if p else "absent")
def test_notebook_and_report_h200_results(folder, tmp_path):
    if folder is None:
        pytest.skip(f"no committed H200 results (results/{{{','.join(H200_DEPLOYMENTS)}}}/trials.csv) yet")
    nb = _run_notebook(folder, tmp_path)
    assert "CPU timings" not in _outputs_text(nb)
    page, plots = _report(folder, tmp_path / "report")
    assert {"latency", "speedup", "nsplit", "outcomes"} <= plots


# --------------------------------------------------------------------------- optional extras
def test_help_works_without_the_review_extra():
    """`kvtune --help` and `kvtune report --help` import no plotting or notebook library,
    and `kvtune report` without them is a clear error naming the extra."""
    code = ("import sys\n"
            "for m in ('matplotlib', 'nbclient', 'nbconvert', 'IPython', 'ipykernel'):\n"
            "    sys.modules[m] = None  # import fails as if not installed\n"
            "from kvtune.tuner.cli import main\n"
            "for argv in (['--help'], ['report', '--help']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "sys.exit(main(['report', 'cpu-tiny']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "report" in r.stdout and "kvtune[review]" in r.stderr


def test_kernels_and_runtime_import_no_review_library():
    code = ("import sys\n"
            "import kvtune.kernels, kvtune.kernels.runtime, kvtune.kernels.tuned\n"
            "bad = [m for m in ('matplotlib', 'nbclient', 'nbconvert', 'kvtune.tuner.review') if m in sys.modules]\n"
            "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_ragged_section_lists_the_phase_beside_the_yaml():
    """The committed H200 sweep's ragged phase in the review: per bucket the NSPLIT the YAML
    serves is the one row marked served, and its ragged and the default's times are the YAML's
    `ragged_us` / `default_ragged_us`, each the median of its ragged rows in trials.csv (read
    here with plain pandas)."""
    import pandas as pd
    import yaml
    folder = RESULTS / "kimi-k2-h200"
    tuned = yaml.safe_load((folder / "kimi-k2-h200.yaml").read_text())
    trials = pd.read_csv(folder / "trials.csv")
    rag = trials[(trials["phase"] == "ragged") & (trials["outcome"] == "ok")]
    t = rv.ragged_table(rv.load_results(folder))
    buckets = [(e, b) for e in tuned["entries"] for b in e["buckets"] if "ragged_us" in b]
    assert len(buckets) >= 20
    for e, b in buckets:
        # the served backend's rows (the sweep ran the ragged phase for cuda and wgmma alike; a
        # bucket of a per-context dispatch may name its own)
        backend = b.get("backend", e["backend"])
        at = t[(t["tp"] == e["tp"]) & (t["bs"] == e["max_batch"]) & (t["ctx"] == f"{b['max_context'] // 1024}k")
               & (t["backend"] == backend)]
        mine = at[at["served"]]
        assert len(mine) == 1 and mine["NSPLIT"].iloc[0] == b["NSPLIT"], (e["tp"], e["max_batch"], b)
        rows = rag[(rag["tp"] == e["tp"]) & (rag["bs"] == e["max_batch"]) & (rag["ctx"] == b["max_context"])
                   & (rag["NSPLIT"] == b["NSPLIT"]) & (rag["backend"] == backend)]
        # the served compile-time config (wgmma: ROWS 64 and 72 alike): under a per-context dispatch
        # the bucket's own (all of them on another backend, else over the entry's), else the entry's
        params = b["params"] if "backend" in b else {**e["params"], **b.get("params", {})}
        for k, v in params.items():
            if k != "NSPLIT":
                rows = rows[rows[k] == v]
        assert mine["ragged µs"].iloc[0] == pytest.approx(rows["median_us"].median(), rel=1e-9)
        assert b["ragged_us"] == pytest.approx(rows["median_us"].median(), abs=1e-3)
        default = at[at["default"]]
        if "default_ragged_us" in b:
            assert len(default) == 1 and b["default_ragged_us"] == pytest.approx(default["ragged µs"].iloc[0], abs=1e-3)
        else:   # a pass stopped by its time limit before the default's ragged batch: none in either
            assert default.empty, (e["tp"], e["max_batch"], b)


def test_a_bucket_served_by_another_backend_is_reported_under_that_backend(tmp_path):
    """The dispatch-chain export (results/serving/dispatch-chain/export/: wgmma_km entries whose
    short-context buckets a wgmma config serves) in the review: each such bucket is listed under
    the backend that serves it, with that backend's compile-time params, and its ragged row of
    that backend's study is the one marked served. Expectations read from the YAML with plain
    yaml."""
    import yaml
    here = RESULTS / "serving" / "dispatch-chain" / "export"
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "merge_trials.py"), str(here / "trials-wgmma.csv"),
                    str(here / "trials-wgmma_km.csv"), "--out", str(tmp_path / "trials.csv")],
                   check=True, capture_output=True)
    shutil.copy(here / "kimi-k2-h200.yaml", tmp_path / "kimi-k2-h200.yaml")
    doc = yaml.safe_load((here / "kimi-k2-h200.yaml").read_text())
    res = rv.load_results(tmp_path)
    ex, rag, summ = rv.exported_table(res), rv.ragged_table(res), rv.summary_table(res)
    crossed = 0
    for e in doc["entries"]:
        for b in e["buckets"]:
            backend = b.get("backend", e["backend"])
            params = b["params"] if "backend" in b else {**e["params"], **b.get("params", {})}
            params = {k: v for k, v in params.items() if k != "NSPLIT"}
            crossed += backend != e["backend"]
            ctx = f"{b['max_context'] // 1024}k"
            row = ex[(ex["tp"] == e["tp"]) & (ex["max_batch"] == e["max_batch"]) & (ex["max context"] == ctx)]
            assert len(row) == 1 and row["backend"].iloc[0] == backend, (e["tp"], e["max_batch"], b)
            assert row["compile-time params"].iloc[0] == ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
            s = summ[(summ["tp"] == e["tp"]) & (summ["bs"] == e["max_batch"]) & (summ["context"] == ctx)]
            assert s["exported"].iloc[0].startswith(f"{backend} NSPLIT={b['NSPLIT']}")
            if "ragged_us" in b:
                at = rag[(rag["tp"] == e["tp"]) & (rag["bs"] == e["max_batch"]) & (rag["ctx"] == ctx) & rag["served"]]
                assert len(at) == 1 and at["backend"].iloc[0] == backend and at["NSPLIT"].iloc[0] == b["NSPLIT"]
                assert at["ragged µs"].iloc[0] == pytest.approx(b["ragged_us"], abs=1e-3)
    assert crossed >= 4, "the export holds buckets served by another backend"


def test_report_of_a_torn_export_warns_on_the_terminal(tmp_path, capsys):
    """An exported YAML cut short is reported in the page and on stderr; the report is still
    written from the trials."""
    folder = tmp_path / "cpu-tiny"
    shutil.copytree(CPU_TINY, folder, ignore=shutil.ignore_patterns("report"))
    y = folder / "cpu-tiny.yaml"
    y.write_text(y.read_text()[:200])
    assert kvtune_main(["report", str(folder), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "cpu-tiny.yaml" in err and "without the exported YAML" in err
    assert (tmp_path / "r" / "index.html").is_file()
