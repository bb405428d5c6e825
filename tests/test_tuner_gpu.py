"""The tuner on a real GPU (skipped without one): a small sweep with CUDA-graph timing over
both backends, exported, loaded, and checked against the choice worked out from its trials."""
from __future__ import annotations

import pandas as pd
import pytest
import yaml
from export_oracle import check_export  # the export's choice worked out from the trials table by brute force

from kvtune.kernels.tuned import load_tuned
from kvtune.tuner.export import export_deployment
from kvtune.tuner.sweep import SweepOptions, run_sweep
from kvtune.tuner.table import read_trials

pytestmark = pytest.mark.gpu


def test_gpu_sweep_graph_timing(tmp_path):
    import torch
    props = torch.cuda.get_device_properties(0)
    dev = {"name": "local", "device_name": props.name, "arch": f"sm_{props.major}{props.minor}",
           "sm_count": props.multi_processor_count, "l2_bytes": int(getattr(props, "L2_cache_size", 0) or 1 << 20),
           "limits": {"smem_per_block_bytes": int(getattr(props, "shared_memory_per_block_optin", 0) or 49152),
                      "smem_per_sm_bytes": int(getattr(props, "shared_memory_per_multiprocessor", 0) or 49152),
                      "regs_per_sm": int(getattr(props, "regs_per_multiprocessor", 0) or 65536),
                      "threads_per_sm": int(getattr(props, "max_threads_per_multi_processor", 0) or 2048)},
           "ceilings": {"read_gbps": 4250, "bf16_tflops": 790}}
    (tmp_path / "devices").mkdir()
    (tmp_path / "deployments").mkdir()
    (tmp_path / "devices" / "local.yaml").write_text(yaml.safe_dump(dev))
    dep = tmp_path / "deployments" / "gpu-small.yaml"
    dep.write_text(yaml.safe_dump({
        "name": "gpu-small", "model": {"name": "Kimi-K2", "num_heads": 64, "draft_tokens": 9, "tree": "random"},
        "device": "local", "tp": [8], "contexts": [4096, 32768], "batches": [1], "backends": ["triton", "cuda"],
        "trials": 4, "timing": "graph"}))
    sw = run_sweep(dep, SweepOptions(device="cuda", out=str(tmp_path / "results"), rounds=2, remeasure_top=2,
                                     progress=False))
    assert sw.status == "complete"
    df = read_trials(tmp_path / "results" / "gpu-small" / "trials.csv")
    ok = df[df["outcome"] == "ok"]
    assert set(ok["backend"]) >= {"triton"} and (ok["timing"] == "graph").all()
    assert (ok["p10_us"] <= ok["median_us"]).all() and (ok["median_us"] <= ok["p90_us"]).all()
    assert (ok["pools"] >= 2).all(), "cold L2: several KV pools rotate"
    tuned = export_deployment(sw.dep, out=str(tmp_path / "results"), quiet=True)
    again = load_tuned(tmp_path / "results" / "gpu-small" / "gpu-small.yaml")
    assert again.entries == tuned.entries
    check_export(yaml.safe_load((tmp_path / "results" / "gpu-small" / "gpu-small.yaml").read_text()),
                 pd.read_csv(tmp_path / "results" / "gpu-small" / "trials.csv"))
