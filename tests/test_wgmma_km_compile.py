"""The wgmma_km backend without a GPU: NVRTC builds it for sm_90a (no spills, no serialized
wgmma, setmaxnreg kept), its Python mirror of the kernel's shared memory, its parameters and their
errors, and its source identity. The kernel itself runs in tests/test_wgmma_km_gpu.py (sm_90 only)."""
from pathlib import Path

import pytest
import torch

from kvtune.kernels import describe_problem, get_backend, make_inputs
from kvtune.kernels.cuda import nvrtc
from kvtune.kernels.cuda.params import WgmmaKmParams

pytest.importorskip("cuda.bindings.nvrtc")


@pytest.mark.parametrize("align", [32, 64])
@pytest.mark.parametrize("dv", [0, 128, 192])
@pytest.mark.parametrize("T", [1, 9, 16, 64])
def test_compiles_for_sm90a_without_spills_or_serialized_mmas(T, dv, align):
    from kvtune.kernels.cuda import wgmma_km
    mod = wgmma_km.compile_km(T, dv_split=dv, align=align)
    res = mod.resources[wgmma_km.split_expr(T, dv, align)]
    assert res.spills == 0 and res.stack == 0
    # 384 (512) threads are launched with 168 (128) registers and redistributed with setmaxnreg, which
    # ptxas must not have dropped; a wait loop inside an accumulator chain serializes every wgmma (C7514)
    assert 0 < res.registers <= 65536 // wgmma_km.threads(dv) // 8 * 8
    assert "setmaxnreg' ignored" not in mod.log and "serialized" not in mod.log


def test_the_smem_mirror_is_the_kernels_sum():
    """wgmma_km.SMEM_BYTES against km::SMEM_BYTES, evaluated by NVRTC itself (the kernel traps if
    launched with less)."""
    from kvtune.kernels.cuda import wgmma_km
    from test_cuda_smem_mirror import _compile
    checks = [f'static_assert(kvtune::km::SMEM_BYTES == {wgmma_km.SMEM_BYTES}, "smem mirror");']
    with nvrtc.source_override(nvrtc.kernel_source(wgmma_km.PARTS)):
        ok, log = _compile(checks)
    assert ok, log[-3000:]
    assert wgmma_km.SMEM_BYTES <= 227 * 1024


def _problem(T=9, H=8, prefix=100):
    return describe_problem(*make_inputs(1, T, H, prefix, device="cpu").args)


@pytest.mark.parametrize("H,T,nsplit", [(8, 9, 132), (16, 9, 66), (32, 9, 33), (64, 9, 16), (1, 1, 132),
                                        (7, 9, 132), (128, 9, 8), (14, 5, 132)])
def test_default_nsplit_is_one_wave_of_72_row_blocks(H, T, nsplit):
    # ceil(H * T / 72) CTAs per split, one per SM: 132 SMs when no GPU is asked
    assert get_backend("wgmma_km").default_params(_problem(T, H)) == WgmmaKmParams(NSPLIT=nsplit)


def test_static_reject_names_the_arch_and_accepts_sm90():
    be = get_backend("wgmma_km")
    p = be.default_params(_problem())
    assert be.static_reject(p, _problem(), "sm_90") is None
    for arch in ("sm_80", "sm_89", "sm_120"):
        why = be.static_reject(p, _problem(), arch)
        assert why and "wgmma" in why and arch in why
    assert "needs a CUDA device" in be.supports(torch.device("cpu"))


def test_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="DV_SPLIT"):
        WgmmaKmParams(NSPLIT=8, DV_SPLIT=256)
    with pytest.raises(ValueError, match="DV_SPLIT"):
        WgmmaKmParams(NSPLIT=8, DV_SPLIT=64)
    with pytest.raises(ValueError, match="SPLIT_ALIGN"):
        WgmmaKmParams(NSPLIT=8, SPLIT_ALIGN=16)
    with pytest.raises(ValueError, match="NSPLIT"):
        WgmmaKmParams(NSPLIT=0)
    with pytest.raises(TypeError):
        WgmmaKmParams(NSPLIT=8, ROWS=72)
    from kvtune.kernels.cuda import wgmma_km
    with pytest.raises(ValueError, match="DV_SPLIT"):
        wgmma_km.compile_km(9, dv_split=64)
    with pytest.raises(ValueError, match="arch"):
        wgmma_km.compile_km(9, arch="sm_120")
    from kvtune.kernels.cuda.params import WgmmaParams
    with pytest.raises(ValueError, match="WgmmaKmParams"):
        get_backend("wgmma_km").check_params(WgmmaParams(), _problem())


def test_source_identity():
    """The module is built from verify.cu, verify_wgmma.cu, then verify_km.cu: the cuda and wgmma
    backends' hashes leave verify_km.cu out (their tuned files survive a change to it)."""
    parts = ("verify.cu", "verify_wgmma.cu", "verify_km.cu")
    assert nvrtc.kernel_source(parts).startswith(nvrtc.kernel_source(parts[:2]))
    km = get_backend("wgmma_km").kernel_hash()
    assert km == nvrtc.kernel_source_hash(parts)
    assert len({km, get_backend("wgmma").kernel_hash(), get_backend("cuda").kernel_hash()}) == 3
    assert get_backend("wgmma").kernel_hash() == nvrtc.kernel_source_hash(parts[:2])


def test_search_space_and_sweep_know_it():
    """Its search space narrows the declared values; `--backend wgmma_km` sweeps it for a deployment
    whose `backends` leave it out (kimi-k2-h200: its export lost at 4k, results/kernel/wgmma-km/);
    the runtime can force it."""
    from kvtune.kernels.cuda.params import WGMMA_KM_PARAMS
    from kvtune.kernels.lookup import VERIFY_MODES
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.options import subset
    from kvtune.tuner.space import load_space
    space = load_space("wgmma_km")
    for name, values in space.choices.items():
        assert set(values) <= set(WGMMA_KM_PARAMS.params[name].legal), name
    dep = load_deployment(Path(__file__).parents[1] / "configs" / "deployments" / "kimi-k2-h200.yaml")
    assert subset(["wgmma_km"], dep.backends, "--backend", dep.source, allow_extra=True) == ["wgmma_km"]
    assert "wgmma_km" in VERIFY_MODES
