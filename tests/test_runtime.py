"""Serving runtime on the CPU (Triton under its interpreter): loading and validating the
exported YAML, lookup order, provenance, the bucket policy, env overrides, and
VerifyAttention against the fp32 oracle."""
from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
import yaml

from kvtune.kernels import make_inputs, reference_attention, rel_error
from kvtune.kernels import lookup
from kvtune.kernels.backends import get_backend
from kvtune.kernels import runtime as rt
from kvtune.kernels.runtime import ProvenanceError, VerifyAttention, load_defaults
from kvtune.kernels.triton_kernel import TritonBackend, kernel_source_hash, partials
from kvtune.kernels.tuned import SchemaError, dump_tuned, load_tuned, parse_tuned

T, TP, NUM_HEADS = 9, 8, 16          # 2 heads per rank: small enough for the interpreter
H = NUM_HEADS // TP
TOL = 2e-2


def tuned_dict(device="cpu", **top) -> dict:
    """A valid exported document for the running device and kernel source."""
    d = {
        "schema_version": 1,
        "deployment": "tiny-test",
        "model": {"name": "Tiny-MLA", "num_heads": NUM_HEADS, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                  "draft_tokens": T, "sm_scale": 0.0721},
        "provenance": {"device_name": rt.device_name(device), "arch": rt.device_arch(device),
                       "kernel_hash": {"triton": kernel_source_hash()}, "date": "2026-11-29T17:00:00Z",
                       "timing": "graph", "kvtune": "0.1.0"},
        "entries": [
            {"tp": TP, "heads_per_rank": H, "max_batch": 1, "backend": "triton",
             "params": {"NSPLIT": 4, "BLOCK_N": 16, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1},
             "buckets": [{"max_context": 64, "NSPLIT": 1, "latency_us": 3.0, "default_latency_us": 4.0},
                         {"max_context": 128, "NSPLIT": 2},
                         {"max_context": 256, "NSPLIT": 4}]},
            {"tp": TP, "heads_per_rank": H, "max_batch": 4, "backend": "triton",
             "params": {"NSPLIT": 2, "BLOCK_N": 32, "HEADS_PER_BLOCK": 1, "NUM_WARPS": 4, "STAGES": 2},
             "buckets": [{"max_context": 100, "NSPLIT": 1}, {"max_context": 200, "NSPLIT": 2}]},
            {"tp": 4, "heads_per_rank": 4, "max_batch": 8, "backend": "triton",
             "params": {"NSPLIT": 8, "BLOCK_N": 32, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 2},
             "buckets": [{"max_context": 4096, "NSPLIT": 8}]},
        ],
    }
    d.update(top)
    return d


def write(tmp_path, doc, name="tiny-test.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(rt.ENV_VERIFY, raising=False)
    monkeypatch.delenv(rt.ENV_CONFIG_DIR, raising=False)
    rt.reset_warn_once()
    yield
    rt.reset_warn_once()


def check_against_oracle(va, prefix_lens, tree, seed, device):
    inp = make_inputs(len(prefix_lens), T, H, prefix_lens, tree=tree, seed=seed, device=device,
                      sm_scale=va.sm_scale)
    lse = torch.empty(len(prefix_lens) * T, H, dtype=torch.float32, device=device)
    o, lse = va(*inp.args[:5], lse=lse)
    ref, ref_lse = reference_attention(*inp.args)
    assert rel_error(o, ref) < TOL
    assert torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3)
    return o


# -- loading ---------------------------------------------------------------------------

def test_round_trip_dump_and_load(tmp_path, device):
    tuned = parse_tuned(tuned_dict(device), "mem")
    path = dump_tuned(tuned, tmp_path / "tiny-test.yaml")
    back = load_defaults(path, device=device)
    assert back.to_dict() == tuned.to_dict()
    assert back.source == str(path)
    # the same file found by deployment name in a folder, and twice dumped is byte-identical
    assert load_defaults(tmp_path, deployment="tiny-test", device=device).to_dict() == tuned.to_dict()
    dump_tuned(back, tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_text() == path.read_text()


def _mutations():
    def m(fn):
        def apply(d):
            d = copy.deepcopy(d)
            fn(d)
            return d
        return apply
    return [
        ("schema_version", m(lambda d: d.update(schema_version=2))),
        ("schema_version", m(lambda d: d.update(schema_version=True))),    # == 1 in Python
        ("schema_version", m(lambda d: d.update(schema_version=1.0))),
        ("model.name", m(lambda d: d["model"].update(name=7))),
        ("provenance.date", m(lambda d: d["provenance"].update(date=20261129))),
        ("provenance.kernel_hash.triton", m(lambda d: d["provenance"]["kernel_hash"].update(triton=None))),
        ("entries[0].params", m(lambda d: d["entries"][0].update(backend="reference", params={"junk": 1}))),
        ("<top>", m(lambda d: d.pop("entries"))),
        ("<top>", m(lambda d: d.update(extra=1))),
        ("deployment", m(lambda d: d.update(deployment=""))),
        ("model.sm_scale", m(lambda d: d["model"].update(sm_scale=-1.0))),
        ("model.num_heads", m(lambda d: d["model"].update(num_heads="16"))),
        ("model.draft_tokens", m(lambda d: d["model"].update(draft_tokens=100))),
        ("provenance.arch", m(lambda d: d["provenance"].update(arch="hopper"))),
        ("provenance", m(lambda d: d["provenance"].pop("kernel_hash"))),
        ("entries", m(lambda d: d.update(entries=[]))),
        ("entries[0].backend", m(lambda d: d["entries"][0].update(backend="fast"))),
        ("entries[0].heads_per_rank", m(lambda d: d["entries"][0].update(heads_per_rank=3))),
        ("entries[1]", m(lambda d: d["entries"][1].update(max_batch=1))),
        ("entries[0].params", m(lambda d: d["entries"][0]["params"].update(VEC=8))),
        ("entries[0].params", m(lambda d: d["entries"][0]["params"].update(BLOCK_N=24))),
        # a parameter left to the dataclass default: defaults change between versions
        ("entries[0].params", m(lambda d: d["entries"][0]["params"].pop("NUM_WARPS"))),
        ("entries[0].buckets[1].max_context", m(lambda d: d["entries"][0]["buckets"][1].update(max_context=64))),
        ("entries[0].buckets[2].NSPLIT", m(lambda d: d["entries"][0]["buckets"][2].update(NSPLIT=5))),
        ("entries[0].buckets[0]", m(lambda d: d["entries"][0]["buckets"][0].pop("NSPLIT"))),
        ("entries[0].buckets", m(lambda d: d["entries"][0].update(buckets=[]))),
    ]


@pytest.mark.parametrize("key,mutate", _mutations(), ids=[f"{k}-{i}" for i, (k, _) in enumerate(_mutations())])
def test_schema_errors_name_file_and_key(tmp_path, device, key, mutate):
    path = write(tmp_path, mutate(tuned_dict(device)))
    with pytest.raises(SchemaError) as e:
        load_defaults(path, device=device)
    msg = str(e.value)
    assert str(path) in msg and key in msg, msg


def test_unreadable_and_invalid_yaml(tmp_path, device):
    bad = tmp_path / "bad.yaml"
    bad.write_text("entries: [unclosed\n")
    with pytest.raises(SchemaError, match="bad.yaml: not valid YAML"):
        load_defaults(bad, device=device)
    with pytest.raises(SchemaError, match="no such file"):
        load_defaults(tmp_path / "missing.yaml", device=device)
    with pytest.raises(ValueError, match="deployment: name the deployment"):
        load_defaults(tmp_path, device=device)


@pytest.mark.parametrize("what,mutate,key", [
    ("arch", lambda d: d["provenance"].update(arch="sm_120" if d["provenance"]["arch"] != "sm_120" else "sm_90"),
     "provenance.arch"),
    ("hash", lambda d: d["provenance"]["kernel_hash"].update(triton="0123456789abcdef"),
     "provenance.kernel_hash.triton"),
    ("no-hash", lambda d: d["provenance"].update(kernel_hash={"cuda": "0123456789abcdef"}),
     "provenance.kernel_hash.triton"),
])
def test_provenance_mismatch_is_an_error_unless_allowed(tmp_path, device, caplog, what, mutate, key):
    doc = tuned_dict(device)
    mutate(doc)
    path = write(tmp_path, doc)
    with pytest.raises(ProvenanceError) as e:
        load_defaults(path, device=device)
    assert key in str(e.value) and str(path) in str(e.value)
    with caplog.at_level(logging.WARNING, logger="kvtune.runtime"):
        for _ in range(3):
            tuned = load_defaults(path, device=device, allow_mismatch=True)
    assert tuned is not None
    hits = [r for r in caplog.records if key in r.getMessage()]
    assert len(hits) == 1, "a mismatch is logged exactly once"


def test_deployment_name_mismatch(tmp_path, device):
    write(tmp_path, tuned_dict(device, deployment="other"), name="tiny-test.yaml")
    with pytest.raises(ProvenanceError, match="deployment: file is for 'other'"):
        load_defaults(tmp_path, deployment="tiny-test", device=device)


def test_lookup_user_dir_before_packaged(tmp_path, device, monkeypatch):
    packaged, user1, user2 = (tmp_path / n for n in ("packaged", "user1", "user2"))
    for d in (packaged, user1, user2):
        d.mkdir()
    monkeypatch.setattr(lookup, "packaged_defaults_dir", lambda: packaged)
    write(packaged, tuned_dict(device, deployment="tiny-test"))
    assert load_defaults(deployment="tiny-test", device=device).source == str(packaged / "tiny-test.yaml")
    # model + device naming is found too, but the deployment name is more specific
    by_model = rt.defaults_file_names(model="Tiny-MLA", device_name=rt.device_name(device))[0]
    write(user2, tuned_dict(device, deployment="tiny-test"), name=by_model)
    monkeypatch.setenv(rt.ENV_CONFIG_DIR, f"{user1}{__import__('os').pathsep}{user2}")
    assert load_defaults(deployment="tiny-test", model="Tiny-MLA", device=device).source == str(user2 / by_model)
    assert load_defaults(deployment="tiny-test", device=device).source == str(packaged / "tiny-test.yaml")
    write(user1, tuned_dict(device, deployment="tiny-test"))
    assert load_defaults(deployment="tiny-test", device=device).source == str(user1 / "tiny-test.yaml")


def test_a_config_dir_that_is_not_a_folder_is_warned_about_and_the_file_used_is_logged(tmp_path, device, caplog,
                                                                                      monkeypatch):
    """A typo in KVTUNE_CONFIG_DIR would serve the packaged file in place of the user's own:
    warned once, and the runtime logs which file it serves."""
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    monkeypatch.setattr(lookup, "packaged_defaults_dir", lambda: packaged)
    write(packaged, tuned_dict(device, deployment="tiny-test"))
    typo = tmp_path / "tunned"
    monkeypatch.setenv(rt.ENV_CONFIG_DIR, str(typo))
    lookup.reset_warn_once()
    with caplog.at_level(logging.INFO, logger="kvtune.runtime"):
        for _ in range(2):
            va = VerifyAttention.from_defaults(None, deployment="tiny-test", tp=TP, max_batch=1, max_context=128,
                                               device=device, warmup=False)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum(f"KVTUNE_CONFIG_DIR entry '{typo}' is not a folder" in m for m in msgs) == 1
    assert va.tuned.source == str(packaged / "tiny-test.yaml")
    assert sum(f"defaults from {packaged / 'tiny-test.yaml'}" in m for m in msgs) == 2


def test_no_file_falls_back_and_warns_once(tmp_path, device, caplog, monkeypatch):
    monkeypatch.setattr(lookup, "packaged_defaults_dir", lambda: tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtune.runtime"):
        assert load_defaults(deployment="absent", device=device) is None
        va = VerifyAttention.from_defaults(None, tp=TP, max_batch=2, max_context=128, device=device,
                                           deployment="absent", draft_tokens=T, heads=H, sm_scale=0.0721)
    assert sum("no tuned defaults" in r.getMessage() for r in caplog.records) == 1
    # the documented fallback: the CUDA kernel on a GPU (every GPU the tests run on is sm_80 or
    # newer, and the CUDA default fits T 9 on each), Triton under its interpreter on a CPU
    want = get_backend("cuda" if device == "cuda" else "triton")
    assert va.plans[0].source == f"untuned default of {want.name}"
    assert va.plans[0].params == want.default_params(va.problem(2))
    # each batch size runs the backend's default for that size (NSPLIT fills the GPU for it)
    assert [va.params_for(n) for n in (1, 2)] == [want.default_params(va.problem(n)) for n in (1, 2)]
    assert va.plans[0].split_table is None
    check_against_oracle(va, [1, 97], "random", 3, device)
    # one error names every value the missing file would have given
    with pytest.raises(ValueError, match=r"^draft_tokens=, heads=, sm_scale=: no tuned defaults file"):
        VerifyAttention.from_defaults(None, tp=TP, max_batch=1, device=device, deployment="absent")
    with pytest.raises(ValueError, match=r"^heads=, sm_scale=: no tuned defaults file"):
        VerifyAttention.from_defaults(None, tp=TP, max_batch=1, device=device, deployment="absent", draft_tokens=T)
    with pytest.raises(ValueError, match=r"^sm_scale=: no tuned defaults file .*YaRN"):
        VerifyAttention.from_defaults(None, tp=TP, max_batch=1, device=device, deployment="absent", draft_tokens=T,
                                      heads=H)


def test_reads_the_tuners_real_export(device):
    """The CPU sweep's committed export (results/cpu-tiny) loads and runs: the tuner's writer
    and this reader agree. allow_mismatch: the kernel source may have changed since. An
    export from before Triton's parameters took their current names is refused for serving,
    naming the new names, and read as evidence with `legacy_names`."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "results" / "cpu-tiny" / "cpu-tiny.yaml"
    if not path.is_file():
        pytest.skip("no committed CPU export")
    if "BLOCK_H" in path.read_text():
        with pytest.raises(SchemaError, match="BLOCK_H was renamed HEADS_PER_BLOCK"):
            load_defaults(path, deployment="cpu-tiny", device="cpu", allow_mismatch=True)
        tuned = load_tuned(path, legacy_names=True)
    else:
        tuned = load_defaults(path, deployment="cpu-tiny", device="cpu", allow_mismatch=True)
    tp = tuned.entries[0].tp
    va = VerifyAttention.from_defaults(tuned, tp=tp, max_batch=2, max_context=300, device=device,
                                       allow_mismatch=True)
    inp = make_inputs(2, va.T, va.H, [1, 97], tree="random", seed=21, device=device, sm_scale=va.sm_scale)
    assert rel_error(va(*inp.args[:5]), reference_attention(*inp.args)[0]) < TOL


# -- the bucket policy -----------------------------------------------------------------

def test_bucket_policy_at_and_between_edges(device):
    tuned = parse_tuned(tuned_dict(device), "mem")
    e1 = tuned.lookup(TP, 1)
    assert e1.max_batch == 1
    assert [tuned.lookup(TP, n).max_batch for n in (2, 3, 4, 5, 64)] == [4, 4, 4, 4, 4]  # largest beyond
    assert tuned.lookup(2, 1) is None
    want = {1: 1, 63: 1, 64: 1, 65: 2, 127: 2, 128: 2, 129: 4, 256: 4, 257: 4, 100000: 4}
    assert {p: e1.bucket_for(p).NSPLIT for p in want} == want
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=6, max_context=300, device=device, warmup=False)
    assert [p.max_batch for p in va.plans] == [1, 4]
    assert all(va.nsplit_for(1, p) == n for p, n in want.items())
    # batches 2..4 run the batch-4 entry with its CTA count: NSPLIT x 4/n, floored
    assert [va.nsplit_for(b, 100) for b in (2, 4, 6)] == [2, 1, 1]
    assert [va.nsplit_for(3, p) for p in (100, 101, 200, 201)] == [1, 2, 2, 2]
    # the split table holds key counts: L = prefix + T
    assert va.plans[0].split_table.max_keys.tolist() == [64 + T, 128 + T, 256 + T]


@pytest.mark.parametrize("prefix", [1, 55, 64, 65, 128, 129, 256, 300])
def test_device_picks_nsplit_from_the_table(device, prefix):
    """The kernel, not the host, chooses NSPLIT per request: count the splits that wrote
    a partial result (an empty split stores lse = -inf) in the runtime's own workspace."""
    tuned = parse_tuned(tuned_dict(device), "mem")
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=1, max_context=300, device=device, warmup=False)
    plan = va.plan_for(1)
    inp = make_inputs(1, T, H, [prefix], tree="random", seed=prefix, device=device, sm_scale=va.sm_scale)
    va.workspace.fill_(255)                                # NaN in every fp32 partial
    o = va(*inp.args[:5])
    assert rel_error(o, reference_attention(*inp.args)[0]) < TOL
    _, part_lse = partials(va.problem(1), plan.params.NSPLIT, va.workspace)
    n = plan.nsplit_for(prefix, T)
    L = prefix + T
    chunk = -(-(-(-L // n)) // plan.params.BLOCK_N) * plan.params.BLOCK_N
    written = int(torch.isfinite(part_lse[:, 0, 0]).sum())
    assert written == -(-L // chunk), (prefix, n, part_lse[:, 0, 0])
    assert bool(torch.isneginf(part_lse[n:]).all())       # splits past this request's NSPLIT: empty


# -- VerifyAttention -------------------------------------------------------------------

@pytest.mark.parametrize("prefix_lens,tree", [([1], "chain"), ([54], "random"), ([1, 54, 97], "chain"),
                                              ([97, 1, 54], "random"), ([300, 2, 160, 33], "random")])
def test_verify_attention_matches_oracle(device, prefix_lens, tree):
    tuned = parse_tuned(tuned_dict(device), "mem")
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=4, max_context=300, device=device)
    o = check_against_oracle(va, prefix_lens, tree, seed=len(prefix_lens), device=device)
    assert o.data_ptr() == va.out_buf.data_ptr()          # no allocation: the preallocated output
    assert va.workspace_bytes == max(TritonBackend().workspace_bytes(va.problem(b), p.params)
                                     for b, p in ((1, va.plans[0]), (4, va.plans[1])))


def test_workspace_budget(device):
    tuned = parse_tuned(tuned_dict(device), "mem")
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=4, max_context=300, device=device, warmup=False)
    assert va.allocated_bytes >= va.workspace_bytes > 0
    with pytest.raises(ValueError, match="workspace_budget_bytes") as e:
        VerifyAttention.from_defaults(tuned, tp=TP, max_batch=4, max_context=300, device=device, warmup=False,
                                      workspace_budget_bytes=va.allocated_bytes - 1)
    # the message's parts add up to its total, and the scratch part is the workspace
    total, scratch, out, tables = map(int, re.search(
        r"needs (\d+) bytes \((\d+) scratch \+ (\d+) output \+ (\d+) split tables\)", str(e.value)).groups())
    assert (total, scratch) == (va.allocated_bytes, va.workspace_bytes)
    assert scratch + out + tables == total and out == 4 * va.T * va.H * va.Dv * 2
    VerifyAttention.from_defaults(tuned, tp=TP, max_batch=4, max_context=300, device=device, warmup=False,
                                  workspace_budget_bytes=va.allocated_bytes)


@pytest.mark.parametrize("given,match", [
    (dict(heads=0), r"heads: expected an int >= 1"),
    (dict(heads=2.0), r"heads: expected an int >= 1"),
    (dict(draft_tokens=2.5), r"draft_tokens: expected an int >= 1"),
    (dict(kv_lora_rank=-512), r"kv_lora_rank: expected an int >= 1"),
    (dict(sm_scale="x"), r"sm_scale: expected a positive finite float"),
    (dict(sm_scale=float("nan")), r"sm_scale: expected a positive finite float"),
    (dict(sm_scale=float("inf")), r"sm_scale: expected a positive finite float"),
    (dict(sm_scale=-0.1), r"sm_scale: expected a positive finite float"),
])
def test_model_kwargs_are_checked_and_named(device, given, match):
    """The model on this rank, given without a YAML: a bad value is refused at construction,
    naming the keyword (a NaN sm_scale used to make every later call return NaN)."""
    model = dict(draft_tokens=T, heads=H, sm_scale=0.1)
    model.update(given)
    with pytest.raises(ValueError, match=match):
        VerifyAttention.from_defaults(None, deployment="none", tp=1, max_batch=1, max_context=64, device=device,
                                      warmup=False, **model)


def test_params_that_do_not_fit_the_rank_name_the_file(tmp_path, device):
    """A YAML whose params fit the schema but not this rank's problem (Triton's HEADS_PER_BLOCK x T
    rows over 256): the runtime's error names the file and the entry, not only the dataclass."""
    doc = tuned_dict(device)
    doc["entries"][0]["params"]["HEADS_PER_BLOCK"] = 64
    path = write(tmp_path, doc)
    with pytest.raises(ValueError, match=r"tiny-test.yaml \(tp=\d+, max_batch=1\): params .*HEADS_PER_BLOCK"):
        VerifyAttention.from_defaults(path, tp=TP, max_batch=1, max_context=64, device=device, warmup=False)


def test_model_mismatch_and_bad_calls(device):
    tuned = parse_tuned(tuned_dict(device), "mem")
    with pytest.raises(ProvenanceError, match="draft_tokens: tuned for 9"):
        VerifyAttention.from_defaults(tuned, tp=TP, max_batch=1, device=device, draft_tokens=4)
    with pytest.raises(ValueError, match="tp: 3 does not divide"):
        VerifyAttention.from_defaults(tuned, tp=3, max_batch=1, device=device)
    with pytest.raises(ValueError, match="max_batch"):
        VerifyAttention.from_defaults(tuned, tp=TP, max_batch=0, device=device)
    va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=2, max_context=128, device=device, warmup=False)
    inp = make_inputs(3, T, H, 5, device=device)
    with pytest.raises(ValueError, match="kv_indptr: .*B=3"):
        va(*inp.args[:5])
    inp = make_inputs(1, T, H + 1, 5, device=device)
    with pytest.raises(ValueError, match=r"q: expected \[9, 2, 576\]"):
        va(*inp.args[:5])


def test_untuned_tp_falls_back(device, caplog):
    tuned = parse_tuned(tuned_dict(device), "mem")
    with caplog.at_level(logging.INFO, logger="kvtune.runtime"):
        va = VerifyAttention.from_defaults(tuned, tp=2, max_batch=1, max_context=128, device=device, warmup=False)
    assert "no entry for tp=2" in caplog.text
    # the start-up line says the defaults are not the file's, not just "defaults from mem"
    assert "defaults from mem, which has no entry for tp=2 (untuned backend defaults)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtune.runtime"):
        VerifyAttention.from_defaults(tuned, tp=TP, max_batch=1, max_context=128, device=device, warmup=False)
    assert "defaults from mem\n" in caplog.text + "\n" and "untuned" not in caplog.text
    assert va.H == NUM_HEADS // 2 and va.plans[0].split_table is None
    assert va.nsplit_for(1, 10) == va.plans[0].params.NSPLIT


# -- a deliberately wrong kernel is caught at start-up ---------------------------------

class _ScaleBugTriton(TritonBackend):
    """The real Triton kernel launched with a wrong softmax scale: a plausible tuning bug."""

    def launch(self, args, params):
        args.sm_scale *= 2.0
        super().launch(args, params)


def test_startup_self_check_rejects_a_wrong_kernel(device, replace_backend):
    replace_backend("triton", _ScaleBugTriton)
    with pytest.raises(RuntimeError, match="self-check failed"):
        VerifyAttention.from_defaults(parse_tuned(tuned_dict(device), "mem"), tp=TP, max_batch=1,
                                      max_context=128, device=device)


@pytest.mark.parametrize("batch", [2, 3])
def test_batches_past_the_largest_bucket_keep_its_cta_count(device, batch):
    """Only a batch-1 entry: a batch of n runs each request with max(1, floor(NSPLIT / n))
    splits (never more CTAs than tuned, but one per request), on the device, and still
    matches the oracle."""
    doc = tuned_dict(device)
    doc["entries"] = [doc["entries"][0]]                     # tuned at batch 1 only: NSPLIT 1/2/4
    # warm-up runs each distinct launch at a batch that uses it (the unscaled batch-1 grid at
    # batch 2 would need more workspace than was allocated)
    va = VerifyAttention.from_defaults(parse_tuned(doc, "mem"), tp=TP, max_batch=3, max_context=300,
                                       device=device)
    prefixes = [300, 129, 7][:batch]
    want = [max(1, va.nsplit_for(1, p) // batch) for p in prefixes]
    assert [va.nsplit_for(batch, p) for p in prefixes] == want
    assert va.nsplit_for(1, 300) == 4 and va.nsplit_for(2, 300) == 2 and va.nsplit_for(3, 300) == 1
    inp = make_inputs(batch, T, H, prefixes, tree="random", seed=batch, device=device, sm_scale=va.sm_scale)
    va.workspace.fill_(255)
    o = va(*inp.args[:5])
    assert rel_error(o, reference_attention(*inp.args)[0]) < TOL
    _, part_lse = partials(va.problem(batch), va.params_for(batch).NSPLIT, va.workspace)
    for b, n in enumerate(want):
        assert bool(torch.isneginf(part_lse[n:, b * T, 0]).all()), (b, n)   # no split past the scaled NSPLIT
        assert bool(torch.isfinite(part_lse[0, b * T, 0]))


def test_scaled_batches_shrink_the_grid_and_the_workspace(device):
    """Past the tuned bucket the grid NSPLIT shrinks with the per-request NSPLIT, so the
    workspace is sized for the scaled grid, not for the tuned one at max_batch."""
    doc = tuned_dict(device)
    doc["entries"] = [doc["entries"][0]]                     # batch 1, grid NSPLIT 4
    va = VerifyAttention.from_defaults(parse_tuned(doc, "mem"), tp=TP, max_batch=8, max_context=300,
                                       device=device, warmup=False)
    grid = {n: va.params_for(n).NSPLIT for n in (1, 2, 3, 4, 8)}
    assert grid == {1: 4, 2: 2, 3: 1, 4: 1, 8: 1}
    be = TritonBackend()
    assert va.workspace_bytes == max(be.workspace_bytes(va.problem(n), va.params_for(n)) for n in range(1, 9))
    assert va.workspace_bytes < be.workspace_bytes(va.problem(8), va.plans[0].params)
    va.warmup()                                               # every scaled variant is compiled and checked
    check_against_oracle(va, [300, 7, 129, 1, 54], "random", 5, device)


def test_untuned_fallback_reports_the_nsplit_it_launches(tmp_path, device, monkeypatch):
    monkeypatch.setattr(lookup, "packaged_defaults_dir", lambda: tmp_path)
    va = VerifyAttention.from_defaults(None, tp=TP, max_batch=2, max_context=128, device=device, warmup=False,
                                       deployment="absent", draft_tokens=T, heads=H, sm_scale=0.0721)
    assert [va.nsplit_for(n, 100) for n in (1, 2)] == [va.params_for(n).NSPLIT for n in (1, 2)]


def test_direct_config_refuses_a_per_request_nsplit(tmp_path, device, monkeypatch):
    """`direct_config` (one plain verify_attention call running what `run` launches): Triton picks
    NSPLIT per request from its table, so there is no one call (ValueError naming the batch);
    without a table (the untuned fallback) it is the launch's own params."""
    va = VerifyAttention.from_defaults(parse_tuned(tuned_dict(device), "mem"), tp=TP, max_batch=4, max_context=200,
                                       device=device, warmup=False)
    with pytest.raises(ValueError, match="batch: the triton backend picks NSPLIT per request"):
        va.direct_config(2, 2 * (100 + T))
    monkeypatch.setattr(lookup, "packaged_defaults_dir", lambda: tmp_path)
    fb = VerifyAttention.from_defaults(None, tp=TP, max_batch=2, max_context=128, device=device, warmup=False,
                                       deployment="absent", draft_tokens=T, heads=H, sm_scale=0.0721)
    for n in (1, 2):
        be, params = fb.direct_config(n, n * 100)
        assert (be.name, params) == (fb.plan_for(n).backend.name, fb.params_for(n))


def test_scaling_up_between_buckets_stops_at_the_largest_nsplit(device):
    """A batch far under its bucket scales Triton's NSPLIT up (the bucket's CTA count), but never
    past TritonParams' largest NSPLIT: an entry tuned at batch 64 with NSPLIT 64 serves batch 1
    with 256 splits per request (not 4096, which the kernel refuses), and still matches the oracle."""
    from kvtune.kernels.triton_params import TRITON_PARAMS
    most = TRITON_PARAMS.params["NSPLIT"].legal[-1]
    doc = tuned_dict(device)
    doc["entries"] = [dict(doc["entries"][1], max_batch=64, params=dict(doc["entries"][1]["params"], NSPLIT=64),
                           buckets=[{"max_context": 100, "NSPLIT": 8}, {"max_context": 200, "NSPLIT": 64}])]
    va = VerifyAttention.from_defaults(parse_tuned(doc, "mem"), tp=TP, max_batch=64, max_context=200,
                                       device=device, warmup=False)
    for n in (1, 2, 16, 64):
        assert va.nsplit_for(n, 200) == min(most, max(1, 64 * 64 // n)), n
        assert va.nsplit_for(n, 50) == min(most, max(1, 8 * 64 // n)), n
        assert va.params_for(n).NSPLIT == min(most, 64 * 64 // n)
    check_against_oracle(va, [150], "random", 3, device)


def test_a_file_named_for_model_and_device_serves_another_deployment(tmp_path, device, monkeypatch):
    """`<model>__<device>.yaml` (README "Lookup"): found through from_defaults(model=...) for a
    deployment of another name, its model.name checked instead of its deployment; by the
    deployment's own name, the deployment is still checked."""
    monkeypatch.setattr(lookup, "packaged_defaults_dir", lambda: tmp_path / "none")
    monkeypatch.setenv(rt.ENV_CONFIG_DIR, str(tmp_path))
    name = f"Tiny-MLA__{rt.slug(rt.device_name(device))}.yaml"
    write(tmp_path, tuned_dict(device, deployment="tuned-elsewhere"), name=name)
    va = VerifyAttention.from_defaults(None, deployment="mydep", model="Tiny-MLA", tp=TP, max_batch=1,
                                       max_context=128, device=device, warmup=False)
    assert va.plans[0].source.startswith(str(tmp_path / name)) and va.plans[0].entry is not None
    doc = tuned_dict(device, deployment="tuned-elsewhere")
    doc["model"]["name"] = "Other-MLA"
    write(tmp_path, doc, name=name)
    with pytest.raises(ProvenanceError, match="model.name: file is for 'Other-MLA', asked for 'Tiny-MLA'"):
        load_defaults(deployment="mydep", model="Tiny-MLA", device=device)
    write(tmp_path, tuned_dict(device, deployment="tuned-elsewhere"), name="mydep.yaml")
    with pytest.raises(ProvenanceError, match="deployment: file is for 'tuned-elsewhere', asked for 'mydep'"):
        load_defaults(deployment="mydep", model="Tiny-MLA", device=device)
    # a model given is checked however the file was found (by name, as a file, or parsed)
    for how in ({"tuned": None, "deployment": "mydep"}, {"tuned": tmp_path / "mydep.yaml"},
                {"tuned": parse_tuned(tuned_dict(device), "mem")}):
        with pytest.raises(ProvenanceError, match="model.name: file is for 'Tiny-MLA', asked for 'Other-MLA'"):
            VerifyAttention.from_defaults(**how, model="Other-MLA", tp=TP, max_batch=1, max_context=128,
                                          device=device, warmup=False)


@pytest.mark.parametrize("bad,match", [
    ("gpu", r"device: 'gpu' is not a device torch knows"),
    ("meta", r"device: 'meta'; kvtune runs on 'cuda'"),
    ("cuda:99", r"device: 'cuda:99'"),
])
def test_a_device_that_cannot_run_is_named(tmp_path, bad, match):
    """A device spelling torch refuses, one that is not cuda or cpu, or a CUDA device this process
    does not have: a ValueError naming `device` from the runtime and the loader alike."""
    path = write(tmp_path, tuned_dict("cpu"))
    with pytest.raises(ValueError, match=match):
        VerifyAttention.from_defaults(path, tp=TP, max_batch=1, device=bad, warmup=False)
    with pytest.raises(ValueError, match=match):
        load_defaults(path, device=bad)


def test_a_given_sm_scale_other_than_the_files_is_used_and_logged(device, caplog):
    tuned = parse_tuned(tuned_dict(device), "mem")
    with caplog.at_level(logging.WARNING, logger="kvtune.runtime"):
        va = VerifyAttention.from_defaults(tuned, tp=TP, max_batch=1, max_context=128, device=device, warmup=False,
                                           sm_scale=0.2)
    assert va.sm_scale == 0.2
    assert sum("model.sm_scale is 0.0721, running with the given sm_scale=0.2" in r.getMessage()
               for r in caplog.records) == 1
