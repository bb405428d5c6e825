"""The verify-attention contract, run against every registered backend that can run here.

Each case builds fresh random inputs (scattered KV slots, ragged prefixes, chain and random
trees) and compares the backend with the fp32 oracle: ||o - ref|| / ||ref|| < 1e-2 for the
bf16 output, NaN never passes.
"""
import pytest
import torch

from conftest import DEVICE
from kvtune.kernels import (SplitTable, backend_names, describe_problem, get_backend, make_inputs,
                            reference_attention, rel_error, verify_attention, workspace_bytes)
from kvtune.kernels.cuda.params import CudaParams

TOL = 1e-2


def _runnable_backends():
    out = []
    for name in backend_names():
        if name == "reference":
            continue
        marks = []
        try:
            why = get_backend(name).supports(torch.device(DEVICE))
        except ImportError as e:   # e.g. NVRTC bindings missing
            why = f"cannot import: {e}"
        if why:
            marks.append(pytest.mark.skip(reason=f"{name}: {why}"))
        try:   # a backend that cannot run on a CPU is in `pytest -m gpu`'s set
            if get_backend(name).supports(torch.device("cpu")):
                marks.append(pytest.mark.gpu)
        except ImportError:
            marks.append(pytest.mark.gpu)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


BACKENDS = _runnable_backends()


def _params(backend, x, **over):
    be = get_backend(backend)
    p = be.default_params(_problem(x))
    if over:
        fields = {k: v for k, v in over.items() if hasattr(p, k)}
        p = type(p)(**{**p.__dict__, **fields})
    return p


def _problem(x):
    from kvtune.kernels import describe_problem
    return describe_problem(*x.args, kv_lora_rank=x.kv_lora_rank)


def check(backend, x, params=None, **kw):
    ref_o, ref_lse = reference_attention(*x.args, kv_lora_rank=x.kv_lora_rank)
    out = torch.full_like(ref_o, float("nan"), dtype=torch.bfloat16)   # poisoned: every row must be written
    o, lse = verify_attention(*x.args, backend=backend, params=params, out=out, return_lse=True, **kw)
    assert o.data_ptr() == out.data_ptr()
    err = rel_error(o, ref_o)
    assert err < TOL, f"{backend}: rel error {err:.3g}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=2e-2, rtol=0)
    return err


# (batch, T, H, prefix lengths, tree) -- deliberately odd sizes
CASES = [
    (1, 9, 8, [54], "chain"),
    (1, 1, 1, [1], "chain"),
    (1, 2, 16, [97], "random"),
    (3, 9, 1, [1, 7, 300], "random"),
    (3, 16, 8, [54, 97, 7], "chain"),
    (1, 16, 16, [300], "random"),
    (3, 2, 8, [300, 1, 54], "chain"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,T,H,prefix,tree", CASES)
def test_matches_oracle(backend, B, T, H, prefix, tree):
    x = make_inputs(B, T, H, prefix, tree=tree, device=DEVICE)
    check(backend, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nsplit_larger_than_tiles_empty_splits_merge(backend):
    # 54 + 9 keys in 16-key tiles is 4 tiles: most of the 64 splits are empty
    x = make_inputs(2, 9, 8, [54, 7], tree="random", device=DEVICE)
    check(backend, x, params=_params(backend, x, NSPLIT=64, BLOCK_N=16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_q_row_stride_int64_indices(backend):
    x = make_inputs(3, 9, 8, [97, 1, 54], tree="random", device=DEVICE, q_noncontiguous=True,
                    row_stride=576 + 40, indices_dtype=torch.int64)
    assert not x.q.is_contiguous() and x.kv_cache.stride(0) == 616
    check(backend, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_table_per_request_nsplit(backend):
    x = make_inputs(3, 9, 8, [7, 97, 300], tree="chain", device=DEVICE)
    p = _params(backend, x, NSPLIT=8, BLOCK_N=16)
    # request 0 (16 keys) -> 1 split, request 1 (106 keys) -> 3, request 2 (309 keys) -> 8
    table = SplitTable.build([20, 120, 1000], [1, 3, 8], device=DEVICE)
    check(backend, x, params=p, split_table=table)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preallocated_workspace_and_lse(backend):
    from kvtune.kernels import workspace_bytes
    x = make_inputs(1, 9, 8, [300], device=DEVICE)
    p = _params(backend, x)
    need = workspace_bytes(_problem(x), backend, p)
    ws = torch.empty(need, dtype=torch.uint8, device=DEVICE)
    lse = torch.empty(9, 8, dtype=torch.float32, device=DEVICE)
    ref_o, ref_lse = reference_attention(*x.args)
    o, lse2 = verify_attention(*x.args, backend=backend, params=p, workspace=ws, lse=lse)
    assert lse2.data_ptr() == lse.data_ptr()
    assert rel_error(o, ref_o) < TOL
    if need:
        with pytest.raises(ValueError, match="workspace"):
            verify_attention(*x.args, backend=backend, params=p, workspace=ws[: need - 4])


def test_row_that_sees_nothing_gives_zero_not_nan():
    # A hand-made mask where draft 1 sees nothing and the request has no prefix.
    x = make_inputs(1, 2, 4, [0], device=DEVICE)
    x.tree_mask = torch.tensor([1, 0], dtype=torch.int64, device=DEVICE)
    for backend in ["reference"] + [p.values[0] for p in BACKENDS if not p.marks]:
        o, lse = verify_attention(*x.args, backend=backend, return_lse=True)
        assert torch.all(o[1] == 0) and torch.all(torch.isneginf(lse[1])), backend
        assert torch.isfinite(o).all() and torch.isfinite(lse[0]).all(), backend


def test_misuse_of_outputs_workspace_and_split_table_is_named():
    x = make_inputs(1, 2, 4, [5], device=DEVICE)
    buf = torch.empty(2, 8, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="^lse: the last"):
        verify_attention(*x.args, backend="triton", lse=buf[:, ::2])
    ws = torch.empty(1 << 24, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="^workspace: must start at a 16-byte"):
        verify_attention(*x.args, backend="triton", workspace=ws[4:])
    # enough bytes, but 2-D: the backends cut partials out of it by byte offset
    with pytest.raises(ValueError, match="^workspace: need a contiguous 1-D tensor .* got 2-D"):
        verify_attention(*x.args, backend="triton", workspace=ws.view(1 << 12, 1 << 12))
    problem = describe_problem(*x.args)
    with pytest.raises(ValueError, match="^params: backend 'triton' takes TritonParams, got CudaParams"):
        workspace_bytes(problem, "triton", CudaParams())
    bad = SplitTable(max_keys=torch.tensor([10, 20, 30], dtype=torch.int32, device=DEVICE),
                     nsplit=torch.tensor([1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="^split_table: needs as many"):
        verify_attention(*x.args, backend="triton", split_table=bad)
