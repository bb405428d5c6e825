"""The kernels and the serving runtime never import the tuner, Optuna, pandas or the review
libraries (DESIGN section 3): checked in a fresh interpreter."""
import subprocess
import sys

FORBIDDEN = ("kvtune.tuner", "optuna", "pandas", "matplotlib", "nbclient", "nbconvert")  # (torch imports tqdm)


def test_kernels_and_runtime_import_nothing_of_the_tuner():
    code = (
        "import sys\n"
        "import kvtune.kernels, kvtune.kernels.runtime, kvtune.kernels.sglang, kvtune.kernels.tuned\n"
        "import kvtune.kernels.triton_kernel, kvtune.kernels.cuda.backend, kvtune.kernels.cuda.nvrtc\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m.startswith('kvtune.tuner'))\n"
        "print(','.join(bad))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"imported by the kernels/runtime: {r.stdout.strip()}"
