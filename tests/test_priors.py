"""The winners of set-aside trials (`trials.forgotten.csv`) measured first in a re-tune's studies
(`tuner/priors.py`)."""
import csv
import json
from pathlib import Path

import yaml

from kvtune.tuner.priors import load_priors
from kvtune.tuner.sweep import SweepOptions, run_sweep

COLS = ["deployment", "study", "phase", "round", "backend", "tp", "heads", "bs", "ctx", "T", "tree", "trial", "role",
        "params", "outcome", "median_us", "kernel_hash", "date"]


def _row(params, us, *, heads=8, bs=1, ctx=4096, phase="search", role="search", outcome="ok", h="new",
         date="2026-12-02T00:00:00Z", backend="wgmma", trial=0):
    return {"deployment": "d", "study": f"d|{backend}|x", "phase": phase, "round": "", "backend": backend, "tp": 8,
            "heads": heads, "bs": bs, "ctx": ctx, "T": 9, "tree": "random", "trial": trial, "role": role,
            "params": json.dumps(params), "outcome": outcome, "median_us": us, "kernel_hash": h, "date": date}


def _write(path: Path, rows, tail: str = ""):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS)
        w.writeheader()
        w.writerows(rows)
        f.write(tail)


A, B, C = {"NSPLIT": 132, "ROWS": 72}, {"NSPLIT": 66, "ROWS": 64}, {"NSPLIT": 33, "ROWS": 72}


def test_the_winner_of_each_bucket_on_its_newest_source(tmp_path):
    """Per bucket: the newest source's rows only, the median over a config's repeats, the search
    phase's ok trials only (no cross, ragged, failure or serving check), params renamed."""
    p = tmp_path / "trials.forgotten.csv"
    old = dict(h="old", date="2026-12-01T00:00:00Z")
    _write(p, [
        # bucket 1: the old source's faster C loses to the newest source's rows
        _row(C, 5.0, **old), _row(A, 20.0), _row(B, 18.0), _row(B, 30.0), _row(B, 25.0),  # B's median 25 > A's 20
        _row(A, 21.0), _row(C, 1.0, role="cross"), _row(C, 1.0, role="ragged"), _row(C, 1.0, outcome="failed"),
        _row(C, 1.0, phase="serve"),
        # bucket 2 (batch 8) was set aside only on the old source: its winner there
        _row(A, 50.0, bs=8, **old), _row(C, 40.0, bs=8, **old),
        # triton rows under an old parameter name
        _row({"BLOCK_H": 8, "NSPLIT": 4}, 9.0, backend="triton"),
    ], tail="kimi,torn row without an end")
    got = load_priors(p)
    assert got[("wgmma", 8, 1, 4096, 9, "random")] == A
    assert got[("wgmma", 8, 8, 4096, 9, "random")] == C
    assert got[("triton", 8, 1, 4096, 9, "random")] == {"HEADS_PER_BLOCK": 8, "NSPLIT": 4}
    assert len(got) == 3
    assert load_priors(tmp_path / "missing.csv") == {}
    (tmp_path / "empty.csv").write_text("")
    assert load_priors(tmp_path / "empty.csv") == {}
    nan = tmp_path / "nan.csv"   # a row without a latency is no winner
    _write(nan, [_row(A, 20.0), _row(B, float("nan"))])
    assert load_priors(nan) == {("wgmma", 8, 1, 4096, 9, "random"): A}


def test_a_retune_measures_the_set_aside_winner_right_after_the_baseline(tmp_path):
    """A CPU sweep whose folder holds only set-aside trials: each study's second trial is the
    winner set aside for its shape, before the neighbour's warm start; a parameter the space no
    longer has is dropped from it; a winner lacking one the space has is skipped (no crash); a
    winner of another model's shape seeds nothing."""
    doc = {"name": "prior", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
           "device": "cpu", "tp": [8], "contexts": [64, 128, 256], "batches": [1], "backends": ["triton"],
           "trials": 3, "timing": "eager"}
    dep = tmp_path / "prior.yaml"
    dep.write_text(yaml.safe_dump(doc))
    first = tmp_path / "first"
    kw = dict(device="cpu", rounds=0, progress=False)
    assert run_sweep(dep, SweepOptions(out=str(first), **kw)).status == "complete"
    rows = list(csv.DictReader((first / "prior" / "trials.csv").open(newline="")))
    search = [r for r in rows if r["phase"] == "search" and r["outcome"] == "ok"]
    picks, aside = {}, []
    for ctx in ("64", "128", "256"):
        mine = [r for r in search if r["ctx"] == ctx]
        baseline = json.loads(next(r for r in mine if r["role"] == "baseline")["params"])
        pick = next(r for r in mine if json.loads(r["params"]) != baseline)
        params = json.loads(pick["params"])
        picks[ctx] = dict(params)
        if ctx == "128":     # a parameter the space has since dropped: measured without it
            params["GONE"] = 3
        if ctx == "256":     # one it has since gained: not measured first
            params.pop("STAGES")
        # the non-default config fastest on "the old source"; the default, faster at another
        # model's shape (heads 2), must not be taken for this one
        for r in mine:
            aside.append(dict(r, kernel_hash="0ld", median_us="9.0"))
        aside.append(dict(pick, kernel_hash="0ld", median_us="1.0", params=json.dumps(params)))
        aside.append(dict(pick, heads="2", median_us="0.5", params=json.dumps(baseline), kernel_hash="0ld"))
    again = tmp_path / "again" / "prior"
    again.mkdir(parents=True)
    with (again / "trials.forgotten.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(aside)
    assert run_sweep(dep, SweepOptions(out=str(tmp_path / "again"), **kw)).status == "complete"
    new = [r for r in csv.DictReader((again / "trials.csv").open(newline="")) if r["phase"] == "search"]
    roles = {ctx: [r["role"] for r in sorted((r for r in new if r["ctx"] == ctx), key=lambda r: int(r["trial"]))]
             for ctx in picks}
    first_two = {ctx: {int(r["trial"]): r for r in new if r["ctx"] == ctx} for ctx in picks}
    for ctx in ("64", "128"):
        assert roles[ctx][:2] == ["baseline", "prior"], (ctx, roles[ctx])
        assert json.loads(first_two[ctx][1]["params"]) == picks[ctx]
    assert "warm" in roles["128"][2:]   # the neighbour's winner comes after the prior
    assert roles["256"][0] == "baseline" and "prior" not in roles["256"]


def test_prior_hits_counts_the_old_winners_against_the_new_bests(tmp_path, capsys):
    """scripts/prior_hits.py: bucket 1's old winner is the new best, bucket 2's is 5% off it,
    bucket 3's was never measured by the new sweep."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("prior_hits", Path(__file__).parents[1] / "scripts" / "prior_hits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    old, new = tmp_path / "old.csv", tmp_path / "new.csv"
    o = dict(h="old")
    _write(old, [_row(A, 10.0, **o), _row(B, 12.0, **o),
                 _row(A, 10.0, bs=8, **o), _row(B, 12.0, bs=8, **o),
                 _row(C, 10.0, bs=64, **o)])
    _write(new, [_row(A, 9.0), _row(B, 11.0),
                 _row(A, 10.5, bs=8), _row(B, 10.0, bs=8),
                 _row(A, 20.0, bs=64)])
    assert mod.main([str(old), str(new), "--backend", "wgmma"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "3 buckets with a prior; the prior is the best at 1; measured by the newer sweep at 2, " \
           "within 2% of its best at 1" in last
