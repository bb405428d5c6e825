"""The SGLang-layout adapter on the CPU (Triton under its interpreter), against the fp32
oracle and against a direct torch rendering of SGLang's own extend semantics."""
from __future__ import annotations

import math

import pytest
import torch

from kvtune.kernels import make_inputs, reference_attention, rel_error
from kvtune.kernels import runtime as rt
from kvtune.kernels.sglang import SGLangVerifyAdapter, sglang_verify_args
from kvtune.kernels.triton_kernel import kernel_source_hash
from kvtune.kernels.tuned import parse_tuned

T, H, DV, DK = 9, 2, 512, 576
TOL = 2e-2


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(rt.ENV_VERIFY, raising=False)
    monkeypatch.delenv(rt.ENV_CONFIG_DIR, raising=False)


def tuned(device):
    """Tuned defaults for the running device: small grids keep the interpreter quick."""
    return parse_tuned({
        "schema_version": 1, "deployment": "sglang-test",
        "model": {"name": "Tiny-MLA", "num_heads": H, "kv_lora_rank": DV, "qk_rope_head_dim": DK - DV,
                  "draft_tokens": T, "sm_scale": 0.0721},
        "provenance": {"device_name": rt.device_name(device), "arch": rt.device_arch(device),
                       "kernel_hash": {"triton": kernel_source_hash()}, "date": "2026-11-29T17:00:00Z"},
        "entries": [{"tp": 1, "heads_per_rank": H, "max_batch": 4, "backend": "triton",
                     "params": {"NSPLIT": 3, "BLOCK_N": 32, "HEADS_PER_BLOCK": 2, "NUM_WARPS": 4, "STAGES": 1},
                     "buckets": [{"max_context": 50, "NSPLIT": 1}, {"max_context": 200, "NSPLIT": 2},
                                 {"max_context": 400, "NSPLIT": 3}]}]}, "mem")


def adapter(device, max_batch=4, max_context=300, **kw):
    kw.setdefault("check_values", True)
    return SGLangVerifyAdapter.from_defaults(tuned(device), tp=1, max_batch=max_batch, max_context=max_context,
                                             device=device, **kw)


@pytest.fixture(scope="module")
def shared():
    """One adapter (compiled and self-checked once) for the tests that need no special config."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(rt.ENV_VERIFY, raising=False)
        return adapter("cuda" if torch.cuda.is_available() else "cpu")


def sglang_args(inp, *, prefix_noise=False, generator=None, **dtypes):
    """`sglang_verify_args` split into (extend_attention_fwd kwargs, out_cache_loc); with
    prefix_noise, random garbage in the prefix columns of the mask (SGLang skips them)."""
    a = sglang_verify_args(inp, **dtypes)
    loc = a.pop("out_cache_loc")
    if prefix_noise:
        ip, mp = a["kv_indptr"].tolist(), a["mask_indptr"].tolist()
        for b in range(inp.B):
            P = ip[b + 1] - ip[b]
            blk = a["custom_mask"][mp[b]:mp[b] + T * (P + T)].view(T, P + T)
            blk[:, :P] = (torch.rand(T, P, generator=generator) < 0.5).to(blk.dtype)
    return a, loc


def sglang_semantics(a) -> torch.Tensor:
    """fp32 torch rendering of SGLang's extend_attention_fwd (skip_prefix_custom_mask=True):
    prefix keys from k_buffer through kv_indices, draft keys from k_extend, draft columns of
    the custom mask. Independent of kvtune's index merge and mask packing. On the CPU, whatever
    device the arguments are on."""
    a = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    q, kb, ke = a["q_extend"].float(), a["k_buffer"][:, 0].float(), a["k_extend"][:, 0].float()
    B = a["qo_indptr"].numel() - 1
    ip = a["kv_indptr"].tolist()
    mp = a["mask_indptr"].tolist() if a["custom_mask"] is not None else None
    out = torch.zeros(B * T, H, DV)
    for b in range(B):
        P = ip[b + 1] - ip[b]
        keys = torch.cat([kb[a["kv_indices"][ip[b]:ip[b + 1]].long()], ke[b * T:(b + 1) * T]])
        if a["custom_mask"] is not None:
            vis = a["custom_mask"][mp[b]:mp[b] + T * (P + T)].view(T, P + T).bool().clone()
            vis[:, :P] = True
        else:
            vis = torch.ones(T, P + T, dtype=torch.bool)
            if a["is_causal"]:
                vis[:, P:] = torch.tril(vis[:, P:])
        logits = torch.einsum("thd,ld->thl", q[b * T:(b + 1) * T], keys) * a["sm_scale"]
        logits = logits.masked_fill(~vis[:, None, :], float("-inf"))
        out[b * T:(b + 1) * T] = torch.einsum("thl,ld->thd", logits.softmax(-1), keys[:, :DV])
    return out


@pytest.mark.parametrize("prefix_lens,tree", [([1], "chain"), ([54], "random"), ([1, 54, 97], "chain"),
                                              ([97, 1, 54], "random"), ([300, 7, 160, 33], "random")])
def test_adapter_matches_oracle_and_sglang(device, shared, prefix_lens, tree):
    ad = shared
    inp = make_inputs(len(prefix_lens), T, H, prefix_lens, tree=tree, seed=sum(prefix_lens), device=device)
    a, loc = sglang_args(inp)
    lse = torch.empty(inp.B * T, H, dtype=torch.float32, device=device)
    o, lse = ad.extend_attention_fwd(**a, out_cache_loc=loc, lse_extend=lse)
    assert o.data_ptr() == a["o_extend"].data_ptr()
    ref, ref_lse = reference_attention(*inp.args)
    assert rel_error(o, ref) < TOL
    assert rel_error(o, sglang_semantics(a)) < TOL
    assert torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3)
    assert torch.equal(ad.tree[:inp.B * T], inp.tree_mask)           # the packed mask, bit for bit
    assert torch.equal(ad.indptr[:inp.B + 1], inp.kv_indptr)
    assert not ad.overflowed()


def test_prefix_columns_of_the_mask_are_ignored(device, shared):
    ad = shared
    inp = make_inputs(3, T, H, [1, 54, 97], tree="random", seed=11, device=device)
    a, loc = sglang_args(inp, prefix_noise=True, mask_dtype=torch.uint8, indices_dtype=torch.int64,
                         loc_dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    o = ad(**a, out_cache_loc=loc)
    assert rel_error(o, reference_attention(*inp.args)[0]) < TOL


@pytest.mark.parametrize("is_causal", [True, False])
def test_no_custom_mask_is_causal_or_full(device, shared, is_causal):
    ad = shared
    parents = [i - 1 for i in range(T)] if is_causal else [-1] * T   # a chain, or T roots seeing all
    inp = make_inputs(2, T, H, [20, 97], tree=parents, seed=4, device=device)
    if not is_causal:
        inp.tree_mask.fill_((1 << T) - 1)                                # every draft sees every draft
    a, loc = sglang_args(inp)
    a.update(custom_mask=None, mask_indptr=None, is_causal=is_causal)
    o = ad(**a, out_cache_loc=loc)
    assert rel_error(o, reference_attention(*inp.args)[0]) < TOL
    assert rel_error(o, sglang_semantics(a)) < TOL


def test_scratch_slots_receive_the_draft_keys(device):
    """Without out_cache_loc the drafts' keys go to reserved scratch slots of the pool."""
    B, max_batch = 3, 4
    inp = make_inputs(B, T, H, [1, 54, 97], tree="random", seed=8, pool_factor=1.0, device=device)
    a, _ = sglang_args(inp)
    n_slots = inp.kv_cache.shape[0]
    pool = torch.randn(n_slots + max_batch * T, DK).to(torch.bfloat16).to(device)
    pool[:n_slots] = inp.kv_cache
    scratch = torch.arange(n_slots, n_slots + max_batch * T, device=device)   # garbage there now
    a.update(k_buffer=pool.unsqueeze(1), v_buffer=pool.unsqueeze(1)[..., :DV])
    a["k_extend"] = torch.randn(B * T, 1, DK).to(torch.bfloat16).to(device)  # the drafts' fresh keys
    ad = adapter(device, max_batch=max_batch, scratch_slots=scratch, warmup=False)
    o = ad(**a)
    assert torch.equal(pool[scratch[:B * T]], a["k_extend"][:, 0])
    assert rel_error(o, sglang_semantics(a)) < TOL
    # write_draft_kv=True does the same at SGLang's own slots
    loc = scratch[:B * T].flip(0).contiguous()
    a["k_extend"] = torch.randn(B * T, 1, DK).to(torch.bfloat16).to(device)
    o = ad.extend_attention_fwd(**a, out_cache_loc=loc, write_draft_kv=True)
    assert rel_error(o, sglang_semantics(a)) < TOL
    assert torch.equal(pool[loc], a["k_extend"][:, 0])


def test_overflow_is_flagged_not_out_of_bounds(device):
    # capacity = 2 * (50 + T) combined keys; these prefixes need more
    ad = adapter(device, max_batch=2, max_context=50, check_values=False, warmup=False)
    inp = make_inputs(2, T, H, [100, 90], seed=2, device=device)
    a, loc = sglang_args(inp)
    ad(**a, out_cache_loc=loc)
    assert ad.overflowed()
    assert int(ad.indptr[2]) == ad.capacity and int(ad.indices.max()) < inp.kv_cache.shape[0]
    ad.reset_overflow()
    assert not ad.overflowed()
    with pytest.raises(ValueError, match="exceed the adapter's capacity"):
        adapter(device, max_batch=2, max_context=50, warmup=False)(**a, out_cache_loc=loc)


def test_env_off_returns_none(device, monkeypatch):
    monkeypatch.setenv(rt.ENV_VERIFY, "off")
    assert adapter(device) is None


def test_default_sm_scale_is_the_models(device, shared):
    """No sm_scale: the model's (0.0721 in the tuned file), not SGLang's 1/sqrt(Dk), which
    would drop MLA's 1/sqrt(192) and any mscale and give a silently different softmax."""
    ad = shared
    assert ad.verify.sm_scale == 0.0721 and abs(0.0721 - 1 / math.sqrt(DK)) > 0.02
    inp = make_inputs(1, T, H, [40], seed=3, device=device, sm_scale=0.0721)
    a, loc = sglang_args(inp)
    a["sm_scale"] = None
    assert rel_error(ad(**a, out_cache_loc=loc), reference_attention(*inp.args)[0]) < TOL


@pytest.mark.parametrize("change,match", [
    (dict(logit_cap=30.0), "logit_cap"),
    (dict(sliding_window_size=128), "sliding_window_size"),
    (dict(sinks="x"), "sinks"),
    (dict(xai_temperature_len=4), "xai_temperature_len"),
    (dict(k_scale=0.125), "k_scale"),
    (dict(skip_prefix_custom_mask=False), "skip_prefix_custom_mask"),
    (dict(max_len_extend=T + 1), "max_len_extend"),
    (dict(out_cache_loc=None), "out_cache_loc"),
    (dict(out_cache_loc="short"), "out_cache_loc: needs at least"),
    (dict(v_buffer="copy"), "v_buffer"),
    (dict(k_buffer="wide"), "k_buffer"),
    (dict(qo_indptr="ragged"), "qo_indptr"),
    (dict(kv_indptr="long"), "kv_indptr"),
    (dict(custom_mask="float"), "custom_mask"),
    (dict(k_extend="short"), "k_extend"),
    # an fp16 (or fp8) pool beside SGLang's bf16 k_extend names the pool, not k_extend
    (dict(k_buffer="fp16", v_buffer=None), r"^k_buffer: expected bf16, got torch.float16"),
    (dict(sm_scale=0.0), r"sm_scale: expected a positive finite float, got 0.0"),
    (dict(max_len_extend=T + 0.5), "max_len_extend"),
    (dict(max_len_extend="9"), "max_len_extend"),
    (dict(k_scale="x"), "k_scale"),
    (dict(v_buffer=[1]), "v_buffer: expected a view of k_buffer's first 512 columns"),
    # a draft slot that is also a prefix slot (the pool would hold one key for both), or given twice
    (dict(out_cache_loc="prefix"), r"out_cache_loc: slot \d+ \(draft row 3\) is also a prefix slot"),
    (dict(out_cache_loc="twice"), r"out_cache_loc: slot \d+ is given to two draft tokens"),
])
def test_bad_arguments_are_named(device, shared, change, match):
    ad = shared
    inp = make_inputs(2, T, H, [5, 30], tree="random", seed=1, device=device)
    a, loc = sglang_args(inp)
    a["out_cache_loc"] = loc
    for k, v in change.items():
        if v == "copy":
            v = a["k_buffer"][..., :DV].clone()
        elif v == "wide":
            v = torch.zeros(10, 2, DK, dtype=torch.bfloat16, device=device)
        elif v == "ragged":
            v = torch.tensor([0, 5, 18], dtype=torch.int32, device=device)
        elif v == "long":
            v = torch.cat([a["kv_indptr"], a["kv_indptr"][-1:]])
        elif v == "float":
            v = a["custom_mask"].float()
        elif v == "short":
            v = loc[:-1] if k == "out_cache_loc" else a["k_extend"][:-1]
        elif v == "fp16":
            v = a[k].to(torch.float16)
        elif v == "prefix":
            v = loc.clone()
            v[3] = a["kv_indices"][7]
        elif v == "twice":
            v = loc.clone()
            v[4] = v[2]
        a[k] = v
    with pytest.raises(ValueError, match=match):
        ad(**a)


def test_cpu_adapter_without_the_interpreter_says_how(tmp_path):
    """On CPU tensors without TRITON_INTERPRET, the adapter (whose plan packs with a Triton
    kernel whatever backend attends, the reference one too) is refused when made, naming the
    variable, not with Triton's driver error at the first plan."""
    import os
    import subprocess
    import sys
    code = ("from kvtune.kernels.sglang import SGLangVerifyAdapter\n"
            "SGLangVerifyAdapter.from_defaults(None, deployment='nope', tp=1, max_batch=2, max_context=300, "
            "device='cpu', draft_tokens=4, heads=8, sm_scale=0.1)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["KVTUNE_VERIFY"] = "reference"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode != 0
    assert "ValueError: device cpu: the adapter packs each step's metadata with Triton" in r.stderr, r.stderr
    assert "TRITON_INTERPRET=1" in r.stderr and "active drivers" not in r.stderr, r.stderr
