"""The GPU diagnostics in scripts/ that build CUDA code keep building on a CPU (NVRTC), so an
edit of verify.cu or of a script is caught here rather than in a device call:

- time_phases.py --variants patches copies of verify.cu at fixed anchors: each anchor must still
  occur exactly once, and each patched copy must compile;
- wgmma_probe.py compiles for sm_90a, with the two warpgroup MMAs it was written for; the later
  probes (pingpong, rows in M, stream) compile without spills or serialized warpgroup MMAs and
  fit their shared memory, and the stream probe's merge of split partials is one softmax;
- bench_proxy.py's candidates for sm_120 fit sm_120's shared memory by the Python geometry
  (computed apart from the NVRTC report the script filters on), the sm_120 default among them;
- the QK^T tilings time_tilings.py times (`backend.qk_tilings`, from which the launcher picks)
  are exactly those the kernel's Config accepts, the launcher's own among them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from kvtune.kernels.cuda import nvrtc  # noqa: E402
from kvtune.kernels.cuda.backend import KernelGeometry, compile_params, default_for_arch, split_expr  # noqa: E402
from kvtune.kernels.cuda.params import ARCH_LIMITS, CudaParams  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTUNE_CACHE_DIR", str(tmp_path))
    yield
    nvrtc._source_cache.clear()
    nvrtc._mem_cache.clear()


def test_phase_variants_patch_once_and_compile(cache):
    import time_phases
    src = nvrtc.kernel_source()
    p = CudaParams(NSPLIT=132)
    shipped_hash = nvrtc.kernel_source_hash()
    for name in time_phases.VARIANTS:
        patched = time_phases.patched_source(src, name)
        assert (patched == src) == (name == "full"), name
        with nvrtc.source_override(patched):
            # the cache names follow the patched text: a variant is never served for verify.cu
            assert (nvrtc.kernel_source_hash() == shipped_hash) == (name == "full"), name
            mod = compile_params(p, 9, "sm_90")
        assert mod.resources[split_expr(p, 9)].spills == 0, name
        assert nvrtc.kernel_source() == src, name   # restored after the block


def test_wgmma_phase_variants_patch_once_and_compile(cache):
    import time_phases
    from kvtune.kernels.cuda.wgmma import PARTS, compile_wgmma, split_expr as wgmma_expr
    part = PARTS[1]
    src = nvrtc.SOURCE_PATH.with_name(part).read_text()
    shipped_hash = nvrtc.kernel_source_hash(PARTS)
    for name in time_phases.WGMMA_VARIANTS:
        patched = time_phases.patched_source(src, name, "wgmma")
        assert (patched == src) == (name == "full"), name
        rows = 72 if name.startswith("tail_") else 64   # the tail's variants patch code only ROWS 72 has
        with nvrtc.source_override(patched, part):
            assert (nvrtc.kernel_source_hash(PARTS) == shipped_hash) == (name == "full"), name
            mod = compile_wgmma(9, "sm_90", rows)
        assert mod.resources[wgmma_expr(9, rows)].spills == 0, name
        assert nvrtc.kernel_source_hash(PARTS) == shipped_hash, name   # restored after the block


def test_km_phase_variants_patch_once():
    """time_phases --backend wgmma_km: each variant's anchors occur once in verify_km.cu (a lost
    anchor would stop a device call); their compiles are the GPU run's."""
    import time_phases
    from kvtune.kernels.cuda.wgmma_km import PARTS
    src = nvrtc.SOURCE_PATH.with_name(PARTS[2]).read_text()
    for name in time_phases.KM_VARIANTS:
        assert (time_phases.patched_source(src, name, "wgmma_km") == src) == (name == "full"), name


def test_phase_variant_with_a_lost_anchor_is_refused():
    import time_phases
    with pytest.raises(SystemExit, match="occurs 0 times"):
        time_phases.patched_source("// no kernel here\n", "no_tiles")


def test_wgmma_probe_compiles_for_sm_90a():
    import wgmma_probe
    src = wgmma_probe.source()
    assert src.count("wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16") == 2
    assert len(wgmma_probe.compile_probe("sm_90a")) > 0
    # the launch covers the probe's own layout: Q, K, two partial S, the max scratch, P^T
    assert wgmma_probe.SMEM >= 17 * 9216 + 2 * 128 * 36 * 4 + 4 * 72 * 4 + 9 * 1024
    assert wgmma_probe.SMEM <= ARCH_LIMITS["sm_90"].smem_per_block


def test_racecheck_probe_kernels_compile_for_sm_90a_with_the_named_probes():
    """Every probe kernel racecheck_probe.py launches is in its source and builds for sm_90a
    (its `wgmma` and `setmaxnreg` probes need the arch-specific target), and each probe's expected
    exchange is the other warpgroup's value: thread t gets t ^ 128 (the tail, at 384 threads, its
    own row of warpgroup 0), independently of the kernels."""
    import racecheck_probe
    from mma_ceiling import nvrtc_cubin
    cubin, log = nvrtc_cubin(racecheck_probe.SRC, "racecheck_probe.cu", ["--gpu-architecture=sm_90a", "-std=c++17"])
    assert len(cubin) > 0
    for fn, threads in racecheck_probe.PROBES:
        assert f'extern "C" __global__ void {fn}(' in racecheck_probe.SRC or \
            f"__launch_bounds__({threads}, 1) {fn}(" in racecheck_probe.SRC, fn
    e = racecheck_probe.expected("k_setmaxnreg", 384, None).tolist()
    assert e[:2] == [128.0, 129.0] and e[128] == 0.0 and e[256:258] == [0.0, 1.0]
    assert racecheck_probe.expected("k_plain", 256, None).tolist()[127:129] == [255.0, 0.0]


def test_proxy_candidates_fit_sm_120():
    import bench_proxy
    shapes = bench_proxy.fitting_shapes("sm_120", 9, 8)
    assert shapes
    limit = ARCH_LIMITS["sm_120"].smem_per_block
    for s in shapes:
        assert KernelGeometry.of(CudaParams(**s), 9).smem_bytes <= limit, s
        assert s["HEADS_PER_BLOCK"] <= 8
    d = default_for_arch(9, 8, "sm_120")
    assert {f: getattr(d, f) for f in bench_proxy.SHAPE_FIELDS} in shapes
    # the H200 default (72 rows, 32-key tiles) does not fit 99 KB
    assert {f: getattr(default_for_arch(9, 8, "sm_90"), f) for f in bench_proxy.SHAPE_FIELDS} not in shapes


def test_qk_tilings_are_exactly_the_tilings_the_kernel_accepts():
    import itertools

    import time_tilings  # noqa: F401  (the script itself still imports on a CPU)
    from test_cuda_smem_mirror import _compile
    from kvtune.kernels.cuda.backend import KV_BITS, qk_tiling, qk_tilings
    p = CudaParams(NSPLIT=132)
    listed = set(qk_tilings(p, 9))
    assert qk_tiling(p, 9) in listed and len(listed) > 10
    # every (QMT, QRG, QKS) up to the warp count: listed <=> Config's static_asserts pass
    for t in itertools.product((1, 2, 3), range(1, 11), (1, 2, 4, 5)):
        inst = f"kvtune::Config<8,32,8,8,2,9,{t[0]},{t[1]},{t[2]},{KV_BITS},1>"
        ok, _ = _compile([f'static_assert({inst}::SMEM_BYTES > 0, "instantiate");'])
        assert ok == (t in listed), t


def test_pingpong_probe_compiles_for_sm_90a_with_its_mmas_in_flight():
    """The ping-pong probe builds for sm_90a without spills and without ptxas serializing its
    warpgroup MMAs (a read of an accumulator that may still be in flight makes ptxas wait after
    every wgmma, which would time a different loop than the one described)."""
    import pingpong_probe
    from mma_ceiling import nvrtc_cubin
    cubin, log = nvrtc_cubin(pingpong_probe.source(), "pingpong_probe.cu",
                             ["--gpu-architecture=sm_90a", "-std=c++17", "--ptxas-options=-v"])
    assert len(cubin) > 0
    assert "C7514" not in log and "serialized" not in log, log
    assert "0 bytes spill stores" in log, log
    # the launch covers Q, K, four P^T buffers, the max, the factors, the column maxima, the flags
    assert pingpong_probe.SMEM >= 17 * 9216 + 4 * 9216 + (72 + 4 * 72 + 8 * 72) * 4 + 16
    assert pingpong_probe.SMEM <= ARCH_LIMITS["sm_90"].smem_per_block


def test_rows_in_m_probe_compiles_for_sm_90a_with_its_mmas_in_flight():
    """The rows-in-M probe (P from registers into PV) builds for sm_90a without spills and without
    ptxas serializing its warpgroup MMAs, and its launch covers its layout."""
    import rows_in_m_probe
    cubin, log = rows_in_m_probe.compile_probe("sm_90a")
    src = rows_in_m_probe.source()
    assert len(cubin) > 0
    assert "C7514" not in log and "serialized" not in log, log
    assert "0 bytes spill stores" in log, log
    assert "m64n32k16" in src and "m64n256k16" in src
    # Q (64 rows), one 32-key tile, four P buffers, the max, the factors, the flags
    assert rows_in_m_probe.SMEM >= 12 * 9216 + 4 * 4096 + (64 + 4 * 64) * 4 + 16
    assert rows_in_m_probe.SMEM <= ARCH_LIMITS["sm_90"].smem_per_block


def test_stream_probe_compiles_for_sm_90a_within_shared_memory():
    """The gather-fed loop builds for sm_90a without spills or serialized warpgroup MMAs, and its
    four 32-key buffers, 64-row Q and two P buffers fit one sm_90 block."""
    import stream_probe
    cubin, log = stream_probe.compile_probe("sm_90a")
    assert len(cubin) > 0
    assert "C7514" not in log and "serialized" not in log, log
    assert "0 bytes spill stores" in log, log
    assert stream_probe.SMEM >= 64 * 1152 + 4 * 32 * 1152 + 2 * 4096 + 320 * 4
    assert stream_probe.SMEM <= ARCH_LIMITS["sm_90"].smem_per_block


def test_stream_probe_merge_is_the_softmax_of_all_splits():
    """The probe's check merges per-split partials (o / l, l, max in log2) in torch; on CPU tensors
    that merge must equal one softmax over every key."""
    import stream_probe
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(64, 16, generator=g), torch.randn(96, 16, generator=g)
    v = torch.randn(96, 512, generator=g)
    logits2 = q @ k.t()                       # log2 units
    parts_o, parts_l, parts_m = [], [], []
    for lo in (0, 32, 64):
        s = logits2[:, lo:lo + 32]
        m = s.amax(1)
        p = torch.exp2(s - m[:, None])
        parts_o.append(p @ v[lo:lo + 32] / p.sum(1)[:, None])
        parts_l.append(p.sum(1))
        parts_m.append(m)
    out = stream_probe.merged(torch.stack(parts_o), torch.stack(parts_l), torch.stack(parts_m))
    ref = torch.softmax(logits2 * 0.6931471805599453, dim=-1) @ v
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)



def test_phase_variants_combine_with_a_plus():
    """`a+b` applies both variants' patches, in order; an unknown part is refused by name."""
    import time_phases
    src = nvrtc.SOURCE_PATH.with_name("verify_wgmma.cu").read_text()
    both = time_phases.patched_source(src, "ranges+no_q", "wgmma")
    one_then_other = time_phases.patched_source(time_phases.patched_source(src, "ranges", "wgmma"), "no_q", "wgmma")
    assert both == one_then_other != src
    assert "RANGE_RESTART_TILES = -1000000;" in both and "if (a.H > 0) {\n  } else if (a.q_vec16)" in both
    with pytest.raises(SystemExit, match="unknown for wgmma"):
        time_phases.main(["--out", "/tmp/x", "--backend", "wgmma", "--variants", "ranges+no_such"])


def test_sass_diff_sees_a_change_and_not_a_register_name(cache):
    """sass_diff.py's comparison: register names left out, everything else kept, so a copy of
    verify.cu with its Q copy left out (time_phases' no_q) differs from the source."""
    import re

    import sass_diff
    import time_phases
    from kvtune.kernels import describe_problem, get_backend, make_inputs
    x = make_inputs(1, 9, 8, [4096], device="cpu", seed=0)
    p = get_backend("cuda").default_params(describe_problem(*x.args))
    here = sass_diff.sass(compile_params(p, 9, "sm_90").cubin)
    assert len(here) > 1000 and not any(re.search(r"\bU?R\d+\b", i) for i in here)
    assert any(i.startswith("LDG") for i in here)
    src = nvrtc.SOURCE_PATH.read_text()
    with nvrtc.source_override(time_phases.patched_source(src, "no_q"), "verify.cu"):
        changed = sass_diff.sass(compile_params(p, 9, "sm_90").cubin)
    assert changed != here and sorted(changed) != sorted(here)


def test_sass_diff_names_a_revision_git_does_not_know():
    import sass_diff
    with pytest.raises(SystemExit, match="--rev no-such-revision"):
        sass_diff.main(["--rev", "no-such-revision"])


def test_the_variants_checked_against_the_oracle_exist():
    """time_phases --oracle checks the variants whose outputs should be right: each is a variant
    of one of the two tables (a misspelt name would silently skip its check)."""
    import time_phases
    assert time_phases.OUTPUTS_RIGHT <= set(time_phases.VARIANTS) | set(time_phases.WGMMA_VARIANTS) | set(
        time_phases.KM_VARIANTS)
    assert not time_phases.OUTPUTS_RIGHT & time_phases.UNSAFE
    assert {"no_tiles", "no_q", "no_gather"}.isdisjoint(time_phases.OUTPUTS_RIGHT)


def test_ncu_source_table_sums_per_region(tmp_path, capsys):
    """ncu_source_table.py on a CSV laid out as ncu writes it (a kernel line, the header, one row
    per instruction): conflicts and samples ranked, and the samples per region summed by offset."""
    import csv
    import gzip

    import ncu_source_table
    hdr = ["Address", "Source", "# Samples", "L1 Wavefronts Shared Excessive",
           "L2 Theoretical Sectors Global Excessive", "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)",
           "Instructions Executed"]
    rows = [["0x1000", "LDS R1, [R2]", "10", "0", "0", "10", "0", "9", "300"],
            ["0x1010", "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]", "4", "512", "0", "1", "3", "0", "100"],
            ["0x1020", "@!P0 LDS R5, [R2+0x10]", "0", "0", "0", "0", "0", "0", "60"],
            ["0x1040", "STG.E desc[UR4][R6.64], R7", "6", "0", "64", "0", "6", "0", "40"]]
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "void k()"])
        w.writerow(hdr)
        w.writerows(rows)
    assert ncu_source_table.main([str(path), "--regions", "head:0,tail:30"]) == 0
    out = capsys.readouterr().out
    assert "L1 Wavefronts Shared Excessive: 512 in all" in out
    assert "L2 Theoretical Sectors Global Excessive: 64 in all" in out
    assert "warp stall samples: 20 in all" in out
    # head: offsets 0x0 and 0x10 (barrier 11 and long_sb 3 of 14); tail: 0x40 (long_sb 6)
    head = next(line for line in out.splitlines() if line.startswith("head"))
    tail = next(line for line in out.splitlines() if line.startswith("tail"))
    assert head.split()[1] == "14" and "barrier 79%" in head and "long_sb 21%" in head
    assert tail.split()[1] == "6" and "long_sb 100%" in tail
    # --mix: executed instructions per region and opcode (a predicated LDS counted as LDS), / 20
    assert ncu_source_table.main([str(path), "--regions", "head:0,tail:30", "--mix", "20"]) == 0
    out = capsys.readouterr().out
    assert "executed instructions in head: 23 per unit" in out and "executed instructions in tail: 2 per unit" in out
    mix = {line.split()[0]: float(line.split()[1]) for line in out.split("executed instructions in head")[1]
           .split("==")[0].splitlines()[1:] if line.strip()}
    assert mix == {"LDS": 18.0, "LDGSTS.E.BYPASS.128": 5.0}


def _expected_tuned_runs(path: Path, legacy_names: bool = False) -> tuple[int, int]:
    """`bench_kernel.tuned_run` on the file at `path`, per shape, against the entry of the first
    batch bucket >= B among those with H heads per rank and its context bucket's NSPLIT, read here
    from the YAML itself (a bucket's own backend and params first); how many of the buckets seen
    name their own compile-time params (a per-context dispatch), and how many another backend."""
    import yaml

    import bench_kernel

    from kvtune.kernels.tuned import load_tuned
    doc = yaml.safe_load(path.read_text())
    tuned = load_tuned(path, legacy_names=legacy_names)
    dispatched = other_backend = 0
    for H, B, prefix in [(8, 1, 256), (8, 8, 65536), (8, 32, 16384), (64, 1, 131072), (16, 64, 200000), (32, 5, 4097),
                         (16, 64, 4096), (16, 33, 65536), (32, 64, 16384), (32, 40, 9000), (8, 16, 4096),
                         (8, 16, 16384), (8, 16, 65536), (64, 16, 16384), (64, 16, 65536), (32, 4, 16384),
                         (32, 4, 65536)]:
        mine = sorted((e for e in doc["entries"] if e["heads_per_rank"] == H), key=lambda e: e["max_batch"])
        e = next((e for e in mine if e["max_batch"] >= B), mine[-1])
        b = next((b for b in e["buckets"] if b["max_context"] >= prefix), e["buckets"][-1])
        dispatched += "params" in b
        other_backend += b.get("backend", e["backend"]) != e["backend"]
        want = (b["backend"], {**b["params"], "NSPLIT": b["NSPLIT"]}) if "backend" in b else \
            (e["backend"], {**e["params"], **b.get("params", {}), "NSPLIT": b["NSPLIT"]})
        backend, label, params = bench_kernel.tuned_run(tuned, H, B, prefix)
        assert (backend, params) == want, (path.name, H, B, prefix)
        assert f"batch bucket {e['max_batch']}" in label
    assert bench_kernel.tuned_run(tuned, 12, 1, 4096) is None   # no entry with 12 heads per rank
    return dispatched, other_backend


def test_bench_kernel_times_the_config_the_packaged_defaults_serve():
    """`bench_kernel.py --tuned`: the packaged file's config per shape; and, on the committed
    dispatch-chain export (its buckets on their own params, some on another backend), each
    bucket's own config, not its entry's."""
    from kvtune.kernels.lookup import packaged_defaults_dir
    _expected_tuned_runs(packaged_defaults_dir() / "kimi-k2-h200.yaml")
    chain = Path(__file__).parents[1] / "results" / "serving" / "dispatch-chain" / "export" / "kimi-k2-h200.yaml"
    dispatched, other_backend = _expected_tuned_runs(chain, legacy_names=True)
    assert dispatched >= 2, "the shapes reach buckets with their own params"
    assert other_backend >= 1, "a bucket on another backend (tp 8 batch 16 at 4k: wgmma in a wgmma_km entry)"


def test_a_forced_schedule_changes_only_the_restart_weight():
    """`forced_schedule` (used by the GPU tests' forced schedules and time_phases.py's `items` /
    `ranges`) rewrites the one RANGE_RESTART_TILES declaration and nothing else."""
    from kvtune.kernels.cuda.wgmma import FORCED_RESTART_TILES, forced_schedule, restart_tiles
    src = nvrtc.SOURCE_PATH.with_name("verify_wgmma.cu").read_text()
    shipped = restart_tiles(src)
    assert shipped not in FORCED_RESTART_TILES.values()
    for name, value in FORCED_RESTART_TILES.items():
        forced = forced_schedule(src, name)
        assert restart_tiles(forced) == value
        changed = [(a, b) for a, b in zip(src.splitlines(), forced.splitlines()) if a != b]
        assert changed == [(f"constexpr int RANGE_RESTART_TILES = {shipped};",
                            f"constexpr int RANGE_RESTART_TILES = {value};")]
    with pytest.raises(ValueError, match="schedule"):
        forced_schedule(src, "both")
    with pytest.raises(ValueError, match="0 times"):
        forced_schedule("no declaration here", "items")


def test_fp8_accuracy_emulation_against_the_oracle():
    """fp8_accuracy.py's emulated attention: with nothing quantized but P's bf16 rounding it is the
    fp32 oracle to within that rounding; e4m3 rounds to 3 mantissa bits; quantizing Q or P moves it
    further off the oracle than bf16 P does."""
    import fp8_accuracy as f8
    from kvtune.kernels import make_inputs, reference_attention, rel_error
    x = torch.tensor([1.0, 1.0625, 1.1875, 300.0, -17.3])
    assert f8.fake_e4m3(x, 1.0).tolist() == [1.0, 1.0, 1.25, 288.0, -18.0]   # ties to even; 3 mantissa bits
    inp = make_inputs(2, 5, 4, [40, 7], tree="random", seed=3)
    kv = f8.fp8_cache(inp.kv_cache)
    ref, _ = reference_attention(inp.q, kv, inp.kv_indptr, inp.kv_indices, inp.tree_mask, inp.sm_scale)
    errs = {(fq, fp): rel_error(f8.emulated(inp.q, kv, inp.kv_indptr, inp.kv_indices, inp.tree_mask, inp.sm_scale,
                                            fq, fp), ref)
            for fq in (False, True) for fp in (False, True)}
    assert errs[False, False] < 4e-3
    assert min(errs[True, False], errs[False, True], errs[True, True]) > 2 * errs[False, False]


def test_cluster_merge_probe_compiles_and_its_two_level_merge_is_the_one_level_merge():
    """cluster_merge_probe.py: its epilogue builds for sm_90a at every cluster size it launches,
    without spills; each grid splits into whole clusters and each cluster's rows into whole
    slices; and merging the synthetic partials in clusters first, then across clusters (what the
    probe's cluster epilogue and merge kernel compute), gives torch's one-level merge."""
    import torch

    import cluster_merge_probe as p
    from mma_ceiling import nvrtc_cubin
    for cl in sorted({cl for _, cls in p.CONFIGS for cl in cls}):
        _, log = nvrtc_cubin(p.source(cl), f"cluster_merge_{cl}.cu",
                             ["--gpu-architecture=sm_90a", "-std=c++17", "--ptxas-options=-v"])
        assert log.count(" 0 bytes spill stores") == log.count("spill stores") == 2, log   # epilogue, merge
    for nsplit, cls in p.CONFIGS:
        for cl in cls:
            assert nsplit % cl == 0 and p.ROWS % cl == 0, (nsplit, cl)
    m, ell, o = p.synthetic(12, "cpu")
    for cl in (2, 3, 4, 6):
        parts = [p.merge_partials(m[i:i + cl], ell[i:i + cl], o[i:i + cl]) for i in range(0, 12, cl)]
        two = p.merge_partials(*(torch.stack(x) for x in zip(*parts)))[2]
        assert torch.allclose(two, p.merge_partials(m, ell, o)[2], rtol=1e-12, atol=1e-12)


def test_timeline_probe_patches_once_and_compiles_without_spills(cache):
    """timeline_probe.py stamps copies of verify.cu and verify_wgmma.cu at fixed anchors: each
    must occur once, the stamped module must compile at both ROWS and both lane counts with no
    spill (a spill would move the times it places), and nothing stays overridden afterwards."""
    import timeline_probe
    from kvtune.kernels.cuda.wgmma import PARTS, compile_wgmma, split_expr as wgmma_expr
    shipped_hash = nvrtc.kernel_source_hash(PARTS)
    texts = timeline_probe.patched()
    for part, anchor, _ in timeline_probe.PATCHES:
        assert anchor is None or texts[part].count(anchor) <= 1, anchor
    with nvrtc.source_override(texts["verify.cu"], "verify.cu"), \
            nvrtc.source_override(texts["verify_wgmma.cu"], "verify_wgmma.cu"):
        assert nvrtc.kernel_source_hash(PARTS) != shipped_hash
        for rows in (64, 72):
            for lanes in (4, 8):
                mod = compile_wgmma(9, "sm_90", rows, lanes)
                assert mod.resources[wgmma_expr(9, rows, lanes)].spills == 0, (rows, lanes)
                assert all(r.spills == 0 for r in mod.resources.values()), (rows, lanes)
    assert nvrtc.kernel_source_hash(PARTS) == shipped_hash


def test_timeline_probe_reads_a_known_timeline():
    """analyse() on stamps laid out by hand: 20 calls 10 us apart, 4 working CTAs entering 50 ns
    apart with stages 100, 200, ... 700 ns long, 3 merge blocks from 8.0 to 9.0-9.002 us."""
    import numpy as np
    import timeline_probe as tp
    s = np.zeros((tp.RING, tp.NS, tp.CTAS), np.uint64)
    m = np.zeros((tp.RING, 2, tp.MB), np.uint64)
    for k in range(20):
        t0 = 1_000 + 10_000 * k
        for y in range(4):
            for i in range(tp.NS):
                s[k, i, y] = t0 + 50 * y + 100 * i * (i + 1) // 2   # stage i lasts 100 * i ns
        for kb in range(3):
            m[k, 0, kb], m[k, 1, kb] = t0 + 8_000, t0 + 9_000 + kb
    r = tp.analyse(s.ravel(), m.ravel(), 20)
    assert r["calls"] == 17 and r["working_ctas"] == 4
    assert r["period_us"] == 10.0 and r["entry_spread_us"] == 0.15
    assert r["split_span_us"] == 2.95      # 0.15 us: the last CTA's entry + its 2.8 us of stages
    assert r["split_to_merge_us"] == round(8.0 - 2.95, 3)
    assert r["merge_span_us"] == 1.002 and r["prev_merge_to_split_us"] == round(10 - 9.002, 3)
    for i, name in enumerate(tp.STAGES, start=1):
        assert r[f"{name}_med_us"] == r[f"{name}_last_us"] == round(0.1 * i, 3), name


def test_phase_rounds_rotate_and_summarise_by_median(capsys):
    """--rounds: every variant leads one round in turn, and the summary is each variant's median
    over its rounds (per prefix and batch), whatever the order the rows came in."""
    import time_phases
    names = ["full", "a", "b"]
    assert [time_phases.round_order(names, r) for r in range(4)] == [
        ["full", "a", "b"], ["a", "b", "full"], ["b", "full", "a"], ["full", "a", "b"]]
    rows = [{"prefix": 4096, "B": 8, "variant": v, "both_us": t, "split_us": t - 4, "merge_us": 4.0}
            for v, t in [("full", 30.0), ("a", 33.0), ("full", 31.0), ("a", 35.0), ("full", 40.0), ("a", 34.0)]]
    time_phases.print_summary(rows)
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("4096")]
    assert [(ln[2], ln[3], ln[4], ln[5]) for ln in lines] == [("full", "3", "31.00", "27.00"),
                                                              ("a", "3", "34.00", "30.00")]
    with pytest.raises(SystemExit, match="--rounds"):
        time_phases.main(["--out", "/tmp/x", "--backend", "wgmma", "--rounds", "0"])
