"""The launcher's Python mirror of the kernel's `Config` (backend.KernelGeometry, qk_tiling)
checked against the C++ itself, without a GPU and without touching verify.cu: a separate
NVRTC program is verify.cu's text followed by one `static_assert` per config, so the compiler
evaluates `Config<...>::SMEM_BYTES` (and every static_assert inside Config, for the tiling
qk_tiling chose) and compares it with `KernelGeometry.of(p, T).smem_bytes`. The launcher
reserves exactly that much dynamic shared memory and the kernel traps when it gets less."""
import itertools

import cuda.bindings.nvrtc  # noqa: F401  (a hard dependency, as in test_cuda_compile)
from kvtune.kernels.cuda import nvrtc
from kvtune.kernels.cuda.backend import KV_BITS, CudaParams, KernelGeometry, check_static

# odd and even shapes: T = 1, 2, 9, 16; heads per CTA 1..64 (3 and 7: ragged row tiles);
# every tile size, warp count and pipeline depth the kernel accepts
TS = (1, 2, 9, 16)
HPBS = (1, 2, 3, 4, 7, 8, 16, 64)


def _configs():
    for T, hpb, bn, w, st in itertools.product(TS, HPBS, (16, 32, 64, 128), (4, 8, 16, 32), (2, 4)):
        try:
            p = CudaParams(VEC=8, BLOCK_N=bn, NUM_WARPS=w, HEADS_PER_BLOCK=hpb, STAGES=st)
            check_static(p, T)        # the T-dependent static_asserts, as ValueErrors
        except ValueError:
            continue
        yield p, T


def _assertions(configs, skew=0):
    out = []
    for p, T in configs:
        g = KernelGeometry.of(p, T)
        qmt, qrg, qks = g.qk
        cfg = (f"kvtune::Config<{p.VEC},{p.BLOCK_N},{p.NUM_WARPS},{p.HEADS_PER_BLOCK},{p.STAGES},{T},{qmt},{qrg},{qks},"
               f"{KV_BITS},{p.CTAS_PER_SM}>")
        out.append(f'static_assert({cfg}::SMEM_BYTES == {g.smem_bytes + skew}, "{cfg}: smem mirror");')
    return out


def _compile(extra: list[str], arch="sm_90") -> tuple[bool, str]:
    nv = nvrtc._nvrtc()
    src = (nvrtc.kernel_source() + "\n// -- test: the Python mirror\n" + "\n".join(extra) + "\n").encode()
    prog = nvrtc._check_nvrtc(nv.nvrtcCreateProgram(src, b"smem_mirror.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device"] + \
            [f"-I{d}" for d in nvrtc.include_dirs()]
        res = nv.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = nvrtc._check_nvrtc(nv.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        nv.nvrtcGetProgramLog(prog, buf)
        return res[0] == nv.nvrtcResult.NVRTC_SUCCESS, buf.decode(errors="replace")
    finally:
        nv.nvrtcDestroyProgram(prog)


def test_smem_mirror_and_tiling_match_the_kernels_config():
    configs = list(_configs())
    assert len(configs) > 500
    ok, log = _compile(_assertions(configs))
    assert ok, log[-4000:]


def test_smem_mirror_check_can_fail():
    # one byte off for a single config: the same program must not compile
    p = CudaParams(VEC=8, BLOCK_N=32, NUM_WARPS=8, HEADS_PER_BLOCK=8, STAGES=2)
    ok, log = _compile(_assertions([(p, 9)], skew=16))
    assert not ok and "smem mirror" in log
    # and a tiling that breaks Config's static_asserts is caught too (QKS = 5 does not divide 36)
    ok, log = _compile(["static_assert(kvtune::Config<8,32,8,8,2,9,2,2,5,16,1>::SMEM_BYTES > 0, \"\");"])
    assert not ok and "QKS must divide" in log

