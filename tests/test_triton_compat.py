"""kernels/triton_compat.py: the interpreter's `__index__` under NumPy >= 2.4 (Triton 3.4-3.6).

CI's Triton already takes the one element, so the fix is inert there; these tests run it against
interpreters written as Triton 3.6's (`_patch_lang_tensor(tensor, scope)` and its patch scope) and
3.4 / 3.5's (`_patch_lang_tensor(tensor)`, patches set for good) are, and check that it leaves a
fixed interpreter alone. The real Triton 3.6.0 ran the whole CPU suite with it
(results/compat/triton-3.4-to-3.6-numpy-2.4/)."""
from __future__ import annotations

import operator
import types

import numpy as np
import pytest

from kvtune.kernels.triton_compat import fix_interpreter_index


class _Scope:
    """Triton 3.6's _LangPatchScope: records each attribute it sets, restores them last-first."""

    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)

    def restore(self):
        while self.changes:
            obj, name, original = self.changes.pop()
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


def _patch_3_6(tensor, scope):   # Triton 3.6's line, verbatim in substance
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


def _patch_3_4(tensor):   # Triton 3.4 / 3.5: no scope, the class keeps the patch
    tensor.__index__ = lambda self: int(self.handle.data)


def _patch_fixed(tensor, scope):
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


def _tensor_class():
    class Tensor:
        def __init__(self, data):
            self.handle = types.SimpleNamespace(data=np.asarray(data))
    return Tensor


def test_the_broken_index_fails_under_this_numpy_where_it_is_2_4():
    Tensor, scope = _tensor_class(), _Scope()
    _patch_3_6(Tensor, scope)
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
        with pytest.raises(TypeError, match="0-dimensional"):
            operator.index(Tensor([7]))
    else:
        assert operator.index(Tensor([7])) == 7


def test_the_fix_makes_a_loaded_loop_bound_an_index_and_is_restored_with_the_call():
    interp = types.SimpleNamespace(_patch_lang_tensor=_patch_3_6)
    assert fix_interpreter_index(interp)
    wrapped = interp._patch_lang_tensor
    assert fix_interpreter_index(interp) and interp._patch_lang_tensor is wrapped   # idempotent
    Tensor, scope = _tensor_class(), _Scope()
    interp._patch_lang_tensor(Tensor, scope)
    assert [name for _, name, _ in scope.changes] == ["__index__", "__index__"]   # ours goes through the scope
    lo, hi = Tensor(np.array([3], dtype=np.int32)), Tensor(np.array([40], dtype=np.int64))
    assert list(range(lo, hi, 16)) == [3, 19, 35]
    assert operator.index(Tensor(np.int32(5))) == 5            # a 0-d value as before
    with pytest.raises(TypeError):
        operator.index(Tensor([1, 2]))                            # a block is no index, as before
    scope.restore()   # after the kernel call: the class as it was
    assert not hasattr(Tensor, "__index__")


def test_the_fix_covers_the_interpreters_without_a_scope():
    interp = types.SimpleNamespace(_patch_lang_tensor=_patch_3_4)
    assert fix_interpreter_index(interp)
    Tensor = _tensor_class()
    interp._patch_lang_tensor(Tensor)
    assert list(range(Tensor([0]), Tensor(np.array([9], dtype=np.int32)), 4)) == [0, 4, 8]
    with pytest.raises(TypeError):
        operator.index(Tensor([1, 2]))


def test_an_interpreter_that_takes_the_element_itself_is_left_alone():
    interp = types.SimpleNamespace(_patch_lang_tensor=_patch_fixed)
    assert not fix_interpreter_index(interp)
    assert interp._patch_lang_tensor is _patch_fixed
    assert not fix_interpreter_index(types.SimpleNamespace())    # no such function: nothing to do
