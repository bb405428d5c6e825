"""Ragged scoring of batch buckets (CPU): the ragged batch a bucket is scored on, the floor of
a ragged batch, the NSPLIT rule the export applies, and a sweep that measures the ragged
phase (Triton under its interpreter), resumes it without repeating rows, and exports what
the brute-force oracle (`export_oracle.py`) works out from its trials table."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml
from export_oracle import check_export, config_latencies, eligible_groups

from kvtune.tuner.config import ConfigError, parse_deployment
from kvtune.tuner.export import NSPLIT_MARGIN, export_deployment, pick_nsplit
from kvtune.tuner.measure import RAGGED_MEAN, Ceilings, ProblemSpec, ragged_prefixes
from kvtune.tuner.ragged import nsplit_candidates, ragged_round
from kvtune.tuner.sweep import SweepOptions, run_sweep
from kvtune.tuner.table import read_trials


@pytest.mark.parametrize("batch,context,spread", [(2, 64, 8.0), (4, 4096, 8.0), (16, 131072, 8.0), (64, 4096, 4.0),
                                                  (7, 300, 2.5)])
def test_ragged_prefixes_spread_and_mean(batch, context, spread):
    p = ragged_prefixes(batch, context, spread)
    assert len(p) == batch and all(isinstance(x, int) and x >= 1 for x in p)
    assert list(p) == sorted(p) and p == ragged_prefixes(batch, context, spread), "ascending, deterministic"
    rounding = 1 / min(p)   # prefixes are whole tokens
    assert max(p) / min(p) == pytest.approx(spread, rel=0.02 + rounding)
    assert sum(p) / batch == pytest.approx(RAGGED_MEAN * context, rel=0.01 + rounding)
    ratios = [b / a for a, b in zip(p, p[1:])]   # log-uniform: consecutive ratios equal
    assert max(ratios) / min(ratios) < 1.05 + 2 * rounding


@pytest.mark.parametrize("batch,spread", [(1, 8.0), (4, 1.0), (4, 0.5)])
def test_ragged_prefixes_refuses_what_is_not_ragged(batch, spread):
    with pytest.raises(ValueError, match="ragged_prefixes"):
        ragged_prefixes(batch, 4096, spread)


def test_ragged_spec_floor_sums_its_requests():
    """A ragged batch moves each request's key rows once: its bytes and flops are the sums of
    one-request problems, worked out here from the README's formula."""
    T, H, Dk, Dv = 9, 8, 576, 512
    prefixes = (100, 2000, 37)
    spec = ProblemSpec(heads=H, batch=3, context=4096, draft_tokens=T, prefixes=list(prefixes))
    assert spec.prefixes == prefixes and spec.keys == sum(prefixes) + 3 * T
    want_bytes = sum((p + T) * (2 * Dk + 4) + T * H * 2 * (Dk + Dv) + 4 * 2 + 8 * T for p in prefixes) - 4 * 2
    assert spec.bytes_moved() == want_bytes
    assert spec.flops() == sum(2 * T * H * (Dk + Dv) * (p + T) for p in prefixes)
    ceil = Ceilings(read_gbps=4000.0, bf16_tflops=600.0)
    assert ceil.floor_us(spec) == pytest.approx(max(want_bytes / 4e6, spec.flops() / 6e8))
    # the trial worker gets the spec as JSON: a list comes back, equal and hashable as before
    again = ProblemSpec(**json.loads(json.dumps(dataclasses.asdict(spec))))
    assert again == spec and hash(again) == hash(spec)
    with pytest.raises(ValueError, match="prefixes"):
        ProblemSpec(heads=H, batch=2, context=64, draft_tokens=T, prefixes=(1, 2, 3))


@pytest.mark.parametrize("equal,ragged,want", [
    ({66: 509.8, 33: 514.2, 132: 520.0}, {66: 792.9, 33: 990.0, 132: 510.9}, 132),   # tp 4, 64 requests
    ({66: 100.0, 132: 120.0}, {66: 200.0, 132: 150.0}, 132),    # 1.33 vs 1.20: the ragged batch decides
    ({66: 100.0, 132: 140.0}, {66: 200.0, 132: 160.0}, 66),     # 1.25 vs 1.40: equal requests decide
    ({66: 100.0, 132: 101.0}, {}, 66),                          # not timed on a ragged batch
    ({8: 10.0, 16: 10.0}, {8: 20.0, 16: 20.0}, 8),              # a tie: the first timed
    ({8: 10.0, 16: 9.0, 32: 11.0}, {8: 5.0, 32: 5.0}, 8),       # the best on equal requests not timed ragged
])
def test_pick_nsplit_least_worse_ratio(equal, ragged, want):
    assert pick_nsplit(equal, ragged) == want


@pytest.mark.parametrize("equal,ragged,keep,want", [
    ({66: 20.30, 132: 20.44}, {}, 132, 132),                     # the tp 8, 4k pick: 0.7% is noise
    ({66: 19.00, 132: 20.44}, {}, 132, 66),                      # 7.6% is not
    ({66: 100.0, 132: 103.0}, {}, 132, 132),                     # 3.0%: at the margin, the default stays
    ({66: 100.0, 132: 103.1}, {}, 132, 66),
    ({66: 100.0, 132: 101.0}, {66: 150.0, 132: 100.0}, 66, 132),  # ragged: 1.01 against 1.5
    ({66: 100.0, 132: 102.0}, {66: 101.0, 132: 100.0}, 66, 66),  # ragged: 1.02 against 1.01, within 3%
    ({66: 100.0, 132: 101.0}, {}, 16, 66),                       # the default's NSPLIT not measured here
    ({66: 100.0, 132: 120.0}, {66: 100.0}, 132, 66),             # nor on the ragged batch
])
def test_pick_nsplit_keeps_the_default_within_the_margin(equal, ragged, keep, want):
    assert NSPLIT_MARGIN == 0.03
    assert pick_nsplit(equal, ragged, keep) == want


def test_nsplit_candidates():
    assert nsplit_candidates({66: 509.8, 33: 514.2, 16: 700.0}, lambda n: True) == [66, 33, 132]
    assert nsplit_candidates({66: 509.8, 33: 514.2}, lambda n: n <= 100) == [66, 33]
    assert nsplit_candidates({4: 1.0}, lambda n: True) == [4, 8]
    assert nsplit_candidates({}, lambda n: True) == []


def test_the_ragged_candidate_above_the_best_is_the_least_legal_value_of_at_least_twice_it():
    """kimi-k2-h100's tp 4 batch 64 x 16k, eight lanes (results/kimi-k2-h100/trials.csv): the best
    on equal requests was NSPLIT 26; its ragged candidates were 26 and 16 only (52 is not in the
    space), so NSPLIT 66, 1.13x faster served (results/serving/h100/), was never timed ragged."""
    space = [7, 14, 16, 26, 29, 33, 44, 66, 88, 132, 264]
    equal = {26: 773.8, 16: 784.0, 132: 795.1}
    in_space = set(space).__contains__
    assert nsplit_candidates(equal, in_space, space) == [26, 16, 66, 29]
    assert nsplit_candidates(equal, lambda n: in_space(n) and n != 66, space) == [26, 16, 88, 29]
    assert nsplit_candidates(equal, lambda n: n <= 44, space) == [26, 16, 29]   # nothing legal at 52+
    assert nsplit_candidates({66: 509.8, 33: 514.2}, in_space, space) == [66, 33, 132, 44, 88]


def test_the_ragged_candidates_include_the_legal_values_next_to_the_best():
    """kimi-k2-h100's tp 4 batch 64 x 4k, eight lanes: the search timed NSPLIT 44, 132 and 88; 66,
    next above the best, served 1.06x faster than the export's 132 and was never timed there."""
    space = [7, 14, 16, 26, 29, 33, 44, 66, 88, 132, 264]
    equal = {44: 218.8, 132: 232.3, 88: 340.3}
    in_space = set(space).__contains__
    assert nsplit_candidates(equal, in_space, space) == [44, 132, 88, 33, 66]
    # an illegal neighbour is skipped for the next legal one; measured values count as neighbours
    assert nsplit_candidates(equal, lambda n: in_space(n) and n not in (33, 66), space) == [44, 132, 88, 29]
    assert nsplit_candidates({44: 1.0, 50: 2.0}, lambda n: in_space(n) or n == 50, space) == [44, 50, 88, 33]
    assert nsplit_candidates({7: 1.0}, in_space, space) == [7, 14]   # the space's ends
    assert nsplit_candidates({264: 1.0}, in_space, space) == [264, 132]


def _compile_part(params: dict) -> str:
    return json.dumps({k: v for k, v in params.items() if k != "NSPLIT"}, sort_keys=True)


def _dep(**over):
    d = {"name": "r", "model": {"name": "m", "num_heads": 8, "draft_tokens": 4}, "device": "cpu", "tp": [8],
         "contexts": [64], "batches": [1, 3], "backends": ["triton"], "trials": 2}
    d.update(over)
    return d


def test_the_ragged_phase_revisits_groups_an_earlier_pick_timed():
    """A group timed on the ragged batch by an earlier pick, and then passed over, is still scored
    (so a resumed sweep times the candidates a changed rule adds for it); without ragged rows of
    the deployment's round only the pick and the default are."""
    import pandas as pd
    from kvtune.tuner.ragged import served_groups
    from kvtune.tuner.study import compile_key

    def row(params, us, phase="search", role="search", rnd="0"):
        return {"backend": "wgmma", "tp": 4, "bs": 64, "ctx": 16384, "params": params, "median_us": us,
                "outcome": "ok", "phase": phase, "role": role, "round": rnd}
    four = {"ROWS": 72, "COPY_LANES": 4}
    eight = {"ROWS": 72, "COPY_LANES": 8}
    rows = [row(dict(four, NSPLIT=66), 853.0, role="baseline"), row(dict(eight, NSPLIT=26), 771.0),
            row(dict(eight, NSPLIT=16), 790.0), row(dict(eight, NSPLIT=26), 1308.0, phase="ragged", rnd="x8")]
    df = pd.DataFrame(rows)
    got = served_groups(df, "wgmma", 4, 64, [16384], compile_key(dict(four, NSPLIT=66)), ragged_round(8.0))
    assert set(got) == {compile_key(four), compile_key(eight)}
    assert got[compile_key(eight)] == {16384: {26: 771.0, 16: 790.0}}
    assert set(served_groups(df, "wgmma", 4, 64, [16384], compile_key(four), ragged_round(4.0))) == {compile_key(four)}
    assert set(served_groups(df, "wgmma", 4, 64, [16384], compile_key(four))) == {compile_key(four)}


def test_deployment_ragged_spread():
    assert parse_deployment(_dep(), "d.yaml").ragged_spread == 8.0
    assert parse_deployment(_dep(ragged_spread=3), "d.yaml").ragged_spread == 3.0
    assert parse_deployment(_dep(ragged_spread=1), "d.yaml").ragged_spread == 1.0
    for bad in (0.5, "wide", 0):
        with pytest.raises(ConfigError, match=r"d\.yaml.*ragged_spread"):
            parse_deployment(_dep(ragged_spread=bad), "d.yaml")


def _sweep(tmp_path, dep, spaces, **kw):
    return run_sweep(str(dep), SweepOptions(device="cpu", out=str(tmp_path / "res"), space_dir=str(spaces),
                                            rounds=1, remeasure_top=1, progress=False, compile_workers=0, **kw))


def _candidates(table, ck, ctx, legal):
    """(the ragged phase's sure NSPLIT candidates, the values a near tie may add) of compile group
    `ck` at `ctx`, ranked on `table` (`config_latencies` rows)."""
    at = table[(table["compile"] == ck) & (table["ctx"] == ctx)].sort_values("latency_us")
    ranked = list(at["NSPLIT"])
    if not ranked:
        return set(), set()
    sure = {(ck, n) for n in ranked[:2]} | ({(ck, 2 * ranked[0])} if 2 * ranked[0] in legal else set())
    sure |= {(ck, n) for n in at[at["default"]]["NSPLIT"]}   # the default, reported beside the pick
    # and the values next to the best, below and above: of either of the top two here, as this
    # table's median and the phase's own latency may rank a near tie either way
    grid, near = sorted(legal | set(ranked)), set()
    for b in ranked[:2]:
        i = grid.index(b)
        near |= {(ck, n) for n in grid[max(i - 1, 0):i] + grid[i + 1:i + 2]}
    return sure, near


def test_sweep_scores_batch_buckets_on_a_ragged_batch(tmp_path):
    """At batch 3 every context bucket's NSPLIT candidates (the best and runner-up on equal
    requests, twice the best and the values next to it) are timed on the bucket's ragged batch,
    each a row that names its equal-requests trial; batch 1 gets none; a second run measures nothing again;
    the export serves, per bucket, what the oracle works out from the table."""
    doc = _dep(name="ragged-tiny", contexts=[64, 300], batches=[1, 3], trials=3, timing="eager", ragged_spread=4)
    dep = tmp_path / "ragged-tiny.yaml"
    dep.write_text(yaml.safe_dump(doc))
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    (spaces / "triton.yaml").write_text(yaml.safe_dump({"backend": "triton", "params": {
        "NSPLIT": [1, 2, 4], "BLOCK_N": [32], "HEADS_PER_BLOCK": [1], "NUM_WARPS": [4], "STAGES": [1]}}))
    sw = _sweep(tmp_path, dep, spaces)
    assert sw.status == "complete"
    df = read_trials(tmp_path / "res" / "ragged-tiny" / "trials.csv")
    rag = df[df["phase"] == "ragged"]
    assert set(rag["bs"]) == {3} and set(rag["ctx"]) == {64, 300}
    assert set(rag["round"].astype(str)) == {ragged_round(4.0)}
    ceil = Ceilings(sw.dep.device.read_gbps, sw.dep.device.bf16_tflops)
    # the groups scored: the export's pick on the table as the phase found it (the rows appended
    # before its first ragged row: later re-measurements can turn a near tie the other way), and
    # the default's
    first = rag.index.min()
    before = df[(df.index < first) & (df["phase"] != "ragged") & (df["role"] != "ragged")]
    groups = eligible_groups(before, 8, 3)
    pick = min(groups, key=lambda k: sum(lt for _, lt in groups[k].values()))[1]
    lat = config_latencies(before)
    lat = lat[lat["bs"] == 3]
    scored = {pick} | set(lat[lat["default"]]["compile"])
    legal = {1, 2, 4} | set(lat[lat["default"]]["NSPLIT"])
    # A pick that serves the ragged batch more than 3% slower than the default gives way to the
    # next (RAGGED_PICKS rounds), whose candidates are ranked on the table as that round finds it:
    # with the equal-request twins the rounds before measured. Those later candidates are allowed
    # by the rows before the bucket's last ragged row.
    later = config_latencies(df[(df.index < rag.index.max()) & (df["phase"] != "ragged")])
    later = later[later["bs"] == 3]

    for ctx, g in rag.groupby("ctx"):
        study = g["study"].iloc[0]
        want, near = set(), set()
        for ck in scored:
            sure, close = _candidates(lat, ck, ctx, legal)
            want |= sure
            near |= close
        got = {(_compile_part(p), p["NSPLIT"]) for p in g["params"]}
        for ck in {c for c, _ in got}:
            sure, close = _candidates(later, ck, ctx, legal)
            near |= sure | close
        assert want <= got <= want | near, (ctx, want, near)
        for _, r in g.iterrows():   # the row names the trial of the same config on equal requests
            twin = df[(df["study"] == study) & (df["phase"] == "search") & (df["trial"] == r["trial"])]
            assert len(twin) == 1 and twin["params"].iloc[0] == r["params"]
        spec = ProblemSpec(heads=1, batch=3, context=int(ctx), draft_tokens=4, tree="random",
                           sm_scale=sw.dep.model.scale, prefixes=ragged_prefixes(3, int(ctx), 4.0))
        assert g["floor_us"].astype(float).tolist() == pytest.approx([ceil.floor_us(spec)] * len(g), rel=1e-5)
        assert (g["outcome"] == "ok").all()
    # resuming measures only what is missing: nothing, unless the phase's new candidate won a
    # bucket on equal requests (then it is re-measured against the default, once)
    for _ in range(3):
        again = _sweep(tmp_path, dep, spaces)
        if again.measured_now == 0:
            break
    assert again.measured_now == 0
    df = read_trials(tmp_path / "res" / "ragged-tiny" / "trials.csv")
    keys = list(zip(df["study"], df["phase"], df["trial"], df["round"].astype(str)))
    assert len(keys) == len(set(keys)), "no row measured twice"
    tuned = export_deployment(str(dep), out=str(tmp_path / "res"), quiet=True)
    path = tmp_path / "res" / "ragged-tiny" / "ragged-tiny.yaml"
    check_export(yaml.safe_load(path.read_text()), df, ragged_round(4.0))
    b3 = next(e for e in tuned.entries if e.max_batch == 3)
    assert all(b.ragged_us is not None and b.default_ragged_us is not None for b in b3.buckets)
    b1 = next(e for e in tuned.entries if e.max_batch == 1)
    assert all(b.ragged_us is None for b in b1.buckets)
    from kvtune.tuner.review.data import search_trials   # the review's trials: not the ragged batch's times
    assert not (search_trials(df)["phase"] == "ragged").any() and len(search_trials(df)) > 0


def test_ragged_spread_one_turns_the_phase_off(tmp_path):
    doc = _dep(name="flat", contexts=[64], batches=[3], trials=2, timing="eager", ragged_spread=1)
    dep = tmp_path / "flat.yaml"
    dep.write_text(yaml.safe_dump(doc))
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    (spaces / "triton.yaml").write_text(yaml.safe_dump({"backend": "triton", "params": {
        "NSPLIT": [1, 2], "BLOCK_N": [32], "HEADS_PER_BLOCK": [1], "NUM_WARPS": [4], "STAGES": [1]}}))
    _sweep(tmp_path, dep, spaces)
    df = read_trials(tmp_path / "res" / "flat" / "trials.csv")
    assert not (df["phase"] == "ragged").any() and not math.isnan(float(df["median_us"].dropna().iloc[0]))


def _tuned_doc(bucket: dict) -> dict:
    return {"schema_version": 1, "deployment": "d",
            "model": {"name": "m", "num_heads": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "draft_tokens": 4,
                      "sm_scale": 0.1},
            "provenance": {"device_name": "cpu", "arch": "cpu", "kernel_hash": {"triton": "x"},
                           "date": "2026-12-01T00:00:00Z"},
            "entries": [{"tp": 8, "heads_per_rank": 1, "max_batch": 64, "backend": "triton",
                         "params": {"NSPLIT": 4, "BLOCK_N": 32, "HEADS_PER_BLOCK": 1, "NUM_WARPS": 4, "STAGES": 1},
                         "buckets": [dict({"max_context": 64, "NSPLIT": 4}, **bucket)]}]}


def test_yaml_ragged_fields_round_trip_and_are_checked(tmp_path):
    from kvtune.kernels.tuned import SchemaError, dump_tuned, load_tuned, parse_tuned
    t = parse_tuned(_tuned_doc({"latency_us": 520.0, "ragged_us": 510.9, "default_ragged_us": 792.9}), "mem")
    b = t.entries[0].buckets[0]
    assert (b.ragged_us, b.default_ragged_us) == (510.9, 792.9)
    back = load_tuned(dump_tuned(t, tmp_path / "t.yaml"), check_params=False).entries[0].buckets[0]
    assert back == b
    # a file without them (batch 1, or an older export) loads with None, and writes none back
    t1 = parse_tuned(_tuned_doc({}), "mem")
    assert t1.entries[0].buckets[0].ragged_us is None and "ragged_us" not in t1.to_dict()["entries"][0]["buckets"][0]
    for bad in ("fast", -1.0, True):
        with pytest.raises(SchemaError, match=r"mem: entries\[0\]\.buckets\[0\]\.ragged_us"):
            parse_tuned(_tuned_doc({"ragged_us": bad}), "mem")
    with pytest.raises(SchemaError, match="ragged_ms"):
        parse_tuned(_tuned_doc({"ragged_ms": 1.0}), "mem")


def test_cuda_no_empty_splits_counts_the_whole_batch():
    """CUDA's NSPLIT cuts the whole batch's keys: 64 requests of 4k keys in 32-key tiles hold
    64 x 129 tiles, so NSPLIT 264 leaves none empty (what ragged batches want), while one
    request of 4k holds 129 and 264 splits would leave 135 empty."""
    from pathlib import Path

    from kvtune.tuner.config import load_device
    from kvtune.tuner.space import load_space, problem_env
    sp = load_space("cuda", None, str(Path(__file__).resolve().parent.parent / "search_spaces"))
    dev = load_device("h200")
    q = {"NSPLIT": 264, "VEC": 8, "BLOCK_N": 32, "NUM_WARPS": 8, "HEADS_PER_BLOCK": 8, "STAGES": 2, "CTAS_PER_SM": 1}
    assert sp.violation(q, problem_env(9, 16, 64, 4096, 576, 512, dev)) is None
    assert "no_empty_splits" in sp.violation(q, problem_env(9, 16, 1, 4096, 576, 512, dev))


def test_a_constraint_dropped_since_lets_the_ragged_phase_measure_twice_the_best(tmp_path):
    """A resumed sweep whose search space has lost a constraint: NSPLIT 4 (twice the best, 2)
    was pruned by `NSPLIT <= 2` in the first run; the second run's ragged phase measures it on
    equal requests and on the ragged batch."""
    doc = _dep(name="grown", contexts=[64], batches=[3], trials=2, timing="eager", ragged_spread=4)
    dep = tmp_path / "grown.yaml"
    dep.write_text(yaml.safe_dump(doc))
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    # one compile-time config, the default's: the group scored whatever the timings
    params = {"NSPLIT": [2, 4], "BLOCK_N": [32], "HEADS_PER_BLOCK": [1], "NUM_WARPS": [8], "STAGES": [2]}
    cap = {"name": "cap", "expr": "NSPLIT <= 2", "reason": "test"}
    (spaces / "triton.yaml").write_text(yaml.safe_dump({"backend": "triton", "params": params, "constraints": [cap]}))
    _sweep(tmp_path, dep, spaces, trials=3)   # a grid of both: NSPLIT 4 pruned by the constraint
    table = tmp_path / "res" / "grown" / "trials.csv"
    df = read_trials(table)
    four = df[[p.get("NSPLIT") == 4 for p in df["params"]]]
    assert list(four["outcome"]) == ["pruned"]
    (spaces / "triton.yaml").write_text(yaml.safe_dump({"backend": "triton", "params": params}))
    _sweep(tmp_path, dep, spaces, trials=3)
    df = read_trials(table)
    got = df[[p.get("NSPLIT") == 4 for p in df["params"]]]
    assert ((got["phase"] == "search") & (got["outcome"] == "ok") & (got["role"] == "ragged")).sum() == 1
    assert ((got["phase"] == "ragged") & (got["outcome"] == "ok")).sum() == 1


RAGGED_WRONG_MODULE = '''
from kvtune.kernels.triton_kernel import TritonBackend


class RaggedWrongTriton(TritonBackend):
    """Zeros for a batch of unequal requests one of which holds more than 68 keys (the test's
    bucket: prefix 64 + 4 draft tokens), as only the bucket's ragged batch does: the real kernel
    on equal requests and on the gate's short ragged prefixes."""

    def launch(self, a, params):
        keys = a.kv_indptr.diff().tolist()
        if len(set(keys)) > 1 and max(keys) > 68:
            a.out.zero_()
            return
        super().launch(a, params)
'''


@pytest.mark.parametrize("wrong_on_ragged", [False, True])
def test_the_serving_check_runs_the_buckets_ragged_batch_through_the_oracle_gate(tmp_path, replace_backend,
                                                                                 wrong_on_ragged):
    """`ServingCheck.ragged` (what the export measures before moving a bucket to another launch)
    runs the same launches on the bucket's ragged batch: the floor of that batch's keys, rows
    under its own round, and the oracle's verdict on that batch, not on equal requests."""
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.executor import backend_info, device_info
    from kvtune.tuner.runner import Runner
    from kvtune.tuner.serve_check import ServingCheck
    if wrong_on_ragged:
        replace_backend("triton", "kvtune_ragged_wrong:RaggedWrongTriton", RAGGED_WRONG_MODULE)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_dep(batches=[4], ragged_spread=4, timing="eager")))
    dep = load_deployment(str(path))
    spec = Runner(dep, "cpu").spec(8, 4, 64)   # the bucket's problem (no worker process started)
    params = backend_info("triton", dataclasses.asdict(spec), "cpu")["default"]
    table = tmp_path / "trials.csv"
    check = ServingCheck(dep, table, device_info("cpu")["device_name"], "cpu", None)
    try:
        equal = check("triton", params, None, 8, 4, [64], "k")
        ragged = check.ragged("triton", params, None, 8, 4, [64], "k ragged x4")
    finally:
        check.close()
    ceil = Ceilings(dep.device.read_gbps, dep.device.bf16_tflops)
    want = dataclasses.replace(spec, prefixes=ragged_prefixes(4, 64, 4.0))
    assert [r["floor_us"] for r in ragged] == pytest.approx([ceil.floor_us(want)], rel=1e-5)
    assert [r["floor_us"] for r in equal] == pytest.approx([ceil.floor_us(spec)], rel=1e-5)
    assert [r["outcome"] for r in equal] == ["ok"]
    assert [r["outcome"] for r in ragged] == (["wrong"] if wrong_on_ragged else ["ok"])
    rows = read_trials(table)
    assert list(rows["round"].astype(str)) == ["k", "k ragged x4"] and set(rows["phase"]) == {"serve"}
