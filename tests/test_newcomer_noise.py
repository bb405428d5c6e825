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


def _setup_with(tmp_path, fake_python: str):
    """A repo holding setup.sh and pyproject.toml, and a venv whose `python` is the bash script
    `fake_python`; returns a function that runs setup.sh on them (CompletedProcess)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(fake_python)
    py.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    shutil.copy(REPO / "scripts" / "check_install.py", repo / "scripts" / "check_install.py")
    shutil.copy(REPO / "pyproject.toml", repo / "pyproject.toml")
    return lambda: subprocess.run(["bash", str(repo / "scripts" / "setup.sh"), str(venv)], capture_output=True,
                                  text=True, timeout=300, env=dict(os.environ))


def test_setup_reinstalls_only_when_pyproject_changes(tmp_path):
    log = tmp_path / "calls"
    run_setup = _setup_with(tmp_path, FAKE_PYTHON.format(log=log, real=sys.executable))
    repo = tmp_path / "repo"

    def setup():
        r = run_setup()
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


BANNER = """  /tmp/pip-build-env-x/overlay/lib/python3.11/site-packages/setuptools/command/editable_wheel.py:354: \
BuildBackendWarning: Editable installation.
  !!

          ********************************************************************************
          Please be careful with folders in your working directory with the same
          name as your package as they may take precedence during imports.
          ********************************************************************************

  !!
    with strategy, WheelFile(wheel_path, "w") as wheel_obj:
WARNING: Location 'x' is ignored
ERROR: a real problem pip reports
"""


def test_setup_hides_the_editable_install_banner_only(tmp_path):
    """setuptools' editable-install banner (printed by pip even under -q) and pip's location note
    are left out of what setup.sh shows; pip's other output is kept."""
    (tmp_path / "banner").write_text(BANNER)
    r = _setup_with(tmp_path, f"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then cat "{tmp_path / 'banner'}" >&2; exit 0; fi
exec "{sys.executable}" "$@"
""")()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("ERROR: a real problem pip reports") >= 2, out   # the pip upgrade's and the install's
    for noise in ("BuildBackendWarning", "!!", "Please be careful", "WheelFile", "*****", "WARNING: Location"):
        assert noise not in out, out


def test_check_install_names_each_module_that_does_not_import(monkeypatch, capsys):
    """setup.sh stops when the package or the tune extra does not import, test.sh when any extra
    does not: each missing module named with its group; the groups are pyproject's extras."""
    import re
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import check_install
    section = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^(\w+)\s*=", section, re.M)   # no tomllib: Python 3.10 is supported
    assert set(extras) == set(check_install.GROUPS) - {"package"}
    assert check_install.main(["package", "tune", "test", "review"]) == 0, capsys.readouterr().err
    monkeypatch.setitem(check_install.GROUPS, "review", ["jinja2", "no_such_module_kvtune"])
    assert check_install.main(["package", "review"]) == 1
    err = capsys.readouterr().err
    assert "no_such_module_kvtune (review: ModuleNotFoundError" in err and "jinja2" not in err, err
    assert check_install.main(["tune", "nope"]) == 2 and "nope" in capsys.readouterr().err


def test_skipped_gpu_tests_are_explained(tmp_path):
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    # test_d: a gpu test whose own skipif (an arch) is met before the marker's skip; still a GPU
    # test. test_e: a skip of another kind.
    (tmp_path / "test_x.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_a():\n    pass\n\n"
                                        "@pytest.mark.gpu\ndef test_b():\n    pass\n\ndef test_c():\n    pass\n\n"
                                        "@pytest.mark.gpu\n@pytest.mark.skipif(True, reason='needs sm_90')\n"
                                        "def test_d():\n    pass\n\n"
                                        "@pytest.mark.skip(reason='a second device type')\ndef test_e():\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", str(tmp_path)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    import torch
    if torch.cuda.is_available():
        assert "GPU tests" not in r.stdout
    else:
        assert "3 skipped: the GPU tests (marked `gpu`)" in r.stdout and "scripts/test.sh" in r.stdout, r.stdout
        assert "1 skipped for other reasons" in r.stdout, r.stdout


def test_progress_off_a_terminal_is_one_line_per_study(tmp_path):
    """`kvtune sweep` with stderr to a file (not a terminal): one progress line per study, each
    naming the study and the trials done of the sweep's total, and no bar redraws."""
    import re

    import yaml
    dep = tmp_path / "tiny.yaml"
    dep.write_text(yaml.safe_dump({"name": "tiny", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4,
                                                             "tree": "random"},
                                   "device": "cpu", "tp": [8], "contexts": [64, 128], "batches": [1],
                                   "backends": ["triton"], "trials": 2, "timing": "eager"}))
    with (tmp_path / "stderr.log").open("w") as log:
        r = subprocess.run([sys.executable, "-m", "kvtune.tuner.cli", "sweep", str(dep), "--device", "cpu", "--out",
                            str(tmp_path / "out"), "--rounds", "0", "--remeasure-top", "0", "--in-process"],
                           stdout=subprocess.DEVNULL, stderr=log, timeout=600)
    err = (tmp_path / "stderr.log").read_text()
    assert r.returncode == 0, err
    assert "\r" not in err, "a bar's redraws in a log file"
    lines = re.findall(r"\[(\d+)/(\d+) trials\] (triton tp8 bs1 ctx\d+): best", err)
    # 2 studies of 2 trials each: a line as each study ends, naming it
    assert [(int(k), int(n), s) for k, n, s in lines] == [(2, 4, "triton tp8 bs1 ctx64"),
                                                         (4, 4, "triton tp8 bs1 ctx128")]
