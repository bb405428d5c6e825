"""A sweep whose every config of a study is pruned (statically impossible: a Dv the Triton kernel
cannot take, a workspace budget nothing fits) says so with the prune reason, exits non-zero and
is not recorded as complete; export then names the pruned buckets and the reason instead of "no
config was correct". Prune reasons give sizes under 1 MiB in bytes."""
from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import yaml

from kvtune.tuner.cli import main
from kvtune.tuner.export import export_deployment
from kvtune.tuner.export_gaps import nothing_exported
from kvtune.tuner.prunes import pruned_summary
from kvtune.tuner.table import read_trials

BUDGET_MB = 0.001


def _dep(tmp_path, model=None, **over):
    doc = {"name": "pruned", "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random",
                                       **(model or {})},
           "device": "cpu", "tp": [8], "contexts": [64, 300], "batches": [1], "backends": ["triton"], "trials": 2,
           "timing": "eager"}
    doc.update(over)
    p = tmp_path / "pruned.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize("model, over, reason", [
    ({"kv_lora_rank": 500}, {}, "triton backend needs power-of-two Dv"),
    (None, {"workspace_budget_mb": BUDGET_MB}, f"exceeds the budget of {int(BUDGET_MB * 2**20)} bytes"),
], ids=["dv-500", "workspace-budget"])
def test_a_sweep_whose_every_config_is_pruned_says_why_and_fails(tmp_path, capsys, model, over, reason):
    dep = _dep(tmp_path, model, **over)
    out = tmp_path / "out"
    rc = main(["sweep", str(dep), "--device", "cpu", "--out", str(out), "--no-progress", "--in-process"])
    captured = capsys.readouterr()
    assert rc == 1
    run = json.loads((out / "pruned" / "runs.jsonl").read_text().splitlines()[-1])
    assert run["status"] == "every config pruned at 2 of 2 (tp, batch, context) buckets"
    assert "search space exhausted" not in captured.out + captured.err

    df = read_trials(out / "pruned" / "trials.csv")
    search = df[df["phase"] == "search"]
    assert (search["outcome"] == "pruned").all()
    for ctx, g in search.groupby("ctx"):
        # the reason every config outside the space's constraints was pruned with, counted from the table
        own = [r for r in g["reason"] if not r.startswith("constraint ")]
        assert len(own) == sum(reason in r for r in own) > 0, own
        n_constraint = len(g) - len(own)
        row = next(line for line in captured.out.splitlines() if re.match(rf"\s*triton\s+8\s+1\s+{ctx}\s", line))
        assert "every config was pruned: " in row and reason in row and f"({len(own)} configs)" in row, row
        if n_constraint:
            assert f"{n_constraint} more broke a search-space constraint" in row, row
        assert f"triton tp=8 bs=1 ctx={ctx}: every config was pruned" in captured.err

    with pytest.raises(ValueError) as e:
        export_deployment(str(dep), out=str(out))
    msg = str(e.value)
    assert "every config was pruned at tp=8 bs=1 ctx=64, tp=8 bs=1 ctx=300: " in msg and reason in msg, msg
    assert "no config was correct" not in msg
    assert f"({int((search['reason'].map(lambda r: not r.startswith('constraint '))).sum())} configs)" in msg


def test_prune_summary_counts_reasons_that_differ_only_in_numbers_together():
    reasons = ["workspace 3072 bytes at batch 1 exceeds the budget of 1048 bytes",
               "constraint heads (HEADS_PER_BLOCK <= H) broken",
               "compile: out of resources",
               "workspace 0.5 MiB at batch 4 exceeds the budget of 0.2 MiB",
               "constraint heads (HEADS_PER_BLOCK <= H) broken",
               "workspace 6144 bytes at batch 1 exceeds the budget of 1048 bytes",
               float("nan")]
    assert pruned_summary(reasons) == ("workspace 3072 bytes at batch 1 exceeds the budget of 1048 bytes (3 configs); "
                                       "compile: out of resources (1 config); "
                                       "2 more broke a search-space constraint")
    assert pruned_summary(reasons[1:2] * 2) == "constraint heads (HEADS_PER_BLOCK <= H) broken (2 configs)"
    assert pruned_summary(["a", "b 1", "c", "b 2"], top=1) == "b 1 (2 configs); 2 other reason(s)"


def test_export_names_only_the_buckets_whose_every_config_was_pruned():
    rows = [  # tp 8: ctx 64 all pruned, ctx 300 measured; tp 4: measured everywhere (but, say, wrong)
        (8, 64, "pruned", "static no"), (8, 64, "pruned", "static no"), (8, 64, "pruned", "constraint x broken"),
        (8, 300, "ok", None), (8, 300, "pruned", "static no"),
        (4, 64, "wrong", "max error"), (4, 300, "pruned", "static no"), (4, 300, "failed", "crash"),
    ]
    df = pd.DataFrame([{"phase": "search", "backend": "triton", "tp": t, "bs": 1, "ctx": c, "outcome": o,
                        "reason": r} for t, c, o, r in rows])
    assert nothing_exported(df, ["triton"]) == ("every config was pruned at tp=8 bs=1 ctx=64: static no (2 configs); "
                                                "1 more broke a search-space constraint; tp=4 bs=1: no config was "
                                                "correct at every context bucket")
    assert nothing_exported(df[df["tp"] == 4], ["triton"]) == "no config was correct at every bucket"
    assert nothing_exported(df, ["cuda"]) == "no config was correct at every bucket"


def test_workspace_prune_reason_keeps_sizes_under_a_mib_in_bytes():
    from kvtune.tuner.measure import Measurer, MeasureOptions, ProblemSpec
    m = Measurer("cpu")
    base = {"NSPLIT": 4, "BLOCK_N": 32, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1}

    def reason(heads, params, budget):
        r = m.measure("triton", params, ProblemSpec(heads=heads, batch=1, context=64, draft_tokens=8),
                      MeasureOptions(timing="eager", workspace_budget_bytes=budget), None)
        assert r.outcome == "pruned", r
        return r.reason

    # fp32 partial outputs and LSE per split: NSPLIT * T * H * (Dv + 1) * 4 bytes
    small = 4 * 8 * 2 * 513 * 4
    assert reason(2, base, small - 1) == (f"workspace {small} bytes at batch 1 exceeds the budget of "
                                          f"{small - 1} bytes")
    big = 64 * 8 * 16 * 513 * 4   # 16.03 MiB
    assert reason(16, dict(base, NSPLIT=64), 8 << 20) == "workspace 16.0 MiB at batch 1 exceeds the budget of 8.0 MiB"
    # one decimal of a MiB would print both as 16.0 MiB
    assert reason(16, dict(base, NSPLIT=64), 16 << 20) == (f"workspace {big} bytes at batch 1 exceeds the budget of "
                                                           f"{16 << 20} bytes")


def test_a_sweep_with_some_studies_pruned_exports_the_rest(tmp_path, capsys):
    """A budget (40000 bytes) that Triton's batch-1 configs at NSPLIT <= 4 fit (8208-32832 bytes
    of workspace) and no batch-8 config does (65664 bytes at NSPLIT 1): the batch-8 studies are
    named with the reason, the sweep still exits 0 and `--export` writes the batch-1 entry."""
    dep = _dep(tmp_path, batches=[1, 8], workspace_budget_mb=40000 / 2**20)
    out = tmp_path / "out"
    rc = main(["sweep", str(dep), "--device", "cpu", "--out", str(out), "--no-progress", "--in-process", "--export"])
    err = capsys.readouterr().err
    assert rc == 0
    run = json.loads((out / "pruned" / "runs.jsonl").read_text().splitlines()[-1])
    assert run["status"] == "every config pruned at 2 of 4 (tp, batch, context) buckets"
    for ctx in (64, 300):
        assert f"triton tp=8 bs=8 ctx={ctx}: every config was pruned: workspace" in err
        assert f"bs=1 ctx={ctx}: every config" not in err
    exported = yaml.safe_load((out / "pruned" / "pruned.yaml").read_text())
    assert [(e["tp"], e["max_batch"]) for e in exported["entries"]] == [(8, 1)]


def test_a_bucket_is_dead_only_when_no_backend_measured_there():
    """One backend pruned out where another measured is the export's choice, not a gap: only the
    buckets where every backend's study was pruned out count (and relabel the sweep's status)."""
    from kvtune.tuner.study import StudyResult, dead_buckets

    def res(backend, ctx, **counts):
        return StudyResult(backend, 8, 1, ctx, f"{backend}-{ctx}", {"ok": 0, "pruned": 0, **counts})
    results = [res("triton", 64, pruned=5), res("cuda", 64, ok=3, pruned=1),      # served by cuda
               res("triton", 300, pruned=5), res("cuda", 300, pruned=2),          # nothing measured
               res("triton", 900, wrong=1, pruned=4)]                              # measured (wrong)
    assert [r.all_pruned for r in results] == [True, False, True, True, False]
    assert dead_buckets(results) == [(8, 1, 300)]


def test_study_plans_hold_only_configs_the_arch_can_run():
    """A study samples and sweeps as a grid only what the deployment's arch can run, judged by
    the kernel's own resource model (`Backend.fit_reject`), not by the search space restating
    it: on the RTX PRO 6000 deployment (sm_120, 99 KB per block) the cuda space's configs that
    pass its constraints are cut to those whose shared memory and threads fit, computed here
    from the kernel's geometry; a search proposal that cannot fit is pruned with the kernel's
    reason before any compile, the baseline never is."""
    from types import SimpleNamespace

    from kvtune.kernels.cuda.backend import CudaParams, KernelGeometry
    from kvtune.kernels.cuda.params import ARCH_LIMITS
    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.runner import Runner
    from kvtune.tuner.space import load_space
    from kvtune.tuner.study import StudyLoop

    dep = load_deployment("kimi-k2-rtx-pro-6000")
    space = load_space("cuda", space_dir=dep.space_dir)
    assert space.source.endswith("sm_120/cuda.yaml")
    default = {"NSPLIT": 94, "VEC": 8, "BLOCK_N": 16, "NUM_WARPS": 8, "HEADS_PER_BLOCK": 4, "STAGES": 2,
               "CTAS_PER_SM": 1}
    runner = SimpleNamespace(spec=lambda tp, bs, ctx: Runner.spec(SimpleNamespace(dep=dep), tp, bs, ctx),
                             default_params=lambda backend, spec: default)
    loop = SimpleNamespace(spaces={"cuda": space}, dep=dep, trials=24, o=SimpleNamespace(grid=False), runner=runner)
    lim = ARCH_LIMITS["sm_120"]

    def fits(g):
        p = CudaParams(**g)
        smem = KernelGeometry.of(p, 9).smem_bytes
        return smem <= lim.smem_per_block and p.threads * p.CTAS_PER_SM <= lim.threads_per_sm and (
            p.CTAS_PER_SM == 1 or p.CTAS_PER_SM * (smem + 1024) <= lim.smem_per_sm)

    for tp in (8, 1):
        plan = StudyLoop._study_plan(loop, "cuda", tp, 1, 4096)
        admitted = [g for g in space.grid(default) if not space.violation(g, plan.env)]
        assert plan.feasible == [g for g in admitted if fits(g)], tp
        assert 0 < len(plan.feasible) < len(admitted) and plan.grid is None
    wide = dict(default, BLOCK_N=32, STAGES=4)
    assert not fits(wide)
    assert "exceeds sm_120's 101376 B" in StudyLoop._violation("search", plan, wide)
    assert StudyLoop._violation("baseline", plan, wide) is None
    assert StudyLoop._violation("search", plan, default) is None
    from kvtune.kernels import get_backend
    from kvtune.kernels.cuda.params import WgmmaParams
    assert "has no wgmma" in get_backend("wgmma").fit_reject(WgmmaParams(ROWS=72), 9, "sm_120")
    assert get_backend("wgmma").fit_reject(WgmmaParams(ROWS=72), 9, "sm_90") is None
    assert get_backend("cuda").fit_reject(CudaParams(**wide), 9, "cpu") is None   # no limits known there


def test_constraints_that_leave_only_the_default_are_named(tmp_path, capsys):
    """A space whose constraints rule out every config but the default: the sweep measures the
    default alone, and says why, instead of a plain complete study reading 'nothing beats it'."""
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    (spaces / "triton.yaml").write_text(yaml.safe_dump({
        "backend": "triton", "params": {"NSPLIT": [1, 2, 4], "BLOCK_N": [32], "HEADS_PER_BLOCK": [1],
                                        "NUM_WARPS": [4], "STAGES": [1]},
        "constraints": [{"name": "huge", "expr": "NSPLIT > 1000"}]}))
    dep = _dep(tmp_path, contexts=[64])
    out = tmp_path / "out"
    main(["sweep", str(dep), "--device", "cpu", "--out", str(out), "--no-progress", "--in-process",
          "--space-dir", str(spaces), "--rounds", "0", "--remeasure-top", "0"])
    captured = capsys.readouterr()
    said = "its constraints leave no config to search but the default"   # (N in the space, widened by it)
    assert said in captured.err
    row = next(line for line in captured.out.splitlines() if re.match(r"\s*triton\s+8\s+1\s+64\s", line))
    assert said in row, row
