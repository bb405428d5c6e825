"""The wgmma backend (sm_90a) on a GPU against the fp32 oracle (skipped elsewhere, never faked).

Odd shapes on purpose, each with 64 and 72 query rows per CTA (ROWS 72: the tail warpgroup
runs rows 64-71): H x T from 1 row (one block, 63 or 71 padded) to 1152 (18 or 16 blocks), 72
rows (a second block holding 8, or one block), prefixes that leave partial last tiles, splits of
one tile (warpgroup 1 with no tile of its own), growing maxima, NaN in a draft key's V (seen by
a row of the tail at ROWS 72), misaligned KV rows, split tables that must give different
partial counts. Ragged batches, non-contiguous and
unaligned q, int64 indices, padded KV rows, NaN in q, a row that sees nothing, a request of 0
keys and a CUDA graph replayed on new lengths and trees: test_cuda_gpu.py, on both backends.
"""
import pytest
import torch

from kvtune.kernels import (SplitTable, describe_problem, get_backend, make_inputs, reference_attention, rel_error,
                            verify_attention)
from kvtune.kernels.cuda import nvrtc
from kvtune.kernels.cuda.wgmma import FORCED_RESTART_TILES, forced_schedule, restart_tiles
from test_cuda_gpu import _check as check_against_oracle
from test_cuda_gpu import _expected_items, _items_per_request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or get_backend("wgmma").supports(torch.device("cuda")) is not None,
    reason="needs a GPU with wgmma (sm_90)")]

TOL = 1e-2


def _params(nsplit=None, x=None, rows=None, lanes=4):
    """NSPLIT (None: the default for x's shape and `rows`), ROWS (None: the default) and COPY_LANES."""
    from dataclasses import replace

    from kvtune.kernels.cuda.params import WgmmaParams
    from kvtune.kernels.cuda.wgmma import one_wave
    if nsplit is None:
        pb = describe_problem(*x.args)
        p = get_backend("wgmma").default_params(pb)
        if rows is None or rows == p.ROWS:
            return replace(p, COPY_LANES=lanes)
        return WgmmaParams(NSPLIT=one_wave(pb.H, pb.T, rows, torch.cuda.get_device_properties(0).multi_processor_count),
                           ROWS=rows, COPY_LANES=lanes)
    return WgmmaParams(NSPLIT=nsplit, ROWS=rows or 64, COPY_LANES=lanes)


def _check(x, params=None, **kw):
    return check_against_oracle(x, params, backend="wgmma", **kw)


@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("prefix", [1, 7, 54, 97, 300, 4096])
@pytest.mark.parametrize("T,H", [(1, 1), (1, 8), (2, 16), (9, 8), (9, 64), (16, 4), (9, 128), (5, 14)])
def test_prefixes_heads_drafts(prefix, T, H, rows):
    x = make_inputs(1, T, H, prefix, tree="random", device="cuda")
    _check(x, params=_params(x=x, rows=rows))


@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("B", [1, 2])
def test_one_request_runs_the_batch_one_split_kernel(B, rows):
    """A launch of one request runs the instantiation that copies Q while the schedule runs (B1),
    any other the general one; both match the oracle on strided q (its row and head strides
    are the early copy's addresses), with one split, several, and more than the tiles."""
    be = get_backend("wgmma")
    x = make_inputs(B, 9, 8, [300] * B, tree="random", device="cuda", q_noncontiguous=True)
    assert not x.q.is_contiguous()
    k = be._get(9, rows, x.q.device, 4)
    assert k.split_b1 is not None and k.split_b1 is not k.split
    for nsplit in (1, 5, 64):
        p = _params(nsplit=nsplit, rows=rows)
        launch = k.split_launch(p, describe_problem(*x.args), ((1, 1, 1), (1, 1, 1)), 0, "")
        assert launch.split_k is (k.split_b1 if B == 1 else k.split)
        _check(x, params=p)


@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("prefix", [1, 7, 17, 54, 300, 4096])
@pytest.mark.parametrize("T,H", [(1, 8), (9, 8), (9, 64), (5, 14)])
def test_eight_copy_lanes(prefix, T, H, rows):
    """COPY_LANES 8 (two key rows per thread, rows crow and crow + 16): prefixes that leave the
    second row of a thread past the split (17: one row of the last tile's second half), or the
    first one too (1, 7)."""
    x = make_inputs(1, T, H, prefix, tree="random", device="cuda")
    _check(x, params=_params(x=x, rows=rows, lanes=8))


@pytest.mark.parametrize("lanes", [4, 8])
@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("nsplit", [1, 2, 5, 64, 300])
def test_nsplit_more_splits_than_tiles(nsplit, rows, lanes):
    x = make_inputs(2, 9, 8, [97, 2000], tree="random", device="cuda")
    _check(x, params=_params(nsplit, rows=rows, lanes=lanes))


@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("nsplit", [1, 3])
@pytest.mark.parametrize("grow", [4.0, 40.0])
def test_growing_max_rescales(nsplit, grow, rows):
    # the kernel keeps a row's max until a tile beats it by more than 2^8 (both warpgroups share
    # it): scale later keys up so their scores pass it mid-split
    x = make_inputs(1, 9, 8, 3000, tree="random", device="cuda", seed=11)
    late = x.kv_indices[1000:].long()
    x.kv_cache[late] = (x.kv_cache[late].float() * grow).to(torch.bfloat16)
    _check(x, params=_params(nsplit, rows=rows))


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

    def items(table):
        return _items_per_request(x, p, table, backend="wgmma")

    # NSPLIT 4: key ranges (39 tiles + a restart: 1.2 x 42 <= items' 65-tile pieces); 40, 64: items
    for bounds, values, nsplit in [([10**6], [4], 4), ([1000, 10**6], [1, 40], 40), ([10**6], [99], 64)]:
        assert items(SplitTable.build(bounds, values, device="cuda")) == _schedule(lengths, nsplit)[1:]
    assert _schedule(lengths, 4)[0] == "ranges" and _schedule(lengths, 40)[0] == "items"
    assert items(None) == _schedule(lengths, 64)[1:]


@pytest.mark.parametrize("n", [1, 31, 32, 33, 40])
def test_split_table_lookup_in_long_tables(n):
    """The batch's bucket (the first bound >= its keys, else the last) wherever it sits in a
    table of `n` (up to 32: a lane each in time_phases.py's table_lanes variant; more: walked),
    the batch on a bound or past the last one. Only that bucket holds NSPLIT 40 (items);
    every other holds 4 (ranges), so a wrong bucket changes every request's split count."""
    x = make_inputs(3, 9, 8, [700, 97, 4096], tree="chain", device="cuda")
    lengths = [700 + 9, 97 + 9, 4096 + 9]
    total = sum(lengths)
    p = _params(64)
    for pos in sorted({0, n // 2, n - 1, n}):  # bounds[pos] == total; pos == n: every bound below it
        bounds = [total - pos + i for i in range(n)]
        values = [4] * n
        values[min(pos, n - 1)] = 40
        got = _items_per_request(x, p, SplitTable.build(bounds, values, device="cuda"), backend="wgmma")
        assert got == _schedule(lengths, 40)[1:], (n, pos)


RESTART_TILES = restart_tiles(nvrtc.SOURCE_PATH.with_name("verify_wgmma.cu").read_text())


def _schedule(lengths, nsplit, restart_tiles=RESTART_TILES, bn=32):
    """The wgmma kernel's documented schedule, written out independently (a scan and a cut list
    where the kernel searches and counts): (mode, firsts, counts) per request. Items (verify.cu's
    rule, _expected_items) unless items' chunk is at least 1.2 x (R + restart_tiles per request
    boundary a range holds, rounded up) tiles, R = ceil(total / nsplit) keys in whole tiles;
    then each request is cut at the multiples of R of the concatenated keys."""
    B, total = len(lengths), sum(lengths)
    cap = max(nsplit, B)
    chunk = bn
    while sum(max(-(-L // chunk), 1) for L in lengths) > cap:
        chunk += bn
    r_tiles = max(-(-(-(-total // nsplit)) // bn), 1)
    if B == 1 or 5 * (chunk // bn) < 6 * (r_tiles + restart_tiles * -(-(B - 1) // nsplit)):
        return ("items",) + _expected_items(lengths, nsplit, bn)
    R = r_tiles * bn
    counts, start = [], 0
    for L in lengths:
        cuts = {c for c in range(start, start + L) if c % R == 0} | {start}
        counts.append(len(cuts) if L else 0)
        start += L
    firsts = [sum(counts[:i]) if counts[i] else 0 for i in range(B)]
    return "ranges", firsts, counts


@pytest.fixture(params=["items", "ranges"])
def forced(request):
    """The source with its schedule forced (RANGE_RESTART_TILES patched: items always, or key
    ranges whenever a batch holds two requests or more), compiled in memory for this test only."""
    be = get_backend("wgmma")
    src = nvrtc.SOURCE_PATH.with_name("verify_wgmma.cu").read_text()
    restart = FORCED_RESTART_TILES[request.param]
    with nvrtc.source_override(forced_schedule(src, request.param), "verify_wgmma.cu"):
        be._kernels.clear()
        yield request.param, restart
    be._kernels.clear()


@pytest.mark.parametrize("lanes", [4, 8])
@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("B,T,H,prefix,nsplit", [
    (16, 9, 8, [1200, 90000, 3000, 17, 40000, 5000, 1, 800, 25000, 2000, 60000, 300, 9000, 150, 7000, 33], 132),
    (40, 9, 8, [1, 2, 5, 3] * 9 + [3000, 4, 0, 700], 8),  # ranges of ~470 keys: many requests per range
    (2, 9, 8, [1015, 1015], 2),                           # request 1 starts at a range start
    (3, 9, 16, [700, 97, 4096], 5),                       # two row blocks at ROWS 64 and 72
    (5, 1, 8, [64, 1, 3000, 31, 500], 3)])                # T 1: 32-key tiles cut mid-request
def test_items_and_ranges_match_the_oracle(forced, B, T, H, prefix, nsplit, rows, lanes):
    """Either schedule, forced, on ragged batches: outputs against the fp32 oracle, and every
    request's (first item, item count) in the kernel's meta against the schedule written out here."""
    mode, restart = forced
    x = make_inputs(B, T, H, prefix, tree="random", device="cuda", seed=B + nsplit)
    p = _params(nsplit, rows=rows, lanes=lanes)
    lengths = [n + T for n in prefix]
    want = _schedule(lengths, nsplit, restart)
    assert want[0] == mode
    assert _items_per_request(x, p, backend="wgmma") == want[1:]


def test_ranges_skip_a_request_without_keys(forced):
    """A request of 0 keys (metadata capture lets through) between two others: no segment under
    ranges, an empty item under items; its rows get o = 0 and lse = -inf either way."""
    x = make_inputs(2, 9, 8, [300, 4000], tree="random", device="cuda", seed=3)
    ref_o, ref_lse = reference_attention(*x.args)
    q = torch.cat([x.q[:9], torch.randn_like(x.q[:9]), x.q[9:]])
    indptr = torch.tensor([0, 309, 309, 309 + 4009], dtype=torch.int32, device="cuda")
    mask = torch.cat([x.tree_mask[:9], x.tree_mask[:9], x.tree_mask[9:]])
    o, lse = verify_attention(q, x.kv_cache, indptr, x.kv_indices, mask, x.sm_scale, backend="wgmma",
                              params=_params(6), return_lse=True, check_values_=False)
    torch.cuda.synchronize()
    keep = torch.cat([torch.arange(9), torch.arange(18, 27)]).cuda()
    assert rel_error(o[keep], ref_o) < TOL and torch.allclose(lse[keep], ref_lse, atol=2e-2, rtol=0)
    assert torch.all(o[9:18] == 0) and torch.all(torch.isneginf(lse[9:18]))


@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("nsplit", [None, 1])
def test_nan_in_a_hidden_draft_keys_v_stays_out(nsplit, rows):
    """A NaN in the V part of a draft key reaches only the rows that may see that key (chain:
    draft key 8 is seen by draft row 8 only, which at H 8 includes row 71, the tail's at ROWS
    72). NSPLIT 1: the draft tile is tile 9 of one split, warpgroup 1's, whose scrubbed V
    warpgroup 0 (and the tail) then reads."""
    x = make_inputs(1, 9, 8, [300], tree="chain", device="cuda")
    ref_o, _ = reference_attention(*x.args)
    slot = int(x.kv_indices[300 + 8])
    x.kv_cache[slot, 100] = float("nan")
    o = verify_attention(*x.args, backend="wgmma", params=_params(nsplit, x, rows))
    assert torch.isnan(o[8]).any()
    assert not torch.isnan(o[:8]).any()
    assert rel_error(o[:8], ref_o[:8]) < TOL


@pytest.fixture(params=["warp", "block"])
def merge(request, monkeypatch):
    """Each merge kernel on every case, whatever the launch's splits per request would pick:
    verify_wgmma.cu's warp merge, or verify.cu's block merge; after the test, every launch is
    checked to have used it (the warp merge is launched with its own grid, `merge_launch`)."""
    from kvtune.kernels.cuda import backend, wgmma
    monkeypatch.setattr(wgmma, "WARP_MERGE_MAX_SPLITS", 10**6 if request.param == "warp" else 0)
    used = []
    launch = backend.launch_split_merge

    def spy(a, sl):
        used.append(sl.merge_kind)
        return launch(a, sl)

    monkeypatch.setattr(backend, "launch_split_merge", spy)
    yield request.param
    assert used and set(used) == {request.param}, used


@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("B,T,H,prefix,nsplit", [
    (3, 9, 8, [5000, 1, 97], 70),     # the long request: more than 32 splits (the warp merge's second lse pass)
    (2, 5, 14, [300, 4096], 7),       # H 14: the second block of 8 heads half empty
    (1, 9, 64, [2000], 14),           # tp 1's default NSPLIT
    (64, 9, 8, [97] * 64, 264),       # a batch bucket: 4 one-tile items per request
    (4, 1, 8, [0, 33, 64, 1], 9)])    # T 1, a request of only its draft key
def test_both_merges_match_the_oracle(merge, B, T, H, prefix, nsplit, rows):
    x = make_inputs(B, T, H, prefix, tree="random", device="cuda", seed=B + nsplit)
    _check(x, params=_params(nsplit, rows=rows))


@pytest.mark.parametrize("row", [3, 12])  # request 0 (one split at NSPLIT 6), request 1 (five)
def test_both_merges_keep_nan_rows_and_strided_out(merge, row):
    """NaN in q[i, h] makes o[i, h] and lse[i, h] NaN (every split of that pair NaN), other rows
    match the oracle; an output whose rows are mostly not 16-byte aligned (head stride 515
    elements: head 7's rows are) is written element by element there."""
    x = make_inputs(2, 9, 8, [300, 4096], tree="random", device="cuda", seed=5)
    ref_o, ref_lse = reference_attention(*x.args)
    x.q[row, 5, 17] = float("nan")
    store = torch.full((18, 8, 512 + 3), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = store[:, :, 3:]  # rows start 6 bytes past an alignment
    o, lse = verify_attention(*x.args, backend="wgmma", params=_params(6), out=out, return_lse=True)
    assert torch.isnan(o[row, 5]).all() and torch.isnan(lse[row, 5])
    keep = torch.ones(o.shape[:2], dtype=torch.bool, device="cuda")
    keep[row, 5] = False
    assert not torch.isnan(o[keep]).any() and not torch.isnan(lse[keep]).any()
    assert rel_error(o[keep], ref_o[keep]) < TOL
    assert torch.allclose(lse[keep], ref_lse[keep], atol=2e-2, rtol=0)
