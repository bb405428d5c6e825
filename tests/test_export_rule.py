"""Which compile-time group `kvtune export` may serve beside the backend's default (CPU, no
device): a small loss at one context bucket is allowed only for a larger win over all of
them (BUCKET_LOSS_MARGIN), and no group serves a bucket's ragged batch more than that slower than
the default. Checked on hand-made trials tables against expectations written
out per case, and against the brute-force oracle (`export_oracle.py`)."""
from __future__ import annotations

import json

import pandas as pd
import pytest
from export_oracle import eligible_groups

from kvtune.tuner.export import BUCKET_LOSS_MARGIN, beside_default, choose

DEFAULT = {"NSPLIT": 26, "ROWS": 64, "COPY_LANES": 4}
LANES8 = {"NSPLIT": 26, "ROWS": 64, "COPY_LANES": 8}
CTXS = [4096, 65536]


def _table(default_us, lanes8_us):
    rows = []
    for params, role, lat in ((DEFAULT, "baseline", default_us), (LANES8, "search", lanes8_us)):
        for ctx, us in zip(CTXS, lat):
            rows.append({"backend": "wgmma", "tp": 2, "bs": 16, "ctx": ctx, "phase": "search", "round": "",
                         "outcome": "ok", "role": role, "params": dict(params), "median_us": float(us),
                         "floor_us": 10.0})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("lanes8_us,served", [
    ((102.0, 60.0), LANES8),    # 2% slower at 4k, 40% faster at 64k: a win worth the loss
    ((104.0, 60.0), DEFAULT),   # 4% slower at 4k: over the margin, however much it wins at 64k
    ((101.0, 98.0), DEFAULT),   # 1% slower at 4k, 0.5% faster in total: not worth it
    ((101.0, 92.0), LANES8),    # 1% slower at 4k, 3.5% faster in total
    ((99.0, 99.5), LANES8),     # faster everywhere: no margin asked
    ((100.0, 100.0), DEFAULT),  # a tie goes to the default's own group
])
def test_a_group_may_lose_a_little_at_one_bucket_to_win_more_over_all(lanes8_us, served):
    df = _table((100.0, 100.0), lanes8_us)
    pick, _ = choose(df, ["wgmma"], 2, 16, CTXS)
    backend, cparams, buckets, _ = pick
    assert backend == "wgmma" and cparams == {k: v for k, v in served.items() if k != "NSPLIT"}
    assert {c: b.nsplit for c, b in buckets.items()} == {c: 26 for c in CTXS}
    oracle = eligible_groups(df.assign(params=df["params"].map(json.dumps)), 2, 16)
    may = json.dumps({"COPY_LANES": 8, "ROWS": 64}, sort_keys=True)
    assert (("wgmma", may) in oracle) == (served is LANES8 or lanes8_us == (100.0, 100.0))


def test_beside_default_reads_the_margin_both_ways():
    m = BUCKET_LOSS_MARGIN
    assert beside_default({1: 100 * (1 + m) - 1e-9, 2: 50.0}, {1: 100.0, 2: 100.0})
    assert not beside_default({1: 100 * (1 + m) + 1e-6, 2: 1.0}, {1: 100.0, 2: 100.0})
    assert beside_default({1: 100.0, 2: 100.0}, {1: 100.0, 2: 100.0})   # equal is not a loss
    assert beside_default({1: 100.0, 2: 100.0}, {1: 100.0})              # a bucket the default lacks


@pytest.mark.parametrize("lanes8_ragged,served", [
    (110.0, DEFAULT),   # 10% slower than the default on the 4k bucket's ragged batch
    (102.0, LANES8),    # within 3%
    (None, LANES8),     # its ragged batch never timed: nothing to hold against it
])
def test_a_group_slower_on_a_ragged_batch_gives_way(lanes8_ragged, served):
    """Eight lanes 1.5x faster on equal requests at both buckets; at 4k the ragged batch (phase
    `ragged`, round "r8") decides."""
    df = _table((100.0, 100.0), (66.0, 66.0))
    ragged = [(DEFAULT, "baseline", 100.0)] + ([(LANES8, "search", lanes8_ragged)] if lanes8_ragged else [])
    rows = [{"backend": "wgmma", "tp": 2, "bs": 16, "ctx": 4096, "phase": "ragged", "round": "r8", "outcome": "ok",
             "role": role, "params": dict(p), "median_us": us, "floor_us": 10.0} for p, role, us in ragged]
    df = pd.concat([df, pd.DataFrame(rows)], ignore_index=True)
    pick, _ = choose(df, ["wgmma"], 2, 16, CTXS, rnd="r8")
    assert pick[1] == {k: v for k, v in served.items() if k != "NSPLIT"}
    oracle = eligible_groups(df.assign(params=df["params"].map(json.dumps)), 2, 16, "r8")
    assert (("wgmma", json.dumps({"COPY_LANES": 8, "ROWS": 64}, sort_keys=True)) in oracle) == (served is LANES8)


def test_a_tie_goes_to_the_default_whatever_the_order_of_the_groups():
    """The default with eight lanes, another group with four, equal everywhere: the default
    (groups are met in the order of their parameters' JSON, four lanes first)."""
    rows = []
    for params, role in ((dict(LANES8), "baseline"), (dict(DEFAULT), "search")):
        for ctx in CTXS:
            rows.append({"backend": "wgmma", "tp": 2, "bs": 16, "ctx": ctx, "phase": "search", "round": "",
                         "outcome": "ok", "role": role, "params": params, "median_us": 100.0, "floor_us": 10.0})
    pick, _ = choose(pd.DataFrame(rows), ["wgmma"], 2, 16, CTXS)
    assert pick[1] == {"ROWS": 64, "COPY_LANES": 8} and pick[3], pick


class _Sweep:
    """What `ragged_pick` / `deployment_trials` read of a `tuner.sweep.Sweep`."""

    def __init__(self, path):
        from types import SimpleNamespace
        self.table = SimpleNamespace(path=path)
        self.ctxs = CTXS
        self.dep = SimpleNamespace(name="dep", ragged_spread=8.0, model=SimpleNamespace(draft_tokens=9))


def test_the_sweeps_ragged_pick_is_the_pick_the_export_can_serve(tmp_path):
    """The ragged phase times the group the export would serve: not one measured on an older
    kernel source (its rows no longer count), nor one whose recorded serving check failed."""
    from kvtune.tuner.export import serve_key, served
    from kvtune.tuner.ragged import deployment_trials, ragged_pick
    from kvtune.tuner.table import TrialsTable

    lanes8_old = dict(LANES8, ROWS=72)
    df = _table((100.0, 100.0), (66.0, 66.0))   # eight lanes 1.5x faster: the pick
    old = df[df["role"] == "search"].assign(params=[dict(lanes8_old)] * 2, median_us=40.0, kernel_hash="0ld")
    df = pd.concat([old, df.assign(kernel_hash="n3w")], ignore_index=True)   # older rows first, as a table grows
    df = df.assign(deployment="dep", device="H200", arch="sm_90", T=9, study=[f"s{i}" for i in range(len(df))],
                   trial=0)
    path = tmp_path / "trials.csv"
    table = TrialsTable(path, ["NSPLIT", "ROWS", "COPY_LANES"])
    for r in df.to_dict("records"):
        table.append(r)
    sweep = _Sweep(path)
    rows = deployment_trials(sweep)
    assert set(rows["kernel_hash"]) == {"n3w"}
    assert json.loads(ragged_pick(sweep, "wgmma", 2, 16, rows)) == {"COPY_LANES": 8, "ROWS": 64}

    # its serving check recorded wrong: the default's group is what the export would serve
    pick, _ = choose(rows, ["wgmma"], 2, 16, CTXS)
    params, split_table = served(pick[1], pick[2], CTXS, 9, "wgmma", 16)
    key = serve_key("wgmma", params, split_table)
    bad = df[df["role"] == "search"].iloc[-2:].assign(phase="serve", round=key, outcome="wrong", reason="rel_err")
    for r in bad.to_dict("records"):
        table.append(r)
    rows = deployment_trials(sweep)
    assert json.loads(ragged_pick(sweep, "wgmma", 2, 16, rows)) == {"COPY_LANES": 4, "ROWS": 64}
