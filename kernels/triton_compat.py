"""Triton's interpreter (TRITON_INTERPRET=1, how the Triton kernel runs on a CPU) under NumPy >= 2.4.

Triton 3.4 to 3.6 turn a scalar tensor into a Python int with `int(self.handle.data)`, where the
data is a NumPy array of shape (1,). NumPy 2.4 refuses that ("only 0-dimensional arrays can be
converted to Python scalars"), so a `for` loop whose bounds were loaded (the split kernel's key
range) fails in every call (triton-lang/triton#9171; later Triton takes the one element). torch
2.11 pins Triton 3.6, so a CPU machine with it and a current NumPy hits this. `fix_interpreter_index`
makes the interpreter's `__index__` take the single element, leaves every other value to raise
as before, and does nothing where the interpreter already does so. It changes Triton's interpreter
for the whole process, and only in a process that runs it (TRITON_INTERPRET set at import).
"""
from __future__ import annotations

import inspect

import numpy as np

#: the expression of the interpreters that need the fix: Triton 3.6's `scope.set_attr(tensor,
#: "__index__", lambda self: int(self.handle.data))` and 3.4 / 3.5's `tensor.__index__ = lambda
#: self: int(self.handle.data)`; the fixed ones read `int(self.handle.data.squeeze())`
_BROKEN = "int(self.handle.data)"


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
    try:
        if interpreter is None:
            from triton.runtime import interpreter
        patch = getattr(interpreter, "_patch_lang_tensor", None)
        if patch is None:
            return False
        if getattr(patch, "_kvtune_index_fix", False):
            return True
        if _BROKEN not in inspect.getsource(patch):
            return False
    except Exception:  # noqa: BLE001 - no interpreter, no source: leave Triton as it is
        return False

    def patched(tensor, *args, **kwargs):
        out = patch(tensor, *args, **kwargs)
        scope = args[0] if args else kwargs.get("scope")
        if scope is not None and hasattr(scope, "set_attr"):   # 3.6: restored with the interpreter's own
            scope.set_attr(tensor, "__index__", scalar_index)
        else:   # 3.4 / 3.5 set their patches for good
            tensor.__index__ = scalar_index
        return out

    patched._kvtune_index_fix = True
    interpreter._patch_lang_tensor = patched
    return True
