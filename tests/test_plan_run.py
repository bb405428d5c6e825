"""Plan once per step, run once per layer (CPU: Triton under its interpreter).

`VerifyAttention.plan` / `run` and `SGLangVerifyAdapter.plan` / `run`: several layers (their
own q, KV pool and drafts' keys) run on one plan and each matches the fp32 oracle; the adapter's
plan + runs match its per-call path; metadata errors are raised by plan and shape mismatches by
run, naming the argument."""
from __future__ import annotations

import pytest
import torch
from kvtune.kernels import make_inputs, reference_attention, rel_error
from kvtune.kernels import runtime as rt
from kvtune.kernels.runtime import StepPlan, VerifyAttention
from kvtune.kernels.sglang import AdapterPlan, SGLangVerifyAdapter, sglang_verify_args
from test_sglang import DK, DV, TOL, H, T, tuned  # the same tiny tuned defaults (Triton, 2 heads)

LAYERS = 3


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(rt.ENV_VERIFY, raising=False)
    monkeypatch.delenv(rt.ENV_CONFIG_DIR, raising=False)


def _built(cls):
    """`cls.from_defaults` on the tiny tuned defaults, once per module (outside any test's env)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(rt.ENV_VERIFY, raising=False)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return cls.from_defaults(tuned(dev), tp=1, max_batch=4, max_context=300, device=dev)


@pytest.fixture(scope="module")
def va():
    return _built(VerifyAttention)


@pytest.fixture(scope="module")
def ad():
    return _built(SGLangVerifyAdapter)


def layer_inputs(inp, layer: int):
    """Another layer of the same step: the same slots, tree and indptr, its own q and KV pool."""
    g = torch.Generator().manual_seed(1000 + layer)
    q = torch.randn(inp.q.shape, generator=g).to(torch.bfloat16).to(inp.q.device)
    kv = torch.randn(inp.kv_cache.shape, generator=g).to(torch.bfloat16).to(inp.q.device)
    return q, kv


# -- VerifyAttention -------------------------------------------------------------------

@pytest.mark.parametrize("prefix_lens,tree", [([54], "random"), ([300, 1, 160], "random"), ([7, 97], "chain")])
def test_one_plan_serves_every_layer(device, va, prefix_lens, tree):
    inp = make_inputs(len(prefix_lens), T, H, prefix_lens, tree=tree, seed=len(prefix_lens), device=device,
                      sm_scale=va.sm_scale)
    step = va.plan(inp.kv_indptr, inp.kv_indices, inp.tree_mask, num_slots=inp.kv_cache.shape[0])
    assert isinstance(step, StepPlan) and step.B == inp.B and va.last_plan is step
    for layer in range(LAYERS):
        q, kv = layer_inputs(inp, layer)
        out = torch.full((inp.B * T, H, DV), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((inp.B * T, H), float("nan"), dtype=torch.float32, device=device)
        o, lse = va.run(q, kv, out, lse=lse)
        assert o.data_ptr() == out.data_ptr()
        ref, ref_lse = reference_attention(q, kv, inp.kv_indptr, inp.kv_indices, inp.tree_mask, va.sm_scale)
        assert rel_error(o, ref) < TOL, layer
        assert torch.allclose(lse, ref_lse, atol=1e-2, rtol=1e-3)
    # the default output is the preallocated buffer
    assert va.run(q, kv).data_ptr() == va.out_buf.data_ptr()


def test_runs_pick_their_plan(device, va):
    """Two steps planned (different batch sizes): each run uses the plan it is given."""
    a = make_inputs(2, T, H, [40, 120], tree="random", seed=1, device=device, sm_scale=va.sm_scale)
    b = make_inputs(3, T, H, [5, 250, 60], tree="random", seed=2, device=device, sm_scale=va.sm_scale)
    pa = va.plan(*a.args[2:5])
    pb = va.plan(*b.args[2:5])
    assert va.last_plan is pb
    oa = va.run(a.q, a.kv_cache, plan=pa).clone()
    assert rel_error(oa, reference_attention(*a.args)[0]) < TOL
    assert rel_error(va.run(b.q, b.kv_cache), reference_attention(*b.args)[0]) < TOL


def test_run_refuses_another_objects_plan(device, va):
    """A plan binds its batch entry and workspace layout: another VerifyAttention's plan (here
    one of a larger max_batch, so a batch this object's workspace was not sized for) is refused."""
    other = VerifyAttention.from_defaults(tuned(device), tp=1, max_batch=4, max_context=300, device=device,
                                          warmup=False)
    inp = make_inputs(2, T, H, [40, 120], tree="random", seed=4, device=device, sm_scale=va.sm_scale)
    foreign = other.plan(*inp.args[2:5])
    with pytest.raises(ValueError, match="plan: made by another VerifyAttention"):
        va.run(inp.q, inp.kv_cache, plan=foreign)
    assert rel_error(other.run(inp.q, inp.kv_cache), reference_attention(*inp.args)[0]) < TOL


def _plan_errors(device):
    """(what, call(va, inp) that must raise, text the message must hold)."""
    i32, i64 = torch.int32, torch.int64
    return [
        ("indptr int64", lambda va, x: va.plan(x.kv_indptr.to(i64), x.kv_indices, x.tree_mask), "kv_indptr: expected"),
        ("indptr 2-D", lambda va, x: va.plan(x.kv_indptr[None], x.kv_indices, x.tree_mask), "kv_indptr"),
        ("no request", lambda va, x: va.plan(x.kv_indptr[:1], x.kv_indices, x.tree_mask[:0]), "kv_indptr: .*B=0"),
        ("too many", lambda va, x: va.plan(torch.arange(6, dtype=i32, device=device) * 10, x.kv_indices,
                                           torch.zeros(5 * T, dtype=i64, device=device)), "kv_indptr: .*B=5"),
        ("indices float", lambda va, x: va.plan(x.kv_indptr, x.kv_indices.float(), x.tree_mask), "kv_indices"),
        ("indices list", lambda va, x: va.plan(x.kv_indptr, x.kv_indices.tolist(), x.tree_mask), "kv_indices"),
        ("tree short", lambda va, x: va.plan(x.kv_indptr, x.kv_indices, x.tree_mask[:-1]), r"tree_mask: .*\[18\]"),
        ("tree int32", lambda va, x: va.plan(x.kv_indptr, x.kv_indices, x.tree_mask.to(i32)), "tree_mask"),
        ("num_slots", lambda va, x: va.plan(*x.args[2:5], num_slots=0), "num_slots"),
        ("tree strided", lambda va, x: va.plan(x.kv_indptr, x.kv_indices, x.tree_mask.repeat_interleave(2)[::2]),
         r"tree_mask: .*got torch.int64 \[18\] with strides \[2\] \(not contiguous\)"),
        ("indices strided", lambda va, x: va.plan(x.kv_indptr, x.kv_indices.repeat_interleave(2)[::2], x.tree_mask),
         r"kv_indices: .*with strides \[2\] \(not contiguous\)"),
        # values (read outside graph capture)
        ("not monotonic", lambda va, x: va.plan(x.kv_indptr.flip(0).contiguous(), x.kv_indices, x.tree_mask),
         "kv_indptr"),
        ("past indices", lambda va, x: va.plan(x.kv_indptr, x.kv_indices[:-1], x.tree_mask), "kv_indptr"),
        ("short request", lambda va, x: va.plan(torch.tensor([0, 4, int(x.kv_indptr[-1])], dtype=i32, device=device),
                                                x.kv_indices, x.tree_mask), "kv_indptr: request 0 holds 4 keys"),
        ("slot range", lambda va, x: va.plan(*x.args[2:5], num_slots=int(x.kv_indices.max())),
         "kv_indices: slot .* out of range"),
        ("tree bits past T", lambda va, x: va.plan(x.kv_indptr, x.kv_indices, x.tree_mask | (1 << 40)),
         "tree_mask: row 0 .* at or beyond T"),
    ]


@pytest.mark.parametrize("what", [w for w, _, _ in _plan_errors("cpu")])
def test_plan_names_bad_metadata(device, va, what):
    call, match = next((c, m) for w, c, m in _plan_errors(device) if w == what)
    inp = make_inputs(2, T, H, [20, 30], tree="random", seed=3, device=device)
    with pytest.raises(ValueError, match=match):
        call(va, inp)


def test_value_checks_can_be_left_to_the_engine(device, va):
    """check_values=False: plan reads no value (an engine that trusts its metadata)."""
    inp = make_inputs(2, T, H, [20, 30], tree="random", seed=3, device=device)
    bad = inp.kv_indptr.flip(0).contiguous()
    with pytest.raises(ValueError, match="kv_indptr"):
        va.plan(bad, inp.kv_indices, inp.tree_mask)
    assert va.plan(bad, inp.kv_indices, inp.tree_mask, check_values=False).B == 2


@pytest.mark.parametrize("change,match", [
    (dict(q="other batch"), r"q: expected \[18, 2, 576\] .*planned B=2"),
    (dict(q="fp16"), "q: expected bf16"),
    (dict(kv_cache="narrow"), r"kv_cache: expected \[num_slots, 576\]"),
    (dict(q="strided last dim"), r"q: expected bf16 .* \(strides \[2304, 1152, 2\]\)"),
    (dict(kv_cache="column-major"), r"kv_cache: expected bf16 rows, contiguous, .* \(strides \[1, \d+\]\)"),
    (dict(kv_cache="fewer slots"), "kv_cache: .* fewer than the num_slots"),
    (dict(out="wrong"), r"out: expected bf16 \[18, 2, 512\]"),
    (dict(lse="wrong"), r"lse: expected fp32 \[18, 2\]"),
    (dict(out="one row for all"), r"out: its elements overlap in memory \(strides \[0, 512, 1\]\)"),
    (dict(lse="one row for all"), r"lse: its elements overlap in memory"),
    (dict(out="strided last dim"), r"out: the last dimension must be contiguous \(strides \[2048, 1024, 2\]\)"),
    (dict(out="a list"), r"out: expected bf16 \[18, 2, 512\] on .*, got list"),
    (dict(sm_scale=-1.0), "sm_scale"),
    (dict(plan="not a plan"), "plan: expected a StepPlan"),
    (dict(out="inside q"), "out: shares memory with q: the kernel would read what it writes"),
    (dict(lse="inside the workspace"), "lse: shares memory with workspace"),
])
def test_run_names_shapes_that_do_not_match_the_plan(device, va, change, match):
    inp = make_inputs(2, T, H, [20, 30], tree="random", seed=3, device=device)
    step = va.plan(*inp.args[2:5], num_slots=inp.kv_cache.shape[0])
    kw = dict(q=inp.q, kv_cache=inp.kv_cache, out=None, lse=None, sm_scale=None, plan=step)
    for k, v in change.items():
        kw[k] = {"other batch": inp.q[:T], "fp16": inp.q.half(), "narrow": inp.kv_cache[:, :DV],
                 "fewer slots": inp.kv_cache[:-1],
                 "wrong": torch.empty(3, dtype=torch.float32, device=device),
                 "strided last dim": torch.empty(2 * T, H, 2 * (DV if k == "out" else inp.q.shape[-1]),
                                                 dtype=torch.bfloat16, device=device)[..., ::2],
                 "column-major": inp.kv_cache.t().contiguous().t(),
                 "a list": [0.0] * (2 * T),
                 "one row for all": (torch.zeros(1, H, DV, dtype=torch.bfloat16, device=device).expand(2 * T, H, DV)
                                     if k == "out" else torch.zeros(1, H, device=device).expand(2 * T, H)),
                 "inside q": inp.q[..., :DV],
                 "inside the workspace": va.workspace[:2 * T * H * 4].view(torch.float32).view(2 * T, H)}.get(v, v)
    with pytest.raises(ValueError, match=match):
        va.run(kw.pop("q"), kw.pop("kv_cache"), **kw)


def test_run_refuses_a_pool_the_planned_slots_pass(device, va):
    """Without num_slots, plan's value checks still record the highest slot used: run refuses a
    kv_cache that slot would read past (it would read other memory silently)."""
    inp = make_inputs(2, T, H, [20, 30], tree="random", seed=3, device=device)
    step = va.plan(*inp.args[2:5])
    top = int(inp.kv_indices.max())
    assert step.slots_used == top + 1
    with pytest.raises(ValueError, match=f"kv_cache: {top} slots, but the planned kv_indices use slot {top}"):
        va.run(inp.q, inp.kv_cache[:top])
    assert va.plan(*inp.args[2:5], check_values=False).slots_used is None
    with pytest.raises(ValueError, match=r"check_values: expected True or False \(or None\), got 0"):
        va.plan(*inp.args[2:5], check_values=0)    # 0 or "False" would silently read as off or on
    with pytest.raises(ValueError, match="check_values: expected True or False, got None"):
        VerifyAttention.from_defaults(tuned(device), tp=1, max_batch=1, max_context=64, device=device,
                                      check_values=None, warmup=False)


def test_run_before_any_plan_is_an_error(device):
    fresh = VerifyAttention.from_defaults(tuned(device), tp=1, max_batch=1, max_context=64, device=device,
                                          warmup=False)
    inp = make_inputs(1, T, H, [5], device=device)
    with pytest.raises(ValueError, match=r"plan: no StepPlan to run; call plan\("):
        fresh.run(inp.q, inp.kv_cache)


# -- the SGLang adapter ----------------------------------------------------------------

def _sglang(inp):
    a = sglang_verify_args(inp)
    return a, a.pop("out_cache_loc")


@pytest.mark.parametrize("prefix_lens", [[54], [300, 1, 160, 33]])
def test_adapter_plan_once_run_per_layer(device, ad, prefix_lens):
    """One plan for the step, one run per layer: each layer matches the oracle on its own pool
    and q, and the per-call path (plan + run in every call) gives the same bits."""
    inp = make_inputs(len(prefix_lens), T, H, prefix_lens, tree="random", seed=sum(prefix_lens), device=device,
                      sm_scale=ad.verify.sm_scale)
    a, loc = _sglang(inp)
    step = ad.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"],
                   out_cache_loc=loc, max_len_extend=T, num_slots=inp.kv_cache.shape[0])
    assert isinstance(step, AdapterPlan) and ad.last_plan is step and not step.write
    assert torch.equal(ad.tree[:inp.B * T], inp.tree_mask)
    assert torch.equal(ad.indptr[:inp.B + 1], inp.kv_indptr)
    outs = []
    for layer in range(LAYERS):
        q, kv = layer_inputs(inp, layer)
        o = torch.full((inp.B * T, H, DV), float("nan"), dtype=torch.bfloat16, device=device)
        ad.run(q, kv.unsqueeze(1), o, v_buffer=kv.unsqueeze(1)[..., :DV], sm_scale=a["sm_scale"])
        ref = reference_attention(q, kv, inp.kv_indptr, inp.kv_indices, inp.tree_mask, inp.sm_scale)[0]
        assert rel_error(o, ref) < TOL, layer
        outs.append((q, kv, o))
    for q, kv, o in outs:                          # the per-call path, layer by layer
        b = dict(a, q_extend=q, k_buffer=kv.unsqueeze(1), v_buffer=kv.unsqueeze(1)[..., :DV],
                 k_extend=kv[loc].unsqueeze(1), o_extend=torch.empty_like(o))
        b["v_extend"] = b["k_extend"][..., :DV]
        assert torch.equal(ad.extend_attention_fwd(**b, out_cache_loc=loc), o)


def test_adapter_writes_each_layers_draft_keys(device):
    """Scratch slots: plan once; each run copies that layer's k_extend into its own pool."""
    B, max_batch = 2, 2
    inp = make_inputs(B, T, H, [54, 97], tree="random", seed=8, pool_factor=1.0, device=device)
    a, _ = _sglang(inp)
    n = inp.kv_cache.shape[0]
    scratch = torch.arange(n, n + max_batch * T, device=device)
    ad = SGLangVerifyAdapter.from_defaults(tuned(device), tp=1, max_batch=max_batch, max_context=300,
                                           device=device, scratch_slots=scratch, warmup=False)
    step = ad.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"])
    assert step.write
    for layer in range(2):
        g = torch.Generator().manual_seed(layer)
        pool = torch.randn(n + max_batch * T, DK, generator=g).to(torch.bfloat16).to(device)
        k_ext = torch.randn(B * T, 1, DK, generator=g).to(torch.bfloat16).to(device)
        q = torch.randn(inp.q.shape, generator=g).to(torch.bfloat16).to(device)
        o = torch.empty(B * T, H, DV, dtype=torch.bfloat16, device=device)
        with pytest.raises(ValueError, match="k_extend"):
            ad.run(q, pool.unsqueeze(1), o)                 # the plan writes drafts: k_extend needed
        ad.run(q, pool.unsqueeze(1), o, k_extend=k_ext, sm_scale=a["sm_scale"])
        assert torch.equal(pool[scratch[:B * T]], k_ext[:, 0])
        # the oracle on the combined list: request b's prefix slots, then its scratch slots
        ip = a["kv_indptr"].tolist()
        idx = torch.cat([torch.cat([a["kv_indices"][ip[b]:ip[b + 1]].long(), scratch[b * T:(b + 1) * T]])
                         for b in range(B)])
        ref = reference_attention(q, pool, inp.kv_indptr, idx, inp.tree_mask, a["sm_scale"])[0]
        assert rel_error(o, ref) < TOL, layer


@pytest.mark.parametrize("what,match", [
    ("qo_indptr", "qo_indptr: B=5 requests; this adapter serves 1..4"),
    ("max_len_extend", "max_len_extend"),
    ("kv_indices range", "kv_indices: slot .* out of range"),
    ("out_cache_loc range", "out_cache_loc: slot .* out of range"),
    ("num_slots", "num_slots"),
    # the pack kernel reads the mask at mask_indptr without bounds: its layout is checked first
    ("mask short", r"custom_mask: 10 entries, fewer than the B\*T\*T"),
    ("mask empty", r"custom_mask: 0 entries"),
    ("mask_indptr zeros", r"mask_indptr: request 0's block must hold T x \(P_b\+T\)"),
    ("mask_indptr T x T blocks", r"mask_indptr: request 0's block must hold"),
    ("mask_indptr past the mask", r"custom_mask: \d+ entries, but mask_indptr places the blocks at \d+\.\.\d+"),
    ("mask_indptr short", r"mask_indptr: needs at least 3 entries"),
    ("mask_indptr long", r"mask_indptr: expected 3 entries"),
])
def test_adapter_plan_names_bad_metadata(device, ad, what, match):
    inp = make_inputs(2, T, H, [20, 30], tree="random", seed=5, device=device)
    a, loc = _sglang(inp)
    kw = dict(out_cache_loc=loc, max_len_extend=T, num_slots=inp.kv_cache.shape[0])
    args = [a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"]]
    if what == "qo_indptr":
        args[0] = torch.arange(6, dtype=torch.int32, device=device) * T
    elif what == "max_len_extend":
        kw["max_len_extend"] = T - 1
    elif what == "kv_indices range":
        kw["num_slots"] = int(a["kv_indices"].max())
    elif what == "out_cache_loc range":
        kw["out_cache_loc"] = loc.clone()
        kw["out_cache_loc"][-1] = inp.kv_cache.shape[0]           # one past the pool
    elif what == "mask short":
        args[3] = args[3][:10].clone()
    elif what == "mask empty":
        args[3] = args[3][:0].clone()
    elif what == "mask_indptr zeros":
        args[4] = torch.zeros_like(args[4])
    elif what == "mask_indptr T x T blocks":
        args[4] = torch.arange(3, dtype=args[4].dtype, device=device) * T * T
    elif what == "mask_indptr past the mask":
        args[4] = args[4] + 10**6
    elif what == "mask_indptr short":
        args[4] = args[4][:-1]
    elif what == "mask_indptr long":
        args[4] = torch.cat([args[4], args[4][-1:]])
    else:
        kw["num_slots"] = -1
    with pytest.raises(ValueError, match=match):
        ad.plan(*args, **kw)


def test_adapter_runs_only_its_latest_plan(device, ad):
    """Every adapter plan packs into the same buffers: after plan B, plan A's packed indices
    are gone, so running A is refused (not a silent read of B's slots); so is another adapter's."""
    a_inp = make_inputs(2, T, H, [20, 30], tree="random", seed=11, device=device, sm_scale=ad.verify.sm_scale)
    b_inp = make_inputs(3, T, H, [200, 5, 90], tree="random", seed=12, device=device, sm_scale=ad.verify.sm_scale)
    (a, aloc), (b, bloc) = _sglang(a_inp), _sglang(b_inp)
    pa = ad.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"],
                 out_cache_loc=aloc)
    pb = ad.plan(b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["custom_mask"], b["mask_indptr"],
                 out_cache_loc=bloc)
    with pytest.raises(ValueError, match=r"plan: superseded \(plan \d+ of this adapter; plan \d+ has since"):
        ad.run(a["q_extend"], a["k_buffer"], a["o_extend"], plan=pa)
    o = ad.run(b["q_extend"], b["k_buffer"], b["o_extend"], plan=pb)
    assert rel_error(o, reference_attention(*b_inp.args)[0]) < TOL
    other = _built(SGLangVerifyAdapter)
    with pytest.raises(ValueError, match="plan: made by another SGLangVerifyAdapter"):
        other.run(b["q_extend"], b["k_buffer"], b["o_extend"], plan=pb)


def test_adapter_run_names_shapes_that_do_not_match_the_plan(device, ad):
    inp = make_inputs(2, T, H, [20, 30], tree="random", seed=6, device=device)
    a, loc = _sglang(inp)
    ad.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"],
            out_cache_loc=loc, num_slots=inp.kv_cache.shape[0])
    kb, o = a["k_buffer"], a["o_extend"]
    with pytest.raises(ValueError, match=r"q_extend: expected \[18, 2, 576\] for the planned B=2"):
        ad.run(inp.q[:T], kb, o)
    with pytest.raises(ValueError, match=r"o_extend: expected \[18, 2, 512\]"):
        ad.run(inp.q, kb, o[:T])
    with pytest.raises(ValueError, match="k_buffer: .* fewer than the num_slots"):
        ad.run(inp.q, kb[:-1], o)
    with pytest.raises(ValueError, match="v_buffer"):
        ad.run(inp.q, kb, o, v_buffer=kb[..., :DV].clone())
    # without num_slots: the highest slot the plan read (prefix or draft) bounds k_buffer
    step = ad.plan(a["qo_indptr"], a["kv_indptr"], a["kv_indices"], a["custom_mask"], a["mask_indptr"],
                   out_cache_loc=loc)
    top = max(int(a["kv_indices"].max()), int(loc.max()))
    assert step.slots_used == top + 1
    with pytest.raises(ValueError, match=f"k_buffer: {top} slots, but the planned kv_indices / draft slots"):
        ad.run(inp.q, kb[:top], o)
    with pytest.raises(ValueError, match="plan: expected an AdapterPlan"):
        ad.run(inp.q, kb, o, plan=ad.verify.last_plan)
    # the runtime's checks speak SGLang's names; a fp16 pool is named as the pool
    with pytest.raises(ValueError, match="q_extend: expected bf16"):
        ad.run(inp.q.half(), kb, o)
    with pytest.raises(ValueError, match="lse_extend: expected fp32"):
        ad.run(inp.q, kb, o, lse_extend=torch.empty(3, device=device))
    with pytest.raises(ValueError, match="k_buffer: expected bf16, got torch.float16"):
        ad.run(inp.q, kb.half(), o)
