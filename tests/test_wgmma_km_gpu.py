"""The wgmma_km backend (sm_90a, keys in wgmma's M) on a GPU against the fp32 oracle (skipped
elsewhere, never faked).

Odd shapes on purpose, each DV_SPLIT x SPLIT_ALIGN at T 9: H x T from 1 row to 1152 (16 blocks of
72), 70 rows (two padding rows in the block), prefixes that leave partial last tiles, draft keys
that straddle two 64-key tiles (T 64), splits of half a tile, growing maxima (the lazy max's
rescale in both warpgroups), NaN in a hidden draft key's V, split tables that must give different
partial counts, both merge kernels. Ragged batches, non-contiguous and unaligned q, int64 indices,
padded KV rows, NaN in q, a row that sees nothing, a request of 0 keys and a CUDA graph replayed on
new lengths and trees: test_cuda_gpu.py, on every backend of verify.cu's schedule.
"""
import pytest
import torch

from kvtune.kernels import SplitTable, describe_problem, get_backend, make_inputs, reference_attention, rel_error, \
    verify_attention
from test_cuda_gpu import _check as check_against_oracle
from test_cuda_gpu import _expected_items, _items_per_request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or get_backend("wgmma_km").supports(torch.device("cuda")) is not None,
    reason="needs a GPU with wgmma (sm_90)")]

TOL = 1e-2
CONFIGS = [(dv, align) for dv in (0, 128, 192) for align in (32, 64)]
CONFIG_IDS = [f"dv{dv}-a{align}" for dv, align in CONFIGS]


def _params(nsplit=None, x=None, dv=192, align=32):
    from kvtune.kernels.cuda.params import WgmmaKmParams
    if nsplit is None:
        nsplit = get_backend("wgmma_km").default_params(describe_problem(*x.args)).NSPLIT
    return WgmmaKmParams(NSPLIT=nsplit, DV_SPLIT=dv, SPLIT_ALIGN=align)


def _check(x, params=None, **kw):
    return check_against_oracle(x, params, backend="wgmma_km", **kw)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("prefix", [1, 7, 54, 97, 300, 4096])
@pytest.mark.parametrize("H", [1, 8, 16, 64, 128])
def test_prefixes_and_heads_at_T9(prefix, H, config):
    x = make_inputs(1, 9, H, prefix, tree="random", device="cuda")
    _check(x, params=_params(x=x, dv=config[0], align=config[1]))


@pytest.mark.parametrize("dv", [0, 192])
@pytest.mark.parametrize("prefix", [1, 54, 97, 300, 4096])
@pytest.mark.parametrize("T,H", [(1, 1), (1, 8), (2, 16), (16, 4), (5, 14), (64, 1), (64, 2)])
def test_other_draft_counts(prefix, T, H, dv):
    """T 64: the draft keys straddle two 64-key tiles at most prefixes; 5 x 14 = 70 rows leaves two
    padding rows in the block; 64 x 2 = 128 rows, two blocks."""
    x = make_inputs(1, T, H, prefix, tree="random", device="cuda")
    _check(x, params=_params(x=x, dv=dv))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("nsplit", [1, 2, 5, 64, 300])
def test_nsplit_more_splits_than_tiles(nsplit, config):
    x = make_inputs(2, 9, 8, [97, 2000], tree="random", device="cuda")
    _check(x, params=_params(nsplit, dv=config[0], align=config[1]))


@pytest.mark.parametrize("dv", [0, 128, 192])
@pytest.mark.parametrize("nsplit", [1, 3])
@pytest.mark.parametrize("grow", [4.0, 40.0])
def test_growing_max_rescales(nsplit, grow, dv):
    # the S warpgroup keeps a row's max until a tile beats it by more than 2^8 and then both
    # warpgroups rescale their O^T columns: scale later keys up so their scores pass it mid-split
    x = make_inputs(1, 9, 8, 3000, tree="random", device="cuda", seed=11)
    late = x.kv_indices[1000:].long()
    x.kv_cache[late] = (x.kv_cache[late].float() * grow).to(torch.bfloat16)
    _check(x, params=_params(nsplit, dv=dv))


def test_misaligned_kv_rows_raise():
    x = make_inputs(1, 9, 8, [54], device="cuda", row_stride=580)
    with pytest.raises(ValueError, match="kv_cache"):
        verify_attention(*x.args, backend="wgmma_km")


@pytest.mark.parametrize("align", [32, 64])
def test_split_table_sets_the_partial_count(align):
    """The backend uses the split table it is given: tables that must give different split
    counts do (verify.cu's rule in pieces of SPLIT_ALIGN keys), and every one matches the oracle."""
    x = make_inputs(3, 9, 8, [700, 97, 4096], tree="chain", device="cuda")
    lengths = [700 + 9, 97 + 9, 4096 + 9]
    p = _params(64, align=align)
    for bounds, values, nsplit in [([10**6], [4], 4), ([1000, 10**6], [1, 40], 40), ([10**6], [99], 64)]:
        got = _items_per_request(x, p, SplitTable.build(bounds, values, device="cuda"), backend="wgmma_km")
        assert got == _expected_items(lengths, nsplit, align), (bounds, values)
    assert _items_per_request(x, p, backend="wgmma_km") == _expected_items(lengths, 64, align)
    four = _expected_items(lengths, 4, align)[1]
    assert four != _expected_items(lengths, 40, align)[1]


@pytest.mark.parametrize("dv", [0, 128, 192])
@pytest.mark.parametrize("nsplit", [None, 1])
def test_nan_in_a_hidden_draft_keys_v_stays_out(nsplit, dv):
    """A NaN in the V part of a draft key reaches only the rows that may see that key (chain:
    draft key 8 is seen by draft row 8 only). NSPLIT 1: the draft tile is the split's fifth,
    whose V the S warpgroup scrubs before both warpgroups' PV reads it."""
    x = make_inputs(1, 9, 8, [300], tree="chain", device="cuda")
    ref_o, _ = reference_attention(*x.args)
    slot = int(x.kv_indices[300 + 8])
    x.kv_cache[slot, 100] = float("nan")
    x.kv_cache[slot, 500] = float("nan")   # a value column of the PV warpgroup
    o = verify_attention(*x.args, backend="wgmma_km", params=_params(nsplit, x, dv=dv))
    assert torch.isnan(o[8]).any()
    assert not torch.isnan(o[:8]).any()
    assert rel_error(o[:8], ref_o[:8]) < TOL


@pytest.fixture(params=["warp", "block"])
def merge(request, monkeypatch):
    """Each merge kernel on every case, whatever the launch's splits per request would pick;
    after the test, every launch is checked to have used it."""
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


@pytest.mark.parametrize("B,T,H,prefix,nsplit", [
    (3, 9, 8, [5000, 1, 97], 70),     # the long request: more than 32 splits
    (2, 5, 14, [300, 4096], 7),       # 70 rows in one block
    (1, 9, 64, [2000], 16),           # tp 1: 8 row blocks
    (64, 9, 8, [97] * 64, 264),       # a batch bucket: several items per request
    (4, 1, 8, [0, 33, 64, 1], 9)])    # T 1, a request of only its draft key
@pytest.mark.parametrize("dv", [0, 192])
def test_both_merges_match_the_oracle(merge, B, T, H, prefix, nsplit, dv):
    x = make_inputs(B, T, H, prefix, tree="random", device="cuda", seed=B + nsplit)
    _check(x, params=_params(nsplit, dv=dv))
