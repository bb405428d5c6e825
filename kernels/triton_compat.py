"""Triton's interpreter (TRITON_INTERPRET=1, how the Triton kernel runs on a CPU) under NumPy >= 2.4.

Triton 3.6 and earlier turn a scalar tensor into a Python int with `int(handle.data)`, where the
data is a NumPy array of shape (1,). NumPy 2.4 refuses that ("only 0-dimensional arrays can be
converted to Python scalars"), so a `for` loop whose bounds were loaded (the split kernel's key
range) fails in every call (triton-lang/triton#9171; later Triton takes the one element). torch
2.11 pins Triton 3.6, so a CPU machine with it and a current NumPy hits this. `fix_interpreter_index`
makes the interpreter's `__index__` take the single element, leaves every other value to raise
as before, and does nothing where the interpreter already does so.
"""
from __future__ import annotations

import inspect

import numpy as np

#: the expression of the interpreters that need the fix (Triton <= 3.6)
_BROKEN = "int(self.handle.data))"


def scalar_index(t) -> int:
    """`t.__index__()` of an interpreted tensor: its one element (shape () or (1,)) as an int.
    A tensor of more elements raises TypeError, as `int()` of it does."""
    data = np.asarray(t.handle.data)
    if data.size != 1:
        raise TypeError(f"only a tensor of one element is an index, got shape {data.shape}")
    return int(data.reshape(()))


def fix_interpreter_index(interpreter=None) -> bool:
    """Wrap `interpreter._patch_lang_tensor` (default: `triton.runtime.interpreter`'s) so that the
    `__index__` it patches onto `tl.tensor` for a kernel call is `scalar_index`, where its own is
    the broken `int(self.handle.data)`. Idempotent. Returns whether the wrapper is in place."""
    if interpreter is None:
        try:
            from triton.runtime import interpreter
        except ImportError:   # a Triton without its interpreter: nothing to fix
            return False
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return False
    if getattr(patch, "_kvtune_index_fix", False):
        return True
    try:
        broken = _BROKEN in inspect.getsource(patch)
    except (OSError, TypeError):   # no source to read: leave Triton as it is
        return False
    if not broken:
        return False

    def patched(tensor, *args, **kwargs):
        out = patch(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None and hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", scalar_index)   # restored with the interpreter's own
        else:
            tensor.__index__ = scalar_index
        return out

    patched._kvtune_index_fix = True
    interpreter._patch_lang_tensor = patched
    return True
