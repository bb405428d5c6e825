"""The runtime's overrides and fallbacks: KVTUNE_VERIFY, an entry's backend that cannot run here,
and a file tuned on a GPU of another SM count (split from test_runtime.py, whose helpers these use)."""
from __future__ import annotations

import logging

import pytest

from kvtune.kernels import lookup
from kvtune.kernels import runtime as rt
from kvtune.kernels.runtime import VerifyAttention
from kvtune.kernels.triton_kernel import TritonParams
from kvtune.kernels.tuned import parse_tuned
from test_runtime import TP, _clean_env, check_against_oracle, tuned_dict  # noqa: F401 (_clean_env: autouse)


@pytest.mark.parametrize("tuned_sms,warned", [(188, True), (170, False)])
def test_a_file_tuned_on_another_sm_count_is_warned_about(device, caplog, monkeypatch, tuned_sms, warned):
    """Same arch and kernels, another SM count (a file of an RTX PRO 6000's 188 SMs on an RTX
    5090's 170): the file loads, and one warning names both counts (its NSPLIT may run a second
    wave here); the same count says nothing."""
    monkeypatch.setattr(lookup, "device_sm_count", lambda dev: 170)
    d = tuned_dict(device)
    d["provenance"]["sm_count"] = tuned_sms
    with caplog.at_level(logging.WARNING, logger="kvtune.runtime"):
        for _ in range(2):
            VerifyAttention.from_defaults(parse_tuned(d, "mem"), tp=TP, max_batch=1, max_context=128,
                                          device=device, warmup=False)
    hits = [r.getMessage() for r in caplog.records if "SMs" in r.getMessage()]
    if warned:
        assert len(hits) == 1 and "a GPU of 188 SMs" in hits[0] and "this one has 170" in hits[0], hits
        assert "second wave" in hits[0] and "kvtune calibrate --deployment-for" in hits[0]
    else:
        assert hits == []


# -- environment overrides -------------------------------------------------------------

def test_env_off_disables(device, monkeypatch):
    monkeypatch.setenv(rt.ENV_VERIFY, "off")
    assert VerifyAttention.from_defaults(parse_tuned(tuned_dict(device), "mem"), tp=TP, device=device) is None


def test_env_invalid_value(device, monkeypatch):
    monkeypatch.setenv(rt.ENV_VERIFY, "fast")
    with pytest.raises(ValueError, match="KVTUNE_VERIFY='fast'"):
        VerifyAttention.from_defaults(parse_tuned(tuned_dict(device), "mem"), tp=TP, device=device)


def test_env_forcing_an_unrunnable_backend_is_named(device, monkeypatch):
    if device != "cpu":
        pytest.skip("needs a device the cuda backend cannot run on")
    monkeypatch.setenv(rt.ENV_VERIFY, "cuda")
    with pytest.raises(ValueError, match="KVTUNE_VERIFY=cuda: backend 'cuda' cannot"):
        VerifyAttention.from_defaults(parse_tuned(tuned_dict(device), "mem"), tp=TP, device=device)


def test_env_forces_backend(device, monkeypatch, caplog):
    tuned = parse_tuned(tuned_dict(device), "mem")
    monkeypatch.setenv(rt.ENV_VERIFY, "reference")
    with caplog.at_level(logging.WARNING, logger="kvtune.runtime"):
        va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=4, max_context=300, device=device)
    assert {p.backend.name for p in va.plans} == {"reference"}
    assert "KVTUNE_VERIFY=reference overrides" in caplog.text
    check_against_oracle(va, [1, 54, 97], "random", 5, device)
    for mode in ("triton", "auto", "  AUTO "):
        monkeypatch.setenv(rt.ENV_VERIFY, mode)
        va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=4, max_context=300, device=device, warmup=False)
        assert [p.params for p in va.plans] == [TritonParams(4, 16, 2, 4, 1), TritonParams(2, 32, 1, 4, 2)]
        assert all(p.split_table is not None for p in va.plans)


def test_unrunnable_entry_backend_falls_back_only_when_allowed(device, caplog):
    if device != "cpu":
        pytest.skip("needs a device the cuda backend cannot run on")
    d = tuned_dict(device)
    d["entries"][0].update(backend="cuda", params={"NSPLIT": 8})
    d["provenance"]["kernel_hash"]["cuda"] = "0123456789abcdef"
    tuned = parse_tuned(d, "mem", check_params=False)
    with pytest.raises(ValueError, match="cuda"):
        VerifyAttention.from_defaults(tuned, tp=TP, max_batch=1, max_context=128, device=device, warmup=False)
    # this checkout's cuda source: the entry's backend is what cannot run; the hint is given
    # because the fallback runs here (Triton under its interpreter, as the tests run it)
    d["provenance"]["kernel_hash"]["cuda"] = lookup.backend_kernel_hash("cuda")
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot .*\(allow_mismatch=True falls back to triton's "):
        VerifyAttention.from_defaults(parse_tuned(d, "mem", check_params=False), tp=TP, max_batch=1,
                                      max_context=128, device=device, warmup=False)
    with caplog.at_level(logging.WARNING, logger="kvtune.runtime"):
        va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=1, max_context=128, device=device,
                                           allow_mismatch=True)
    assert va.plans[0].backend.name == "triton" and va.plans[0].split_table is None
    assert "falling back to triton" in caplog.text
    check_against_oracle(va, [54], "random", 9, device)


@pytest.mark.parametrize("arch,smem,T,Dk,want", [
    ("sm_120", 101376, 9, 576, "cuda"),       # the CUDA default fits a 99-KB part at T 9
    ("sm_120", 101376, 48, 576, "cuda"),      # 4 warps, one head: 101 KB
    ("sm_120", 101376, 56, 576, "triton"),    # no CUDA config fits above T 48
    ("sm_121", 101376, 56, 576, "triton"),    # an arch without a table entry: the device's own limit
    ("sm_89", 101376, 44, 576, "triton"),     # the 4-warp config that would fit spills there
    ("sm_90", 232448, 9, 576, "cuda"),
    ("sm_90", 232448, 9, 320, "triton"),      # kv_lora_rank 256: the CUDA kernel is built for Dk 576
])
def test_the_untuned_fallback_on_a_gpu(monkeypatch, arch, smem, T, Dk, want):
    """Which backend serves a GPU without tuned defaults, decided on a faked GPU of `arch` with
    `smem` bytes per block: cuda where its default config runs the problem there, else triton."""
    import torch

    from kvtune.kernels import plans
    from kvtune.kernels.cuda import backend as cuda_backend
    from kvtune.kernels.shapes import VerifyProblem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_backend, "device_arch", lambda device: arch)
    monkeypatch.setattr(cuda_backend, "sm_count", lambda problem: 188)
    monkeypatch.setattr(cuda_backend.CudaBackend, "supports", lambda self, device: None)
    monkeypatch.setattr(cuda_backend, "device_smem_per_block", lambda device: smem)
    problem = VerifyProblem(B=1, T=T, H=8, Dk=Dk, Dv=Dk - 64, device=torch.device("cuda"))
    assert plans.default_backend(problem) == want


def test_device_readers_on_a_faked_gpu_and_the_cpu(monkeypatch):
    """kernels/devices.py: a CUDA ordinal, 'cuda:N' and a torch.device read the same GPU's
    properties; the SM count is read once per device; a CPU device has no SMs or shared memory."""
    import types

    import torch

    from kvtune.kernels import devices
    reads = []

    def props(idx):
        reads.append(idx)
        return types.SimpleNamespace(multi_processor_count=170 + idx, shared_memory_per_block_optin=101376)
    monkeypatch.setattr(devices, "_SM_COUNTS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda idx: (12, 0))
    assert [devices.device_sm_count(d) for d in (1, "cuda:1", torch.device("cuda", 1))] == [171] * 3
    assert reads == [1]
    assert devices.device_sm_count(2) == 172
    assert devices.device_smem_per_block("cuda:1") == 101376
    assert devices.device_arch(1) == "sm_120"
    assert devices.device_arch("cpu") == "cpu" and devices.device_name("cpu").startswith("cpu (")
    assert devices.device_sm_count("cpu") is None and devices.device_smem_per_block(torch.device("cpu")) is None


@pytest.mark.parametrize("name", ["cuda", "wgmma", "wgmma_km"])
def test_split_merge_backends_check_the_devices_shared_memory(monkeypatch, name):
    """The split-merge backends check a config's shared memory against the device's own opt-in
    limit in one place (`device_reject`), before the first compile of a launch: on a faked sm_90
    of 99 KB per block every default (each over 99 KB and within sm_90's table limit) is refused
    with both numbers, the kernel and the arch named; on sm_90's own limit it launches."""
    import torch

    from kvtune.kernels.backends import get_backend
    from kvtune.kernels.cuda import backend as cuda_backend
    from kvtune.kernels.cuda.params import ARCH_LIMITS
    from kvtune.kernels.shapes import VerifyProblem
    limit = {"now": 101376}
    monkeypatch.setattr(cuda_backend, "device_smem_per_block", lambda device: limit["now"])
    monkeypatch.setattr(cuda_backend, "device_arch", lambda device: "sm_90")
    be = get_backend(name)
    params = be.default_params(VerifyProblem(B=1, T=9, H=8, Dk=576, Dv=512, device=torch.device("cpu")))
    need = be.split_smem_bytes(params, 9)
    assert 101376 < need <= ARCH_LIMITS["sm_90"].smem_per_block
    why = be.device_reject(params, 9, 0)
    assert why is not None and f"{need} bytes" in why and "101376 (sm_90)" in why and f"{name} kernel" in why
    with pytest.raises(ValueError) as e:   # refused before compiling or touching a GPU
        if name == "cuda":
            be._get(params, 9, torch.device("cuda", 0))
        elif name == "wgmma":
            be._get(9, params.ROWS, torch.device("cuda", 0), params.COPY_LANES)
        else:
            be._get(9, torch.device("cuda", 0), params.DV_SPLIT, params.SPLIT_ALIGN)
    assert str(e.value) == why
    limit["now"] = ARCH_LIMITS["sm_90"].smem_per_block
    assert be.device_reject(params, 9, 0) is None
