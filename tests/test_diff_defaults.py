"""scripts/diff_defaults.py: the buckets two exported files serve differently, and only those."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ROOT / "kernels" / "defaults" / "kimi-k2-h200.yaml"
SCRIPT = ROOT / "scripts" / "diff_defaults.py"

END = "# end of kvtune tuned defaults\n"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def _write(doc, path: Path) -> Path:
    head = PACKAGED.read_text().splitlines(keepends=True)[0]
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False) + END)
    return path


def test_the_changed_buckets_and_no_others(tmp_path):
    doc = yaml.safe_load(PACKAGED.read_text())
    want = set()
    # one bucket's NSPLIT, and another entry's bucket moved to other compile-time params
    e8 = next(e for e in doc["entries"] if e["tp"] == 8 and e["max_batch"] > 1)
    b = e8["buckets"][1]
    b["NSPLIT"] = 66 if b["NSPLIT"] != 66 else 33
    want.add((8, e8["max_batch"], b["max_context"]))
    e4 = next(e for e in doc["entries"] if e["tp"] == 4)
    b4 = e4["buckets"][0]
    lanes = dict(e4["params"], **b4.get("params", {}))["COPY_LANES"]
    b4["params"] = {"ROWS": dict(e4["params"], **b4.get("params", {}))["ROWS"], "COPY_LANES": 12 - lanes}
    want.add((4, e4["max_batch"], b4["max_context"]))
    new = _write(doc, tmp_path / "new.yaml")

    got = _run(PACKAGED, new, "--changed")
    assert got.returncode == 0, got.stderr
    seen = set()
    for line in got.stdout.splitlines():
        tp, bs, ctxs = line.split()
        seen |= {(int(tp), int(bs), int(c)) for c in ctxs.split(",")}
    assert seen == want

    table = _run(PACKAGED, new)
    rows = [r for r in table.stdout.splitlines() if r.startswith("| ")]
    assert table.returncode == 0 and len(rows) == 1 + 2   # the header, two rows


def test_the_same_file_changes_nothing():
    got = _run(PACKAGED, PACKAGED)
    assert got.returncode == 0 and got.stdout.startswith("no bucket changed")


def test_a_torn_file_is_named(tmp_path):
    torn = tmp_path / "torn.yaml"
    torn.write_text("".join(PACKAGED.read_text().splitlines(keepends=True)[:-5]))
    got = _run(PACKAGED, torn)
    assert got.returncode == 2 and str(torn) in got.stderr
