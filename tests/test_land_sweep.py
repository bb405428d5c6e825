"""scripts/land_sweep.sh on a CPU: a sweep call's archive becomes the committed evidence and the
packaged file only when the file was measured on this checkout's kernel source."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kvtune.kernels.tuned import load_tuned

REPO = Path(__file__).resolve().parents[1]
DEP = "kimi-k2-h200"
HEADER = "kernel_hash: {wgmma: "


def _workdir(tmp_path: Path) -> Path:
    """A checkout's layout with what the script reads: the deployment, the packaged file's folder,
    diff_defaults.py."""
    w = tmp_path / "work"
    (w / "configs" / "deployments").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "deployments" / f"{DEP}.yaml", w / "configs" / "deployments")
    (w / "kernels" / "defaults").mkdir(parents=True)
    (w / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "diff_defaults.py", w / "scripts")
    (w / "results" / "serving" / "dispatch").mkdir(parents=True)
    return w


def _archive(tmp_path: Path, yaml_text: str, export_first: bool = False) -> Path:
    """A sweep.tgz as gpu_evidence.sh packs it: <dep>/ with the committed sweep's tables and
    `yaml_text` as its export (newer than the trials; `export_first`: older), logs/."""
    src = tmp_path / "res"
    (src / DEP).mkdir(parents=True)
    (src / "logs").mkdir()
    for f in ("trials.csv", "studies.db", "runs.jsonl"):
        shutil.copy(REPO / "results" / DEP / f, src / DEP / f)
    (src / "logs" / "sweep.log").write_text("== a sweep\n")
    y = src / DEP / f"{DEP}.yaml"
    y.write_text(yaml_text)
    t = os.path.getmtime(y)
    for f in ("trials.csv", "studies.db", "runs.jsonl"):
        os.utime(src / DEP / f, (t - 10, t - 10))
    if export_first:
        os.utime(y, (t - 20, t - 20))
    tgz = tmp_path / "sweep.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(src, arcname=".")
    return tgz


def _run(w: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", str(REPO / "scripts" / "land_sweep.sh"), *map(str, args)], cwd=w, env=env,
                          capture_output=True, text=True, timeout=600)


def test_an_archive_of_another_kernel_source_is_not_packaged(tmp_path):
    packaged = (REPO / "kernels" / "defaults" / f"{DEP}.yaml").read_text()
    assert HEADER in packaged
    start = packaged.index(HEADER) + len(HEADER)
    stale = packaged[:start] + "deadbeefdeadbeef" + packaged[start + 16:]
    w = _workdir(tmp_path)
    r = _run(w, _archive(tmp_path, stale), DEP)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "provenance.kernel_hash.wgmma: tuned against kernel source 'deadbeefdeadbeef'" in r.stderr
    assert "nothing landed" in r.stderr
    assert not (w / "kernels" / "defaults" / f"{DEP}.yaml").exists()
    assert not (w / "results" / DEP).exists()


def test_a_stale_backend_of_one_bucket_is_not_packaged(tmp_path):
    """A bucket served by another backend (a per-context dispatch) needs that backend's hash
    too, as the runtime checks it: the packaged file names no wgmma_km hash."""
    packaged = (REPO / "kernels" / "defaults" / f"{DEP}.yaml").read_text()
    assert "wgmma_km" not in packaged
    lines = packaged.splitlines(keepends=True)
    i = next(i for i, ln in enumerate(lines) if "{max_context: 131072, NSPLIT: " in ln)
    lines[i] = lines[i].replace("{max_context: 131072, NSPLIT: ", "{max_context: 131072, backend: wgmma_km, "
                                "params: {DV_SPLIT: 192, SPLIT_ALIGN: 64}, NSPLIT: ", 1)
    w = _workdir(tmp_path)
    r = _run(w, _archive(tmp_path, "".join(lines)), DEP)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "provenance.kernel_hash.wgmma_km: missing (entries use backend 'wgmma_km')" in r.stderr
    assert "nothing landed" in r.stderr
    assert not (w / "results" / DEP).exists()


@pytest.mark.parametrize("how", ["torn", "older than the trials"])
def test_an_export_that_is_not_whole_is_made_again_here(tmp_path, how):
    """The call's export cut mid-file (no end marker) or left from before the sweep: exported
    again from the archive's trials, without serving checks, and that export lands."""
    packaged = (REPO / "kernels" / "defaults" / f"{DEP}.yaml").read_text()
    w = _workdir(tmp_path)
    text = packaged.rsplit("#", 1)[0] if how == "torn" else packaged
    tgz = _archive(tmp_path, text, export_first=how != "torn")
    r = _run(w, tgz, DEP)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exporting here, without serving checks" in r.stdout
    landed = (w / "kernels" / "defaults" / f"{DEP}.yaml").read_text()
    assert landed.rstrip().endswith("# end of kvtune tuned defaults")
    assert landed == (w / "results" / DEP / f"{DEP}.yaml").read_text()
    assert (w / "results" / DEP / "logs" / "export-no-check.log").exists()
    load_tuned(w / "kernels" / "defaults" / f"{DEP}.yaml")


def test_a_current_archive_lands_whole(tmp_path):
    packaged = (REPO / "kernels" / "defaults" / f"{DEP}.yaml").read_text()
    w = _workdir(tmp_path)
    r = _run(w, _archive(tmp_path, packaged), DEP)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (w / "kernels" / "defaults" / f"{DEP}.yaml").read_text() == packaged
    for f in ("trials.csv", "studies.db", "runs.jsonl"):
        assert (w / "results" / DEP / f).read_bytes() == (REPO / "results" / DEP / f).read_bytes()
    assert (w / "results" / DEP / "logs" / "sweep.log").read_text() == "== a sweep\n"
    assert (w / "results" / DEP / "report" / "index.html").stat().st_size > 0
    assert (w / "results" / "serving" / "dispatch" / "context-alternatives.csv").read_text().count("\n") > 1


def test_an_export_that_does_not_load_is_not_packaged(tmp_path):
    packaged = (REPO / "kernels" / "defaults" / f"{DEP}.yaml").read_text()
    w = _workdir(tmp_path)
    r = _run(w, _archive(tmp_path, packaged.replace("schema_version: 1", "schema_version: 99")), DEP)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "schema_version" in r.stderr and "does not load; nothing landed" in r.stderr
    assert not (w / "kernels" / "defaults" / f"{DEP}.yaml").exists()


def test_another_checkouts_kvtune_is_refused(tmp_path):
    """A checkout whose kernels are not the importable kvtune's: its hashes would be another's."""
    w = _workdir(tmp_path)
    (w / "kernels" / "__init__.py").write_text("")
    r = _run(w, _archive(tmp_path, "x"), DEP)
    assert r.returncode == 2
    assert "not from this checkout" in r.stderr


def test_outside_the_repository_root_it_says_so(tmp_path):
    r = _run(tmp_path, tmp_path / "none.tgz", DEP)
    assert r.returncode == 2
    assert "repository root" in r.stderr


@pytest.mark.parametrize("what", ["archive", "deployment"])
def test_a_missing_input_is_named(tmp_path, what):
    w = _workdir(tmp_path)
    args = (tmp_path / "none.tgz", DEP) if what == "archive" else (_archive(tmp_path, "x"), "no-such-dep")
    r = _run(w, *args)
    assert r.returncode == 2
    assert str(args[0] if what == "archive" else "no-such-dep") in r.stderr
