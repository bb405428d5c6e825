"""The wgmma kernel's fused merge (verify_wgmma.cu's merge tree: the last CTA of a node's items
merges them, no merge kernel) on a GPU against the fp32 oracle (skipped elsewhere, never faked).

Forced on every case (KVTUNE_WGMMA_MERGE=fused) whatever the launch's items per request would
pick, and checked to have run fused: requests of 1 item (written straight to the output), 2-4
(one merge), 5 (a lone fifth child: two levels) and 129 (four levels); several row blocks (H 64,
H 14 at 64 and 72 rows); both schedules; a request of 0 keys; NaN rows; an unaligned output; a
workspace of random bytes and one reused by calls of other shapes (the counters' tag); CUDA
graph replays with new lengths.
"""
import pytest
import torch

from kvtune.kernels import describe_problem, get_backend, make_inputs, reference_attention, rel_error, verify_attention
from kvtune.kernels.cuda import nvrtc
from kvtune.kernels.cuda.backend import FUSE_LEVELS
from kvtune.kernels.cuda.params import WgmmaParams
from kvtune.kernels.cuda.wgmma import forced_schedule
from test_cuda_gpu import _check as check_against_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or get_backend("wgmma").supports(torch.device("cuda")) is not None,
    reason="needs a GPU with wgmma (sm_90)")]

TOL = 1e-2
TAG = 0x7FC17FC3 << 32


@pytest.fixture
def fused(monkeypatch):
    """Every wgmma launch of the test merges in the split kernel; checked after the test."""
    from kvtune.kernels.cuda import backend
    monkeypatch.setenv("KVTUNE_WGMMA_MERGE", "fused")
    used = []
    launch = backend.launch_split_merge

    def spy(a, sl):
        used.append(sl.merge_kind)
        return launch(a, sl)

    monkeypatch.setattr(backend, "launch_split_merge", spy)
    yield used
    assert used and set(used) == {"fused"}, used


@pytest.fixture(params=["items", "ranges"])
def schedule(request):
    be = get_backend("wgmma")
    src = nvrtc.SOURCE_PATH.with_name("verify_wgmma.cu").read_text()
    with nvrtc.source_override(forced_schedule(src, request.param), "verify_wgmma.cu"):
        be._kernels.clear()
        yield request.param
    be._kernels.clear()


def _p(nsplit, rows=72, lanes=8):
    return WgmmaParams(NSPLIT=nsplit, ROWS=rows, COPY_LANES=lanes)


CASES = [
    (1, 9, 8, [4096], 132),           # 129 items: a tree of four levels
    (1, 9, 8, [300], 5),              # 5 items: four children and a lone fifth, two levels
    (3, 9, 8, [5000, 1, 97], 70),     # 68 items, 1, 1
    (2, 5, 14, [300, 4096], 7),       # H 14: two row blocks at ROWS 64
    (1, 9, 64, [2000], 14),           # nine or eight row blocks, 14 items
    (64, 9, 8, [97] * 64, 264),       # 4 one-tile items per request
    (4, 1, 8, [0, 33, 64, 1], 9),     # T 1, a request of only its draft key
    (16, 9, 8, [1200, 90000, 3000, 17, 40000, 5000, 1, 800, 25000, 2000, 60000, 300, 9000, 150, 7000, 33], 132)]


@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("B,T,H,prefix,nsplit", CASES)
def test_fused_merge_matches_the_oracle(fused, B, T, H, prefix, nsplit, rows):
    x = make_inputs(B, T, H, prefix, tree="random", device="cuda", seed=B + nsplit)
    check_against_oracle(x, _p(nsplit, rows), backend="wgmma")


@pytest.mark.parametrize("B,T,H,prefix,nsplit", [
    CASES[2], CASES[7], (40, 9, 8, [1, 2, 5, 3] * 9 + [3000, 4, 0, 700], 8)])
def test_fused_merge_under_either_schedule(fused, schedule, B, T, H, prefix, nsplit):
    """Ranges cut requests into segments that several CTAs share, one CTA holding several
    requests' segments; each segment arrives in its own request's tree. A request of 0 keys has
    no segment under ranges: its rows are written o = 0, lse = -inf."""
    x = make_inputs(B, T, H, prefix, tree="random", device="cuda", seed=B + nsplit)
    check_against_oracle(x, _p(nsplit), backend="wgmma", check_values_=False)


@pytest.mark.parametrize("row", [3, 12])  # request 0 (one item at NSPLIT 6: written directly), request 1 (five)
def test_fused_merge_keeps_nan_rows_and_unaligned_out(fused, row):
    x = make_inputs(2, 9, 8, [300, 4096], tree="random", device="cuda", seed=5)
    ref_o, ref_lse = reference_attention(*x.args)
    x.q[row, 5, 17] = float("nan")
    store = torch.full((18, 8, 512 + 3), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = store[:, :, 3:]  # rows start 6 bytes past an alignment
    o, lse = verify_attention(*x.args, backend="wgmma", params=_p(6), out=out, return_lse=True)
    assert torch.isnan(o[row, 5]).all() and torch.isnan(lse[row, 5])
    keep = torch.ones(o.shape[:2], dtype=torch.bool, device="cuda")
    keep[row, 5] = False
    assert not torch.isnan(o[keep]).any() and not torch.isnan(lse[keep]).any()
    assert rel_error(o[keep], ref_o[keep]) < TOL
    assert torch.allclose(lse[keep], ref_lse[keep], atol=2e-2, rtol=0)


def _counter_words(x, p, ws):
    """The fused merge's counter words in workspace `ws` for a call of `p` on `x`."""
    from kvtune.kernels.cuda.backend import split_workspace_bytes
    from kvtune.kernels.cuda.wgmma import row_blocks
    pb = describe_problem(*x.args)
    start = (split_workspace_bytes(p, pb) + 15) // 16 * 16
    n = FUSE_LEVELS * (p.NSPLIT + pb.B) * row_blocks(pb.H, pb.T, p.ROWS)
    return ws[start:start + 8 * n].view(torch.int64)


def test_a_workspace_of_any_content_and_reuse_across_shapes(fused):
    """Counters need no zeroing: a workspace of random bytes (a word without the tag counts as 0),
    then calls of other shapes on the same workspace, whose counters overlap each other's
    partials; after each call every counter word it touched holds the tag and 0 arrivals."""
    g = torch.Generator(device="cuda").manual_seed(7)
    ws = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda", generator=g)
    shapes = [(1, 9, 8, [4096], 132), (16, 9, 8, [300] * 16, 40), (3, 9, 64, [2000, 97, 5000], 30),
              (1, 9, 8, [4096], 132)]
    for B, T, H, prefix, nsplit in shapes:
        x = make_inputs(B, T, H, prefix, tree="random", device="cuda", seed=B * nsplit)
        p = _p(nsplit)
        check_against_oracle(x, p, backend="wgmma", workspace=ws)
        words = _counter_words(x, p, ws)
        touched = words[(words >> 32) == (TAG >> 32)]
        assert touched.numel() > 0 and torch.all(touched == TAG), "a counter was left with arrivals"


def test_graph_replays_with_new_lengths(fused):
    """One captured call replayed on metadata that changes the items per request (1, 2-4, many):
    the counters reset themselves between replays."""
    from kvtune.kernels import tree_mask_from_parents
    from kvtune.kernels.tree import random_parents
    B, T, H, cap_keys = 8, 9, 8, 6000
    gen = torch.Generator().manual_seed(1)
    num_slots = 2 * B * cap_keys
    kv = torch.randn(num_slots, 576, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(B * T, H, 576, generator=gen).to(torch.bfloat16).cuda()
    indptr = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(B * cap_keys, dtype=torch.int32, device="cuda")
    mask = torch.zeros(B * T, dtype=torch.int64, device="cuda")
    sm_scale = 576 ** -0.5
    p = _p(40)
    ws = torch.empty(get_backend("wgmma").workspace_bytes(describe_problem(q, kv, indptr, indices, mask, sm_scale), p),
                     dtype=torch.uint8, device="cuda")
    out = torch.empty(B * T, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B * T, H, dtype=torch.float32, device="cuda")

    def fill(prefixes):
        starts = [0]
        for n in prefixes:
            starts.append(starts[-1] + n + T)
        indptr.copy_(torch.tensor(starts, dtype=torch.int32))
        indices[: starts[-1]] = torch.randperm(num_slots, generator=gen)[: starts[-1]].to(torch.int32).cuda()
        mask.copy_(tree_mask_from_parents([random_parents(T, gen) for _ in range(B)]).cuda())
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))

    def call():
        verify_attention(q, kv, indptr, indices, mask, sm_scale, backend="wgmma", params=p, out=out, lse=lse,
                         workspace=ws)

    fill([cap_keys - T] * B)
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for prefixes in ([cap_keys - T] * B, [7, 300, 5000, 1, 64, 900, 2000, 33], [100] * B, [3000, 1] * 4):
        fill(prefixes)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        n = int(indptr[-1])
        ref_o, ref_lse = reference_attention(q, kv, indptr, indices[:n], mask, sm_scale)
        assert rel_error(out, ref_o) < TOL, f"prefixes {prefixes}"
        assert torch.allclose(lse, ref_lse, atol=2e-2, rtol=0), f"prefixes {prefixes}: lse differs"
