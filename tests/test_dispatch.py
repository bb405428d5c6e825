"""The per-context dispatch on the CPU (no device): buckets naming their own compile-time params
in the exported YAML (schema and `TunedEntry.configs`), the export's rule for them
(`tuner.dispatch.dispatch_moves`, `tuner.dispatch.with_dispatch`) on hand-made trials tables with
the expected outcome written out per case, and the runtime plan's host mirrors. Its kernels
(a launch whose batch falls in a bucket of another config writes nothing) are checked on the
GPU: `tests/test_dispatch_gpu.py`."""
from __future__ import annotations

import copy
import json

import pandas as pd
import pytest

from kvtune.kernels.backends import SplitTable, get_backend, split_bounds
from kvtune.kernels.plans import Plan
from kvtune.kernels.tuned import SchemaError, parse_tuned
from kvtune.tuner.dispatch import DISPATCH_COST_US, dispatch_moves
from kvtune.tuner.dispatch import with_dispatch
from kvtune.tuner.export import Bucket, serve_key

CTXS = [4096, 16384, 65536]
LANES4 = {"ROWS": 72, "COPY_LANES": 4}
LANES8 = {"ROWS": 72, "COPY_LANES": 8}


def _doc(buckets, backend="wgmma", params=None) -> dict:
    return {
        "schema_version": 1, "deployment": "d",
        "model": {"name": "m", "num_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "draft_tokens": 9,
                  "sm_scale": 0.1},
        "provenance": {"device_name": "NVIDIA H200", "arch": "sm_90", "kernel_hash": {backend: "x"},
                       "date": "2026-12-01T00:00:00Z"},
        "entries": [{"tp": 4, "heads_per_rank": 16, "max_batch": 64, "backend": backend,
                     "params": params or dict(LANES4, NSPLIT=66), "buckets": buckets}]}


def test_a_bucket_with_its_own_params_makes_a_second_config():
    t = parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66},
                          {"max_context": 16384, "NSPLIT": 44, "params": {"COPY_LANES": 8}},
                          {"max_context": 65536, "NSPLIT": 132},
                          {"max_context": 131072, "NSPLIT": 33, "params": {"COPY_LANES": 8}}],
                     params=dict(LANES4, NSPLIT=132)))
    (e,) = t.entries
    assert e.configs() == [("wgmma", {"ROWS": 72, "COPY_LANES": 4, "NSPLIT": 132}, [66, 0, 132, 0]),
                           ("wgmma", {"ROWS": 72, "COPY_LANES": 8, "NSPLIT": 44}, [0, 44, 0, 33])]
    assert e.backends() == ["wgmma"]
    assert parse_tuned(t.to_dict()) == t          # written and read back the same


@pytest.mark.parametrize("bucket,error", [
    ({"params": {"NSPLIT": 3}}, "but NSPLIT"),
    ({"params": {"VEC": 8}}, "but NSPLIT"),                     # not a parameter of the entry
    ({"params": {}}, "empty"),
    ({"params": {"COPY_LANES": 4}}, "entry's own"),
    ({"params": {"COPY_LANES": 5}}, "COPY_LANES"),              # an illegal value, named by its declaration
    ({"params": [8]}, "expected a mapping"),
])
def test_bucket_params_are_checked_and_named(bucket, error):
    with pytest.raises(SchemaError, match=error):
        parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66}, {"max_context": 16384, "NSPLIT": 44, **bucket}]))


def test_every_bucket_on_other_params_or_a_per_request_backend_is_refused():
    with pytest.raises(SchemaError, match="serve none"):
        parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66, "params": {"COPY_LANES": 8}}]))
    triton = {"NSPLIT": 4, "BLOCK_N": 16, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1}
    with pytest.raises(SchemaError, match="triton picks NSPLIT per request"):
        parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 4},
                          {"max_context": 16384, "NSPLIT": 4, "params": {"BLOCK_N": 32}}], "triton", triton))
    # the oracle has no parameters: a file giving it some, and a bucket others, is a schema error too
    with pytest.raises(SchemaError, match="reference picks NSPLIT per request"):
        parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 1},
                          {"max_context": 16384, "NSPLIT": 1, "params": {"X": 2}}], "reference", {"X": 1}),
                    check_params=False)


def test_a_split_table_of_another_configs_buckets():
    t = SplitTable.build([10, 20], [0, 5], "cpu")
    assert t.dispatch and not SplitTable.build([10, 20], [1, 5], "cpu").dispatch
    # int32 on the device: a fraction would be cut, a value past int32 would wrap
    for bounds, nsplit in (([10.5, 20], [1, 5]), ([10, 2**40], [1, 5]), ([10, 20], [1, True])):
        with pytest.raises(ValueError, match="SplitTable .* must be int32 integers"):
            SplitTable.build(bounds, nsplit, "cpu")
    with pytest.raises(ValueError, match="one at least"):
        SplitTable.build([10, 20], [0, 0], "cpu")
    with pytest.raises(ValueError, match=">= 1"):
        SplitTable.build([10], [-1], "cpu")


def test_the_plan_mirrors_the_devices_choice_of_config_and_nsplit():
    """The launch serving a batch is the one whose table holds the bucket of the batch's keys
    (bounds: (max_context + T) x max_batch); each bucket's NSPLIT is within its config's grid."""
    t = parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66},
                          {"max_context": 16384, "NSPLIT": 44, "params": {"COPY_LANES": 8}},
                          {"max_context": 65536, "NSPLIT": 33}]))
    (e,) = t.entries
    be = get_backend("wgmma")
    from kvtune.kernels.cuda.params import WgmmaParams
    main, alt = WgmmaParams(NSPLIT=66, **LANES4), WgmmaParams(NSPLIT=44, **LANES8)
    bounds = split_bounds(be, [b.max_context for b in e.buckets], 9, 64)
    assert bounds == [(c + 9) * 64 for c in (4096, 16384, 65536)]
    plan = Plan(64, be, main, SplitTable.build(bounds, [66, 0, 33], "cpu"), e, "mem",
                ((alt, SplitTable.build(bounds, [0, 44, 0], "cpu"), be),))
    assert plan.bucket_nsplits() == (66, 44, 33)
    assert plan.params_for_keys(bounds[0], 9) == main
    assert plan.params_for_keys(bounds[0] + 1, 9) == alt and plan.params_for_keys(bounds[1], 9) == alt
    assert plan.params_for_keys(bounds[1] + 1, 9) == main
    assert plan.params_for_keys(10 * bounds[2], 9) == main  # past the last bound: the last bucket
    # NSPLIT of equal requests: the batch's keys pick the bucket, not one request's prefix
    assert plan.nsplit_for(16384, 9, batch=1) == 66                 # 16393 keys <= (4096 + 9) x 64
    assert plan.nsplit_for(16384, 9, batch=64) == 44                # 64 x 16393 keys, the second bound
    assert plan.nsplit_for(65536, 9, batch=5) == 44                 # 327725 keys, past the first bound
    assert plan.nsplit_for(65536, 9, batch=64) == 33


# -- the export's rule ----------------------------------------------------------------------

def _trial(params, ctx, us, phase="search", role="search", rnd="", outcome="ok"):
    return {"backend": "wgmma", "tp": 4, "bs": 64, "ctx": ctx, "phase": phase, "round": rnd, "outcome": outcome,
            "role": role, "params": dict(params), "median_us": float(us), "reason": ""}


def _pick(latency: dict):
    return ("wgmma", dict(LANES4), {c: Bucket(66, us, us, 10.0) for c, us in latency.items()}, True)


def _table(rows):
    return pd.DataFrame(rows)


SERVED = {4096: 200.0, 16384: 800.0, 65536: 3200.0}


def _search(lanes8: dict) -> list[dict]:
    rows = [_trial(dict(LANES4, NSPLIT=66), c, us, role="baseline") for c, us in SERVED.items()]
    for c, (n, us) in lanes8.items():
        rows.append(_trial(dict(LANES8, NSPLIT=n), c, us))
    return rows


@pytest.mark.parametrize("lanes8,moved", [
    ({4096: (66, 210.0), 16384: (44, 700.0), 65536: (33, 2900.0)}, {16384: 44, 65536: 33}),
    ({4096: (66, 195.0), 16384: (44, 790.0), 65536: (33, 3150.0)}, {}),      # 2.5%, 1.3%, 1.6%: in the noise
    ({4096: (66, 196.0), 16384: (44, 799.0), 65536: (33, 3300.0)}, {}),      # 2% at 4k only: 4 us, not 3%
    ({4096: (66, 190.0), 16384: (44, 700.0), 65536: (33, 2900.0)}, None),    # faster everywhere: not a dispatch
])
def test_dispatch_moves_the_buckets_another_group_wins_by_the_margin_and_the_cost(lanes8, moved):
    df = _table(_search(lanes8))
    moves, alt, alt_be = dispatch_moves(df, "wgmma", 4, 64, CTXS, dict(LANES4), _pick(SERVED)[2], None)
    if moved is None:   # every bucket would move: the pick itself should have been this group
        assert moves == {} and alt == {} and alt_be is None
        return
    assert alt_be == ("wgmma" if moved else None)
    assert {c: b.nsplit for c, b in moves.items()} == moved
    assert alt == (LANES8 if moved else {})
    for c, b in moves.items():
        assert b.latency == lanes8[c][1] and b.default == SERVED[c]


def test_a_group_slower_on_the_ragged_batch_is_not_moved_there():
    rows = _search({16384: (44, 700.0), 65536: (33, 2900.0)})
    rows += [_trial(dict(LANES4, NSPLIT=66), 65536, 1000.0, "ragged", "baseline", "x8"),
             _trial(dict(LANES8, NSPLIT=33), 65536, 1100.0, "ragged", "search", "x8")]
    moves, _, _ = dispatch_moves(_table(rows), "wgmma", 4, 64, CTXS, dict(LANES4), _pick(SERVED)[2], "x8")
    assert sorted(moves) == [16384]


def _serve_rows(key, latency: dict, role="dispatch", outcome="ok"):
    return [_trial(dict(LANES4, NSPLIT=66), c, us, "serve", role, key, outcome) for c, us in latency.items()]


def _dispatch_key():
    from kvtune.tuner.dispatch import dispatch_tables
    moves = {16384: Bucket(44, 700.0, 800.0, 10.0), 65536: Bucket(33, 2900.0, 3200.0, 10.0)}
    params, table, others = dispatch_tables("wgmma", dict(LANES4), _pick(SERVED)[2], moves, dict(LANES8), CTXS, 9,
                                            64)
    assert params["NSPLIT"] == 66 and table[1] == [66, 0, 0] and others[0][1][1] == [0, 44, 33]
    assert others[0][0] == dict(LANES8, NSPLIT=44)
    return serve_key("wgmma", params, table, others), (params, table, others)


@pytest.mark.parametrize("checked,kept", [
    ({4096: 203.0, 16384: 705.0, 65536: 2910.0}, True),    # the idle launch costs 4k 3 us; 16k, 64k win
    ({4096: 203.0, 16384: 790.0, 65536: 2910.0}, False),   # 16k: 1.3% faster through the runtime only
    ({4096: 203.0, 16384: 705.0}, False),                  # 64k never checked (and no device to check it)
])
def test_the_dispatch_stays_only_if_its_serving_check_beats_the_picks(checked, kept):
    key, _ = _dispatch_key()
    df = _table(_search({16384: (44, 700.0), 65536: (33, 2900.0)}) + _serve_rows(key, checked))
    moves, alt, _, lat, notes = with_dispatch(df, _pick(SERVED), 4, 64, CTXS, 9, dict(SERVED))
    assert bool(moves) is kept and (alt == LANES8) is kept and (lat == checked) is kept
    assert ("per-context dispatch" if kept else "no dispatch") in notes[0]
    # 16k failing alone: 64k's dispatch by itself is next, and nothing recorded it here
    if checked.get(16384) == 790.0:
        assert len(notes) == 2 and "at context(s) [65536]" in notes[1] and "check was not measured" in notes[1]
    else:
        assert len(notes) == 1


@pytest.mark.parametrize("alone,kept", [
    ({4096: 202.0, 16384: 800.0, 65536: 2905.0}, True),     # 64k alone: 9% and 295 us
    ({4096: 202.0, 16384: 800.0, 65536: 3150.0}, False),    # 64k alone: 1.6%, not the 3% margin
])
def test_where_only_some_moved_buckets_win_those_alone_are_checked_in_turn(alone, kept):
    """The dispatch of 16k and 64k served 16k no faster (790 vs 800 us): the dispatch of 64k alone
    is measured next (its own tables and key) and ships only on its own check."""
    from kvtune.tuner.dispatch import dispatch_tables
    key, (params, table, others) = _dispatch_key()
    df = _table(_search({16384: (44, 700.0), 65536: (33, 2900.0)}) +
                _serve_rows(key, {4096: 203.0, 16384: 790.0, 65536: 2910.0}))
    moves64 = {65536: Bucket(33, 2900.0, 3200.0, 10.0)}
    p64, t64, o64 = dispatch_tables("wgmma", dict(LANES4), _pick(SERVED)[2], moves64, dict(LANES8), CTXS, 9, 64)
    assert t64[1] == [66, 66, 0] and o64[0][1][1] == [0, 0, 33]
    calls, beside = [], []

    def check(be, p, t, tp, bs, contexts, k, dispatch=None):
        if dispatch is None:   # the pick, measured again beside the dispatch about to be measured
            beside.append(k)
            return _serve_rows(k, {c: SERVED[c] for c in contexts}, "export")
        calls.append((p, t, contexts, k, dispatch))
        return _serve_rows(k, {c: alone[c] for c in contexts})
    moves, alt, _, lat, notes = with_dispatch(df, _pick(SERVED), 4, 64, CTXS, 9, dict(SERVED), check)
    assert calls == [(p64, t64, CTXS, serve_key("wgmma", p64, t64, o64), o64)]
    # the 16k + 64k dispatch was recorded, so only the 64k one needed the pick beside it
    assert len(beside) == 1 and beside[0].endswith(" beside " + serve_key("wgmma", p64, t64, o64))
    assert (sorted(moves) == [65536]) is kept and (lat == alone) is kept and (alt == LANES8) is kept
    assert len(notes) == 2
    assert "no dispatch" in notes[0] and ("per-context dispatch" if kept else "no dispatch") in notes[1]


def test_a_dispatch_check_is_measured_when_missing_and_a_failed_one_keeps_the_pick():
    key, (params, table, others) = _dispatch_key()
    df = _table(_search({16384: (44, 700.0), 65536: (33, 2900.0)}))
    calls, beside = [], []

    def check(be, p, t, tp, bs, contexts, k, dispatch=None):
        if dispatch is None:
            beside.append(k)
            return _serve_rows(k, {c: SERVED[c] for c in contexts}, "export")
        calls.append((p, t, contexts, k, dispatch))
        return _serve_rows(k, {c: SERVED[c] * 0.9 for c in contexts})
    moves, _, _, lat, _ = with_dispatch(df, _pick(SERVED), 4, 64, CTXS, 9, dict(SERVED), check)
    assert calls == [(params, table, CTXS, key, others)] and sorted(moves) == [16384, 65536]
    assert len(beside) == 1 and beside[0].endswith(" beside " + key)
    wrong = _table(_search({16384: (44, 700.0), 65536: (33, 2900.0)}) +
                   _serve_rows(key, {c: 1.0 for c in CTXS}, outcome="wrong"))
    moves, _, _, lat, notes = with_dispatch(wrong, _pick(SERVED), 4, 64, CTXS, 9, dict(SERVED))
    assert moves == {} and lat is None and "failed (wrong" in notes[0]


def test_a_per_request_backend_never_dispatches():
    df = _table([dict(r, backend="triton") for r in _search({16384: (44, 700.0), 65536: (33, 2900.0)})])
    assert dispatch_moves(df, "triton", 4, 64, CTXS, dict(LANES4), _pick(SERVED)[2], None) == ({}, {}, None)


def test_the_cost_is_the_measured_one():
    """DISPATCH_COST_US is the largest early-exit cost `scripts/bench_dispatch.py` measured, rounded
    to 0.1 us (the committed run: results/serving/dispatch/dispatch.csv)."""
    from kvtune.tuner.config import REPO_ROOT
    measured = pd.read_csv(REPO_ROOT / "results" / "serving" / "dispatch" / "dispatch.csv")["skip_cost_us"]
    assert DISPATCH_COST_US == pytest.approx(round(float(measured.max()), 1))


def test_an_old_file_without_bucket_params_is_one_config():
    t = parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66}, {"max_context": 16384, "NSPLIT": 44}]))
    (e,) = t.entries
    assert e.configs() == [("wgmma", dict(LANES4, NSPLIT=66), [66, 44])]
    doc = copy.deepcopy(t.to_dict())
    assert all("params" not in b for b in doc["entries"][0]["buckets"])
    assert json.dumps(doc)   # plain data


def test_export_measures_at_most_max_checks_serving_checks_per_bucket_then_keeps_the_next_pick_unchecked():
    """Every pick's serving check comes back wrong: export measures MAX_CHECKS of them, in order
    of their trials latency, then stops measuring and returns the next pick with no check."""
    from kvtune.tuner.export import MAX_CHECKS, pick_served
    n = MAX_CHECKS + 2   # groups "COPY_LANES" 4 (the default) .. 4 + n - 1, each faster than the one before
    rows = [dict(_trial({"ROWS": 72, "COPY_LANES": 4 + i, "NSPLIT": 66}, c, us * (1 - 0.05 * i),
                        role="baseline" if i == 0 else "search"), floor_us=10.0)
            for i in range(n) for c, us in SERVED.items()]
    calls = []

    def check(be, p, t, tp, bs, contexts, k, dispatch=None):
        calls.append(p["COPY_LANES"])
        return [dict(r, reason="mismatch") for r in _serve_rows(k, {c: 1.0 for c in contexts}, "export", "wrong")]
    pick, notes, lat = pick_served(_table(rows), ["wgmma"], 4, 64, CTXS, 9, check)
    assert calls == [4 + n - 1 - i for i in range(MAX_CHECKS)] and len(notes) == MAX_CHECKS
    assert pick[1]["COPY_LANES"] == 4 + n - 1 - MAX_CHECKS and lat is None


class _Check:
    """A serving check with its ragged-batch method, answering from fixed latencies per call
    (equal requests: `equal[i]` for the i-th equal check; ragged: `ragged`), recording calls."""

    def __init__(self, equal: list[dict], ragged: dict):
        self.equal, self.rag, self.calls = equal, ragged, []

    def __call__(self, be, p, t, tp, bs, contexts, k, dispatch=None):
        if dispatch is None:   # the pick beside the dispatch: served as its own check had it
            self.calls.append(("beside", list(contexts), k))
            return _serve_rows(k, {c: SERVED[c] for c in contexts}, "export")
        lat = self.equal[sum(c[0] == "equal" for c in self.calls)]
        self.calls.append(("equal", list(contexts), k))
        return _serve_rows(k, {c: lat[c] for c in contexts})

    def ragged(self, be, p, t, tp, bs, contexts, k, dispatch=None):
        self.calls.append(("ragged", list(contexts), k))
        return _serve_rows(k, {c: self.rag[c] for c in contexts})


@pytest.mark.parametrize("ragged64,moved", [
    (1020.0, [16384, 65536]),   # 2% slower than the default's 1000 us on 64k's ragged batch: within 3%
    (1100.0, [16384]),          # 10% slower there: 64k stays with the pick, 16k alone is checked next
])
def test_a_moved_bucket_must_not_serve_its_ragged_batch_slower_than_the_default(ragged64, moved):
    """The sweep never timed the other group on the ragged batch (only the default, 1000 us at
    64k): the dispatch is measured there, the way serving runs it, before a bucket moves."""
    rows = _search({16384: (44, 700.0), 65536: (33, 2900.0)})
    rows.append(_trial(dict(LANES4, NSPLIT=66), 65536, 1000.0, "ragged", "baseline", "x8"))
    check = _Check([{4096: 203.0, 16384: 705.0, 65536: 2910.0}, {4096: 202.0, 16384: 704.0, 65536: 3199.0}],
                   {65536: ragged64})
    moves, alt, _, lat, notes = with_dispatch(_table(rows), _pick(SERVED), 4, 64, CTXS, 9, dict(SERVED), check, "x8")
    assert sorted(moves) == moved and alt == LANES8
    kinds = [c[0] for c in check.calls]
    assert kinds == (["beside", "equal", "ragged"] if len(moved) == 2 else
                     ["beside", "equal", "ragged", "beside", "equal"])
    assert check.calls[2][1] == [65536] and check.calls[2][2].endswith("ragged x8")
    assert f"ragged at 65536: {ragged64:.1f} vs the default's 1000.0 us" in notes[0]
    # no ragged measurement (a check without that method, nothing recorded): the bucket cannot move
    plain = _Check(check.equal, {})
    moves, _, _, _, notes = with_dispatch(_table(rows), _pick(SERVED), 4, 64, CTXS, 9, dict(SERVED),
                                       lambda *a, **k: plain(*a, **k), "x8")
    assert sorted(moves) == [16384] and "ragged at 65536: not measured" in notes[0]


def test_a_dispatch_that_wins_every_moved_bucket_but_loses_in_total_is_not_tried_smaller():
    """Fewer moved buckets would gain less and pay the same idle launches: one check, no dispatch."""
    check = _Check([{4096: 600.0, 16384: 705.0, 65536: 2910.0}], {})
    df = _table(_search({16384: (44, 700.0), 65536: (33, 2900.0)}))
    moves, alt, _, lat, notes = with_dispatch(df, _pick(SERVED), 4, 64, CTXS, 9, dict(SERVED), check)
    assert moves == {} and lat is None and [c[0] for c in check.calls] == ["beside", "equal"]
    assert "no dispatch" in notes[0]
