"""What one compile-time config per (tp, batch bucket) leaves (`tuner.dispatch`), on a
hand-made trials table and exported entry (CPU, no device): per bucket the fastest other
compile-time group, its win, the win net of the dispatch's launch cost, and whether it pays."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from kvtune.kernels.tuned import ContextBucket, TunedDefaults, TunedEntry
from kvtune.tuner.dispatch import DISPATCH_COST_US, context_alternatives

SERVED = {"ROWS": 72, "COPY_LANES": 4}
LANES8 = {"ROWS": 72, "COPY_LANES": 8}
ROWS64 = {"ROWS": 64, "COPY_LANES": 4}


def _row(params, ctx, us, phase="search", role="search", kernel_hash="h1", outcome="ok"):
    return {"backend": "wgmma", "tp": 4, "bs": 64, "ctx": ctx, "phase": phase, "round": "", "outcome": outcome,
            "role": role, "params": dict(params), "median_us": float(us), "kernel_hash": kernel_hash,
            "device": "H200", "arch": "sm_90"}


def _tuned(served_us):
    buckets = tuple(ContextBucket(max_context=c, NSPLIT=66, latency_us=us) for c, us in served_us.items())
    entry = TunedEntry(tp=4, heads_per_rank=16, max_batch=64, backend="wgmma", params=dict(SERVED, NSPLIT=66),
                       buckets=buckets)
    return TunedDefaults(deployment="d", model={}, provenance={}, entries=(entry,))


def test_each_bucket_gets_its_fastest_other_group_and_what_a_dispatch_would_net():
    rows = [
        _row(dict(SERVED, NSPLIT=66), 4096, 100.0, role="baseline"),
        _row(dict(SERVED, NSPLIT=66), 65536, 1000.0, role="baseline"),
        # eight lanes: 1% faster at 4k (within the noise margin), 10% at 64k (best at NSPLIT 33)
        _row(dict(LANES8, NSPLIT=66), 4096, 99.0),
        _row(dict(LANES8, NSPLIT=33), 65536, 900.0),
        _row(dict(LANES8, NSPLIT=66), 65536, 950.0),
        # ROWS 64 slower everywhere but at 64k, where its re-measurements (the export's judgment)
        # are slower than its search time
        _row(dict(ROWS64, NSPLIT=66), 4096, 120.0),
        _row(dict(ROWS64, NSPLIT=132), 65536, 800.0),
        _row(dict(ROWS64, NSPLIT=132), 65536, 990.0, phase="remeasure"),
        _row(dict(ROWS64, NSPLIT=132), 65536, 994.0, phase="remeasure"),
        _row(dict(ROWS64, NSPLIT=132), 65536, 996.0, phase="remeasure"),
        # never counts: wrong, or measured on an older kernel source, or on the ragged batch
        _row(dict(ROWS64, NSPLIT=26), 4096, 10.0, outcome="wrong"),
        _row(dict(ROWS64, NSPLIT=44), 4096, 10.0, phase="ragged"),
    ]
    old = [_row(dict(ROWS64, NSPLIT=7), 65536, 10.0, kernel_hash="h0")]
    df = pd.DataFrame(old + rows)
    out = {r["ctx"]: r for r in context_alternatives(df, _tuned({4096: 100.0, 65536: 1000.0}))}
    at4k, at64k = out[4096], out[65536]
    assert json.loads(at4k["alternative"]) == {"COPY_LANES": 8, "ROWS": 72} and at4k["alt_NSPLIT"] == 66
    assert at4k["win_us"] == pytest.approx(1.0) and at4k["win_pct"] == pytest.approx(1.0)
    assert at4k["net_us"] == pytest.approx(1.0 - DISPATCH_COST_US) and not at4k["pays"]
    assert json.loads(at64k["alternative"]) == {"COPY_LANES": 8, "ROWS": 72} and at64k["alt_NSPLIT"] == 33
    assert at64k["win_us"] == pytest.approx(100.0) and at64k["win_pct"] == pytest.approx(10.0)
    assert at64k["net_us"] == pytest.approx(100.0 - DISPATCH_COST_US) and at64k["pays"]
    assert at64k["served"] == json.dumps({"COPY_LANES": 4, "ROWS": 72}) and at64k["served_us"] == 1000.0


@pytest.mark.parametrize("served_us,alt_us,pays", [
    (1000.0, 975.0, False),   # 25 us faster, but 2.5%: within the noise margin
    (50.0, 48.0, False),      # 4% faster, but 2 us: less than the dispatch's launches cost
    (100.0, 90.0, True),      # 10 us and 10%
])
def test_a_win_pays_only_past_both_the_noise_margin_and_the_launch_cost(served_us, alt_us, pays):
    df = pd.DataFrame([_row(dict(SERVED, NSPLIT=66), 4096, served_us, role="baseline"),
                       _row(dict(LANES8, NSPLIT=66), 4096, alt_us)])
    (r,) = context_alternatives(df, _tuned({4096: served_us}))
    assert r["win_us"] == pytest.approx(served_us - alt_us) and r["pays"] is pays


def test_a_bucket_with_no_other_group_has_no_alternative():
    df = pd.DataFrame([_row(dict(SERVED, NSPLIT=66), 4096, 100.0, role="baseline"),
                       _row(dict(SERVED, NSPLIT=132), 4096, 50.0)])   # another NSPLIT: not a compile-time group
    (r,) = context_alternatives(df, _tuned({4096: 100.0}))
    assert r["alternative"] is None and r["win_us"] is None and not r["pays"]


def test_a_bucket_a_dispatch_already_serves_is_judged_by_its_own_config():
    """A bucket naming its own params (a per-context dispatch) is served by them: the entry's
    config is the alternative there."""
    df = pd.DataFrame([_row(dict(SERVED, NSPLIT=66), 4096, 100.0, role="baseline"),
                       _row(dict(LANES8, NSPLIT=33), 4096, 90.0)])
    bucket = ContextBucket(max_context=4096, NSPLIT=33, latency_us=90.0, params={"COPY_LANES": 8})
    entry = TunedEntry(tp=4, heads_per_rank=16, max_batch=64, backend="wgmma", params=dict(SERVED, NSPLIT=66),
                       buckets=(ContextBucket(max_context=2048, NSPLIT=66, latency_us=50.0), bucket))
    rows = context_alternatives(df, TunedDefaults(deployment="d", model={}, provenance={}, entries=(entry,)))
    at4k = rows[1]
    assert json.loads(at4k["served"]) == {"COPY_LANES": 8, "ROWS": 72}
    assert json.loads(at4k["alternative"]) == {"COPY_LANES": 4, "ROWS": 72} and at4k["win_us"] == -10.0
