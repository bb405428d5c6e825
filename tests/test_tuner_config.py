"""Deployment, device-profile and search-space files: the shipped ones load; bad ones give
errors that name the file and the key."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from kvtune.tuner.config import CONFIG_DIR, ConfigError, load_deployment, load_device
from kvtune.tuner.space import SPACE_DIR, load_space, problem_env

TRITON_FIELDS = ["NSPLIT", "BLOCK_N", "HEADS_PER_BLOCK", "NUM_WARPS", "STAGES"]
CUDA_FIELDS = ["NSPLIT", "VEC", "BLOCK_N", "NUM_WARPS", "HEADS_PER_BLOCK", "STAGES"]

GOOD = {
    "name": "t",
    "model": {"name": "m", "num_heads": 8, "draft_tokens": 4, "tree": "chain"},
    "device": "cpu",
    "tp": [4, 8],
    "contexts": [64, 300],
    "batches": [1],
    "backends": ["triton"],
    "trials": 3,
}


def _write(tmp_path: Path, doc, name="dep.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize("path", sorted((CONFIG_DIR / "deployments").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_deployments_load(path):
    dep = load_deployment(path)
    assert dep.name == path.stem
    for tp in dep.tp:
        assert dep.heads(tp) * tp == dep.model.num_heads


def test_shipped_search_spaces_match_the_parameter_dataclasses():
    from kvtune.kernels.triton_kernel import TritonParams
    fields = [f.name for f in dataclasses.fields(TritonParams)]
    assert fields == TRITON_FIELDS
    sp = load_space("triton", fields)
    assert sp.names == fields
    # cuda-bindings is a hard dependency: the CUDA backend imports on every machine
    from kvtune.kernels.cuda.backend import CudaParams
    cfields = [f.name for f in dataclasses.fields(CudaParams)]
    assert cfields[:len(CUDA_FIELDS)] == CUDA_FIELDS
    assert load_space("cuda", cfields).names == cfields


def test_shipped_devices_load():
    h200 = load_device("h200")
    assert h200.arch == "sm_90" and h200.sm_count == 132 and 4000 < h200.read_gbps < 4500
    h100 = load_device("h100")   # same chip, slower HBM: only the name and the ceilings differ
    assert h100.arch == "sm_90" and h100.device_name != h200.device_name and 2800 < h100.read_gbps < 3400
    rtx = load_device("rtx-pro-6000")
    assert rtx.arch == "sm_120" and rtx.sm_count == 188 and rtx.smem_per_block_bytes == 99 * 1024


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.update(bogus=1), "bogus"),
    (lambda d: d.update(name=".."), "name"),        # <out>/.. would put the run's files beside --out
    (lambda d: d.pop("tp"), "missing key(s) ['tp']"),
    (lambda d: d.update(tp=[3]), "tp[0]"),
    (lambda d: d.update(contexts=[300, 64]), "contexts"),
    (lambda d: d.update(trials=0), "trials"),
    (lambda d: d["model"].update(num_heads=-8), "model.num_heads"),
    (lambda d: d["model"].update(tree="bush"), "model.tree"),
    (lambda d: d["model"].update(rope=64), "model"),
    (lambda d: d.update(device="no-such-gpu"), "device"),
    (lambda d: d.update(backends=["reference"]), "backends"),
    (lambda d: d.update(timing="fast"), "timing"),
    (lambda d: d.update({1: "x", "foo": "y"}), "unknown key(s) ['foo', 1]"),      # keys of two types
    (lambda d: d["model"].update({2: "x"}), "model: unknown key(s) [2]"),
    (lambda d: d.update(workspace_budget_mb=float("inf")), "workspace_budget_mb: expected a finite positive"),
    (lambda d: d.update(ragged_spread=float("inf")), "ragged_spread: expected a finite positive"),
    (lambda d: d.update(ragged_spread=float("nan")), "ragged_spread"),
])
def test_bad_deployment_names_file_and_key(tmp_path, mutate, key):
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    mutate(doc)
    p = _write(tmp_path, doc)
    with pytest.raises(ConfigError) as e:
        load_deployment(p)
    assert str(p) in str(e.value) and key in str(e.value)


def test_a_deployment_key_given_twice_is_refused(tmp_path):
    """A hand edit that adds `trials:` again must not silently take the last one."""
    p = _write(tmp_path, GOOD)
    p.write_text(p.read_text() + f"trials: {GOOD['trials']}\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: key 'trials' given twice"):
        load_deployment(p)


def test_good_tmp_deployment_loads(tmp_path):
    dep = load_deployment(_write(tmp_path, GOOD))
    assert dep.tp == (4, 8) and dep.heads(8) == 1 and dep.device.arch == "cpu"


SPACE = {"backend": "triton",
         "params": {"NSPLIT": [1, 2], "BLOCK_N": {"choices": [32]},
                    "HEADS_PER_BLOCK": {"range": {"low": 1, "high": 4, "log": True}},
                    "NUM_WARPS": [4], "STAGES": [1]},
         "constraints": [{"name": "heads", "expr": "HEADS_PER_BLOCK <= H", "reason": "too many heads"}]}


def _space(tmp_path, doc):
    d = tmp_path / "spaces"
    d.mkdir(exist_ok=True)
    p = d / "triton.yaml"
    p.write_text(yaml.safe_dump(doc))
    return d, p


def test_space_choices_ranges_and_constraints(tmp_path):
    d, _ = _space(tmp_path, SPACE)
    sp = load_space("triton", TRITON_FIELDS, d)
    assert sp.choices["HEADS_PER_BLOCK"] == (1, 2, 4)
    env = problem_env(4, 2, 1, 64, 576, 512, load_device("cpu"))
    assert sp.violation({"NSPLIT": 1, "BLOCK_N": 32, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1}, env) is None
    why = sp.violation({"NSPLIT": 1, "BLOCK_N": 32, "HEADS_PER_BLOCK": 4, "NUM_WARPS": 4, "STAGES": 1}, env)
    assert "heads" in why and "too many heads" in why
    # the default of a study is always a legal point
    assert 16 in sp.distributions(extra={"NSPLIT": 16, "BLOCK_N": 32, "HEADS_PER_BLOCK": 1, "NUM_WARPS": 4,
                                         "STAGES": 1})["NSPLIT"]


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d["params"].update(BLOCK_Q=[1]), "params.BLOCK_Q"),
    (lambda d: d["params"].pop("STAGES"), "missing parameter(s) ['STAGES']"),
    (lambda d: d["params"].update(num_warps=d["params"].pop("NUM_WARPS")), "num_warps was renamed NUM_WARPS"),
    (lambda d: d["params"].update(NSPLIT={"choices": []}), "params.NSPLIT.choices"),
    (lambda d: d["params"].update(NSPLIT={"range": {"low": 4, "high": 1}}), "params.NSPLIT.range"),
    (lambda d: d["params"].update(NSPLIT={"choices": [1], "range": {"low": 1, "high": 2}}), "params.NSPLIT"),
    (lambda d: d["constraints"].append({"expr": "HEADS_PER_BLOCK <= heads"}), "constraints[1].expr"),
    (lambda d: d["constraints"].append({"expr": "__import__('os')"}), "constraints[1].expr"),
    (lambda d: d["constraints"].append({"expr": "HEADS_PER_BLOCK <="}), "constraints[1].expr"),
    (lambda d: d.update(backend="cuda"), "backend"),
    (lambda d: d.update(extra=1), "extra"),
])
def test_bad_search_space_names_file_and_key(tmp_path, mutate, key):
    doc = yaml.safe_load(yaml.safe_dump(SPACE))
    mutate(doc)
    d, p = _space(tmp_path, doc)
    with pytest.raises(ConfigError) as e:
        load_space("triton", TRITON_FIELDS, d)
    assert str(p) in str(e.value) and key in str(e.value)


def test_missing_search_space_file(tmp_path):
    with pytest.raises(ConfigError, match="no search space"):
        load_space("triton", TRITON_FIELDS, tmp_path)


def test_repo_space_dir_is_the_default():
    assert (SPACE_DIR / "triton.yaml").is_file()


def test_calibrate_cpu_writes_a_loadable_profile(tmp_path):
    from kvtune.tuner.cli import main
    path = tmp_path / "devices" / "here.yaml"
    assert main(["calibrate", "--device", "cpu", "--name", "here", "--path", str(path), "--reps", "1"]) == 0
    prof = load_device(path)
    assert prof.name == "here" and prof.arch == "cpu" and prof.read_gbps > 0 and prof.bf16_tflops > 0


def test_a_gpu_sweep_refuses_a_gpu_its_deployment_does_not_name(capsys):
    """H100 and H200 share sm_90 and every kernel: only device_name tells their timings apart,
    so sweeping kimi-k2-h200 on an H100 (or the reverse) is refused unless asked for."""
    from kvtune.tuner.sweep import check_device_name
    h200 = load_deployment(CONFIG_DIR / "deployments" / "kimi-k2-h200.yaml")
    h100 = load_deployment(CONFIG_DIR / "deployments" / "kimi-k2-h100.yaml")
    on_h100 = {"device_name": "NVIDIA H100 80GB HBM3", "arch": "sm_90"}
    check_device_name(h100, on_h100)                       # its own GPU: nothing to say
    with pytest.raises(ConfigError) as e:
        check_device_name(h200, on_h100)
    msg = str(e.value)
    assert "kimi-k2-h200.yaml" in msg and "NVIDIA H200" in msg and "NVIDIA H100 80GB HBM3" in msg
    assert "--other-device" in msg
    capsys.readouterr()
    check_device_name(h200, on_h100, other_device=True)    # asked for: a warning, no error
    err = capsys.readouterr().err   # the tuner's log reaches stderr, not the root logger caplog reads
    assert "warning:" in err and "NVIDIA H100 80GB HBM3" in err and "(--other-device)" in err, err
    with pytest.raises(ConfigError, match="NVIDIA H200"):
        check_device_name(h100, {"device_name": "NVIDIA H200", "arch": "sm_90"})
    with pytest.raises(ConfigError, match="sm_80"):   # a profile whose arch is wrong for its own GPU
        check_device_name(h100, {"device_name": "NVIDIA H100 80GB HBM3", "arch": "sm_80"})


def test_the_other_device_flag_reaches_the_options_and_the_workers():
    from kvtune.tuner.cli import build_parser
    from kvtune.tuner.options import options_from_args
    from kvtune.tuner.sweep_cli import _worker_args
    dep_path = CONFIG_DIR / "deployments" / "kimi-k2-h100.yaml"
    parser = build_parser()
    on = parser.parse_args(["sweep", str(dep_path), "--other-device"])
    off = parser.parse_args(["sweep", str(dep_path)])
    assert options_from_args(on).other_device and not options_from_args(off).other_device
    dep = load_deployment(dep_path)
    assert "--other-device" in _worker_args(on, dep, "sqlite:///x.db", "cuda")
    assert "--other-device" not in _worker_args(off, dep, "sqlite:///x.db", "cuda")
    worker = parser.parse_args(_worker_args(on, dep, "sqlite:///x.db", "cuda")[3:])
    assert options_from_args(worker).other_device


def _profile(name, device_name, arch, smem_kb):
    from kvtune.tuner.config import DeviceProfile
    return DeviceProfile(name=name, device_name=device_name, arch=arch, sm_count=170, l2_bytes=96 << 20,
                         smem_per_block_bytes=smem_kb * 1024, smem_per_sm_bytes=(smem_kb + 1) * 1024,
                         regs_per_sm=65536, threads_per_sm=1536, read_gbps=1700.0, bf16_tflops=400.0,
                         ceilings_source="test")


def test_the_deployment_for_a_gpu_is_the_shipped_one_that_names_it(tmp_path):
    from kvtune.tuner.calibrate import deployment_for_gpu

    def never():
        raise AssertionError("a shipped deployment names this GPU: nothing to measure")
    for dev, dep in [("NVIDIA H100 80GB HBM3", "kimi-k2-h100"), ("NVIDIA H200", "kimi-k2-h200"),
                     ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "kimi-k2-rtx-pro-6000")]:
        path = deployment_for_gpu(dev, "kimi-k2", tmp_path, never)
        assert path == CONFIG_DIR / "deployments" / f"{dep}.yaml"
        assert load_deployment(path).device.device_name == dev
    assert not (tmp_path / "deployments").exists()
    with pytest.raises(ValueError, match="family"):
        deployment_for_gpu("NVIDIA H200", "no-such-model", tmp_path, never)


def test_another_gpu_gets_a_deployment_written_from_its_measured_profile(tmp_path):
    """An RTX 5090 (sm_120, 99 KB per block) takes the RTX PRO 6000 deployment's buckets and its
    sm_120 search space, with its own device profile; the files load as a sweep loads them."""
    from kvtune.tuner.calibrate import deployment_for_gpu
    prof = _profile("geforce-rtx-5090", "NVIDIA GeForce RTX 5090", "sm_120", 99)
    path = deployment_for_gpu(prof.device_name, "kimi-k2", tmp_path, lambda: prof)
    assert path == tmp_path / "deployments" / "kimi-k2-geforce-rtx-5090.yaml"
    dep = load_deployment(path)
    base = load_deployment("kimi-k2-rtx-pro-6000")
    assert dep.name == "kimi-k2-geforce-rtx-5090" and dep.device.device_name == "NVIDIA GeForce RTX 5090"
    assert dep.device.read_gbps == 1700.0 and dep.device.source == str(tmp_path / "devices" / "geforce-rtx-5090.yaml")
    # the buckets; the space is the sm_120 one with NSPLIT's choices, eighths to doubles of the
    # PRO 6000's 188 SMs, made the same of the 5090's 170
    assert dataclasses.replace(dep, name=base.name, device=base.device, space_dir=base.space_dir) == base
    assert dep.space_dir == str(tmp_path / "deployments" / ".." / "search_spaces" / "geforce-rtx-5090")
    assert _choices(dep.space_dir, "cuda") == [170 // 8, 170 // 4, 170 // 2, 170, 170 * 3 // 2, 170 * 2]
    assert _choices(base.space_dir, "cuda") == [23, 47, 94, 188, 282, 376]
    assert _choices(dep.space_dir, "triton") == _choices(base.space_dir, "triton")   # splits per request
    for name in ("cuda", "triton"):
        load_space(name, space_dir=dep.space_dir)      # loads as a sweep loads it
    again = deployment_for_gpu(prof.device_name, "kimi-k2", tmp_path, lambda: pytest.fail("measured twice"))
    assert again == path, "the deployment written for this GPU is reused (its floors are the trials')"
    # a 227-KB sm_90 part no file names (an H800, say) takes an sm_90 deployment's buckets and space
    h800 = dataclasses.replace(_profile("h800", "NVIDIA H800", "sm_90", 227), sm_count=132)
    assert load_deployment(deployment_for_gpu("NVIDIA H800", "kimi-k2", tmp_path, lambda: h800)).space_dir is None
    # an H100 PCIe (114 SMs): the sm_90 spaces, NSPLIT as the same fractions of 114 SMs
    pcie = dataclasses.replace(_profile("h100-pcie", "NVIDIA H100 PCIe", "sm_90", 227), sm_count=114)
    dep = load_deployment(deployment_for_gpu(pcie.device_name, "kimi-k2", tmp_path, lambda: pcie))
    assert _choices(dep.space_dir, "cuda") == [114 // 8, 114 // 4, 114 // 2, 114, 114 * 3 // 2, 114 * 2]
    assert _choices(dep.space_dir, "wgmma")[-2:] == [114, 228] and 114 // 3 in _choices(dep.space_dir, "wgmma")
    with pytest.raises(ValueError, match="NVIDIA H800"):
        deployment_for_gpu("NVIDIA A100-SXM4-80GB", "kimi-k2", tmp_path, lambda: h800)
    # 163 KB: as far from 99 as from 227; the base whose configs fit (sm_120's space, 99 KB) wins
    a100 = dataclasses.replace(_profile("a100-sxm4-80gb", "NVIDIA A100-SXM4-80GB", "sm_80", 163), sm_count=108)
    dep = load_deployment(deployment_for_gpu(a100.device_name, "kimi-k2", tmp_path, lambda: a100))
    assert _choices(dep.space_dir, "cuda") == [108 // 8, 108 // 4, 108 // 2, 108, 108 * 3 // 2, 108 * 2]
    assert _choices(dep.space_dir, "triton") == _choices(base.space_dir, "triton")   # sm_120's


def _choices(space_dir, backend):
    return yaml.safe_load((Path(space_dir) / f"{backend}.yaml").read_text())["params"]["NSPLIT"]["choices"]


def test_a_written_deployment_never_takes_a_shipped_name(tmp_path):
    """A GPU named plainly "NVIDIA H100" slugs to the shipped profile's name h100: its timings go
    under kimi-k2-h100-local, never under the shipped kimi-k2-h100."""
    from kvtune.tuner.calibrate import deployment_for_gpu
    prof = _profile("h100", "NVIDIA H100", "sm_90", 227)
    dep = load_deployment(deployment_for_gpu("NVIDIA H100", "kimi-k2", tmp_path, lambda: prof))
    assert dep.name == "kimi-k2-h100-local" and dep.device.name == "h100-local"
    assert dep.device.source == str(tmp_path / "devices" / "h100-local.yaml")
