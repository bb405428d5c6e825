"""The per-context dispatch on the GPU: a launch whose batch falls in a bucket its split table
marks 0 writes nothing (no output, no lse), and an entry whose buckets name two compile-time
configs, captured once in a CUDA graph, matches the fp32 oracle on every replay as the batch
moves between the configs' buckets (cuda everywhere, wgmma and wgmma_km on sm_90), and an entry
whose buckets name another backend (wgmma beside wgmma_km) does the same across the two kernels."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtune.kernels import SplitTable, get_backend, make_inputs, reference_attention, rel_error, verify_attention
from kvtune.kernels.cuda.backend import work_items
from kvtune.kernels.runtime import VerifyAttention
from kvtune.kernels.shapes import VerifyProblem
from test_runtime_gpu import (DK, DV, H, MAX_CONTEXT, NUM_HEADS, T, TOL, TP, Requests, _backend_or_skip, _capture,
                              tuned_for)

pytestmark = pytest.mark.gpu


def _two_configs(backend: str) -> tuple[dict, dict]:
    """The backend's default and another legal compile-time config of it (same NSPLIT)."""
    be = get_backend(backend)
    p = be.default_params(VerifyProblem(B=2, T=T, H=H, Dk=DK, Dv=DV, device=torch.device("cuda")))
    if backend == "wgmma":
        q = dataclasses.replace(p, COPY_LANES=8 if p.COPY_LANES == 4 else 4, ROWS=72 if p.ROWS == 64 else 64)
    elif backend == "wgmma_km":
        q = dataclasses.replace(p, SPLIT_ALIGN=32 if p.SPLIT_ALIGN == 64 else 64, DV_SPLIT=128)
    else:
        q = dataclasses.replace(p, HEADS_PER_BLOCK=max(1, p.HEADS_PER_BLOCK // 2))
    return dataclasses.asdict(p), dataclasses.asdict(q)


@pytest.mark.parametrize("backend", ["cuda", "wgmma", "wgmma_km"])
def test_an_idle_launch_writes_nothing(backend):
    """Split table 0 at the batch's bucket: poisoned o and lse stay poisoned; the same launch
    with the other bucket's batch computes the oracle's."""
    _backend_or_skip(backend)
    p, _ = _two_configs(backend)
    be = get_backend(backend)
    params = be.params_type(**p)
    B = 3
    for prefixes, active in (([100, 7, 900], False), ([3000, 5000, 4000], True)):
        x = make_inputs(B, T, H, prefixes, device="cuda", seed=sum(prefixes))
        keys = sum(prefixes) + B * T
        table = SplitTable.build([2000, 10**9], [0, 16], "cuda")   # the small bucket is another launch's
        assert (keys > 2000) is active
        out = torch.full((B * T, H, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((B * T, H), float("nan"), dtype=torch.float32, device="cuda")
        verify_attention(*x.args, backend=backend, params=params, out=out, lse=lse, split_table=table)
        torch.cuda.synchronize()
        if active:
            ref, _ = reference_attention(*x.args)
            assert rel_error(out, ref) < TOL
        else:
            assert bool(torch.isnan(out.float()).all()) and bool(torch.isnan(lse).all())


@pytest.mark.parametrize("backend", ["cuda", "wgmma", "wgmma_km"])
def test_a_dispatch_in_one_graph_follows_the_batch_between_configs(backend):
    _backend_or_skip(backend)
    p, q = _two_configs(backend)
    other = {k: v for k, v in q.items() if k != "NSPLIT" and v != p[k]}
    buckets = [{"max_context": 2048, "NSPLIT": 8},
               {"max_context": 16384, "NSPLIT": 16, "params": other},
               {"max_context": MAX_CONTEXT, "NSPLIT": p["NSPLIT"]}]
    tuned = tuned_for(backend, p, buckets)
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=2, max_context=MAX_CONTEXT, device="cuda",
                                       check_values=False)   # warmup: each config, then both in turn
    assert len(va.plan_for(2).others) == 1
    _replays_follow_the_batch(va, seed=7)


@pytest.mark.parametrize("backend", ["cuda", "wgmma"])
def test_the_exports_check_of_a_dispatch_runs_it_on_the_moved_buckets_ragged_batch(tmp_path, backend):
    """What the export measures before a bucket moves to another config (`tuner.dispatch`: the
    dispatch's launches, `ServingCheck` and its `ragged` method): on this GPU, equal requests at
    every bucket and the moved bucket's ragged batch, each served by both launches in turn, pass
    the oracle gate; the ragged row has that batch's floor and its own round."""
    import yaml

    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.dispatch import dispatch_tables
    from kvtune.tuner.export import Bucket
    from kvtune.tuner.measure import Ceilings, ProblemSpec, ragged_prefixes
    from kvtune.tuner.executor import device_info
    from kvtune.tuner.serve_check import ServingCheck
    from kvtune.tuner.table import read_trials
    _backend_or_skip(backend)
    p, q = _two_configs(backend)
    contexts, bs, spread = [2048, 16384], 4, 4.0
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"name": "d", "model": {"name": "m", "num_heads": NUM_HEADS, "draft_tokens": T},
                                    "device": "h200", "tp": [TP], "contexts": contexts, "batches": [bs],
                                    "backends": [backend], "trials": 1, "ragged_spread": spread}))
    dep = load_deployment(str(path))
    own = {k: v for k, v in p.items() if k != "NSPLIT"}
    alt = {k: v for k, v in q.items() if k != "NSPLIT"}
    buckets = {2048: Bucket(8, 1.0, 1.0, 1.0), 16384: Bucket(16, 1.0, 1.0, 1.0)}
    params, table, others = dispatch_tables(backend, own, buckets, {16384: Bucket(32, 1.0, 1.0, 1.0)}, alt,
                                            contexts, T, bs)
    here = device_info("cuda")
    check = ServingCheck(dep, tmp_path / "trials.csv", here["device_name"], here["arch"], "graph")
    try:
        equal = check(backend, params, table, TP, bs, contexts, "k", dispatch=others)
        ragged = check.ragged(backend, params, table, TP, bs, [16384], "k ragged x4", dispatch=others)
    finally:
        check.close()
    assert [(r["ctx"], r["outcome"]) for r in equal + ragged] == [(2048, "ok"), (16384, "ok"), (16384, "ok")], \
        [r["reason"] for r in equal + ragged]
    want = ProblemSpec(heads=H, batch=bs, context=16384, draft_tokens=T, prefixes=ragged_prefixes(bs, 16384, spread))
    assert ragged[0]["floor_us"] == pytest.approx(Ceilings(dep.device.read_gbps, dep.device.bf16_tflops)
                                                  .floor_us(want), rel=1e-5)
    rows = read_trials(tmp_path / "trials.csv")
    assert list(rows["round"].astype(str)) == ["k", "k", "k ragged x4"] and set(rows["role"]) == {"dispatch"}


@pytest.mark.parametrize("chain", ["1", "0"])
@pytest.mark.parametrize("primary", ["wgmma", "wgmma_km"])
def test_a_dispatch_across_backends_in_one_graph_follows_the_batch_between_kernels(monkeypatch, primary, chain):
    """One backend serves the short and long buckets, the other the middle one (its own full
    params): the runtime launches both kernels on every replay, the one holding the batch's bucket
    writes the output and the other exits at once, and every replay matches the oracle as
    prefixes and trees change; chained (wgmma_km after the other kernel, one merge) or not
    (KVTUNE_DISPATCH_CHAIN=0: each kernel with its own merge)."""
    from test_runtime_gpu import rt
    _backend_or_skip("wgmma")
    _backend_or_skip("wgmma_km")
    monkeypatch.setenv("KVTUNE_DISPATCH_CHAIN", chain)
    other = "wgmma_km" if primary == "wgmma" else "wgmma"
    p, _ = _two_configs(primary)
    q, _ = _two_configs(other)
    q = {k: v for k, v in q.items() if k != "NSPLIT"}
    buckets = [{"max_context": 2048, "NSPLIT": 8},
               {"max_context": 16384, "NSPLIT": 48, "backend": other, "params": q},
               {"max_context": MAX_CONTEXT, "NSPLIT": p["NSPLIT"]}]
    tuned = tuned_for(primary, p, buckets)
    tuned = dataclasses.replace(tuned, provenance=dict(tuned.provenance, kernel_hash={
        be: rt.backend_kernel_hash(be) for be in ("wgmma", "wgmma_km")}))
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=2, max_context=MAX_CONTEXT, device="cuda",
                                       check_values=False)   # warmup: each kernel, then both in turn
    plan = va.plan_for(2)
    assert [be.name for _, _, be in plan.launches()] == [primary, other]
    _replays_follow_the_batch(va, seed=11, also=lambda keys, other_serves: (
        plan.launch_for_keys(keys, T)[2].name == other) is other_serves)


def test_two_wgmma_km_configs_chain_in_one_graph():
    """Both launches chainable: the first runs plainly, the second chained after it, one merge."""
    _backend_or_skip("wgmma_km")
    p, q = _two_configs("wgmma_km")
    other = {k: v for k, v in q.items() if k != "NSPLIT" and v != p[k]}
    buckets = [{"max_context": 2048, "NSPLIT": 8},
               {"max_context": 16384, "NSPLIT": 16, "params": other},
               {"max_context": MAX_CONTEXT, "NSPLIT": p["NSPLIT"]}]
    va = VerifyAttention.from_defaults(tuned_for("wgmma_km", p, buckets), tp=TP, max_batch=2,
                                       max_context=MAX_CONTEXT, device="cuda", check_values=False)
    _replays_follow_the_batch(va, seed=5)


def _meta_watch(va):
    """Where the device shows which launch of batch 2's dispatch served: (int32 view of a [2][2]
    meta, True when its item counts are >= 1 exactly when the other config serves, the counts it
    holds when that launch was idle). Chained (`kernels.cuda.backend.launch_dispatch`; wgmma_km
    after the plain launch): the chained launch's own meta after the shared one, written only
    when it serves (the poison, -7, stays). Not chained: the other config's meta, marked -1 when
    it was idle (verify.cu: mark_idle)."""
    import os
    plan = va.plan_for(2)
    launches = plan.launches()
    names = [be.name for _, _, be in launches]
    chain = os.environ.get("KVTUNE_DISPATCH_CHAIN", "1") != "0" and names.count("wgmma") + names.count("cuda") <= 1
    if not chain:
        rows = work_items(launches[1][0], 2) * T * H
        return va.workspace[rows * (2 * DV + 4): rows * (2 * DV + 4) + 16].view(torch.int32), True, -1
    order = [i for i, n in enumerate(names) if n != "wgmma_km"] + [i for i, n in enumerate(names) if n == "wgmma_km"]
    rows = max(work_items(c, 2) for c, _, _ in launches) * T * H
    off = rows * (2 * DV + 4) + 16   # after the shared [2][2] meta: the second launch's own
    return va.workspace[off: off + 16].view(torch.int32), order[1] == 1, -7


def _replays_follow_the_batch(va, seed: int, also=None) -> None:
    """`va` (batch 2; buckets 2048, 16384 on the other config, MAX_CONTEXT), captured once: as the
    replays' prefixes cross the buckets, the host mirror names the launch that serves, the output
    matches the oracle, and a meta on the device says which launch served (`_meta_watch`).
    `also(keys, other_serves)`: a further host-side check, true when right."""
    plan = va.plan_for(2)
    alt = plan.others[0][0]
    meta, counts_when_other, idle = _meta_watch(va)
    req = Requests(seed=seed)
    req.fill((1000, 1))
    g, out = _capture(lambda: va(*req.args))
    # the device picks the bucket by the batch's keys against (max_context + T) x 2
    for prefixes in [(1000, 1), (5000, 9000), (2040, 1), (60000, 30000), (16384, 16384), (3000, 1000), (1, 1)]:
        req.fill(prefixes)
        keys = sum(prefixes) + 2 * T
        alt_serves = (2048 + T) * 2 < keys <= (16384 + T) * 2
        assert (va.params_for(2, keys) == alt) is alt_serves, prefixes
        assert also is None or also(keys, alt_serves), prefixes
        out.fill_(float("nan"))
        meta.fill_(-7)
        g.replay()
        ref, _ = reference_attention(*req.args, va.sm_scale)
        assert rel_error(out, ref) < TOL, (prefixes, alt_serves)
        counts = meta[1::2].tolist()   # requests 0 and 1: (first item, item count) pairs
        watched_serves = alt_serves is counts_when_other
        assert (all(c >= 1 for c in counts) if watched_serves else counts == [idle, idle]), (prefixes, counts)
