"""The CUDA backend on a GPU against the fp32 oracle (skipped without CUDA, never faked).

Odd shapes on purpose: prefixes of 1, 7, 54, 97, 300 and 4k keys, ragged batches, T in
{1, 2, 9, 16}, H in {1, 8, 16, 64}, chain and random trees, more splits than tiles,
non-contiguous q, padded KV rows, int64 indices, lse, per-request split tables, and a CUDA
graph captured once and replayed on new prefix lengths and tree masks. The cases that do not
depend on the CUDA backend's block shape run on the wgmma and wgmma_km backends too (`BACKENDS`,
sm_90 only).
"""
import pytest
import torch

from kvtune.kernels import (SplitTable, describe_problem, get_backend, make_inputs, reference_attention, rel_error,
                            tree_mask_from_parents, verify_attention, workspace_bytes)
from kvtune.kernels.tree import random_parents

pytestmark = pytest.mark.gpu

TOL = 1e-2
#: the kernels on verify.cu's arguments, schedule and merge: the cases below that do not depend
#: on the cuda backend's block shape run on all three (the wgmma backends' own: test_wgmma_gpu.py,
#: test_wgmma_km_gpu.py)
BACKENDS = ["cuda"] + [pytest.param(name, marks=pytest.mark.skipif(
    not torch.cuda.is_available() or get_backend(name).supports(torch.device("cuda")) is not None,
    reason="needs a GPU with wgmma (sm_90)")) for name in ("wgmma", "wgmma_km")]


def _cuda_params(x, **over):
    from kvtune.kernels.cuda.backend import CudaBackend, CudaParams
    p = CudaBackend().default_params(describe_problem(*x.args))
    return CudaParams(**{**p.__dict__, **over})


def _check(x, params=None, backend="cuda", **kw):
    ref_o, ref_lse = reference_attention(*x.args)
    out = torch.full(ref_o.shape, float("nan"), dtype=torch.bfloat16, device=ref_o.device)
    lse = torch.full(ref_lse.shape, float("nan"), dtype=torch.float32, device=ref_o.device)
    verify_attention(*x.args, backend=backend, params=params, out=out, lse=lse, **kw)
    err = rel_error(out, ref_o)
    assert err < TOL, f"rel error {err:.3g}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "lse: -inf / finite pattern differs from the oracle"
    assert torch.allclose(lse[fin], ref_lse[fin], atol=2e-2, rtol=0), "lse differs from the oracle"
    return err


@pytest.mark.parametrize("prefix", [1, 7, 54, 97, 300, 4096])
@pytest.mark.parametrize("T,H", [(1, 8), (2, 16), (9, 8), (9, 64), (16, 1)])
def test_prefixes_heads_drafts(prefix, T, H):
    x = make_inputs(1, T, H, prefix, tree="random", device="cuda")
    _check(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,H,tree", [(9, 8, "chain"), (9, 16, "random"), (16, 8, "random"), (1, 64, "chain"),
                                      (2, 1, "random")])
def test_ragged_batch(T, H, tree, backend):
    x = make_inputs(3, T, H, [54, 1, 300], tree=tree, device="cuda")
    _check(x, backend=backend)


@pytest.mark.parametrize("over", [dict(BLOCK_N=16, NSPLIT=64), dict(BLOCK_N=64, NUM_WARPS=16, HEADS_PER_BLOCK=2),
                                  dict(VEC=4, STAGES=3, HEADS_PER_BLOCK=4),
                                  dict(VEC=2, NUM_WARPS=16, HEADS_PER_BLOCK=4),
                                  dict(HEADS_PER_BLOCK=3, NSPLIT=5), dict(STAGES=4, BLOCK_N=16, NSPLIT=2),
                                  dict(NUM_WARPS=32, NSPLIT=1),
                                  dict(HEADS_PER_BLOCK=2, BLOCK_N=16, STAGES=3, CTAS_PER_SM=2),
                                  dict(HEADS_PER_BLOCK=4, BLOCK_N=16, NUM_WARPS=4, CTAS_PER_SM=2, NSPLIT=7)])
def test_configs_and_more_splits_than_tiles(over):
    x = make_inputs(2, 9, 8, [97, 7], tree="random", device="cuda")
    _check(x, params=_cuda_params(x, **over))


@pytest.mark.parametrize("over", [dict(NSPLIT=1), dict(NSPLIT=4, BLOCK_N=16, STAGES=3)])
@pytest.mark.parametrize("grow", [4.0, 40.0])
def test_growing_max_rescales(over, grow):
    # the kernel keeps a row's max in use until a tile beats it by more than 2^8: scale the
    # later keys up so their scores pass it mid-split, and check the rescaled partials
    x = make_inputs(1, 9, 8, 3000, tree="random", device="cuda", seed=11)
    late = x.kv_indices[1000:].long()
    x.kv_cache[late] = (x.kv_cache[late].float() * grow).to(torch.bfloat16)
    _check(x, params=_cuda_params(x, **over))


@pytest.mark.parametrize("over", [dict(NSPLIT=1), dict(NSPLIT=3, BLOCK_N=16, STAGES=4),
                                  dict(NSPLIT=2, NUM_WARPS=4, BLOCK_N=64, HEADS_PER_BLOCK=1, STAGES=2),
                                  dict(NSPLIT=5, NUM_WARPS=4, BLOCK_N=32, HEADS_PER_BLOCK=2, STAGES=4)])
def test_long_splits_cross_slot_chunks(over):
    # each split spans several chunks of staged slots (one chunk = NUM_WARPS * 32 keys)
    x = make_inputs(2, 9, 8, [4096, 1500], tree="random", device="cuda")
    _check(x, params=_cuda_params(x, **over))


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_q_padded_rows_int64_indices(backend):
    x = make_inputs(3, 9, 16, [300, 1, 54], tree="random", device="cuda", q_noncontiguous=True,
                    row_stride=640, indices_dtype=torch.int64)
    assert not x.q.is_contiguous() and x.kv_cache.stride(0) == 640
    _check(x, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unaligned_q_takes_the_scalar_path(backend):
    # q with a head stride of 577 elements: no 16-byte loads possible
    x = make_inputs(1, 9, 8, [97], device="cuda")
    wide = torch.zeros(9, 8, 577, dtype=torch.bfloat16, device="cuda")
    wide[:, :, :576] = x.q
    x.q = wide[:, :, :576]
    _check(x, backend=backend)


def test_misaligned_kv_rows_raise():
    x = make_inputs(1, 9, 8, [54], device="cuda", row_stride=580)
    with pytest.raises(ValueError, match="kv_cache"):
        verify_attention(*x.args, backend="cuda", params=_cuda_params(x, VEC=8))
    _check(x, params=_cuda_params(x, VEC=4))


def test_split_table():
    x = make_inputs(3, 9, 8, [7, 97, 4096], tree="chain", device="cuda")
    p = _cuda_params(x, NSPLIT=16, BLOCK_N=16)
    table = SplitTable.build([20, 120, 1000], [1, 3, 16], device="cuda")
    _check(x, params=p, split_table=table)
    # NSPLIT values past the grid are clamped to it
    table = SplitTable.build([50, 10**6], [40, 99], device="cuda")
    _check(x, params=p, split_table=table)


def _items_per_request(x, p, table=None, backend="cuda"):
    """Run `backend` (cuda, wgmma or wgmma_km: the same workspace layout) against the oracle and read back
    how many work items (splits) each request got: the per-request (first item, count) table the
    split kernel leaves at the end of the workspace."""
    from kvtune.kernels.cuda.backend import work_items
    pb = describe_problem(*x.args)
    ws = torch.zeros(workspace_bytes(pb, backend, p), dtype=torch.uint8, device="cuda")
    _check(x, params=p, backend=backend, workspace=ws, split_table=table)
    meta_off = work_items(p, pb.B) * pb.T * pb.H * (2 * pb.Dv + 4)
    meta = ws[meta_off:meta_off + 8 * pb.B].view(torch.int32).view(pb.B, 2).cpu()
    return meta[:, 0].tolist(), meta[:, 1].tolist()


def _expected_ranges(lengths, nsplit, block_n):
    """The documented split rule, written out independently (a linear scan, where the kernel
    searches): chunk = the least multiple of block_n with sum_b ceil(L_b / chunk) <=
    max(nsplit, B); request b in n_b = ceil(L_b / chunk) equal pieces of whole tiles. Returns
    each request's [(lo, hi), ...] key ranges."""
    cap = max(nsplit, len(lengths))
    chunk = block_n
    while sum(max(-(-L // chunk), 1) for L in lengths) > cap:
        chunk += block_n
    ranges = []
    for L in lengths:
        n = max(-(-L // chunk), 1)
        piece = -(-(-(-L // n)) // block_n) * block_n
        ranges.append([(lo, min(lo + piece, L)) for lo in range(0, L, piece)])
    return ranges


def _expected_items(lengths, nsplit, block_n):
    counts = [len(r) for r in _expected_ranges(lengths, nsplit, block_n)]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    return firsts, counts


def test_split_table_sets_the_partial_count():
    """The CUDA backend uses the split table it is given: two tables that must give different
    split counts do, and both match the oracle."""
    x = make_inputs(3, 9, 8, [700, 97, 4096], tree="chain", device="cuda")
    lengths = [700 + 9, 97 + 9, 4096 + 9]
    p = _cuda_params(x, NSPLIT=64, BLOCK_N=16)
    for bounds, values, nsplit in [([10**6], [4], 4), ([1000, 10**6], [1, 40], 40), ([10**6], [99], 64)]:
        got = _items_per_request(x, p, SplitTable.build(bounds, values, device="cuda"))
        assert got == _expected_items(lengths, nsplit, 16), (bounds, values)
    assert _items_per_request(x, p) == _expected_items(lengths, 64, 16)  # no table: the grid's NSPLIT
    firsts, counts = _items_per_request(x, p)
    assert sum(counts) <= 64


def test_ragged_batch_is_balanced_by_keys():
    """A long request among short ones gets most of the splits (work balanced by keys)."""
    prefixes = [6000, 30, 900, 5, 2500]
    x = make_inputs(5, 9, 8, prefixes, tree="random", device="cuda")
    p = _cuda_params(x, NSPLIT=32, BLOCK_N=32)
    firsts, counts = _items_per_request(x, p)
    assert (firsts, counts) == _expected_items([n + 9 for n in prefixes], 32, 32)
    assert counts[0] > counts[4] > counts[2] >= counts[1] == counts[3] == 1


def test_equal_requests_get_equal_splits_holding_the_documented_keys():
    """Four equal requests at NSPLIT 8 get two splits each of about half their keys (not one
    full chunk and a short remainder); each split's partial lse is the log-sum-exp of exactly
    its documented key range, computed here in fp32 from the inputs."""
    T, H, BN = 9, 8, 16
    x = make_inputs(4, T, H, [1000] * 4, tree="random", device="cuda", seed=5)
    p = _cuda_params(x, NSPLIT=8, BLOCK_N=BN)
    ranges = _expected_ranges([1000 + T] * 4, 8, BN)
    assert [len(r) for r in ranges] == [2] * 4 and ranges[0] == [(0, 512), (512, 1009)]
    pb = describe_problem(*x.args)
    ws = torch.zeros(workspace_bytes(pb, "cuda", p), dtype=torch.uint8, device="cuda")
    _check(x, params=p, workspace=ws)
    from kvtune.kernels.cuda.backend import work_items
    items = work_items(p, pb.B)
    lse_off = items * T * H * pb.Dv * 2
    part_lse = ws[lse_off:lse_off + items * T * H * 4].view(torch.float32).view(items, T, H)
    ptr, idx = x.kv_indptr.tolist(), x.kv_indices.long()
    item = 0
    for b, rs in enumerate(ranges):
        keys = x.kv_cache[idx[ptr[b]:ptr[b + 1]]].float()               # [L, Dk]
        q = x.q[b * T:(b + 1) * T].float()                                # [T, H, Dk]
        s = torch.einsum("thd,ld->thl", q, keys) * x.sm_scale
        P = ptr[b + 1] - ptr[b] - T
        for t in range(T):                                                # draft keys by the tree
            for d in range(T):
                if not (int(x.tree_mask[b * T + t]) >> d) & 1:
                    s[t, :, P + d] = float("-inf")
        for lo, hi in rs:
            want = torch.logsumexp(s[:, :, lo:hi], dim=-1)
            assert torch.allclose(part_lse[item], want, atol=2e-2, rtol=0), (b, lo, hi)
            item += 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_q_gives_nan_rows_only(backend):
    """NaN in, NaN out: a NaN in q[i, h] makes o[i, h] and lse[i, h] NaN; other rows match
    the oracle."""
    x = make_inputs(2, 9, 8, [300, 4096], tree="random", device="cuda")
    ref_o, ref_lse = reference_attention(*x.args)
    x.q[3, 5, 17] = float("nan")
    o, lse = verify_attention(*x.args, backend=backend, return_lse=True)
    assert torch.isnan(o[3, 5]).all() and torch.isnan(lse[3, 5])
    keep = torch.ones(o.shape[:2], dtype=torch.bool, device="cuda")
    keep[3, 5] = False
    assert not torch.isnan(o[keep]).any() and not torch.isnan(lse[keep]).any()
    assert rel_error(o[keep], ref_o[keep]) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_that_sees_nothing(backend):
    x = make_inputs(1, 2, 4, [0], device="cuda")
    x.tree_mask = torch.tensor([1, 0], dtype=torch.int64, device="cuda")
    o, lse = verify_attention(*x.args, backend=backend, return_lse=True)
    assert torch.all(o[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.isfinite(o).all() and torch.isfinite(lse[0]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_without_keys_gives_zeros_not_a_hang(backend):
    """Metadata the value checks reject (a request of 0 keys) but graph capture lets through:
    its rows get o = 0 and lse = -inf, the other request's rows are right."""
    x = make_inputs(1, 9, 8, [300], tree="random", device="cuda")
    ref_o, ref_lse = reference_attention(*x.args)
    q = torch.cat([x.q, torch.randn_like(x.q)])
    indptr = torch.tensor([0, 309, 309], dtype=torch.int32, device="cuda")
    mask = torch.cat([x.tree_mask, x.tree_mask])
    o, lse = verify_attention(q, x.kv_cache, indptr, x.kv_indices, mask, x.sm_scale, backend=backend,
                              return_lse=True, check_values_=False)
    torch.cuda.synchronize()
    assert rel_error(o[:9], ref_o) < TOL and torch.allclose(lse[:9], ref_lse, atol=2e-2, rtol=0)
    assert torch.all(o[9:] == 0) and torch.all(torch.isneginf(lse[9:]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay_new_lengths_and_trees(backend):
    """One capture; replays with other prefix lengths, slots and trees match the oracle."""
    B, T, H, cap_keys = 2, 9, 8, 2000
    gen = torch.Generator().manual_seed(1)
    first = make_inputs(B, T, H, [300, 54], tree="random", device="cuda", generator=gen)
    num_slots = first.kv_cache.shape[0] + 4 * cap_keys
    kv = torch.randn(num_slots, 576, generator=gen).to(torch.bfloat16).cuda()
    q = first.q.clone()
    indptr = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(B * cap_keys, dtype=torch.int32, device="cuda")
    mask = torch.zeros(B * T, dtype=torch.int64, device="cuda")
    sm_scale = first.sm_scale
    problem = describe_problem(q, kv, indptr, indices, mask, sm_scale)
    p = get_backend(backend).default_params(problem)
    ws = torch.empty(workspace_bytes(problem, backend, p), dtype=torch.uint8, device="cuda")
    out = torch.empty(B * T, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B * T, H, dtype=torch.float32, device="cuda")
    table = SplitTable.build([64, 512, 10**6], [1, 4, p.NSPLIT], device="cuda")

    def fill(prefixes):
        lens = [pl + T for pl in prefixes]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        indptr.copy_(torch.tensor(starts, dtype=torch.int32))
        perm = torch.randperm(num_slots, generator=gen)[: starts[-1]]
        indices[: starts[-1]] = perm.to(torch.int32).cuda()
        parents = [random_parents(T, gen) for _ in range(B)]
        mask.copy_(tree_mask_from_parents(parents).cuda())
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))

    fill([300, 54])
    verify_attention(q, kv, indptr, indices, mask, sm_scale, backend=backend, params=p, out=out, lse=lse,
                     workspace=ws, split_table=table)  # compile + load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        verify_attention(q, kv, indptr, indices, mask, sm_scale, backend=backend, params=p, out=out, lse=lse,
                         workspace=ws, split_table=table)
    for prefixes in ([300, 54], [1, 1991], [700, 7], [1500, 400]):
        fill(prefixes)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        n = int(indptr[-1])
        ref_o, ref_lse = reference_attention(q, kv, indptr, indices[:n], mask, sm_scale)
        err = rel_error(out, ref_o)
        assert err < TOL, f"prefixes {prefixes}: rel error {err:.3g}"
        assert torch.allclose(lse, ref_lse, atol=2e-2, rtol=0), f"prefixes {prefixes}: lse differs"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_gpu_other_than_the_current_one():
    """The kernel is loaded and launched in the tensors' GPU's context, not the current one's."""
    assert torch.cuda.current_device() == 0
    for dev in ("cuda:1", "cuda:0", "cuda:1"):
        x = make_inputs(2, 9, 8, [300, 54], tree="random", device=dev)
        o = verify_attention(*x.args, backend="cuda")
        torch.cuda.synchronize(dev)
        assert o.device == torch.device(dev)
        assert rel_error(o, reference_attention(*x.args)[0]) < 1e-2
    assert torch.cuda.current_device() == 0
