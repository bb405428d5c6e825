"""The wgmma backend (sm_90a) on a GPU against the fp32 oracle (skipped elsewhere, never faked).

Odd shapes on purpose: H x T from 1 row (one block of 64, 63 padded) to 1152 (18 blocks), 72
rows (a second block holding 8), prefixes that leave partial last tiles, splits of one tile
(warpgroup 1 with no tile of its own), ragged batches, a request of 0 keys, growing maxima, NaN
in a draft key's V, a row that sees nothing, non-contiguous and unaligned q, int64 indices,
padded KV rows, split tables that must give different partial counts, and a CUDA graph replayed
on new lengths and trees.
"""
import pytest
import torch

from kvtune.kernels import (SplitTable, describe_problem, get_backend, make_inputs, reference_attention, rel_error,
                            tree_mask_from_parents, verify_attention, workspace_bytes)
from kvtune.kernels.tree import random_parents
from test_cuda_gpu import _expected_items

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or get_backend("wgmma").supports(torch.device("cuda")) is not None,
    reason="needs a GPU with wgmma (sm_90)")]

TOL = 1e-2


def _params(nsplit=None, x=None):
    from kvtune.kernels.cuda.params import WgmmaParams
    if nsplit is None:
        return get_backend("wgmma").default_params(describe_problem(*x.args))
    return WgmmaParams(NSPLIT=nsplit)


def _check(x, params=None, **kw):
    ref_o, ref_lse = reference_attention(*x.args)
    out = torch.full(ref_o.shape, float("nan"), dtype=torch.bfloat16, device=ref_o.device)
    lse = torch.full(ref_lse.shape, float("nan"), dtype=torch.float32, device=ref_o.device)
    verify_attention(*x.args, backend="wgmma", params=params, out=out, lse=lse, **kw)
    err = rel_error(out, ref_o)
    assert err < TOL, f"rel error {err:.3g}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "lse: -inf / finite pattern differs from the oracle"
    assert torch.allclose(lse[fin], ref_lse[fin], atol=2e-2, rtol=0), "lse differs from the oracle"
    return err


@pytest.mark.parametrize("prefix", [1, 7, 54, 97, 300, 4096])
@pytest.mark.parametrize("T,H", [(1, 1), (1, 8), (2, 16), (9, 8), (9, 64), (16, 4), (9, 128)])
def test_prefixes_heads_drafts(prefix, T, H):
    x = make_inputs(1, T, H, prefix, tree="random", device="cuda")
    _check(x)


@pytest.mark.parametrize("T,H,tree", [(9, 8, "chain"), (9, 16, "random"), (16, 8, "random"), (1, 64, "chain"),
                                      (2, 1, "random")])
def test_ragged_batch(T, H, tree):
    x = make_inputs(3, T, H, [54, 1, 300], tree=tree, device="cuda")
    _check(x)


@pytest.mark.parametrize("nsplit", [1, 2, 5, 64, 300])
def test_nsplit_more_splits_than_tiles(nsplit):
    x = make_inputs(2, 9, 8, [97, 2000], tree="random", device="cuda")
    _check(x, params=_params(nsplit))


@pytest.mark.parametrize("nsplit", [1, 3])
@pytest.mark.parametrize("grow", [4.0, 40.0])
def test_growing_max_rescales(nsplit, grow):
    # the kernel keeps a row's max until a tile beats it by more than 2^8 (both warpgroups share
    # it): scale later keys up so their scores pass it mid-split
    x = make_inputs(1, 9, 8, 3000, tree="random", device="cuda", seed=11)
    late = x.kv_indices[1000:].long()
    x.kv_cache[late] = (x.kv_cache[late].float() * grow).to(torch.bfloat16)
    _check(x, params=_params(nsplit))


def test_noncontiguous_q_padded_rows_int64_indices():
    x = make_inputs(3, 9, 16, [300, 1, 54], tree="random", device="cuda", q_noncontiguous=True,
                    row_stride=640, indices_dtype=torch.int64)
    assert not x.q.is_contiguous() and x.kv_cache.stride(0) == 640
    _check(x)


def test_unaligned_q_takes_the_scalar_path():
    x = make_inputs(1, 9, 8, [97], device="cuda")
    wide = torch.zeros(9, 8, 577, dtype=torch.bfloat16, device="cuda")
    wide[:, :, :576] = x.q
    x.q = wide[:, :, :576]
    _check(x)


def test_misaligned_kv_rows_raise():
    x = make_inputs(1, 9, 8, [54], device="cuda", row_stride=580)
    with pytest.raises(ValueError, match="kv_cache"):
        verify_attention(*x.args, backend="wgmma")


def test_split_table_sets_the_partial_count():
    """The backend uses the split table it is given: tables that must give different split
    counts do (the documented rule, 32-key tiles), and every one matches the oracle."""
    x = make_inputs(3, 9, 8, [700, 97, 4096], tree="chain", device="cuda")
    lengths = [700 + 9, 97 + 9, 4096 + 9]
    p = _params(64)
    pb = describe_problem(*x.args)

    def items(table):
        ws = torch.zeros(workspace_bytes(pb, "wgmma", p), dtype=torch.uint8, device="cuda")
        _check(x, params=p, workspace=ws, split_table=table)
        off = (p.NSPLIT + pb.B) * pb.T * pb.H * (2 * pb.Dv + 4)
        meta = ws[off:off + 8 * pb.B].view(torch.int32).view(pb.B, 2).cpu()
        return meta[:, 0].tolist(), meta[:, 1].tolist()

    for bounds, values, nsplit in [([10**6], [4], 4), ([1000, 10**6], [1, 40], 40), ([10**6], [99], 64)]:
        assert items(SplitTable.build(bounds, values, device="cuda")) == _expected_items(lengths, nsplit, 32)
    assert items(None) == _expected_items(lengths, 64, 32)


@pytest.mark.parametrize("nsplit", [None, 1])
def test_nan_in_a_hidden_draft_keys_v_stays_out(nsplit):
    """A NaN in the V part of a draft key reaches only the rows that may see that key (chain:
    draft key 8 is seen by draft row 8 only). NSPLIT 1: the draft tile is tile 9 of one split,
    warpgroup 1's, whose scrubbed V warpgroup 0 then reads."""
    x = make_inputs(1, 9, 8, [300], tree="chain", device="cuda")
    ref_o, _ = reference_attention(*x.args)
    slot = int(x.kv_indices[300 + 8])
    x.kv_cache[slot, 100] = float("nan")
    o = verify_attention(*x.args, backend="wgmma", params=_params(nsplit, x))
    assert torch.isnan(o[8]).any()
    assert not torch.isnan(o[:8]).any()
    assert rel_error(o[:8], ref_o[:8]) < TOL


def test_nan_in_q_gives_nan_rows_only():
    x = make_inputs(2, 9, 8, [300, 4096], tree="random", device="cuda")
    ref_o, _ = reference_attention(*x.args)
    x.q[3, 5, 17] = float("nan")
    o, lse = verify_attention(*x.args, backend="wgmma", return_lse=True)
    assert torch.isnan(o[3, 5]).all() and torch.isnan(lse[3, 5])
    keep = torch.ones(o.shape[:2], dtype=torch.bool, device="cuda")
    keep[3, 5] = False
    assert not torch.isnan(o[keep]).any() and not torch.isnan(lse[keep]).any()
    assert rel_error(o[keep], ref_o[keep]) < TOL


@pytest.mark.parametrize("backend", ["cuda", pytest.param("wgmma", marks=pytest.mark.skip(
    reason="known hang of the shipped wgmma source on a 0-key request; fix measured in "
           "results/kernel/wgmma/zero-key-fix/, waiting for a wgmma re-sweep"))])
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


def test_row_that_sees_nothing():
    x = make_inputs(1, 2, 4, [0], device="cuda")
    x.tree_mask = torch.tensor([1, 0], dtype=torch.int64, device="cuda")
    o, lse = verify_attention(*x.args, backend="wgmma", return_lse=True)
    assert torch.all(o[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.isfinite(o).all() and torch.isfinite(lse[0]).all()


def test_cuda_graph_replay_new_lengths_and_trees():
    B, T, H, cap_keys = 2, 9, 8, 2000
    gen = torch.Generator().manual_seed(1)
    first = make_inputs(B, T, H, [300, 54], tree="random", device="cuda", generator=gen)
    num_slots = first.kv_cache.shape[0] + 4 * cap_keys
    kv = torch.randn(num_slots, 576, generator=gen).to(torch.bfloat16).cuda()
    q = first.q.clone()
    indptr = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(B * cap_keys, dtype=torch.int32, device="cuda")
    mask = torch.zeros(B * T, dtype=torch.int64, device="cuda")
    problem = describe_problem(q, kv, indptr, indices, mask, first.sm_scale)
    p = get_backend("wgmma").default_params(problem)
    ws = torch.empty(workspace_bytes(problem, "wgmma", p), dtype=torch.uint8, device="cuda")
    out = torch.empty(B * T, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B * T, H, dtype=torch.float32, device="cuda")
    table = SplitTable.build([64, 512, 10**6], [1, 4, p.NSPLIT], device="cuda")
    kw = dict(backend="wgmma", params=p, out=out, lse=lse, workspace=ws, split_table=table)

    def fill(prefixes):
        starts = [0]
        for pl in prefixes:
            starts.append(starts[-1] + pl + T)
        indptr.copy_(torch.tensor(starts, dtype=torch.int32))
        indices[: starts[-1]] = torch.randperm(num_slots, generator=gen)[: starts[-1]].to(torch.int32).cuda()
        mask.copy_(tree_mask_from_parents([random_parents(T, gen) for _ in range(B)]).cuda())
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))

    fill([300, 54])
    verify_attention(q, kv, indptr, indices, mask, first.sm_scale, **kw)  # compile + load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        verify_attention(q, kv, indptr, indices, mask, first.sm_scale, **kw)
    for prefixes in ([300, 54], [1, 1991], [700, 7], [1500, 400]):
        fill(prefixes)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        n = int(indptr[-1])
        ref_o, ref_lse = reference_attention(q, kv, indptr, indices[:n], mask, first.sm_scale)
        assert rel_error(out, ref_o) < TOL, f"prefixes {prefixes}"
        assert torch.allclose(lse, ref_lse, atol=2e-2, rtol=0), f"prefixes {prefixes}: lse differs"
