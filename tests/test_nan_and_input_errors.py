"""NaN in, NaN out for exactly the rows it touches, in the oracle and every backend; and the
input mistakes that used to pass silently (issue 14, cases 4, 5 and 6)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from kvtune.kernels import make_inputs, verify_attention

REPO = Path(__file__).resolve().parents[1]
T = 4
PARENTS = [-1, 0, 1, 1]   # row 0 sees key 0; row 1 keys 0-1; rows 2 and 3 keys 0, 1 and themselves


def _sees(i: int, j: int) -> bool:
    """Whether draft row i may see draft key j, from PARENTS alone (not from the code under test)."""
    while i >= 0:
        if i == j:
            return True
        i = PARENTS[i]
    return False


def _inputs(device):
    x = make_inputs(batch=2, draft_tokens=T, heads=2, prefix_lens=[37, 5], tree="chain", device=device, seed=3)
    from kvtune.kernels import tree_mask_from_parents
    x.tree_mask.copy_(tree_mask_from_parents(torch.tensor([PARENTS, PARENTS])).to(device))
    return x


def _run(x, backend, params=None):
    o, lse = verify_attention(x.q, x.kv_cache, x.kv_indptr, x.kv_indices, x.tree_mask, x.sm_scale,
                              backend=backend, params=params, return_lse=True)
    return o.float().cpu(), lse.cpu()


def _slot(x, b, k):
    """The KV slot of key k (prefix keys first, then the T drafts) of request b."""
    return int(x.kv_indices[int(x.kv_indptr[b]) + k])


def _check(x, backend, poison, touched):
    clean_o, clean_lse = _run(x, backend)
    assert torch.isfinite(clean_o).all() and torch.isfinite(clean_lse).all()
    poison(x)
    o, lse = _run(x, backend)
    H = x.q.shape[1]
    for i in range(x.q.shape[0]):
        for h in range(H):
            if (i, h) in touched:
                assert torch.isnan(o[i, h]).all(), (backend, i, h)
                assert torch.isnan(lse[i, h]), (backend, i, h)
            else:
                assert torch.equal(o[i, h], clean_o[i, h]), (backend, i, h)
                assert torch.equal(lse[i, h], clean_lse[i, h]), (backend, i, h)


BACKENDS = ["reference", "triton", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_q_poisons_that_row_only(backend, device):
    x = _inputs(device)

    def poison(x):
        x.q[5, 1, 100] = float("nan")
    _check(x, backend, poison, {(5, 1)})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("col", [7, 520], ids=["v-and-k-column", "rope-column"])
def test_nan_in_a_prefix_key_poisons_its_request(backend, device, col):
    x = _inputs(device)

    def poison(x):
        x.kv_cache[_slot(x, 0, 20), col] = float("nan")   # prefix key 20 of request 0
    _check(x, backend, poison, {(i, h) for i in range(T) for h in range(2)})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize("col", [7, 520], ids=["v-and-k-column", "rope-column"])
def test_nan_in_a_draft_key_poisons_the_rows_that_see_it(backend, device, j, col):
    """V is the first Dv columns of a key row, so a NaN value is also a NaN key: the rows
    that may see draft key j get NaN; the rows that may not are untouched (no 0 * NaN)."""
    x = _inputs(device)

    def poison(x):
        x.kv_cache[_slot(x, 1, 5 + j), col] = float("nan")   # request 1 has 5 prefix keys
    touched = {(T + i, h) for i in range(T) if _sees(i, j) for h in range(2)}
    assert touched and (j == 0 or len(touched) < 2 * T)   # key 0 is the root: every row sees it
    _check(x, backend, poison, touched)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_an_unused_slot_changes_nothing(backend, device):
    x = _inputs(device)
    used = set(x.kv_indices[: int(x.kv_indptr[-1])].tolist())
    free = next(s for s in range(x.kv_cache.shape[0]) if s not in used)

    def poison(x):
        x.kv_cache[free] = float("nan")
    _check(x, backend, poison, set())


# ------------------------------------------------------------------ case 6: silent input mistakes
def test_tree_mask_bits_beyond_t_are_an_error(device):
    x = _inputs(device)
    x.tree_mask[6] |= 1 << T
    with pytest.raises(ValueError, match=r"tree_mask: row 6 .* bits at or beyond T=4"):
        _run(x, "reference")


def test_params_for_the_reference_backend_are_an_error(device):
    from kvtune.kernels.triton_kernel import TritonParams
    x = _inputs(device)
    with pytest.raises(ValueError, match="params: the reference backend takes no parameters"):
        _run(x, "reference", TritonParams())


def test_more_heads_per_block_than_heads_warns(device):
    from kvtune.kernels.triton_kernel import TritonParams
    x = _inputs(device)   # 2 heads
    with pytest.warns(UserWarning, match=r"HEADS_PER_BLOCK = 4 exceeds the 2 head\(s\) of q"):
        o = _run(x, "triton", TritonParams(HEADS_PER_BLOCK=4))[0]
    assert torch.equal(o, _run(x, "triton", TritonParams(HEADS_PER_BLOCK=2))[0])
    from kvtune.kernels import reference_attention, rel_error
    ref, _ = reference_attention(x.q, x.kv_cache, x.kv_indptr, x.kv_indices, x.tree_mask, x.sm_scale)
    assert rel_error(o, ref.cpu()) < 1e-2   # right, not only the same as the smaller block


def test_non_utf8_yaml_names_the_file(tmp_path):
    from kvtune.kernels.tuned import SchemaError, load_tuned
    from kvtune.tuner.config import ConfigError, load_deployment
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"{p}: not UTF-8 text"):
        load_deployment(p)
    with pytest.raises(SchemaError, match=f"{p}: not UTF-8 text"):
        load_tuned(p)


# ------------------------------------------------------------------ case 4: Triton without a GPU
NO_INTERPRETER = textwrap.dedent("""
    import torch
    from kvtune.kernels import make_inputs, verify_attention
    x = make_inputs(batch=1, draft_tokens=2, heads=2, prefix_lens=[8], device="cpu")
    try:
        verify_attention(*x.args, backend="triton")
    except ValueError as e:
        print("ERROR:", e)
    from kvtune.kernels.runtime import VerifyAttention
    try:
        # no tuned file for it: the untuned Triton fallback, built on the CPU
        VerifyAttention.from_defaults(None, deployment="no-such-deployment", draft_tokens=4, heads=8,
                                      sm_scale=0.1, max_context=64, device="cpu")
    except ValueError as e:
        print("ERROR:", e)
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_triton_on_cpu_without_the_interpreter_says_how():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", NO_INTERPRETER], capture_output=True, text=True, env=env, timeout=300)
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR:")]
    assert len(errors) == 2, r.stdout + r.stderr
    for e in errors:
        assert "TRITON_INTERPRET=1" in e, e
    assert "active drivers" not in r.stdout + r.stderr
