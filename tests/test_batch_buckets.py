"""Batch buckets (CPU; selection logic, plus the Triton interpreter where a kernel runs).

A synthetic export with entries at batch 1, 4 and 16 (tp 8) and one at tp 4: a batch of n
requests runs the first entry whose bucket holds it (the largest beyond), with the entry's
CTA count kept (each context bucket's NSPLIT scaled by bucket/n, floored: never more split
CTAs than tuned, so never a second wave), and with no more workspace than the entry needs
at its own bucket bound, where the sweep checked the budget."""
from __future__ import annotations

import pytest
import torch

from kvtune.kernels import make_inputs, reference_attention, rel_error
from kvtune.kernels import runtime as rt
from kvtune.kernels.runtime import VerifyAttention
from kvtune.kernels.triton_kernel import TritonBackend, TritonParams, kernel_source_hash, partials
from kvtune.kernels.tuned import parse_tuned

T, TP, NUM_HEADS = 9, 8, 16
H = NUM_HEADS // TP
TOL = 2e-2
CONTEXTS = (64, 128, 256)
# bucket -> (compile-time params, NSPLIT per context bucket); each entry's tile differs, so the
# launch parameters say which entry serves a batch
ENTRIES = {
    1: ({"NSPLIT": 8, "BLOCK_N": 16, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1}, (2, 4, 8)),
    4: ({"NSPLIT": 4, "BLOCK_N": 32, "HEADS_PER_BLOCK": 1, "NUM_WARPS": 4, "STAGES": 1}, (1, 3, 4)),
    16: ({"NSPLIT": 2, "BLOCK_N": 16, "HEADS_PER_BLOCK": 1, "NUM_WARPS": 2, "STAGES": 2}, (1, 1, 2)),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(rt.ENV_VERIFY, raising=False)
    monkeypatch.delenv(rt.ENV_CONFIG_DIR, raising=False)


def exported(device):
    """What `kvtune export` writes for a sweep over batches [1, 4, 16] at tp 8 (and tp 4)."""
    entries = [{"tp": TP, "heads_per_rank": H, "max_batch": m, "backend": "triton", "params": dict(p),
                "buckets": [{"max_context": c, "NSPLIT": n} for c, n in zip(CONTEXTS, ns)]}
               for m, (p, ns) in ENTRIES.items()]
    entries.append({"tp": 4, "heads_per_rank": 4, "max_batch": 64, "backend": "triton",
                    "params": {"NSPLIT": 1, "BLOCK_N": 16, "HEADS_PER_BLOCK": 4, "NUM_WARPS": 4, "STAGES": 1},
                    "buckets": [{"max_context": 256, "NSPLIT": 1}]})
    return parse_tuned({
        "schema_version": 1, "deployment": "buckets-test",
        "model": {"name": "Tiny-MLA", "num_heads": NUM_HEADS, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                  "draft_tokens": T, "sm_scale": 0.0721},
        "provenance": {"device_name": rt.device_name(device), "arch": rt.device_arch(device),
                       "kernel_hash": {"triton": kernel_source_hash()}, "date": "2026-11-29T17:00:00Z"},
        "entries": entries}, "mem")


def bucket_of(n: int) -> int:
    """The README's policy, written out: the first bucket >= n, the largest beyond."""
    return next((m for m in sorted(ENTRIES) if n <= m), max(ENTRIES))


def test_entry_by_batch_on_and_between_buckets(device):
    va = VerifyAttention.from_defaults(exported(device), tp=TP, max_batch=24, max_context=256, device=device,
                                       warmup=False)
    assert [p.max_batch for p in va.plans] == [1, 4, 16]        # tp 4's entry is not this rank's
    for n in range(1, 25):
        m = bucket_of(n)
        assert va.plan_for(n).max_batch == m, n
        got = va.params_for(n)
        want = TritonParams(**ENTRIES[m][0])
        assert (got.BLOCK_N, got.HEADS_PER_BLOCK, got.NUM_WARPS, got.STAGES) == \
            (want.BLOCK_N, want.HEADS_PER_BLOCK, want.NUM_WARPS, want.STAGES), n
    # a smaller runtime stops at the first bucket that holds its max_batch
    small = VerifyAttention.from_defaults(exported(device), tp=TP, max_batch=3, max_context=256, device=device,
                                          warmup=False)
    assert [p.max_batch for p in small.plans] == [1, 4]


@pytest.mark.parametrize("n", range(1, 25))
def test_nsplit_keeps_the_tuned_cta_count(device, n):
    """Split CTAs per context bucket ~ n x NSPLIT: at most the tuned m x NSPLIT_m (no second
    wave; but at least one split per request), and the most that fits (no idle SMs left
    that one more split per request would have filled)."""
    va = VerifyAttention.from_defaults(exported(device), tp=TP, max_batch=24, max_context=256, device=device,
                                       warmup=False)
    m = bucket_of(n)
    for c, tuned_ns in zip(CONTEXTS, ENTRIES[m][1]):
        for prefix in (c - 1, c):                              # on the context bucket's edge and inside
            ns = va.nsplit_for(n, prefix)
            cta, tuned_cta = n * ns, m * tuned_ns
            assert cta <= tuned_cta or ns == 1, (n, prefix, ns)
            assert n * (ns + 1) > tuned_cta, (n, prefix, ns)
            assert ns <= va.params_for(n).NSPLIT                # within the launched grid
    if n == m:                                                 # on a bucket: the tuned values as exported
        assert [va.nsplit_for(n, c) for c in CONTEXTS] == list(ENTRIES[m][1])


def test_nsplit_for_refuses_a_prefix_that_is_no_length(device):
    va = VerifyAttention.from_defaults(exported(device), tp=TP, max_batch=4, max_context=256, device=device,
                                       warmup=False)
    for bad in (-5, 1.5, "64", True):
        with pytest.raises(ValueError, match=r"^prefix_len: expected a prefix length in tokens >= 0, got "):
            va.nsplit_for(1, bad)
    assert va.nsplit_for(1, 0) >= 1


def test_workspace_stays_within_each_bucket_bound(device):
    """The sweep checks the workspace budget at each bucket's bound (its largest batch); no
    batch the bucket serves needs more, so the runtime's workspace is the largest of those."""
    va = VerifyAttention.from_defaults(exported(device), tp=TP, max_batch=16, max_context=256, device=device,
                                       warmup=False)
    be = TritonBackend()
    at_bound = {m: be.workspace_bytes(va.problem(m), TritonParams(**p)) for m, (p, _) in ENTRIES.items()}
    for n in range(1, 17):
        assert be.workspace_bytes(va.problem(n), va.params_for(n)) <= at_bound[bucket_of(n)], n
    assert va.workspace_bytes == max(at_bound.values())
    # a budget of exactly that (plus the output buffer and tables) is enough
    VerifyAttention.from_defaults(exported(device), tp=TP, max_batch=16, max_context=256, device=device,
                                  warmup=False, workspace_budget_bytes=va.allocated_bytes)


@pytest.mark.parametrize("prefixes", [[256, 3, 129], [64, 65, 200, 1, 128, 7]])
def test_between_buckets_the_device_splits_as_planned(device, prefixes):
    """Batches 3 (bucket 4) and 6 (bucket 16) against the oracle per request; each request
    wrote partial results only in the splits its scaled NSPLIT allows (chosen on the device)."""
    n = len(prefixes)
    va = VerifyAttention.from_defaults(exported(device), tp=TP, max_batch=n, max_context=256, device=device,
                                       warmup=False)
    inp = make_inputs(n, T, H, prefixes, tree="random", seed=n, device=device, sm_scale=va.sm_scale)
    step = va.plan(inp.kv_indptr, inp.kv_indices, inp.tree_mask, num_slots=inp.kv_cache.shape[0])
    va.workspace.fill_(255)                                    # NaN in every fp32 partial
    o = va.run(inp.q, inp.kv_cache)
    ref = reference_attention(*inp.args)[0]
    for b in range(n):
        rows = slice(b * T, (b + 1) * T)
        assert rel_error(o[rows], ref[rows]) < TOL, b
    _, part_lse = partials(step.problem, step.params.NSPLIT, va.workspace)
    bn = step.params.BLOCK_N
    for b, p in enumerate(prefixes):
        ns = va.nsplit_for(n, p)
        L = p + T
        chunk = -(-(-(-L // ns)) // bn) * bn                  # keys per split, whole tiles
        assert int(torch.isfinite(part_lse[:, b * T, 0]).sum()) == -(-L // chunk), (b, p, ns)
        assert bool(torch.isneginf(part_lse[ns:, b * T, 0]).all()), (b, p, ns)


def test_the_shipped_deployment_sweeps_batch_buckets():
    """kimi-k2-h200 sweeps at least batches 1, 4, 16, 64 at tp 8 and tp 4; a sweep measures
    each bucket at its bound (ProblemSpec.batch = the bucket), so the budget is checked there:
    a config whose workspace fits at batch 1 but not at the bound is pruned, naming the batch."""
    pytest.importorskip("pandas")
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.measure import MeasureOptions, Measurer, ProblemSpec
    dep = load_deployment("kimi-k2-h200")
    assert {1, 4, 16, 64} <= set(dep.batches) and {4, 8} <= set(dep.tp)
    params = {"NSPLIT": 4, "BLOCK_N": 16, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1}
    spec1 = ProblemSpec(heads=H, batch=1, context=64, draft_tokens=T)
    # Triton runs on the CPU only under its interpreter (set by conftest where there is no GPU)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    budget = TritonBackend().workspace_bytes(spec1.problem(dev), TritonParams(**params))
    m = Measurer(dev)
    opts = MeasureOptions(timing="eager", workspace_budget_bytes=budget)
    res = m.measure("triton", params, ProblemSpec(heads=H, batch=4, context=64, draft_tokens=T), opts, None)
    assert res.outcome == "pruned" and "at batch 4 exceeds the budget" in res.reason, res.reason
    assert m.measure("triton", params, spec1, opts, None).outcome == "ok"
