"""How a per-context dispatch's launches run as one chain (no GPU needed): which orders are
chained, whose merge runs, the workspace a chain needs and that every caller sizes for it, and the
errors of `verify_attention_dispatch` that name the launch. The chain itself runs on the GPU
(`tests/test_dispatch_gpu.py`: both orders, chain on and off, against the oracle)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtune.kernels.api import verify_attention_dispatch
from kvtune.kernels.backends import call_workspace_bytes, get_backend, launch_all
from kvtune.kernels.cuda.backend import (SplitLaunch, chain_merge, chain_order, chain_workspace_bytes,
                                         split_workspace_bytes, work_items)
from kvtune.kernels.cuda.wgmma_km import compile_km, split_expr
from kvtune.kernels.shapes import VerifyProblem

PB = VerifyProblem(B=4, T=9, H=8, Dk=576, Dv=512, device=torch.device("cpu"))


def _sl(chainable: bool, items: int, kind: str = "warp") -> SplitLaunch:
    return SplitLaunch(params=None, split_k=None, split_shape=((1, items, 1), (384, 1, 1)), smem=0, vec=8,
                       vec_hint="", items=items, merge_k=kind, merge_kind=kind, merge_launch=((1, 1, 1), (1, 1, 1)),
                       pdl=False, chainable=chainable)


def test_a_plain_launch_leads_and_the_chainable_ones_follow(monkeypatch):
    monkeypatch.delenv("KVTUNE_DISPATCH_CHAIN", raising=False)
    assert chain_order([_sl(False, 136), _sl(True, 136)]) == [0, 1]
    assert chain_order([_sl(True, 136), _sl(False, 136)]) == [1, 0]   # wgmma_km primary, wgmma beside it
    assert chain_order([_sl(True, 136), _sl(True, 68), _sl(False, 72)]) == [2, 0, 1]
    assert chain_order([_sl(True, 136), _sl(True, 68)]) == [0, 1]


def test_no_chain_for_one_launch_two_plain_ones_or_when_turned_off(monkeypatch):
    monkeypatch.delenv("KVTUNE_DISPATCH_CHAIN", raising=False)
    assert chain_order([_sl(True, 136)]) is None
    assert chain_order([_sl(False, 136), _sl(False, 68), _sl(True, 68)]) is None   # wgmma and cuda cannot follow
    monkeypatch.setenv("KVTUNE_DISPATCH_CHAIN", "0")
    assert chain_order([_sl(False, 136), _sl(True, 136)]) is None


def test_the_chain_merges_with_the_merge_of_the_launch_with_the_most_items():
    a, b = _sl(False, 40, "warp"), _sl(True, 136, "block")
    assert chain_merge([a, b]) is b and chain_merge([b, a]) is b


def test_a_chain_workspace_holds_the_largest_layout_and_a_meta_per_launch():
    """Partials of the most items (o bf16 + lse fp32 per row), then B x 2 ints for the shared
    meta and for each chained launch's own."""
    rows = 136 * PB.T * PB.H
    assert chain_workspace_bytes(PB, [40, 136]) == rows * (2 * 512 + 4) + 2 * 8 * PB.B


def test_every_caller_sizes_a_dispatch_for_its_chain():
    """call_workspace_bytes: one launch (or a backend that never chains) as its own
    workspace_bytes; split-merge backends' dispatch at least the chain's."""
    km, wg = get_backend("wgmma_km"), get_backend("wgmma")
    p = km.default_params(dataclasses.replace(PB, device=torch.device("cpu")))
    q = dataclasses.replace(p, NSPLIT=3 * p.NSPLIT)
    w = wg.params_type(NSPLIT=p.NSPLIT, ROWS=72)
    assert call_workspace_bytes(PB, [(p, km)]) == split_workspace_bytes(p, PB)
    both = call_workspace_bytes(PB, [(w, wg), (q, km)])
    assert both == chain_workspace_bytes(PB, [work_items(w, PB.B), work_items(q, PB.B)])
    assert both > max(split_workspace_bytes(w, PB), split_workspace_bytes(q, PB))
    tr = get_backend("triton")
    tp = tr.default_params(PB)
    assert call_workspace_bytes(PB, [(tp, tr)]) == tr.workspace_bytes(PB, tp)


def test_launch_all_launches_each_in_turn_where_it_cannot_chain():
    seen = []

    class Fake:
        name = "fake"

        def launch(self, a, p):
            seen.append((a, p))

    f = Fake()
    launch_all([(f, 1, "a"), (f, 2, "b")])
    assert seen == [("a", 1), ("b", 2)]


def test_verify_attention_dispatch_names_the_bad_launch():
    from kvtune.kernels import make_inputs
    x = make_inputs(1, 2, 2, [5], device="cpu", seed=0)
    out = torch.empty(2, 2, 512, dtype=torch.bfloat16)
    ws = torch.empty(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"launches\[0\]: wgmma cannot run here"):
        verify_attention_dispatch(*x.args, [("wgmma", None, None)], out, workspace=ws)
    with pytest.raises(ValueError, match="launches: expected at least one"):
        verify_attention_dispatch(*x.args, [], out, workspace=ws)


@pytest.mark.parametrize("dv_split,align", [(192, 64), (0, 32)])
def test_the_chainable_kernel_builds_for_sm_90a_without_spills(dv_split, align):
    """verify_km_kernel's chained_meta argument and its waits compile, no spills."""
    res = compile_km(9, "sm_90", dv_split, align).resources[split_expr(9, dv_split, align)]
    assert res.spill_stores == 0 and res.spill_loads == 0
