"""The wgmma launch's choice between the split kernel's merge tree (fused) and a merge kernel, and
the workspace the tree's counters take (no GPU needed). The tree itself runs on the GPU
(`tests/test_wgmma_fused_gpu.py`, against the oracle)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtune.kernels import get_backend
from kvtune.kernels.cuda import backend, wgmma
from kvtune.kernels.cuda.params import WgmmaParams
from kvtune.kernels.shapes import VerifyProblem


def _pb(B, H=8, T=9):
    return VerifyProblem(B=B, T=T, H=H, Dk=576, Dv=512, device=torch.device("cpu"))


@pytest.mark.parametrize("nsplit,B,fused", [
    (132, 1, False),    # batch 1: a merge kernel spreads 132 partials over the GPU; the tree climbs 4 levels
    (132, 8, False),    # 17 items per request
    (132, 17, True),    # 8
    (132, 64, True),    # a batch-64 bucket: 2-3 items per request
    (264, 64, True),
    (14, 1, False)])
def test_auto_fuses_where_requests_hold_few_items(monkeypatch, nsplit, B, fused):
    monkeypatch.delenv("KVTUNE_WGMMA_MERGE", raising=False)
    assert wgmma.FUSED_MAX_SPLITS == 8
    assert wgmma.uses_fused_merge(nsplit, B) is fused


def test_the_environment_forces_either_and_names_itself_when_wrong(monkeypatch):
    monkeypatch.setenv("KVTUNE_WGMMA_MERGE", "fused")
    assert wgmma.uses_fused_merge(132, 1)
    assert not wgmma.uses_fused_merge(4096, 1), "a request of 4097 items is deeper than the tree's six levels"
    monkeypatch.setenv("KVTUNE_WGMMA_MERGE", "separate")
    assert not wgmma.uses_fused_merge(132, 64)
    monkeypatch.setenv("KVTUNE_WGMMA_MERGE", "yes")
    with pytest.raises(ValueError, match="KVTUNE_WGMMA_MERGE"):
        wgmma.uses_fused_merge(132, 64)


def test_a_fused_launch_has_no_merge_kernel(monkeypatch):
    """The launch records the choice; launch_split_merge then launches the split kernel only."""
    monkeypatch.delenv("KVTUNE_WGMMA_MERGE", raising=False)
    k = wgmma._Loaded(split="split", merge="block", merge_warp="warp", pdl=False)
    p = WgmmaParams(NSPLIT=132, ROWS=72)
    shape = ((1, 196, 1), (384, 1, 1))
    fused = k.split_launch(p, _pb(64), shape, 0, "", fusable=True)
    assert fused.fused and fused.merge_kind == "fused"
    assert not k.split_launch(p, _pb(64), shape, 0, "").fused, "wgmma_km's kernel has no tree"
    sep = k.split_launch(p, _pb(1), shape, 0, "", fusable=True)
    assert not sep.fused and sep.merge_kind == "block"


def test_a_dispatch_merges_with_a_merge_kernel(monkeypatch):
    """A per-context dispatch's launches share one workspace and (chained) one merge: each is
    launched unfused."""
    seen = []
    monkeypatch.setattr(backend, "launch_split_merge", lambda a, sl: seen.append(sl.fused))
    monkeypatch.setenv("KVTUNE_DISPATCH_CHAIN", "0")
    sl = backend.SplitLaunch(params=None, split_k=None, split_shape=None, smem=0, vec=8, vec_hint="", items=196,
                             merge_k=None, merge_kind="fused", merge_launch=None, pdl=False, fused=True)
    backend.launch_dispatch([(None, sl), (None, sl)])
    assert seen == [False, False]


@pytest.mark.parametrize("B,H,rows,nsplit", [(1, 8, 72, 132), (64, 8, 72, 264), (3, 64, 64, 14), (5, 14, 72, 7),
                                             (7, 1, 64, 1)])
def test_the_counters_lie_inside_the_workspace_after_the_meta(B, H, rows, nsplit):
    """FUSE_LEVELS x work items x row blocks u64 counters, 16-byte aligned, after the partials and
    the meta (whose offsets are unchanged: the merge kernels and tests read them there)."""
    pb, p = _pb(B, H), WgmmaParams(NSPLIT=nsplit, ROWS=rows)
    need = get_backend("wgmma").workspace_bytes(pb, p)
    a = SimpleNamespace(problem=pb, workspace=SimpleNamespace(data_ptr=lambda: 0))
    part_o, part_lse, meta = backend._layout(a, backend.work_items(p, B))
    start = backend._counters(meta, B)
    n = backend.FUSE_LEVELS * (nsplit + B) * wgmma.row_blocks(H, 9, rows)
    assert start % 16 == 0 and start >= meta + 8 * B == backend.split_workspace_bytes(p, pb)
    assert start + 8 * n <= need
