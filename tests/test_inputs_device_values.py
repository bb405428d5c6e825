"""`make_inputs(device_values=True)`: on a CUDA device q and the KV pool are drawn there (the
tuner's correctness inputs: a 64 x 128k batch's pool is 15 GB to draw on the host); the
structure (indices, indptr, tree) is the host path's; on the CPU nothing changes."""
import pytest
import torch

from kvtune.kernels import make_inputs, reference_attention, rel_error, verify_attention

FIELDS = ("q", "kv_cache", "kv_indptr", "kv_indices", "tree_mask")


def test_on_the_cpu_device_values_change_nothing():
    a = make_inputs(3, 4, 2, [5, 9, 1], tree="random", seed=7)
    b = make_inputs(3, 4, 2, [5, 9, 1], tree="random", seed=7, device_values=True)
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in FIELDS) and a.parents == b.parents


@pytest.mark.gpu
def test_on_a_gpu_values_are_drawn_there_with_the_same_structure():
    kw = dict(tree="random", seed=11, device="cuda")
    host = make_inputs(4, 9, 8, [300, 4096, 1, 77], **kw)
    dev = make_inputs(4, 9, 8, [300, 4096, 1, 77], device_values=True, **kw)
    again = make_inputs(4, 9, 8, [300, 4096, 1, 77], device_values=True, **kw)
    for k in ("kv_indptr", "kv_indices", "tree_mask"):
        assert torch.equal(getattr(host, k), getattr(dev, k)), k
    assert dev.q.shape == host.q.shape and dev.kv_cache.shape == host.kv_cache.shape
    assert dev.q.dtype == dev.kv_cache.dtype == torch.bfloat16 and dev.kv_cache.is_cuda
    assert torch.equal(dev.q, again.q) and torch.equal(dev.kv_cache, again.kv_cache), "seeded: the same twice"
    assert not torch.equal(dev.kv_cache, host.kv_cache)
    pool = dev.kv_cache.float()
    assert abs(pool.mean().item()) < 0.01 and abs(pool.std().item() - 1) < 0.01   # standard normal draws
    ref = reference_attention(*dev.args)[0]
    assert rel_error(verify_attention(*dev.args, backend="cuda"), ref) < 1e-2
