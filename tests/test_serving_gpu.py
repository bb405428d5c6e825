"""Serving as engines run it (GPU only): a step is plan once + one run per layer, all inside
one captured CUDA graph, replayed with new metadata written into the static input buffers and
matching the fp32 oracle at every layer; batch-bucket selection at batch sizes on and between
buckets; ragged batches against the oracle request by request."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from kvtune.kernels import (
    get_backend,
    make_inputs,
    reference_attention,
    rel_error,
)
from kvtune.kernels import runtime as rt
from kvtune.kernels.reference import visibility
from kvtune.kernels.runtime import VerifyAttention
from kvtune.kernels.sglang import SGLangVerifyAdapter
from kvtune.kernels.shapes import VerifyProblem
from kvtune.kernels.tuned import parse_tuned
from test_runtime_gpu import _backend_or_skip, _capture, _without_allocation, fill_metadata  # the same GPU helpers

pytestmark = pytest.mark.gpu

T, TP, NUM_HEADS, DK, DV = 9, 8, 64, 576, 512       # Kimi-K2 at tp 8: 8 heads per rank
H = NUM_HEADS // TP
TOL = 2e-2
LAYERS = 4
MAX_CONTEXT = 65536
CONTEXTS = (4096, 16384, MAX_CONTEXT)
# (prefixes of the 3 requests) per replay: bucket edges, both sides, ragged, 1 .. MAX_CONTEXT
REPLAYS = [(1024, 1, 300), (4096, 4097, 16384), (MAX_CONTEXT, 17, 16385), (1, 1, 1), (40000, MAX_CONTEXT, 4096)]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(rt.ENV_VERIFY, raising=False)
    monkeypatch.delenv(rt.ENV_CONFIG_DIR, raising=False)


def _params(backend: str, nsplit: int, variant: int) -> dict:
    if backend == "triton":   # 18 or 9 query rows per tile: small enough for any GPU's registers
        hpb, warps = ((2, 4), (1, 4), (2, 8))[variant % 3]
        return {"NSPLIT": nsplit, "BLOCK_N": 32, "HEADS_PER_BLOCK": hpb, "NUM_WARPS": warps, "STAGES": 2}
    p = get_backend("cuda").default_params(VerifyProblem(B=1, T=T, H=H, Dk=DK, Dv=DV, device=torch.device("cuda")))
    return dataclasses.asdict(dataclasses.replace(p, NSPLIT=nsplit))


def tuned_for(backend: str, entries: dict[int, tuple[int, ...]]):
    """An export with one entry per batch bucket: {max_batch: NSPLIT per context bucket}.
    Triton entries differ in their tile, so the launch parameters name the entry."""
    _backend_or_skip(backend)
    dev = torch.device("cuda")
    rows = []
    for i, (m, ns) in enumerate(sorted(entries.items())):
        rows.append({"tp": TP, "heads_per_rank": H, "max_batch": m, "backend": backend,
                     "params": _params(backend, max(ns), i),
                     "buckets": [{"max_context": c, "NSPLIT": n} for c, n in zip(CONTEXTS, ns)]})
    return parse_tuned({
        "schema_version": 1, "deployment": "serving-gpu-test",
        "model": {"name": "Kimi-K2-like", "num_heads": NUM_HEADS, "kv_lora_rank": DV, "qk_rope_head_dim": DK - DV,
                  "draft_tokens": T, "sm_scale": 0.13086079996295005},
        "provenance": {"device_name": rt.device_name(dev), "arch": rt.device_arch(dev),
                       "kernel_hash": {backend: rt.backend_kernel_hash(backend) or "unknown"},
                       "date": "2026-11-29T18:00:00Z"},
        "entries": rows}, "serving-gpu-test")


class Step:
    """Static buffers of one decode step of B requests and LAYERS layers, sized for
    MAX_CONTEXT: the metadata (indptr, indices, tree) once, and per layer its own q and KV
    pool. `fill` writes fresh values into the same buffers, as an engine does between replays."""

    def __init__(self, B: int, seed: int = 0):
        self.B = B
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.cpu_gen = torch.Generator().manual_seed(seed)
        self.capacity = B * (MAX_CONTEXT + T)
        self.num_slots = int(self.capacity * 1.1)
        self.pools = [torch.randn(self.num_slots, DK, device="cuda", generator=self.gen).to(torch.bfloat16)
                      for _ in range(LAYERS)]
        self.qs = [torch.empty(B * T, H, DK, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        self.outs = [torch.empty(B * T, H, DV, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
        self.indptr = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
        self.indices = torch.zeros(self.capacity, dtype=torch.int32, device="cuda")
        self.tree = torch.zeros(B * T, dtype=torch.int64, device="cuda")
        self.prefixes = None

    def fill(self, prefixes):
        self.prefixes = list(prefixes)
        fill_metadata(self, prefixes, T)
        for q in self.qs:
            q.copy_(torch.randn(q.shape, device="cuda", generator=self.gen).to(torch.bfloat16))
        for o in self.outs:
            o.fill_(float("nan"))

    def check(self, sm_scale, outs=None):
        for layer, (q, kv, o) in enumerate(zip(self.qs, self.pools, outs or self.outs)):
            ref, _ = reference_attention(q, kv, self.indptr, self.indices, self.tree, sm_scale)
            err = rel_error(o, ref)
            assert err < TOL, (self.prefixes, layer, err)


# -- plan once, run per layer, inside one graph -----------------------------------------

@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_plan_and_layers_in_one_graph(backend):
    B = 3
    va = VerifyAttention.from_defaults(tuned_for(backend, {4: (4, 16, 32)}), tp=TP, max_batch=4,
                                       max_context=MAX_CONTEXT, device="cuda", preallocate_out=False)
    st = Step(B)

    def step(check_values=None):
        # plan inside the graph too: it must neither sync nor allocate under capture
        va.plan(st.indptr, st.indices, st.tree, check_values=check_values)
        for layer in range(LAYERS):
            va.run(st.qs[layer], st.pools[layer], st.outs[layer])

    st.fill(REPLAYS[0])
    step()                                                     # eager, value checks on
    st.check(va.sm_scale)
    _without_allocation(lambda: step(check_values=False), "an eager plan + runs")
    g, _ = _capture(step)
    for prefixes in REPLAYS:
        st.fill(prefixes)
        _without_allocation(g.replay, "graph replay")
        st.check(va.sm_scale)


def test_adapter_plan_and_layers_in_one_graph():
    """SGLang's static buffers (prefix-only kv_indptr/kv_indices, flat custom mask,
    out_cache_loc) refilled between replays; the graph holds the adapter's plan (one pack
    launch) and a run per layer, each layer with its own pool."""
    B = 3
    ad = SGLangVerifyAdapter.from_defaults(tuned_for("triton", {4: (4, 16, 32)}), tp=TP, max_batch=4,
                                           max_context=MAX_CONTEXT, device="cuda")
    st = Step(B, seed=1)
    buf = dict(
        qo_indptr=torch.arange(B + 1, dtype=torch.int32, device="cuda") * T,
        kv_indptr=torch.zeros(B + 1, dtype=torch.int32, device="cuda"),
        kv_indices=torch.zeros(B * MAX_CONTEXT, dtype=torch.int64, device="cuda"),
        custom_mask=torch.zeros(B * T * (MAX_CONTEXT + T), dtype=torch.bool, device="cuda"),
        mask_indptr=torch.zeros(B + 1, dtype=torch.int64, device="cuda"),
        out_cache_loc=torch.zeros(B * T, dtype=torch.int64, device="cuda"))

    def fill(prefixes):
        st.fill(prefixes)
        ip = st.indptr.tolist()
        pre = torch.cat([st.indices[ip[b]:ip[b] + prefixes[b]] for b in range(B)])
        buf["kv_indptr"].copy_(torch.tensor([0, *prefixes]).cumsum(0).to(torch.int32))
        buf["kv_indices"][:pre.numel()].copy_(pre)
        buf["out_cache_loc"].copy_(torch.cat([st.indices[ip[b + 1] - T:ip[b + 1]] for b in range(B)]))
        mask = torch.cat([visibility(T, p, st.tree[b * T:(b + 1) * T]).flatten() for b, p in enumerate(prefixes)])
        buf["custom_mask"][:mask.numel()].copy_(mask)
        buf["mask_indptr"].copy_(torch.tensor([0] + [T * (p + T) for p in prefixes]).cumsum(0))

    def step():
        ad.plan(buf["qo_indptr"], buf["kv_indptr"], buf["kv_indices"], buf["custom_mask"], buf["mask_indptr"],
                out_cache_loc=buf["out_cache_loc"], max_len_extend=T)
        for layer in range(LAYERS):
            kb = st.pools[layer].unsqueeze(1)
            ad.run(st.qs[layer], kb, st.outs[layer], v_buffer=kb[..., :DV], sm_scale=ad.verify.sm_scale)

    fill(REPLAYS[0])
    step()
    st.check(ad.verify.sm_scale)
    g, _ = _capture(step)
    for prefixes in REPLAYS:
        fill(prefixes)
        _without_allocation(g.replay, "graph replay")
        st.check(ad.verify.sm_scale)
    assert not ad.overflowed()


# -- batch buckets ----------------------------------------------------------------------

BUCKETS = {1: (8, 32, 64), 4: (4, 16, 32), 16: (1, 4, 8)}


def _bucket_of(n):
    return next((m for m in sorted(BUCKETS) if n <= m), max(BUCKETS))


def _ragged(n, seed):
    """n prefixes on and around the context bucket edges (1 .. MAX_CONTEXT)."""
    pool = [1, 300, 4096, 4097, 16384, 16385, 40000, MAX_CONTEXT]
    return [random.Random(seed + b).choice(pool) for b in range(n)]


def _check_per_request(o, inp, what):
    ref = reference_attention(*inp.args)[0]
    for b in range(inp.B):
        rows = slice(b * T, (b + 1) * T)
        err = rel_error(o[rows], ref[rows])
        assert err < TOL, (what, b, inp.prefix_lens[b], err)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_batch_bucket_selection_on_and_between_buckets(backend):
    tuned = tuned_for(backend, BUCKETS)
    # warmup=False: each batch below is checked against the oracle anyway, and warming up
    # every batch size 1..16 would compile a Triton variant per scaled NSPLIT
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=16, max_context=MAX_CONTEXT, device="cuda",
                                       warmup=False)
    entries = {e.max_batch: e for e in tuned.entries_for(TP)}
    for n in (1, 2, 4, 5, 11, 16):
        m = _bucket_of(n)
        assert va.plan_for(n).max_batch == m, n
        got = dataclasses.asdict(va.params_for(n))
        want = dict(entries[m].params)
        assert {k: v for k, v in got.items() if k != "NSPLIT"} == {k: v for k, v in want.items() if k != "NSPLIT"}
        per_batch = va.plan_for(n).backend.nsplit_per_batch
        for c, tuned_ns in zip(CONTEXTS, BUCKETS[m]):
            ns = va.nsplit_for(n, c)
            if per_batch:   # NSPLIT counts the batch's splits: the bucket of the batch's keys, bounds x m
                bounds = [(x + T) * m for x in CONTEXTS]
                i = next((j for j, b in enumerate(bounds) if n * (c + T) <= b), len(bounds) - 1)
                assert ns == BUCKETS[m][i], (n, c, ns)
            else:
                assert n * ns <= m * tuned_ns or ns == 1, (n, c, ns)    # never more split CTAs than tuned
        inp = make_inputs(n, T, H, _ragged(n, n), tree="random", seed=n, device="cuda", sm_scale=va.sm_scale)
        step = va.plan(inp.kv_indptr, inp.kv_indices, inp.tree_mask, num_slots=inp.kv_cache.shape[0])
        if backend == "triton":
            va.workspace.fill_(255)
        o = va.run(inp.q, inp.kv_cache).clone()
        _check_per_request(o, inp, f"batch {n}")
        if backend == "triton":
            # each request's NSPLIT was chosen on the device: no partial past it
            from kvtune.kernels.triton_kernel import partials
            _, part_lse = partials(step.problem, step.params.NSPLIT, va.workspace)
            for b, p in enumerate(inp.prefix_lens):
                ns = va.nsplit_for(n, p)
                assert bool(torch.isneginf(part_lse[ns:, b * T]).all()), (n, b, p, ns)
                assert bool(torch.isfinite(part_lse[:ns, b * T]).any())
        del inp, o
        torch.cuda.empty_cache()


# -- ragged batches with the shipped defaults ------------------------------------------------

def _log_uniform(n, lo, hi, seed):
    r = random.Random(seed)
    return [int(math.exp(r.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]


@pytest.mark.parametrize("n,lo,hi", [(16, 1024, 131072), (64, 1024, 8192)])
def test_ragged_batch_with_shipped_defaults(n, lo, hi):
    """The packaged kimi-k2-h200 defaults at tp 8 (allow_mismatch: this is about correctness,
    test_packaged_defaults about provenance), a ragged batch through plan/run and through the
    SGLang adapter, each request against the oracle."""
    ad = SGLangVerifyAdapter.from_defaults(None, deployment="kimi-k2-h200", tp=TP, max_batch=n, max_context=hi,
                                           device="cuda", allow_mismatch=True)
    va = ad.verify
    assert va.H == H
    prefixes = _log_uniform(n, lo, hi, seed=n)
    inp = make_inputs(n, T, H, prefixes, tree="random", seed=n, device="cuda", sm_scale=va.sm_scale)
    out = torch.full((n * T, H, DV), float("nan"), dtype=torch.bfloat16, device="cuda")
    va.plan(inp.kv_indptr, inp.kv_indices, inp.tree_mask, num_slots=inp.kv_cache.shape[0])
    va.run(inp.q, inp.kv_cache, out)
    _check_per_request(out, inp, "plan/run")
    from kvtune.kernels.sglang import sglang_verify_args
    a = sglang_verify_args(inp)
    loc = a.pop("out_cache_loc")
    ad.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"], out_cache_loc=loc,
            num_slots=inp.kv_cache.shape[0])
    o = ad.run(a["q_extend"], a["k_buffer"], a["o_extend"], sm_scale=va.sm_scale)
    _check_per_request(o, inp, "adapter plan/run")
    assert not ad.overflowed()


@pytest.mark.parametrize("tp,prefixes", [
    (8, "ragged64"),                 # one config, every bucket NSPLIT 132
    (8, [4096] * 4),                 # batch bucket 4 at 4k: the table's 88 on a grid of 132
    (2, [16384] * 40),               # batch bucket 64 at 16k: a per-context dispatch to ROWS 72, NSPLIT 29
])
def test_runtime_launches_what_direct_config_names(tp, prefixes):
    """`VerifyAttention.direct_config` (what bench_serving's `tuned-direct` times) names the
    launch `run` makes: with the shipped defaults, one verify_attention call with its backend and
    params (no split table) writes the same output bit for bit where both merge with the same
    kernel, and both match the oracle."""
    from kvtune.kernels import verify_attention
    from kvtune.kernels.cuda import wgmma
    _backend_or_skip("wgmma")
    if prefixes == "ragged64":
        prefixes = _log_uniform(64, 1024, 8192, seed=64)
    B, heads = len(prefixes), NUM_HEADS // tp
    va = VerifyAttention.from_defaults(None, deployment="kimi-k2-h200", tp=tp, max_batch=64, max_context=65536,
                                       device="cuda", allow_mismatch=True)
    inp = make_inputs(B, T, heads, prefixes, tree="random", seed=B + tp, device="cuda", sm_scale=va.sm_scale,
                      device_values=True)
    keys = sum(prefixes) + B * T
    grid, _, served = va.plan_for(B).launch_for_keys(keys, T)
    if served.name != "wgmma":   # gpu_evidence.sh's sweep step runs this on a fresh export
        pytest.skip(f"the defaults serve this batch with {served.name}; the merge rule below is wgmma's")
    grid = grid if va.plan_for(B).others else va.params_for(B)   # past a bucket the grid is scaled
    be, params = va.direct_config(B, keys)
    assert be is served and 1 <= params.NSPLIT <= grid.NSPLIT
    va.plan(inp.kv_indptr, inp.kv_indices, inp.tree_mask)
    got = va.run(inp.q, inp.kv_cache, torch.full((B * T, heads, DV), float("nan"), dtype=torch.bfloat16,
                                                  device="cuda"))
    direct = verify_attention(*inp.args, backend=be, params=params, kv_lora_rank=DV)
    ref = reference_attention(*inp.args, kv_lora_rank=DV)[0]
    assert rel_error(got, ref) < TOL and rel_error(direct, ref) < TOL
    if wgmma.uses_warp_merge(grid.NSPLIT, B) == wgmma.uses_warp_merge(params.NSPLIT, B):
        assert torch.equal(got, direct), (params, grid)
    else:
        assert rel_error(got, direct) < 5e-3, (params, grid)
