"""Bad inputs: every error of the contract is a ValueError that names the argument."""
import pytest
import torch

from conftest import DEVICE
from kvtune.kernels import ModelShape, make_inputs, params_from_dict, tree_mask_from_parents, verify_attention
from kvtune.kernels.triton_kernel import TritonParams


@pytest.fixture
def x():
    return make_inputs(2, 4, 2, [5, 9], device=DEVICE)


def call(x, **over):
    args = dict(q=x.q, kv_cache=x.kv_cache, kv_indptr=x.kv_indptr, kv_indices=x.kv_indices,
                tree_mask=x.tree_mask, sm_scale=x.sm_scale)
    args.update(over)
    backend = args.pop("backend", "reference")
    return verify_attention(**args, backend=backend)


@pytest.mark.parametrize("over,name", [
    (lambda x: dict(q=x.q.float()), "q"),
    (lambda x: dict(q=x.q[0]), "q"),
    (lambda x: dict(q=x.q[:-1]), "q"),                                  # T does not divide
    (lambda x: dict(kv_cache=x.kv_cache.half()), "kv_cache"),
    (lambda x: dict(kv_cache=x.kv_cache[:, :500]), "kv_cache"),          # width != Dk
    (lambda x: dict(q=x.q[..., :512]), "q"),                              # Dk 512 against a 576-wide cache
    (lambda x: dict(kv_indptr=x.kv_indptr.long()), "kv_indptr"),
    (lambda x: dict(kv_indptr=x.kv_indptr[:1]), "kv_indptr"),
    (lambda x: dict(kv_indices=x.kv_indices.float()), "kv_indices"),
    (lambda x: dict(kv_indices=x.kv_indices[None]), "kv_indices"),
    (lambda x: dict(tree_mask=x.tree_mask.int()), "tree_mask"),
    (lambda x: dict(tree_mask=x.tree_mask[:-1]), "tree_mask"),
    (lambda x: dict(sm_scale=float("nan")), "sm_scale"),
    (lambda x: dict(sm_scale=-1.0), "sm_scale"),
    (lambda x: dict(sm_scale="0.1"), "sm_scale"),
    (lambda x: dict(backend="nope"), "backend"),
])
def test_metadata_errors_name_the_argument(x, over, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        call(x, **over(x))


def test_t_over_64_rejected():
    q = torch.zeros(65, 1, 576, dtype=torch.bfloat16)
    kv = torch.zeros(100, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^q: T = 65"):
        verify_attention(q, kv, torch.tensor([0, 65], dtype=torch.int32), torch.arange(65, dtype=torch.int32),
                         torch.zeros(65, dtype=torch.int64), 0.1, backend="reference")


def test_device_mismatch_named():
    x = make_inputs(1, 2, 1, [3])
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    with pytest.raises(ValueError, match="^kv_cache"):
        verify_attention(x.q.cuda(), *x.args[1:], backend="reference")


@pytest.mark.parametrize("mutate,name,msg", [
    (lambda x: x.kv_indptr.copy_(torch.tensor([0, 9, 8], dtype=torch.int32)), "kv_indptr", "monotonic"),
    (lambda x: x.kv_indptr.copy_(torch.tensor([0, 2, 13], dtype=torch.int32)), "kv_indptr", "fewer than"),
    (lambda x: x.kv_indptr.copy_(torch.tensor([0, 9, 10**6], dtype=torch.int32)), "kv_indptr", "exceeds"),
    (lambda x: x.kv_indices.__setitem__(3, 10**7), "kv_indices", "out of range"),
    (lambda x: x.kv_indices.__setitem__(0, -1), "kv_indices", "out of range"),
])
def test_value_errors(x, mutate, name, msg):
    mutate(x)
    with pytest.raises(ValueError, match=rf"^{name}.*{msg}"):
        call(x, backend="triton")


def test_out_and_params_errors(x):
    with pytest.raises(ValueError, match="^out"):
        call(x, out=torch.empty(8, 2, 256, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="^params"):
        call(x, backend="triton", params=object())
    with pytest.raises(ValueError, match="^lse"):
        verify_attention(*x.args, backend="reference", lse=torch.empty(8, 2, dtype=torch.float64, device=DEVICE))
    # one row expanded over all: every row would write the same memory
    one = torch.zeros(1, 2, 512, dtype=torch.bfloat16, device=DEVICE).expand(8, 2, 512)
    with pytest.raises(ValueError, match=r"^out: its elements overlap in memory \(strides \[0, 512, 1\]\)"):
        call(x, out=one)
    with pytest.raises(ValueError, match="^lse: its elements overlap"):
        verify_attention(*x.args, backend="reference", lse=torch.zeros(1, 2, device=DEVICE).expand(8, 2))
    with pytest.raises(ValueError, match=r"^out: the last dimension must be contiguous \(strides \[2048, 1024, 2\]\)"):
        call(x, out=torch.empty(8, 2, 1024, dtype=torch.bfloat16, device=DEVICE)[..., ::2])
    with pytest.raises(ValueError, match=r"^out: expected bf16 \[8, 2, 512\] on .*, got str$"):
        call(x, out="out")


@pytest.mark.parametrize("make,overlaps", [
    (lambda: torch.zeros(1, 4, 8).expand(3, 4, 8), True),
    (lambda: torch.zeros(12, 8).as_strided((3, 4, 8), (16, 4, 1)), True),      # rows 8 apart, 32 wide
    (lambda: torch.zeros(3, 4, 16)[:, :, :8], False),                          # padded rows
    (lambda: torch.zeros(4, 3, 8).transpose(0, 1), False),
    (lambda: torch.zeros(1, 4, 8).expand(1, 4, 8), False),                     # a stride 0 over one element
    (lambda: torch.zeros(3, 4, 8), False),
])
def test_overlapping_layouts(make, overlaps):
    from kvtune.kernels.shapes import overlapping
    assert overlapping(make()) is overlaps


def test_results_that_share_memory_with_an_input_or_each_other_are_named(x):
    """out / lse / workspace inside q, kv_cache or one another: the kernel would read what other
    CTAs write (no error before: a silent race on a GPU). Separate views of one buffer pass and match
    the oracle."""
    from kvtune.kernels import reference_attention, rel_error
    rows, H = x.q.shape[:2]
    q_buf = x.q.clone()
    with pytest.raises(ValueError, match="^out: shares memory with q: the kernel would read what it writes"):
        call(x, q=q_buf, out=q_buf[..., :512])
    cache = x.kv_cache.clone()
    in_cache = cache.view(-1)[:rows * H * 576].view(rows, H, 576)[..., :512]
    with pytest.raises(ValueError, match="^out: shares memory with kv_cache"):
        call(x, kv_cache=cache, out=in_cache)
    ws = torch.empty(4096, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="^lse: shares memory with workspace"):
        verify_attention(*x.args, backend="reference", lse=ws[:rows * H * 4].view(torch.float32).view(rows, H),
                         workspace=ws)
    out = torch.empty(rows, H, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="^out: shares memory with lse"):
        call(x, out=out, lse=out.view(-1).view(torch.float32)[:rows * H].view(rows, H))
    from kvtune.kernels.api import verify_attention_dispatch
    with pytest.raises(ValueError, match="^out: shares memory with q"):
        verify_attention_dispatch(q_buf, *x.args[1:], [("reference", None, None)], q_buf[..., :512], workspace=ws)
    # q and out side by side in one buffer: no element shared
    buf = torch.empty(rows * H * (576 + 512), dtype=torch.bfloat16, device=DEVICE)
    q2 = buf[:rows * H * 576].view(rows, H, 576)
    q2.copy_(x.q)
    out = buf[rows * H * 576:].view(rows, H, 512)
    call(x, q=q2, out=out)
    assert rel_error(out, reference_attention(*x.args)[0]) < 1e-2


@pytest.mark.parametrize("make,span", [
    (lambda: torch.zeros(3, 4, 8), 96),
    (lambda: torch.zeros(3, 4, 16)[:, :, :8], 2 * 64 + 3 * 16 + 8),   # the last row's padding is not reached
    (lambda: torch.zeros(4, 3, 8).transpose(0, 1), 96),
    (lambda: torch.zeros(1, 4, 8).expand(5, 4, 8), 32),
    (lambda: torch.zeros(0, 4), 0),
])
def test_byte_span(make, span):
    from kvtune.kernels.shapes import byte_span
    t = make()
    lo, hi = byte_span(t)
    assert lo == t.data_ptr() and hi - lo == span * t.element_size()


@pytest.mark.parametrize("kw,field", [
    (dict(NSPLIT=0), "NSPLIT"), (dict(BLOCK_N=24), "BLOCK_N"), (dict(HEADS_PER_BLOCK=0), "HEADS_PER_BLOCK"),
    (dict(NUM_WARPS=3), "NUM_WARPS"), (dict(STAGES=9), "STAGES"), (dict(NSPLIT=2.0), "NSPLIT"),
])
def test_triton_params_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        TritonParams(**kw)


def test_renamed_triton_params_name_the_new_names():
    """Triton's parameters took the CUDA backend's names; an old name says which one it became."""
    with pytest.raises(ValueError, match="BLOCK_H was renamed HEADS_PER_BLOCK, num_stages was renamed STAGES"):
        params_from_dict(TritonParams, {"NSPLIT": 4, "BLOCK_H": 2, "num_stages": 1}, where="triton params")


def test_tree_mask_from_parents():
    # chain: row i sees 0..i; tree 0 -> {1, 2}, 1 -> 3
    assert tree_mask_from_parents([-1, 0, 1]).tolist() == [1, 3, 7]
    assert tree_mask_from_parents([-1, 0, 0, 1]).tolist() == [1, 3, 5, 11]
    both = tree_mask_from_parents([[-1, 0], [-1, -1]])
    assert both.dtype == torch.int64 and both.tolist() == [1, 3, 1, 2]
    full = tree_mask_from_parents(list(range(-1, 63)))      # a 64-chain uses bit 63
    assert full[-1].item() == -1                            # all 64 bits set
    for bad in ([0], [-1, 1], [-1, -2], [[-1, 0], [-1]], list(range(-1, 64))):
        with pytest.raises(ValueError, match="parents"):
            tree_mask_from_parents(bad)


def test_model_shape():
    m = ModelShape(num_heads=64, draft_tokens=9)
    assert [m.heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [64, 32, 16, 8]
    assert m.dk == 576 and m.dv == 512 and m.flops_per_key(8) == 2176 * 9 * 8
    with pytest.raises(ValueError, match="tp=3 does not divide num_heads=64"):
        m.heads_per_rank(3)
    with pytest.raises(ValueError, match="draft_tokens"):
        ModelShape(num_heads=8, draft_tokens=65)


@pytest.mark.parametrize("call_,match", [
    (lambda: make_inputs(2, 3, 4, 5, tree="chian"), "^tree: expected 'chain', 'random'"),
    (lambda: make_inputs(0, 3, 4, 5), "^batch: expected an int >= 1, got 0"),
    (lambda: make_inputs(2, 3, 4, [5, -1]), "^prefix_lens: a prefix holds >= 0 keys, got -1"),
    (lambda: tree_mask_from_parents([-1, 0.5]), r"^parents\[1\] = 0.5: a parent must be an int"),
    (lambda: make_inputs(2, 4, 2, [10, 10], tree=[-1, 0, 1]), r"^tree: parent list 0 has 3 entries, but draft_tok"),
    (lambda: make_inputs(2, 3, 2, [10, 10], tree=[[-1, 0, 1]]), r"^tree: 1 parent lists for batch=2"),
    (lambda: tree_mask_from_parents(torch.tensor(3)), r"^parents: expected a list `\[T\]` or `\[B, T\]`"),
    (lambda: make_inputs(1, 0, 2, 5), r"^draft_tokens: expected an int >= 1 and <= 64, got 0"),
    (lambda: make_inputs(1, 3, 0, 5), r"^heads: expected an int >= 1, got 0"),
    (lambda: tree_mask_from_parents([[-1, 0], [-1, True]]), r"^parents\[1\]\[1\] = True"),
])
def test_input_builders_name_what_is_wrong(call_, match):
    """A typo in a tree name, an empty batch, a negative prefix or a fractional parent is an
    error, not inputs that silently differ from what was asked for."""
    with pytest.raises(ValueError, match=match):
        call_()


def test_a_shape_the_default_params_cannot_run_is_named_before_the_compiler():
    """No params given: the backend's default is checked like given ones (Triton needs Dk - Dv
    >= 16 and a power-of-two Dv), a ValueError saying so, not an error from inside Triton."""
    x = make_inputs(2, 4, 2, [10, 40], rope_dim=48, device=DEVICE)
    with pytest.raises(ValueError, match="power-of-two Dv and Dk-Dv >= 16"):
        verify_attention(*x.args, backend="triton")
    with pytest.raises(ValueError, match="power-of-two Dv and Dk-Dv >= 16"):
        verify_attention(*x.args, backend="triton", kv_lora_rank=256)
