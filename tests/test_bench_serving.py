"""scripts/bench_serving.py --smoke runs end to end (tiny shapes; on a CPU the Triton
interpreter and the runtime on the oracle, no timing): every variant of every case, the
61-layer-step variants included, is checked against the fp32 oracle and written to the CSV."""
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
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--smoke", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "serving.csv").read_text().splitlines()))
    assert {r["case"] for r in rows} == {"B2xP40", "ragged2"}
    variants = {r["variant"] for r in rows}
    assert {"tuned", "tuned-b1", "default-triton", "step:runtime", "step:adapter", "step:per-call"} <= variants
    assert all(r["outcome"] == "ok" for r in rows), [(r["case"], r["variant"], r["outcome"], r["reason"]) for r in rows]
    assert all(float(r["floor_us"]) > 0 for r in rows)
    meta = json.loads((tmp_path / "serving.json").read_text())["meta"]
    assert meta["cases_done"] == meta["cases"] == 2   # written after each case: a cut run keeps what it timed
