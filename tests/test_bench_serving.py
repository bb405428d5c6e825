"""scripts/bench_serving.py --smoke runs end to end (tiny shapes, no timing on a CPU): every variant
of every case, the layer-step variants included, is checked against the fp32 oracle and written to
the CSV. The test asks for the runtime's own backend choice (`KVTUNE_VERIFY=auto`): the script's
CPU default runs the runtime on the oracle to stay short, which would check the oracle against
itself. So here the tuned variants run the Triton kernel under the interpreter (about a minute)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_serving_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KVTUNE_VERIFY", "KVTUNE_CONFIG_DIR")}
    env["KVTUNE_VERIFY"] = "auto"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--smoke", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "serving.csv").read_text().splitlines()))
    assert {r["case"] for r in rows} == {"B2xP40", "ragged2"}
    variants = {r["variant"] for r in rows}
    assert {"tuned", "tuned-b1", "default-triton", "step:runtime", "step:adapter", "step:per-call"} <= variants
    assert all(r["outcome"] == "ok" for r in rows), [(r["case"], r["variant"], r["outcome"], r["reason"]) for r in rows]
    assert all(float(r["floor_us"]) > 0 for r in rows)
    # the runtime's variants ran a kernel, not the oracle they are checked against
    ran = {r["config"].split()[0] for r in rows if r["variant"] in ("tuned", "tuned-b1")}
    assert ran and "reference" not in ran, ran
    assert all(0 <= float(r["rel_err"]) < 2e-2 for r in rows), [(r["variant"], r["rel_err"]) for r in rows]
    meta = json.loads((tmp_path / "serving.json").read_text())["meta"]
    assert meta["cases_done"] == meta["cases"] == 2   # written after each case: a cut run keeps what it timed
