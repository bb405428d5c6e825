"""The wgmma backend without a GPU: NVRTC builds it for sm_90a (registers, spills), its Python
mirror of the kernel's shared memory, its parameters and their errors, and its source identity.
The kernel itself runs in tests/test_wgmma_gpu.py (sm_90 only)."""
from pathlib import Path

import pytest
import torch

from kvtune.kernels import describe_problem, get_backend, make_inputs
from kvtune.kernels.cuda import nvrtc
from kvtune.kernels.cuda.params import WgmmaParams

pytest.importorskip("cuda.bindings.nvrtc")


@pytest.mark.parametrize("lanes", [4, 8])
@pytest.mark.parametrize("rows", [64, 72])
@pytest.mark.parametrize("T", [1, 9, 16, 64])
def test_compiles_for_sm90a_without_spills(T, rows, lanes):
    from kvtune.kernels.cuda import wgmma
    mod = wgmma.compile_wgmma(T, rows=rows, lanes=lanes)
    # both split kernels: any batch, and batch 1's (Q copied under the schedule)
    exprs = wgmma.split_exprs(T, rows, lanes)
    assert exprs == (wgmma.split_expr(T, rows, lanes), wgmma.split_expr(T, rows, lanes, b1=True))
    for expr in exprs:
        res = mod.resources[expr]
        assert res.spills == 0 and res.stack == 0, expr
        # one CTA per SM: 256 threads may hold up to 255 registers; 384 (the tail warpgroup) are
        # launched with 168 and redistribute them with setmaxnreg, which ptxas must not have dropped
        assert 0 < res.registers <= (255 if rows == 64 else 168), expr
    assert "setmaxnreg' ignored" not in mod.log and "serialized" not in mod.log
    # the warp merge's launch bound (3 blocks of 256 per SM) holds without spills (NVRTC 13.0 spilled at 4)
    merge = mod.resources[wgmma.MERGE_WARP_EXPR]
    assert merge.spills == 0 and merge.stack == 0 and 0 < merge.registers <= 85


def test_rows_outside_the_kernels_two_shapes_raise():
    from kvtune.kernels.cuda import wgmma
    with pytest.raises(ValueError, match="rows"):
        wgmma.compile_wgmma(9, rows=80)
    with pytest.raises(ValueError, match="ROWS"):
        WgmmaParams(NSPLIT=8, ROWS=80)


def test_copy_lanes_outside_the_gathers_two_mappings_raise():
    from kvtune.kernels.cuda import wgmma
    with pytest.raises(ValueError, match="COPY_LANES.*4 or 8, got 16"):
        wgmma.compile_wgmma(9, rows=64, lanes=16)
    with pytest.raises(ValueError, match="COPY_LANES"):
        WgmmaParams(NSPLIT=8, ROWS=64, COPY_LANES=2)


def test_the_smem_mirror_is_the_kernels_sum():
    """wgmma.smem_bytes(rows) against wg::Layout<XR>::SMEM_BYTES, evaluated by NVRTC itself: the
    module's source followed by one static_assert per shape (the kernel traps if launched with
    less)."""
    from kvtune.kernels.cuda import wgmma
    from test_cuda_smem_mirror import _compile
    checks = [f'static_assert(kvtune::wg::Layout<{rows - 64}>::SMEM_BYTES == {wgmma.smem_bytes(rows)}, "{rows}");'
              for rows in (64, 72)]
    with nvrtc.source_override(nvrtc.kernel_source(wgmma.PARTS)):   # verify.cu's text then verify_wgmma.cu's
        ok, log = _compile(checks)
    assert ok, log[-3000:]
    assert wgmma.smem_bytes(64) < wgmma.smem_bytes(72) <= 227 * 1024


def _problem(T=9, H=8, prefix=100):
    return describe_problem(*make_inputs(1, T, H, prefix, device="cpu").args)


@pytest.mark.parametrize("H,T,nsplit,rows", [(8, 9, 132, 72), (64, 9, 14, 64), (32, 9, 26, 64), (16, 9, 66, 72),
                                             (1, 1, 132, 64), (7, 9, 132, 64), (8, 8, 132, 64), (16, 5, 66, 64)])
def test_default_nsplit_is_one_wave_of_row_blocks(H, T, nsplit, rows):
    # 72 rows where the tail saves a third of the blocks (72: 1 not 2; 144: 2 not 3; 288: 4 not 5
    # is not enough; 80: 2 either way), then ceil(H * T / rows) CTAs per split, one per SM: 132
    # SMs when no GPU is asked
    assert get_backend("wgmma").default_params(_problem(T, H)) == WgmmaParams(NSPLIT=nsplit, ROWS=rows)


def test_static_reject_names_the_arch_and_accepts_sm90():
    be = get_backend("wgmma")
    p = be.default_params(_problem())
    assert be.static_reject(p, _problem(), "sm_90") is None
    for arch in ("sm_80", "sm_89", "sm_120"):
        why = be.static_reject(p, _problem(), arch)
        assert why and "wgmma" in why and arch in why
    assert "needs a CUDA device" in be.supports(torch.device("cpu"))


def test_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="NSPLIT"):
        WgmmaParams(NSPLIT=0)
    with pytest.raises(TypeError):
        WgmmaParams(NSPLIT=8, BLOCK_N=32)
    from kvtune.kernels.cuda.params import CudaParams
    with pytest.raises(ValueError, match="WgmmaParams"):
        get_backend("wgmma").check_params(CudaParams(), _problem())


def test_source_identity():
    """The wgmma module is built from verify.cu then verify_wgmma.cu; the cuda backend's hash
    stays verify.cu's alone (its tuned files survive a wgmma change), the two differ."""
    parts = ("verify.cu", "verify_wgmma.cu")
    assert nvrtc.kernel_source(parts).startswith(nvrtc.SOURCE_PATH.read_text())
    assert get_backend("cuda").kernel_hash() == nvrtc.kernel_source_hash()
    assert get_backend("wgmma").kernel_hash() == nvrtc.kernel_source_hash(parts) != nvrtc.kernel_source_hash()
    for bad in ((), ("verify_wgmma.cu",), ("verify.cu", "other.cu")):
        with pytest.raises(ValueError, match="parts"):
            nvrtc.kernel_source(bad)


def test_search_space_and_deployment_know_it():
    from kvtune.kernels.lookup import VERIFY_MODES
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.space import load_space
    space = load_space("wgmma")
    from kvtune.kernels.cuda.params import WGMMA_PARAMS
    assert set(space.choices["NSPLIT"]) <= set(WGMMA_PARAMS.params["NSPLIT"].legal)
    dep = Path(__file__).parents[1] / "configs" / "deployments" / "kimi-k2-h200.yaml"
    assert "wgmma" in load_deployment(dep).backends
    assert "wgmma" in VERIFY_MODES


@pytest.mark.parametrize("nsplit,B,warp", [(132, 1, False), (132, 2, False), (132, 3, True), (132, 64, True),
                                           (14, 1, True), (49, 1, False), (48, 1, True), (264, 5, False),
                                           (264, 6, True), (7, 200, True)])
def test_the_merge_follows_the_splits_per_request(nsplit, B, warp):
    """The warp merge serves launches whose requests hold at most 48 work items on average
    (max(NSPLIT, B) / B, rounded up); the block merge the rest."""
    from kvtune.kernels.cuda import wgmma
    assert wgmma.WARP_MERGE_MAX_SPLITS == 48
    assert wgmma.uses_warp_merge(nsplit, B) is warp


@pytest.mark.parametrize("B,T,H,grid", [(1, 9, 8, (9, 1, 1)), (64, 9, 8, (576, 1, 1)), (2, 5, 14, (10, 2, 1)),
                                        (1, 1, 128, (1, 16, 1)), (3, 16, 1, (48, 1, 1))])
def test_the_warp_merge_grid_has_a_warp_per_row_and_head(B, T, H, grid):
    """A block of 8 warps per (row, 8 heads): B*T rows in x, ceil(H / 8) in y."""
    from kvtune.kernels.cuda import wgmma
    assert wgmma.merge_warp_shape(B, T, H) == (grid, (256, 1, 1))


def test_a_launch_takes_the_merge_kernel_and_grid_of_its_rule():
    """The loaded module's choice pairs each merge kernel with its own grid (None: verify.cu's)."""
    from kvtune.kernels.cuda import wgmma
    k = wgmma._Loaded(split="split", merge="block", merge_warp="warp", pdl=False)
    assert k.merge_for(132, 64, 9, 8) == ("warp", ((576, 1, 1), (256, 1, 1)))
    assert k.merge_for(132, 1, 9, 8) == ("block", None)


def test_one_request_takes_the_batch_one_split_kernel():
    """The loaded module's split kernel per launch: batch 1's own instantiation for one request,
    the general one otherwise (and for one request when the module has no batch-1 kernel)."""
    from kvtune.kernels.cuda import wgmma
    k = wgmma._Loaded(split="split", merge="block", merge_warp="warp", pdl=False, split_b1="b1")
    assert [k.split_for(B) for B in (1, 2, 64)] == ["b1", "split", "split"]
    assert wgmma._Loaded(split="split", merge="block", merge_warp="warp", pdl=False).split_for(1) == "split"
