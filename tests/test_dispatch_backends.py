"""A per-context dispatch across backends on the CPU (no device): a bucket of a wgmma entry
served by wgmma_km's kernel (or the other way round) in the exported YAML (schema,
`TunedEntry.configs`, provenance), the runtime plan's host mirror of which launch serves a
batch, and the export's choice of it (`tuner.dispatch`, `tuner.export._entries`) on hand-made
trials tables, against expectations written out per case and the brute-force oracle
(`export_oracle.py`). The kernels' side (an idle launch of either backend writes nothing, one
graph following the batch between the two) is `tests/test_dispatch_gpu.py`."""
from __future__ import annotations


import pandas as pd
import pytest
import yaml
from export_oracle import check_export

from kvtune.kernels.backends import get_backend, split_bounds
from kvtune.kernels.lookup import provenance_mismatches
from kvtune.kernels.plans import Plan
from kvtune.kernels.tuned import SchemaError, parse_tuned
from kvtune.tuner.dispatch import dispatch_moves, dispatch_tables
from kvtune.tuner.export import Bucket, serve_key

WG = {"ROWS": 64, "COPY_LANES": 4}
KM = {"DV_SPLIT": 192, "SPLIT_ALIGN": 64}


def _doc(buckets, backend="wgmma", params=None, hashes=None) -> dict:
    return {
        "schema_version": 1, "deployment": "d",
        "model": {"name": "m", "num_heads": 64, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "draft_tokens": 9,
                  "sm_scale": 0.1},
        "provenance": {"device_name": "NVIDIA H200", "arch": "sm_90",
                       "kernel_hash": hashes or {"wgmma": "x", "wgmma_km": "y"}, "date": "2026-12-02T00:00:00Z"},
        "entries": [{"tp": 8, "heads_per_rank": 8, "max_batch": 16, "backend": backend,
                     "params": params or dict(WG, NSPLIT=66), "buckets": buckets}]}


def test_a_bucket_on_another_backend_is_a_config_of_that_backend():
    t = parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66},
                          {"max_context": 65536, "NSPLIT": 132, "backend": "wgmma_km", "params": dict(KM)},
                          {"max_context": 131072, "NSPLIT": 66, "backend": "wgmma_km", "params": dict(KM)}]))
    (e,) = t.entries
    assert e.configs() == [("wgmma", dict(WG, NSPLIT=66), [66, 0, 0]),
                           ("wgmma_km", dict(KM, NSPLIT=132), [0, 132, 66])]
    assert e.backends() == ["wgmma", "wgmma_km"]
    assert parse_tuned(t.to_dict()) == t    # written and read back the same
    assert t.to_dict()["entries"][0]["buckets"][1] == {"max_context": 65536, "NSPLIT": 132, "backend": "wgmma_km",
                                                       "params": KM}


@pytest.mark.parametrize("bucket,error", [
    ({"backend": "wgmma"}, "entry's own"),                                   # the entry's backend named again
    ({"backend": "nope", "params": KM}, "expected one of"),
    ({"backend": "triton", "params": {"BLOCK_N": 16}}, "triton picks NSPLIT per request"),
    ({"backend": "wgmma_km"}, "required with backend wgmma_km"),           # which config of it?
    ({"backend": "wgmma_km", "params": dict(KM, NSPLIT=4)}, "NSPLIT is the bucket's own key"),
    ({"backend": "wgmma_km", "params": {"DV_SPLIT": 192}}, "SPLIT_ALIGN"),  # all its params, not a part
    ({"backend": "wgmma_km", "params": dict(KM, DV_SPLIT=256)}, "DV_SPLIT"),  # illegal, named by its declaration
    ({"backend": "wgmma_km", "params": dict(KM, ROWS=64)}, "ROWS"),          # the entry's backend's name
    ({"backend": "wgmma_km", "params": [1]}, "expected a mapping"),
])
def test_a_bucket_backend_and_its_params_are_checked_and_named(bucket, error):
    with pytest.raises(SchemaError, match=error) as e:
        parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66}, {"max_context": 65536, "NSPLIT": 132, **bucket}]))
    assert "entries[0].buckets[1]" in str(e.value)   # the bucket, not only its entry


def test_an_entry_of_a_per_request_backend_takes_no_other_backends_bucket():
    triton = {"NSPLIT": 4, "BLOCK_N": 16, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1}
    with pytest.raises(SchemaError, match="triton picks NSPLIT per request"):
        parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 4},
                          {"max_context": 65536, "NSPLIT": 132, "backend": "wgmma_km", "params": KM}],
                         "triton", triton))


def test_the_provenance_check_covers_a_bucket_backend():
    """The runtime refuses a file whose kernel_hash misses a backend only a bucket launches, or
    records another source for it than runs here."""
    buckets = [{"max_context": 4096, "NSPLIT": 66},
               {"max_context": 65536, "NSPLIT": 132, "backend": "wgmma_km", "params": KM}]
    here = {be: get_backend(be).kernel_hash() for be in ("wgmma", "wgmma_km")}
    ok = parse_tuned(_doc(buckets, hashes=dict(here)))
    assert not [m for m in provenance_mismatches(ok, "cpu") if "kernel_hash" in m]
    missing = parse_tuned(_doc(buckets, hashes={"wgmma": here["wgmma"]}))
    assert [m for m in provenance_mismatches(missing, "cpu") if "kernel_hash" in m] == \
        ["<memory>: provenance.kernel_hash.wgmma_km: missing (entries use backend 'wgmma_km')"]
    old = parse_tuned(_doc(buckets, hashes=dict(here, wgmma_km="0" * 16)))
    (line,) = [m for m in provenance_mismatches(old, "cpu") if "kernel_hash" in m]
    assert "kernel_hash.wgmma_km: tuned against kernel source '0000000000000000'" in line


def test_the_plan_names_the_backend_of_the_launch_that_serves_a_batch():
    t = parse_tuned(_doc([{"max_context": 4096, "NSPLIT": 66},
                          {"max_context": 65536, "NSPLIT": 132, "backend": "wgmma_km", "params": dict(KM)}]))
    (e,) = t.entries
    from kvtune.kernels.cuda.params import WgmmaKmParams, WgmmaParams
    wg, km = get_backend("wgmma"), get_backend("wgmma_km")
    main, alt = WgmmaParams(NSPLIT=66, **WG), WgmmaKmParams(NSPLIT=132, **KM)
    plan = Plan(16, wg, main, None, e, "mem", ((alt, None, km),))
    bounds = split_bounds(wg, [4096, 65536], 9, 16)
    assert bounds == [(4096 + 9) * 16, (65536 + 9) * 16] and plan.bucket_nsplits() == (66, 132)
    assert [b.name for _, _, b in plan.launches()] == ["wgmma", "wgmma_km"]
    assert plan.launch_for_keys(bounds[0], 9)[2] is wg and plan.launch_for_keys(bounds[0], 9)[0] == main
    assert plan.launch_for_keys(bounds[0] + 1, 9)[2] is km and plan.params_for_keys(bounds[1], 9) == alt
    assert plan.launch_for_keys(10 * bounds[1], 9)[2] is km   # past the last bound: the last bucket's


# -- the export's choice ---------------------------------------------------------------------

CTXS = [4096, 65536]
PARAM_COLUMNS = ["NSPLIT", "ROWS", "COPY_LANES", "DV_SPLIT", "SPLIT_ALIGN"]


def _row(backend, params, ctx, us, phase="search", role="search", rnd="", outcome="ok"):
    cols = {k: params.get(k) for k in PARAM_COLUMNS}
    return {"deployment": "d", "phase": phase, "round": rnd, "backend": backend, "tp": 8, "bs": 16, "ctx": ctx,
            "role": role, **cols, "params": dict(params), "outcome": outcome, "reason": "",
            "median_us": float(us), "floor_us": 10.0}


def _trials(wgmma_us: dict, km_us: dict, triton_us: dict | None = None) -> pd.DataFrame:
    rows = [_row("wgmma", dict(WG, NSPLIT=66), c, us, role="baseline") for c, us in wgmma_us.items()]
    rows += [_row("wgmma_km", dict(KM, NSPLIT=132), c, us, role="baseline") for c, us in km_us.items()]
    if triton_us:   # NSPLIT per request: faster, but it cannot leave a launch idle
        rows += [_row("triton", {"NSPLIT": 4, "BLOCK_N": 16}, c, us, role="baseline") for c, us in triton_us.items()]
    return pd.DataFrame(rows)


def test_the_other_backends_group_is_the_move_and_a_per_request_backend_is_not():
    df = _trials({4096: 18.0, 65536: 50.0}, {4096: 24.0, 65536: 40.0}, triton_us={4096: 1.0, 65536: 1.0})
    buckets = {4096: Bucket(66, 18.0, 18.0, 10.0), 65536: Bucket(66, 50.0, 50.0, 10.0)}
    moves, alt, alt_be = dispatch_moves(df, "wgmma", 8, 16, CTXS, dict(WG), buckets, None)
    assert alt_be == "wgmma_km" and alt == KM and sorted(moves) == [65536]
    assert moves[65536].nsplit == 132 and moves[65536].latency == 40.0 and moves[65536].default == 50.0
    # the tables serving runs: the other launch names its backend; a same-backend one does not
    params, table, others = dispatch_tables("wgmma", dict(WG), buckets, moves, alt, CTXS, 9, 16, alt_be)
    assert params == dict(WG, NSPLIT=66) and table[1] == [66, 0]
    assert others == [[dict(KM, NSPLIT=132), [table[0], [0, 132]], "wgmma_km"]]
    same = dispatch_tables("wgmma", dict(WG), buckets, moves, {"ROWS": 72, "COPY_LANES": 8}, CTXS, 9, 16, "wgmma")
    assert len(same[2][0]) == 2 and serve_key("wgmma", *same) != serve_key("wgmma", params, table, others)


class _Check:
    """A serving check: each launch served at its trials latency plus 1.5 us per idle launch;
    `slower`: extra us of the dispatch at its moved buckets. Records the launches it is given."""

    def __init__(self, df, slower=0.0):
        self.df, self.slower, self.calls = df, slower, []

    def _lat(self, be, params, ctx):
        sel = self.df[(self.df["backend"] == be) & (self.df["ctx"] == ctx) & (self.df["phase"] == "search")]
        want = {k: v for k, v in params.items() if k != "NSPLIT"}
        return min(float(r["median_us"]) for _, r in sel.iterrows()
                   if {k: v for k, v in r["params"].items() if k != "NSPLIT"} == want)

    def __call__(self, be, params, table, tp, bs, contexts, key, dispatch=None):
        self.calls.append((be, params, table, dispatch))
        rows = []
        for c in contexts:
            i = CTXS.index(c)
            if not dispatch or table[1][i]:
                us = self._lat(be, params, c) + (1.5 if dispatch else 0.0)
            else:
                d = dispatch[0]
                us = self._lat(d[2] if len(d) > 2 else be, d[0], c) + 1.5 + self.slower
            rows.append(dict(_row(be, params, c, us, "serve", "dispatch" if dispatch else "export", key)))
        return rows


@pytest.mark.parametrize("wgmma_us,km_us,entry,moved", [
    # wgmma in total, wgmma_km at 64k by 10 us (more than two buckets' dispatch cost): 64k moves
    ({4096: 18.0, 65536: 52.0}, {4096: 30.0, 65536: 42.0}, "wgmma", {65536: "wgmma_km"}),
    # wgmma_km in total, wgmma at 4k by 8 us: the 4k bucket moves to wgmma
    ({4096: 18.0, 65536: 50.0}, {4096: 26.0, 65536: 40.0}, "wgmma_km", {4096: "wgmma"}),
    # wgmma_km 2 us faster at 64k: less than the dispatch costs, no move
    ({4096: 18.0, 65536: 50.0}, {4096: 24.0, 65536: 48.0}, "wgmma", {}),
])
def test_export_serves_each_bucket_on_the_backend_that_wins_it(tmp_path, wgmma_us, km_us, entry, moved):
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.export import _entries
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"name": "d", "model": {"name": "m", "num_heads": 64, "draft_tokens": 9},
                                    "device": "h200", "tp": [8], "contexts": CTXS, "batches": [16],
                                    "backends": ["wgmma", "wgmma_km"], "trials": 1}))
    dep = load_deployment(str(path))
    df = _trials(wgmma_us, km_us)
    check = _Check(df)
    entries, report = _entries(df, dep, ["wgmma", "wgmma_km"], check)
    (e,) = entries
    assert e.backend == entry
    assert {b.max_context: b.backend for b in e.buckets if b.params} == moved
    for b in e.buckets:
        on = b.backend or e.backend
        assert b.latency_us == (wgmma_us if on == "wgmma" else km_us)[b.max_context]
        assert b.default_latency_us == (wgmma_us if entry == "wgmma" else km_us)[b.max_context]
        if b.backend:
            assert b.params == (KM if b.backend == "wgmma_km" else WG)
    assert [r["backend"] for r in report] == [b.backend or e.backend for b in e.buckets]
    dispatches = [c[3] for c in check.calls if c[3]]
    if moved:
        (other,) = moved.values()
        assert dispatches and all(d[0][2] == other for d in dispatches)
    # what serving reads: the file validates, and the brute-force oracle agrees with it
    hashes = {be: "x" for be in e.backends()}
    doc = {"schema_version": 1, "deployment": "d", "model": _doc([])["model"],
           "provenance": {"device_name": "NVIDIA H200", "arch": "sm_90", "kernel_hash": hashes,
                          "date": "2026-12-02T00:00:00Z"},
           "entries": [{"tp": 8, "heads_per_rank": 8, "max_batch": 16, "backend": e.backend, "params": e.params,
                        "buckets": [{k: v for k, v in vars(b).items() if v is not None} for b in e.buckets]}]}
    parse_tuned(doc)
    served = pd.DataFrame([r for c in list(check.calls) for r in check(*c[:3], 8, 16, CTXS, serve_key(
        c[0], c[1], c[2], c[3]), dispatch=c[3])])
    check_export(doc, pd.concat([df, served], ignore_index=True))


def test_a_dispatch_whose_check_loses_at_the_moved_bucket_is_dropped(tmp_path):
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.export import _entries
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"name": "d", "model": {"name": "m", "num_heads": 64, "draft_tokens": 9},
                                    "device": "h200", "tp": [8], "contexts": CTXS, "batches": [16],
                                    "backends": ["wgmma", "wgmma_km"], "trials": 1}))
    df = _trials({4096: 18.0, 65536: 52.0}, {4096: 30.0, 65536: 42.0})
    check = _Check(df, slower=7.0)   # served at 42 + 1.5 + 7 us: no longer 2.9 us and 3% faster than 52
    (e,), _ = _entries(df, load_deployment(str(path)), ["wgmma", "wgmma_km"], check)
    assert e.backend == "wgmma" and all(b.backend is None and b.params is None for b in e.buckets)
    assert any(c[3] for c in check.calls)   # the dispatch was measured, and lost


def _dep(tmp_path):
    from kvtune.tuner.config import load_deployment
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"name": "d", "model": {"name": "m", "num_heads": 64, "draft_tokens": 9},
                                    "device": "h200", "tp": [8], "contexts": CTXS, "batches": [16],
                                    "backends": ["wgmma", "wgmma_km"], "trials": 1}))
    return load_deployment(str(path))


def test_a_dispatch_measured_now_is_compared_with_the_pick_measured_beside_it(tmp_path):
    """A pick check recorded a session earlier (8 us slower at 64k than this machine serves it)
    against a dispatch measured now would pass a dispatch that does not pay: 42 + 1.5 + 7 us
    served against the recorded 60, but against the pick measured in the same call, 52, it wins
    2.5 us, under the 2.9-us cost. The export measures the pick again beside the dispatch, under a
    round of its own, and keeps the entry as it is."""
    from kvtune.tuner.export import _entries
    dep = _dep(tmp_path)
    df = _trials({4096: 18.0, 65536: 52.0}, {4096: 30.0, 65536: 42.0})
    first = _Check(df)
    _entries(df, dep, ["wgmma", "wgmma_km"], first)
    # the earlier session's table: the pick's check only (8 us slower at 64k), no dispatch check yet
    pick_only = first.calls[:1]
    be, params, table, _ = pick_only[0]
    stale = [dict(r, median_us=r["median_us"] + (8.0 if r["ctx"] == 65536 else 0.0))
             for r in _Check(df)(be, params, table, 8, 16, CTXS, serve_key(be, params, table))]
    old = pd.concat([df, pd.DataFrame(stale)], ignore_index=True)
    now = _Check(df, slower=7.0)
    (e,), _ = _entries(old, dep, ["wgmma", "wgmma_km"], now)
    assert e.backend == "wgmma" and all(b.backend is None for b in e.buckets)
    beside = [c for c in now.calls if c[3] is None]
    assert len(beside) == 1 and beside[0][:3] == pick_only[0][:3], "the pick was measured again, once"
    assert any(c[3] for c in now.calls), "and the dispatch after it"


def test_recorded_checks_of_both_export_again_without_measuring(tmp_path):
    """Once the table holds the dispatch's check and the pick's beside it, a second export
    measures nothing and makes the same file."""
    from kvtune.tuner.export import _entries
    dep = _dep(tmp_path)
    df = _trials({4096: 18.0, 65536: 52.0}, {4096: 30.0, 65536: 42.0})
    first = _Check(df)
    (e1,), _ = _entries(df, dep, ["wgmma", "wgmma_km"], first)
    assert {b.max_context: b.backend for b in e1.buckets if b.params} == {65536: "wgmma_km"}
    assert len([c for c in first.calls if c[3] is None]) == 2   # the pick, then the pick beside the dispatch
    rows = []
    for n, (be, params, table, dispatch) in enumerate(list(first.calls)):
        key = serve_key(be, params, table, dispatch)
        if n == 1:   # the pick beside the dispatch: its own round
            dkey = serve_key(*[c for c in first.calls if c[3]][0])
            key = f"{serve_key(be, params, table)} beside {dkey}"
        rows += first(be, params, table, 8, 16, CTXS, key, dispatch=dispatch)
    again = _Check(df)
    (e2,), _ = _entries(pd.concat([df, pd.DataFrame(rows)], ignore_index=True), dep, ["wgmma", "wgmma_km"], again)
    assert e2 == e1 and again.calls == []


class _WrongBeside(_Check):
    """A serving check whose wgmma pick comes back wrong when it is measured again beside a
    dispatch (a config that passed once and fails now must not ship). Keeps the rows it returns,
    as the trials table would."""

    def __init__(self, df):
        super().__init__(df)
        self.rows = []

    def __call__(self, be, params, table, tp, bs, contexts, key, dispatch=None):
        rows = super().__call__(be, params, table, tp, bs, contexts, key, dispatch)
        if " beside " in key and be == "wgmma":
            rows = [dict(r, outcome="wrong", reason="mismatch at head 3") for r in rows]
        self.rows += rows
        return rows


def test_a_pick_wrong_when_measured_beside_its_dispatch_gives_way_here_and_in_later_exports(tmp_path):
    """wgmma's pick passed its check, then came back wrong measured beside its dispatch: the
    export serves the next pick (wgmma_km's; its own dispatch check may still run a bucket on
    wgmma's kernel, which that check proves correct), and a later export from the table, which
    now holds the wrong row, makes the same entry without measuring."""
    from kvtune.tuner.export import _entries
    dep = _dep(tmp_path)
    df = _trials({4096: 18.0, 65536: 52.0}, {4096: 30.0, 65536: 42.0})
    first = _WrongBeside(df)
    (e1,), _ = _entries(df, dep, ["wgmma", "wgmma_km"], first)
    assert [c[0] for c in first.calls][:2] == ["wgmma", "wgmma"] and first.calls[1][3] is None
    assert e1.backend == "wgmma_km", "the wgmma pick failed beside its dispatch and was served anyway"
    again = _Check(df)
    (e2,), _ = _entries(pd.concat([df, pd.DataFrame(first.rows)], ignore_index=True), dep,
                        ["wgmma", "wgmma_km"], again)
    assert e2 == e1 and again.calls == []
    # the brute-force oracle, on that table: a group with a wrong serving row never serves an entry
    doc = {"schema_version": 1, "deployment": "d", "model": _doc([])["model"],
           "provenance": {"device_name": "NVIDIA H200", "arch": "sm_90",
                          "kernel_hash": {be: "x" for be in e2.backends()}, "date": "2026-12-02T00:00:00Z"},
           "entries": [{"tp": 8, "heads_per_rank": 8, "max_batch": 16, "backend": e2.backend, "params": e2.params,
                        "buckets": [{k: v for k, v in vars(b).items() if v is not None} for b in e2.buckets]}]}
    parse_tuned(doc)
    check_export(doc, pd.concat([df, pd.DataFrame(first.rows)], ignore_index=True))
