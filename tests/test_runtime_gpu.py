"""The serving runtime under CUDA graphs (GPU only): one graph captured, then replayed with
prefixes from 1k to 128k and changing trees, matching the fp32 oracle on every replay, with
no allocation during replay; the same for the SGLang-layout adapter."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from kvtune.kernels import get_backend, reference_attention, rel_error, tree_mask_from_parents
from kvtune.kernels import runtime as rt
from kvtune.kernels.runtime import VerifyAttention
from kvtune.kernels.sglang import SGLangVerifyAdapter
from kvtune.kernels.tree import random_parents
from kvtune.kernels.tuned import parse_tuned

pytestmark = pytest.mark.gpu

T, TP, NUM_HEADS, DK, DV = 9, 8, 128, 576, 512
H = NUM_HEADS // TP
MAX_CONTEXT = 131072
TOL = 2e-2
BUCKETS = [(2048, 4), (16384, 16), (MAX_CONTEXT, 32)]
# (prefix of request 0, prefix of request 1) per replay: bucket edges, both sides, 1k..128k
REPLAYS = [(1024, 1), (2048, 2049), (16384, 16385), (4096, 65536), (MAX_CONTEXT, 1000), (77777, MAX_CONTEXT),
           (MAX_CONTEXT, MAX_CONTEXT), (1, 1)]


def _params(backend: str) -> dict:
    be = get_backend(backend)
    if backend == "triton":
        return {"NSPLIT": 32, "BLOCK_N": 32, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 2}
    from kvtune.kernels.shapes import VerifyProblem
    p = be.default_params(VerifyProblem(B=2, T=T, H=H, Dk=DK, Dv=DV, device=torch.device("cuda")))
    return dataclasses.asdict(dataclasses.replace(p, NSPLIT=max(n for _, n in BUCKETS)))


def _backend_or_skip(backend: str):
    try:
        why = get_backend(backend).supports(torch.device("cuda"))
    except ImportError as e:
        why = str(e)
    if why:
        pytest.skip(f"{backend} backend unavailable: {why}")


def tuned_for(backend: str, params: dict | None = None, buckets: list[dict] | None = None):
    """A one-entry tuned file (tp 8, batch 2) for this GPU and the backend's current source:
    `params` (default `_params`) and `buckets` (default BUCKETS)."""
    _backend_or_skip(backend)
    dev = torch.device("cuda")
    return parse_tuned({
        "schema_version": 1, "deployment": "gpu-test",
        "model": {"name": "MLA-128h", "num_heads": NUM_HEADS, "kv_lora_rank": DV, "qk_rope_head_dim": DK - DV,
                  "draft_tokens": T, "sm_scale": 192 ** -0.5},
        "provenance": {"device_name": rt.device_name(dev), "arch": rt.device_arch(dev),
                       "kernel_hash": {backend: rt.backend_kernel_hash(backend) or "unknown"},
                       "date": "2026-11-29T18:00:00Z"},
        "entries": [{"tp": TP, "heads_per_rank": H, "max_batch": 2, "backend": backend,
                     "params": params or _params(backend),
                     "buckets": buckets or [{"max_context": c, "NSPLIT": n} for c, n in BUCKETS]}]}, "gpu-test")


def fill_metadata(buf, prefixes, T):
    """Write a batch's metadata into `buf`'s static buffers (indptr, indices, tree): fresh
    scattered slots of its `num_slots` and fresh random trees of T drafts, from its generators."""
    lens = [p + T for p in prefixes]
    total = sum(lens)
    buf.indptr.copy_(torch.tensor([0] + lens).cumsum(0).to(torch.int32))
    perm = torch.randperm(buf.num_slots, device="cuda", generator=buf.gen)[:total]
    buf.indices[:total].copy_(perm.to(torch.int32))
    buf.tree.copy_(tree_mask_from_parents([random_parents(T, buf.cpu_gen) for _ in prefixes]))


class Requests:
    """Static input buffers of a 2-request batch sized for MAX_CONTEXT, refilled per replay."""

    def __init__(self, B=2, seed=0):
        self.B = B
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.cpu_gen = torch.Generator().manual_seed(seed)
        self.capacity = B * (MAX_CONTEXT + T)
        self.num_slots = int(self.capacity * 1.1)
        self.kv = torch.randn(self.num_slots, DK, device="cuda", generator=self.gen).to(torch.bfloat16)
        self.q = torch.empty(B * T, H, DK, dtype=torch.bfloat16, device="cuda")
        self.indptr = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
        self.indices = torch.zeros(self.capacity, dtype=torch.int32, device="cuda")
        self.tree = torch.zeros(B * T, dtype=torch.int64, device="cuda")

    def fill(self, prefixes):
        """Fresh q, fresh scattered slots and fresh random trees, written into the same buffers."""
        fill_metadata(self, prefixes, T)
        self.q.copy_(torch.randn(self.q.shape, device="cuda", generator=self.gen).to(torch.bfloat16))

    @property
    def args(self):
        return self.q, self.kv, self.indptr, self.indices, self.tree


def _capture(fn):
    """Warm up on a side stream (as serving engines do), then capture one call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    torch.cuda.synchronize()
    return g, out


def _without_allocation(fn, what):
    """Run fn and check the caching allocator saw no allocation: the count of allocations made
    is unchanged, and the bytes held did not grow (they may shrink: a collection of an earlier
    test's tensors can land inside fn)."""
    gc.collect()
    torch.cuda.synchronize()
    before = (torch.cuda.memory_allocated(), torch.cuda.memory_stats().get("allocation.all.allocated", 0))
    fn()
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), torch.cuda.memory_stats().get("allocation.all.allocated", 0))
    assert after[1] == before[1] and after[0] <= before[0], f"{what} allocated: (bytes, count) {before} -> {after}"


def _replay_without_allocation(g):
    _without_allocation(g.replay, "graph replay")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_one_graph_stays_tuned_as_contexts_grow(backend):
    # check_values=False: the eager calls below must allocate nothing, and the value checks of
    # plan (outside capture) read the metadata through small device temporaries
    va = VerifyAttention.from_defaults(tuned_for(backend), tp=TP, max_batch=2, max_context=MAX_CONTEXT,
                                       device="cuda", check_values=False)
    plan = va.plan_for(2)
    assert plan.backend.name == backend and plan.split_table is not None
    req = Requests()
    req.fill(REPLAYS[0])
    va(*req.args)                                   # compiled at start-up; this one is warm
    _without_allocation(lambda: va(*req.args), "an eager call")   # the call itself allocates nothing
    g, out = _capture(lambda: va(*req.args))
    for prefixes in REPLAYS:
        req.fill(prefixes)
        out.fill_(float("nan"))
        _replay_without_allocation(g)
        ref, _ = reference_attention(*req.args, va.sm_scale)
        err = rel_error(out, ref)
        assert err < TOL, (prefixes, err)
        if backend == "triton":
            # the split count each request used was chosen on the device from its own length
            from kvtune.kernels.triton_kernel import partials
            _, part_lse = partials(va.problem(2), plan.params.NSPLIT, va.workspace)
            for b, p in enumerate(prefixes):
                n = plan.nsplit_for(p, T)
                assert bool(torch.isneginf(part_lse[n:, b * T]).all()), (prefixes, b, n)
                assert bool(torch.isfinite(part_lse[:n, b * T]).any())
        del ref


def test_adapter_graph_replays():
    """The SGLang-layout adapter captured once: SGLang-style static buffers (prefix-only
    kv_indptr/kv_indices, flat custom mask, out_cache_loc) refilled between replays."""
    B = 2
    ad = SGLangVerifyAdapter.from_defaults(tuned_for("triton"), tp=TP, max_batch=B, max_context=MAX_CONTEXT,
                                           device="cuda", check_values=False)   # as above
    req = Requests(B, seed=1)
    mask_cap = B * T * (MAX_CONTEXT + T)
    buf = dict(
        q_extend=req.q, k_extend=torch.empty(B * T, 1, DK, dtype=torch.bfloat16, device="cuda"),
        o_extend=torch.empty(B * T, H, DV, dtype=torch.bfloat16, device="cuda"),
        k_buffer=req.kv.unsqueeze(1), qo_indptr=torch.arange(B + 1, dtype=torch.int32, device="cuda") * T,
        kv_indptr=torch.zeros(B + 1, dtype=torch.int32, device="cuda"),
        kv_indices=torch.zeros(B * MAX_CONTEXT, dtype=torch.int64, device="cuda"),
        custom_mask=torch.zeros(mask_cap, dtype=torch.bool, device="cuda"),
        mask_indptr=torch.zeros(B + 1, dtype=torch.int64, device="cuda"),
        out_cache_loc=torch.zeros(B * T, dtype=torch.int64, device="cuda"))
    buf["v_extend"] = buf["k_extend"][..., :DV]
    buf["v_buffer"] = buf["k_buffer"][..., :DV]

    def fill(prefixes):
        req.fill(prefixes)
        ip = req.indptr.tolist()
        pre = torch.cat([req.indices[ip[b]:ip[b] + prefixes[b]] for b in range(B)])
        loc = torch.cat([req.indices[ip[b + 1] - T:ip[b + 1]] for b in range(B)])
        buf["kv_indptr"].copy_(torch.tensor([0, *prefixes]).cumsum(0).to(torch.int32))
        buf["kv_indices"][:pre.numel()].copy_(pre)
        buf["out_cache_loc"].copy_(loc)
        buf["k_extend"].copy_(req.kv[loc.long()].unsqueeze(1))
        from kvtune.kernels.reference import visibility
        mask = torch.cat([visibility(T, p, req.tree[b * T:(b + 1) * T]).flatten() for b, p in enumerate(prefixes)])
        buf["custom_mask"][:mask.numel()].copy_(mask)
        buf["mask_indptr"].copy_(torch.tensor([0] + [T * (p + T) for p in prefixes]).cumsum(0))

    def call():
        return ad.extend_attention_fwd(buf["q_extend"], buf["k_extend"], buf["v_extend"], buf["o_extend"],
                                       buf["k_buffer"], buf["v_buffer"], buf["qo_indptr"], buf["kv_indptr"],
                                       buf["kv_indices"], buf["custom_mask"], False, buf["mask_indptr"], T,
                                       sm_scale=ad.verify.sm_scale, out_cache_loc=buf["out_cache_loc"])

    fill(REPLAYS[0])
    call()
    _without_allocation(call, "an eager adapter call")
    g, out = _capture(call)
    assert out.data_ptr() == buf["o_extend"].data_ptr()
    for prefixes in REPLAYS:
        fill(prefixes)
        out.fill_(float("nan"))
        _replay_without_allocation(g)
        ref, _ = reference_attention(*req.args, ad.verify.sm_scale)
        assert rel_error(out, ref) < TOL, prefixes
    assert not ad.overflowed()
