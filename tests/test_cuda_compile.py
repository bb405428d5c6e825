"""The CUDA backend without a GPU: NVRTC compiles the kernel for every target arch, the
resource report is sane, parameter validation names the field, and the cache is used."""
import dataclasses
import itertools
import json
import os

import pytest
import torch

import cuda.bindings.nvrtc  # noqa: F401  (a hard dependency: a broken install must fail here, not skip)

from kvtune.kernels import VerifyProblem  # noqa: E402
from kvtune.kernels.cuda import nvrtc  # noqa: E402
from kvtune.kernels.cuda import backend as cuda_backend  # noqa: E402
from kvtune.kernels.cuda.backend import (ARCH_LIMITS, CudaBackend, CudaParams, KernelGeometry,  # noqa: E402
                                         check_static, compile_params, default_for_arch, fit_reason,
                                         reject_reason, split_expr)

ARCHS = ["sm_80", "sm_89", "sm_90", "sm_120"]


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    old = os.environ.get("KVTUNE_CACHE_DIR")
    os.environ["KVTUNE_CACHE_DIR"] = str(tmp_path_factory.mktemp("kvtune-cuda-cache"))
    yield
    if old is None:
        os.environ.pop("KVTUNE_CACHE_DIR", None)
    else:
        os.environ["KVTUNE_CACHE_DIR"] = old


def _problem(H=8, T=9, B=1):
    return VerifyProblem(B=B, T=T, H=H, Dk=576, Dv=512, device=torch.device("cpu"))


@pytest.mark.parametrize("arch", ARCHS)
def test_default_compiles_without_spills(arch):
    be = CudaBackend()
    p = default_for_arch(9, 8, arch)
    mod = compile_params(p, 9, arch)
    res = mod.resources[split_expr(p, 9)]
    assert res.registers > 0 and res.spills == 0 and res.stack == 0, res
    assert mod.cubin[:4] == b"\x7fELF"  # CUBIN, not PTX
    assert be.static_reject(p, _problem(), arch) is None
    # the sm_90 default does not fit the smaller parts, and static_reject says why
    p90 = be.default_params(_problem())
    why = be.static_reject(p90, _problem(), arch)
    if KernelGeometry.of(p90, 9).smem_bytes > ARCH_LIMITS[arch].smem_per_block:
        assert why is not None and "shared memory" in why


# a spread: small/large tiles, every VEC, deep pipelines, few/many heads, T = 1 and 64
SPREAD = [
    CudaParams(VEC=4, BLOCK_N=16, NUM_WARPS=8, HEADS_PER_BLOCK=2, STAGES=3),
    CudaParams(VEC=2, BLOCK_N=32, NUM_WARPS=16, HEADS_PER_BLOCK=1, STAGES=2),
    CudaParams(VEC=8, BLOCK_N=64, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=2),
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("i", range(len(SPREAD)))
def test_spread_compiles(arch, i):
    p = SPREAD[i]
    mod = compile_params(p, 9, arch)
    assert mod.resources[split_expr(p, 9)].registers > 0


@pytest.mark.parametrize("T,H", [(1, 64), (64, 1), (16, 8)])
def test_defaults_for_other_T_build_on_sm90(T, H):
    be = CudaBackend()
    p = be.default_params(_problem(H=H, T=T))
    assert be.static_reject(p, _problem(H=H, T=T), "sm_90") is None


@pytest.mark.parametrize("arch,T,H", [("sm_120", 1, 64), ("sm_120", 16, 8), ("sm_120", 41, 1), ("sm_120", 48, 1),
                                      ("sm_89", 40, 1), ("sm_86", 24, 3)])
def test_99kb_defaults_build(arch, T, H):
    # sm_120 at T 41-48 fits 99 KB only with 4 warps: the default must find that, not give up
    be = CudaBackend()
    p = default_for_arch(T, max(1, min(H, 72 // T)), arch)
    assert be.static_reject(p, _problem(H=H, T=T), arch) is None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("T", [40, 41, 48])
def test_a_default_that_fits_builds_cleanly(arch, T):
    # the runtime's fallback judges the default by shared memory alone: one that fits must not
    # spill (4 warps at T 41-48 spill on sm_80/86/89)
    p = default_for_arch(T, 1, arch)
    if fit_reason(p, T, arch) is None:
        assert reject_reason(p, T, arch) is None, (arch, T, p)


def _legal(p, T):
    try:
        check_static(p, T)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("arch", ARCHS)
def test_default_fits_wherever_any_config_fits(arch):
    # every legal template config of CUDA_PARAMS, judged by the kernel's shared-memory model
    # (fit_reason) at each T: where one fits, the default must fit too
    space = [CudaParams(VEC=v, BLOCK_N=n, NUM_WARPS=w, HEADS_PER_BLOCK=h, STAGES=st)
             for v, n, w, h, st in itertools.product((2, 4, 8), (16, 32, 64), (4, 8, 16), (1, 2, 4, 8), (2, 3))]
    for T in range(1, 65):
        fitting = [q for q in space if _legal(q, T) and fit_reason(q, T, arch) is None]
        p = default_for_arch(T, max(1, min(8, 72 // T)), arch)
        assert _legal(p, T), (T, p)
        if fit_reason(p, T, arch) is None or not fitting:
            assert bool(fitting) == (fit_reason(p, T, arch) is None), (arch, T, p)
            continue
        # the default gave up where some config fits: only if those spill here (compiled; the
        # VEC-8 ones, VEC changes neither shared memory nor the accumulator's registers much)
        for q in (q for q in fitting if q.VEC == 8):
            why = reject_reason(q, T, arch)
            assert why is not None and "spills" in why, (arch, T, q, why)


@pytest.mark.parametrize("sms", [132, 114, 108, 170, 188])
def test_default_nsplit_is_one_full_wave(sms, monkeypatch):
    # one CTA per SM (the default's shared memory): NSPLIT x head groups CTAs must not pass the
    # SM count (a second wave), and one more split per group would
    monkeypatch.setattr(cuda_backend, "sm_count", lambda problem: sms)
    be = CudaBackend()
    for H in range(1, 129):
        p = be.default_params(_problem(H=H, T=9))
        groups = -(-H // p.HEADS_PER_BLOCK)
        assert p.NSPLIT * groups <= sms or p.NSPLIT == 1, (H, p)
        assert (p.NSPLIT + 1) * groups > sms or p.NSPLIT == 256, (H, p)


def test_small_config_fits_sm120():
    p = CudaParams(VEC=8, BLOCK_N=16, NUM_WARPS=8, HEADS_PER_BLOCK=2, STAGES=2)
    assert reject_reason(p, 9, "sm_120") is None


@pytest.mark.parametrize("field,value", [("VEC", 3), ("BLOCK_N", 48), ("NUM_WARPS", 6), ("STAGES", 1),
                                         ("STAGES", 5), ("HEADS_PER_BLOCK", 0), ("NSPLIT", 0), ("NSPLIT", 2000),
                                         ("VEC", True), ("BLOCK_N", 32.0)])
def test_param_validation_names_field(field, value):
    with pytest.raises(ValueError, match=f"CudaParams.{field}"):
        CudaParams(**{field: value})


def test_problem_validation():
    be = CudaBackend()
    with pytest.raises(ValueError, match="Dk=576"):
        be.check_params(CudaParams(), VerifyProblem(B=1, T=9, H=8, Dk=192, Dv=128, device=torch.device("cpu")))
    with pytest.raises(ValueError, match="HEADS_PER_BLOCK"):
        be.check_params(CudaParams(HEADS_PER_BLOCK=64), _problem(T=9))       # 576 rows
    with pytest.raises(ValueError, match="NUM_WARPS"):
        be.check_params(CudaParams(NUM_WARPS=4, HEADS_PER_BLOCK=8), _problem(T=9))  # 288 acc registers


def test_static_reject_reasons():
    be = CudaBackend()
    big = CudaParams(BLOCK_N=128, STAGES=4, HEADS_PER_BLOCK=8)
    why = be.static_reject(big, _problem(), "sm_90")
    assert why and "shared memory" in why
    with pytest.raises(ValueError, match="arch"):
        reject_reason(CudaParams(), 9, "sm_61")


def test_cache_hit_and_source_hash():
    p = CudaParams(VEC=8, BLOCK_N=16, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=2)
    a = compile_params(p, 3, "sm_90")
    nvrtc._mem_cache.clear()
    b = compile_params(p, 3, "sm_90")        # from disk now
    assert b.from_cache and b.cubin == a.cubin and b.resources == a.resources
    assert a.name.startswith("verify_T3_VEC8_BN16_W8_HPB1_S2") and "sm_90" in a.name
    assert nvrtc.kernel_source_hash() in a.name and len(nvrtc.kernel_source_hash()) == 16


def _compile_without_ptxas_report(monkeypatch):
    """Make every NVRTC compile from here on lose its `ptxas -v` report, as one GPU machine's NVRTC
    13.0 did (its resources then read 0); the in-memory cache is emptied. Returns the real compile."""
    real = nvrtc._compile_uncached

    def no_report(*args, **kw):
        mod = real(*args, **kw)
        mod.log = "\n".join(line for line in mod.log.splitlines() if not line.startswith("ptxas"))
        mod.resources = {e: nvrtc.KernelResources() for e in mod.resources}
        return mod
    nvrtc._mem_cache.clear()
    monkeypatch.setattr(nvrtc, "_compile_uncached", no_report)
    return real


def test_a_module_without_a_ptxas_report_is_not_cached(monkeypatch):
    """A compile whose log lacks the ptxas report of a requested kernel (seen once on a GPU
    machine's NVRTC 13.0) reads 0 registers and spills: it warns, stays out of the disk cache, and
    an entry written with such a log before is compiled again, not read."""
    p = CudaParams(VEC=8, BLOCK_N=16, NUM_WARPS=4, HEADS_PER_BLOCK=1, STAGES=2)
    real = _compile_without_ptxas_report(monkeypatch)
    with pytest.warns(RuntimeWarning, match="no ptxas report"):
        a = compile_params(p, 5, "sm_90")
    assert split_expr(p, 5) in a.unreported and a.unreported == list(a.lowered)
    files = list(nvrtc.cache_dir().glob(a.name + ".*"))
    assert not [f for f in files if f.suffix in (".cubin", ".json")], files
    # the same entry on disk, as an older kvtune wrote it: rebuilt with the report
    (nvrtc.cache_dir() / f"{a.name}.cubin").write_bytes(a.cubin)
    (nvrtc.cache_dir() / f"{a.name}.json").write_text(json.dumps(
        {"name_exprs": list(a.lowered), "lowered": a.lowered, "log": a.log,
         "resources": {k: dataclasses.asdict(v) for k, v in a.resources.items()}}))
    monkeypatch.setattr(nvrtc, "_compile_uncached", real)
    nvrtc._mem_cache.clear()
    b = compile_params(p, 5, "sm_90")
    assert not b.from_cache and b.unreported == [] and b.resources[split_expr(p, 5)].registers > 0
    nvrtc._mem_cache.clear()
    assert compile_params(p, 5, "sm_90").from_cache


def test_compile_check_shows_unknown_resources_as_unknown(monkeypatch, tmp_path, capsys):
    """compile-check's row for a kernel without a ptxas report says so and shows no register or
    spill count, rather than the 0s that would read as a clean compile."""
    from kvtune.tuner.compile_check import check_one
    monkeypatch.setenv("KVTUNE_CACHE_DIR", str(tmp_path))
    cfg = {"VEC": 8, "BLOCK_N": 16, "NUM_WARPS": 4, "HEADS_PER_BLOCK": 1, "STAGES": 2, "CTAS_PER_SM": 1}
    real = _compile_without_ptxas_report(monkeypatch)
    with pytest.warns(RuntimeWarning, match="no ptxas report"):
        row = check_one(cfg, 7, 8, "sm_90")
    assert row["registers"] is None and row["spills"] is None and "no ptxas report" in row["reason"], row
    assert row["fits"], row   # the sweep's verdict (reject_reason) stands: it times the config, it does not prune it
    # the command: a default whose spills cannot be checked fails it, as a spill would
    from kvtune.tuner import compile_check
    from kvtune.tuner.cli import main
    monkeypatch.setattr(compile_check, "BUILTIN_SPREAD", [])
    nvrtc._mem_cache.clear()
    with pytest.warns(RuntimeWarning, match="no ptxas report"):
        assert main(["compile-check", "--arch", "sm_90", "--jobs", "1"]) == 1
    assert "registers and spills are unknown" in capsys.readouterr().err
    monkeypatch.setattr(nvrtc, "_compile_uncached", real)
    nvrtc._mem_cache.clear()
    row = check_one(cfg, 7, 8, "sm_90")
    assert row["registers"] > 0 and row["spills"] == 0 and row["fits"] and row["reason"] == "", row


def test_compile_error_carries_the_log():
    with pytest.raises(nvrtc.NvrtcError, match="NVRTC log"):
        nvrtc.compile_module("bad", ["kvtune::verify_split_kernel<3,32,8,8,2,9>"], "sm_90")


def test_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z3foov' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z3foov\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 200 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]\n")
    r = nvrtc.parse_ptxas_log(log)["_Z3foov"]
    assert (r.registers, r.spill_stores, r.spill_loads, r.stack, r.static_smem) == (200, 4, 12, 8, 1024)


@pytest.mark.parametrize("T", [1, 2, 9, 16])
def test_qk_tiling_meets_the_kernels_static_asserts(T):
    # the Python side picks the QK^T warp tiling (template values QMT, QRG, QKS); it must
    # satisfy Config's static_asserts for every config the search space can produce
    from kvtune.kernels.cuda.backend import qk_tiling
    from kvtune.kernels.shapes import cdiv
    for w in (4, 8, 16, 32):
        for bn in (16, 32, 64, 128):
            for hpb in (1, 2, 4, 8):
                if w * 32 < bn or hpb * T > 256:
                    continue
                p = CudaParams(BLOCK_N=bn, NUM_WARPS=w, HEADS_PER_BLOCK=hpb)
                qmt, qrg, qks = qk_tiling(p, T)
                nt, kt = cdiv(hpb * T, 8), bn // 16
                s_nt = cdiv(nt, qrg)
                assert kt % qmt == 0 and 1 <= qrg <= nt and cdiv(nt, s_nt) == qrg and 36 % qks == 0, (p, T)
                assert (kt // qmt) * qrg * qks <= w, (p, T)


def test_qk_tiling_of_the_default_keeps_every_warp_busy():
    from kvtune.kernels.cuda.backend import qk_tiling
    p = default_for_arch(9, 8, "sm_90")
    qmt, qrg, qks = qk_tiling(p, 9)
    assert (p.BLOCK_N // 16 // qmt) * qrg * qks == p.NUM_WARPS
    # with S accumulators of at most 40 registers (beside the 144 of O) and the least traffic
    assert qmt * -(-9 // qrg) * 4 <= 40 and (qmt, qrg, qks) == (2, 2, 4)
