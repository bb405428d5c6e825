"""What a newcomer sees first (issue 14, case 7): an install without setuptools warnings,
`scripts/setup.sh` skipping the install when nothing changed, one line explaining the skipped
GPU tests, and progress as one line per study when stderr is a file."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_building_the_package_gives_no_setuptools_warning(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("kernels", "tuner"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-v", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "BuildBackendWarning" not in log and "absent from" not in log
    (whl,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "kvtune/kernels/defaults/kimi-k2-h200.yaml" in names and "kvtune/kernels/cuda/verify.cu" in names


FAKE_PYTHON = """#!/usr/bin/env bash
# logs every call; pip does nothing, the rest runs the real interpreter
echo "$*" >> "{log}"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi
exec "{real}" "$@"
"""


def test_setup_reinstalls_only_when_pyproject_changes(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls"
    py = venv / "bin" / "python"
    py.write_text(FAKE_PYTHON.format(log=log, real=sys.executable))
    py.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")

    def setup():
        r = subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), str(venv)], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ))
        assert r.returncode == 0, r.stdout + r.stderr
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return [c for c in calls if c.startswith("-m pip install") and "-e" in c.split()]

    assert len(setup()) == 1, "first run installs"
    assert setup() == [], "nothing changed: no reinstall"
    with (repo / "pyproject.toml").open("a") as f:
        f.write("\n# changed\n")
    assert len(setup()) == 1, "pyproject.toml changed: reinstall"
    assert setup() == []


def test_skipped_gpu_tests_are_explained(tmp_path):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_a():\n    pass\n\n"
                                        "@pytest.mark.gpu\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    import torch
    if torch.cuda.is_available():
        assert "GPU tests" not in r.stdout
    else:
        assert "2 skipped: the GPU tests (marked `gpu`)" in r.stdout and "scripts/test.sh" in r.stdout, r.stdout


def test_progress_off_a_terminal_is_one_line_per_study(capsys):
    from kvtune.tuner.progress import Progress
    bar = Progress(total=8, file=sys.stderr)   # captured: not a terminal
    for study, bests in (("triton tp8 bs1 ctx64", [3.0, 2.0, 1.5]), ("triton tp8 bs1 ctx300", [9.0, 8.0])):
        for b in bests:
            bar.update(1)
            bar.best(study, b, 1.0)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[3/8 trials] triton tp8 bs1 ctx64: best 1.5 us (1.0% of floor)",
                     "[5/8 trials] triton tp8 bs1 ctx300: best 8.0 us (1.0% of floor)"]
