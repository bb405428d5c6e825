"""Each backend's parameters are declared once, beside its kernel (kernels/triton_params.py,
kernels/cuda/params.py): the dataclasses are built from the declaration, search spaces may
only narrow it, and the declared rules reject exactly what the CUDA kernel's static_asserts
reject (checked by NVRTC compiling the kernel's `Config` at the boundaries, no GPU)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from kvtune.kernels.backends import get_backend
from kvtune.kernels.cuda.params import ARCH_LIMITS, CUDA_PARAMS, CudaParams
from kvtune.kernels.params import params_type
from kvtune.kernels.triton_params import TritonParams
from kvtune.tuner.config import ConfigError, load_device, parse_device
from kvtune.tuner.space import SPACE_DIR, load_space, problem_env, read_space

TRITON = {"NSPLIT": [1, 2], "BLOCK_N": [32], "HEADS_PER_BLOCK": [1, 2], "NUM_WARPS": [4], "STAGES": [1]}
CUDA = {"NSPLIT": [16], "VEC": [8], "BLOCK_N": [32], "NUM_WARPS": [4, 8], "HEADS_PER_BLOCK": [4, 8], "STAGES": [2],
        "CTAS_PER_SM": [1]}


def _write_space(tmp_path, backend, params, name=None):
    d = tmp_path / "spaces"
    d.mkdir(exist_ok=True)
    p = d / f"{name or backend}.yaml"
    p.write_text(yaml.safe_dump({"backend": backend, "params": params}))
    return d, p


def test_the_backends_take_the_declared_dataclasses():
    assert params_type("triton") is TritonParams is get_backend("triton").params_type
    assert params_type("cuda") is CudaParams is get_backend("cuda").params_type
    # field order is the declaration's: positional construction and the trials table follow it
    assert TritonParams(4, 16, 2, 4, 1) == TritonParams(NSPLIT=4, BLOCK_N=16, HEADS_PER_BLOCK=2, NUM_WARPS=4, STAGES=1)
    assert CudaParams() == CudaParams(NSPLIT=64, VEC=8, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=8, STAGES=2,
                                      CTAS_PER_SM=1)


def test_reading_a_declaration_does_not_import_triton():
    # an in-process CPU sweep sets TRITON_INTERPRET after loading its spaces; Triton must not be
    # imported before that
    code = ("import sys; from kvtune.tuner.space import load_space; load_space('triton'); load_space('cuda'); "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("backend, param, spec, key", [
    ("triton", "NSPLIT", [1, 512], "params.NSPLIT.choices[1]"),
    ("triton", "NUM_WARPS", {"choices": [4, 3]}, "params.NUM_WARPS.choices[1]"),
    ("triton", "BLOCK_N", {"range": {"low": 16, "high": 48, "step": 16}}, "params.BLOCK_N.range"),
    ("cuda", "STAGES", [1, 2], "params.STAGES.choices[0]"),
    ("cuda", "VEC", [8, 16], "params.VEC.choices[1]"),
    ("cuda", "CTAS_PER_SM", [1, 2.5], "params.CTAS_PER_SM.choices[1]"),
])
def test_a_space_value_outside_the_declaration_names_file_and_key(tmp_path, backend, param, spec, key):
    params = dict(TRITON if backend == "triton" else CUDA, **{param: spec})
    d, p = _write_space(tmp_path, backend, params)
    with pytest.raises(ConfigError) as e:
        load_space(backend, None, d)
    msg = str(e.value)
    assert msg.startswith(f"{p}: {key}:") and "outside the declaration" in msg and param in msg, msg


def test_an_unknown_parameter_names_it_and_the_declared_ones(tmp_path):
    d, p = _write_space(tmp_path, "cuda", dict(CUDA, BLOCK_M=[16]))
    with pytest.raises(ConfigError) as e:
        load_space("cuda", None, d)
    assert str(p) in str(e.value) and "params.BLOCK_M" in str(e.value)
    for name in ("NSPLIT", "VEC", "BLOCK_N", "NUM_WARPS", "HEADS_PER_BLOCK", "STAGES", "CTAS_PER_SM"):
        assert name in str(e.value)


def test_every_shipped_and_committed_space_loads():
    for p in sorted(SPACE_DIR.rglob("*.yaml")):
        assert read_space(p).size() > 1, p
    # the TPE-vs-grid evidence predates CTAS_PER_SM: replayed with the parameters its table has
    ev = SPACE_DIR.parent / "results/tpe-vs-grid/spaces"
    for be in ("triton", "cuda"):
        fields = list(yaml.safe_load((ev / f"{be}.yaml").read_text())["params"])
        assert load_space(be, fields, ev).names == fields


def test_grid_and_size_cover_the_choices_widened_by_the_default(tmp_path):
    d, _ = _write_space(tmp_path, "triton", TRITON)
    sp = load_space("triton", None, d)
    default = {"NSPLIT": 16, "BLOCK_N": 32, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 8, "STAGES": 1}
    want = {(ns, 32, h, w, 1) for ns in (1, 2, 16) for h in (1, 2) for w in (4, 8)}
    got = sp.grid(default)
    assert {tuple(g.values()) for g in got} == want and len(got) == len(want) == sp.size(default) == 12
    assert all(list(g) == ["NSPLIT", "BLOCK_N", "HEADS_PER_BLOCK", "NUM_WARPS", "STAGES"] for g in got)
    assert sp.size() == len(sp.grid()) == 4


def test_the_declared_rules_are_constraints_of_every_space(tmp_path):
    d, _ = _write_space(tmp_path, "cuda", CUDA)
    sp = load_space("cuda", None, d)
    env = problem_env(9, 8, 1, 4096, 576, 512, load_device("h200"))
    point = {"NSPLIT": 16, "VEC": 8, "BLOCK_N": 32, "NUM_WARPS": 4, "HEADS_PER_BLOCK": 8, "STAGES": 2,
             "CTAS_PER_SM": 1}
    # 8 heads x 9 rows over 4 warps: 8 x 9 x 4 = 288 accumulator registers per thread
    why = sp.violation(point, env)
    assert why and "o_accumulator" in why
    with pytest.raises(ValueError, match="CudaParams.NUM_WARPS"):
        get_backend("cuda").check_params(CudaParams(**point), SimpleNamespace(T=9, Dk=576, Dv=512))
    assert sp.violation(dict(point, NUM_WARPS=8), env) is None


def test_compile_check_reads_spaces_through_the_loader(tmp_path, capsys):
    from kvtune.tuner.cli import main
    from kvtune.tuner.compile_check import template_configs
    cfgs = template_configs(read_space(SPACE_DIR / "sm_120/cuda.yaml"))
    # VEC 2 x BLOCK_N 2 x NUM_WARPS 2 x HEADS_PER_BLOCK 3 x STAGES 3 x CTAS_PER_SM 1; NSPLIT is no template value
    assert len(cfgs) == 72 and len({tuple(c.items()) for c in cfgs}) == 72
    assert all("NSPLIT" not in c and "CTAS_PER_SM" in c for c in cfgs)
    d, p = _write_space(tmp_path, "cuda", dict(CUDA, STAGES=[5]))
    assert main(["compile-check", "--arch", "sm_90", "--space", str(p)]) == 2
    err = capsys.readouterr().err
    assert str(p) in err and "params.STAGES.choices[0]" in err
    with pytest.raises(ValueError, match="cuda space"):
        template_configs(read_space(SPACE_DIR / "triton.yaml"))


@pytest.mark.parametrize("T,fits", [(48, True), (64, False)])
def test_compile_check_at_large_T_on_sm120(T, fits, capsys, tmp_path, monkeypatch):
    """sm_120's 99 KB: at T 48 the default (4 warps, one head) builds; at T 64 nothing does, and
    compile-check says so and what to do, not only that the default does not fit."""
    from kvtune.tuner.cli import main
    monkeypatch.setenv("KVTUNE_CACHE_DIR", str(tmp_path))
    rc = main(["compile-check", "--arch", "sm_120", "--T", str(T), "--jobs", "1"])
    err = capsys.readouterr().err
    if fits:
        assert rc == 0, err
    else:
        assert rc == 1 and f"no cuda config fits T={T} draft tokens on sm_120" in err and "backend='triton'" in err, err


DEVICE = {"name": "x", "device_name": "X", "arch": "sm_90", "sm_count": 132, "l2_bytes": 1 << 20,
          "ceilings": {"read_gbps": 4000, "bf16_tflops": 700}}


def test_device_limits_come_from_the_arch_table():
    h200 = load_device("h200")
    a = ARCH_LIMITS["sm_90"]
    assert (h200.smem_per_block_bytes, h200.smem_per_sm_bytes, h200.threads_per_sm) == (232448, 233472, 2048) == \
        (a.smem_per_block, a.smem_per_sm, a.threads_per_sm)
    assert "limits" not in h200.to_dict() and parse_device(h200.to_dict(), "<dict>") == h200
    agree = dict(DEVICE, limits={"smem_per_block_bytes": 232448, "smem_per_sm_bytes": 233472, "regs_per_sm": 65536,
                                 "threads_per_sm": 2048})
    assert parse_device(agree, "x.yaml").smem_per_block_bytes == 232448
    with pytest.raises(ConfigError, match=r"^x.yaml: limits.smem_per_block_bytes: .*ARCH_LIMITS"):
        parse_device(dict(agree, limits=dict(agree["limits"], smem_per_block_bytes=99 * 1024)), "x.yaml")
    with pytest.raises(ConfigError, match=r"^x.yaml: limits: required for arch 'sm_87'"):
        parse_device(dict(DEVICE, arch="sm_87"), "x.yaml")
    cpu = load_device("cpu")
    assert "limits" in cpu.to_dict() and parse_device(cpu.to_dict(), "<dict>") == cpu


# ---------------------------------------------------------------- the rules against the kernel itself
# (template values, T) at the edges of the declaration, and the static_assert of verify.cu's
# Config that must reject each one outside it (None: NVRTC must accept it)
BOUNDARY = [
    (dict(VEC=8, BLOCK_N=32, NUM_WARPS=32, HEADS_PER_BLOCK=16, STAGES=2, CTAS_PER_SM=1), 16, None),  # 256 rows
    (dict(VEC=8, BLOCK_N=32, NUM_WARPS=32, HEADS_PER_BLOCK=16, STAGES=2, CTAS_PER_SM=1), 17, "* T must be in [1, 256]"),
    (dict(VEC=8, BLOCK_N=16, NUM_WARPS=8, HEADS_PER_BLOCK=8, STAGES=2, CTAS_PER_SM=1), 12, None),   # 192 registers
    (dict(VEC=8, BLOCK_N=16, NUM_WARPS=8, HEADS_PER_BLOCK=8, STAGES=2, CTAS_PER_SM=1), 13, "192 registers"),
    (dict(VEC=2, BLOCK_N=128, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=4, CTAS_PER_SM=4), 64, None),
    (dict(VEC=2, BLOCK_N=128, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=4, CTAS_PER_SM=4), 65, "T in [1, 64]"),
    (dict(VEC=16, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=2, CTAS_PER_SM=1), 9, "VEC must be"),
    (dict(VEC=8, BLOCK_N=256, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=2, CTAS_PER_SM=1), 9, "BLOCK_N in"),
    (dict(VEC=8, BLOCK_N=32, NUM_WARPS=2, HEADS_PER_BLOCK=1, STAGES=2, CTAS_PER_SM=1), 9, "NUM_WARPS in"),
    (dict(VEC=8, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=5, CTAS_PER_SM=1), 9, "STAGES in [2, 4]"),
    (dict(VEC=8, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=1, CTAS_PER_SM=1), 9, "STAGES in [2, 4]"),
    (dict(VEC=8, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=1, STAGES=2, CTAS_PER_SM=5), 9, "CTAS_PER_SM in [1, 4]"),
]


def _declared_ok(cfg: dict, T: int) -> bool:
    values = dict(cfg, NSPLIT=1)
    try:
        CUDA_PARAMS.check(values)
        CUDA_PARAMS.check_problem(values, T=T, Dk=576, Dv=512)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("cfg, T, assert_text", BOUNDARY, ids=[f"T{t}-{c['HEADS_PER_BLOCK']}x{c['NUM_WARPS']}w-"
                                                                f"{c['VEC']}v{c['BLOCK_N']}n{c['STAGES']}s{c['CTAS_PER_SM']}c"
                                                                for c, t, _ in BOUNDARY])
def test_declared_rules_reject_what_the_kernels_static_asserts_reject(cfg, T, assert_text):
    pytest.importorskip("cuda.bindings.nvrtc")
    from kvtune.kernels.cuda.backend import KV_BITS, qk_tiling
    from test_cuda_smem_mirror import _compile  # NVRTC on verify.cu plus a few lines
    # the tiling the launcher would pick; for values outside the declaration, any the kernel's
    # own checks accept (qk_tiling reads only these attributes)
    qmt, qrg, qks = qk_tiling(SimpleNamespace(**cfg, threads=cfg["NUM_WARPS"] * 32), T)
    inst = (f"kvtune::Config<{cfg['VEC']},{cfg['BLOCK_N']},{cfg['NUM_WARPS']},{cfg['HEADS_PER_BLOCK']},"
            f"{cfg['STAGES']},{T},{qmt},{qrg},{qks},{KV_BITS},{cfg['CTAS_PER_SM']}>")
    ok, log = _compile([f'static_assert({inst}::SMEM_BYTES > 0, "instantiate");'])
    assert ok == (assert_text is None), log[-3000:]
    assert assert_text is None or assert_text in log, log[-3000:]
    assert _declared_ok(cfg, T) == ok
