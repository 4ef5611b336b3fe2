"""Whole-block reductions for tilec's kernels in Triton's interpreter.

tilec's kernels reduce with ``tl.reduce`` and combine functions of their own
(:data:`tilec.codegen.triton_ops.PRELUDE`: ``_add``, ``_maximum``, ...), not
with ``tl.sum`` and ``tl.max``, which the interpreter cannot call (see
``triton_ops``).  The interpreter reduces a combine function it does not know
one element at a time, calling the function in Python for each: a
``[64, 1024]`` block is 65,536 calls.  That was about a third of the CPU time
of a compile-and-run test.

:func:`install` teaches the interpreter's reduction (``ReduceOps.apply_impl``,
the same in triton 3.6 to 3.8) the combine functions of tilec's kernel
modules, each as one NumPy reduction with the same semantics: NaN propagates
through ``_maximum`` and ``_minimum``; ``_argmax_combine`` and
``_argmin_combine`` pick a NaN first, then the extreme value, and among equals
the smallest index.  Sums and products add in NumPy's order, not one element
after the other: a different rounding of the same sum, as a GPU's tree order
is.  Any other reduction, and every reduction if a triton release lays out
its interpreter differently, goes on to the interpreter's own code.
"""

from __future__ import annotations

import numpy as np

# Where the kernel modules live (tilec.codegen.cache.load_module).
KERNEL_MODULES = "tilec_kernels."

_UFUNCS = {
    "_add": np.add,
    "_mul": np.multiply,
    "_maximum": np.maximum,
    "_minimum": np.minimum,
}
# The extreme an arg-reduction looks for, and the value that never is it.
_ARG = {"_argmax_combine": (np.max, -np.inf), "_argmin_combine": (np.min, np.inf)}


def _tilec_combine(ops) -> str | None:
    """The name of the reduction's combine function if a tilec kernel module
    defined it, else None."""
    fn = getattr(ops.combine_fn, "fn", None)
    if not getattr(fn, "__module__", "").startswith(KERNEL_MODULES):
        return None
    return fn.__name__


def _arg_reduce(
    extreme, never, values: np.ndarray, indices: np.ndarray, axis: int, keep_dims: bool
):
    """``(value, index)`` of the chosen element along ``axis``: a NaN if there
    is one, else the ``extreme`` (``np.max`` or ``np.min``) value; among
    equals, the smallest index.  ``never`` stands in for NaNs while the extreme
    is found."""
    nan = values != values
    if values.dtype.kind == "f":
        top = extreme(np.where(nan, never, values), axis=axis, keepdims=True)
    else:
        top = extreme(values, axis=axis, keepdims=True)
    winners = np.where(nan.any(axis=axis, keepdims=True), nan, values == top)
    last = np.iinfo(indices.dtype).max
    position = np.argmin(np.where(winners, indices, last), axis=axis, keepdims=True)
    value = np.take_along_axis(values, position, axis=axis)
    index = np.take_along_axis(indices, position, axis=axis)
    if not keep_dims:
        value, index = value.squeeze(axis), index.squeeze(axis)
    return value, index


def _whole_block(ops, input) -> list | None:
    """The reduction's results as the interpreter's tensors, or None where it
    is not one of tilec's combine functions on an axis."""
    name = _tilec_combine(ops)
    if name is None or ops.axis is None:
        return None
    data = [tensor.handle.data for tensor in input]
    if name in _UFUNCS and len(data) == 1 and data[0].dtype != np.bool_:
        result = _UFUNCS[name].reduce(
            data[0], axis=ops.axis, dtype=data[0].dtype, keepdims=ops.keep_dims
        )
        results = [result]
    elif name in _ARG and len(data) == 2 and data[1].dtype.kind in "iu":
        results = list(_arg_reduce(*_ARG[name], data[0], data[1], ops.axis, ops.keep_dims))
    else:
        return None
    return [ops.to_tensor(result, tensor.dtype) for result, tensor in zip(results, input)]


def install() -> bool:
    """Route tilec's reductions in the interpreter through :func:`_whole_block`
    (once per process); False where this triton's interpreter has no
    ``ReduceOps.apply_impl`` to extend (its own code then does them all)."""
    try:
        from triton.runtime.interpreter import ReduceOps
    except ImportError:
        return False
    original = getattr(ReduceOps, "apply_impl", None)
    if original is None:
        return False
    if getattr(original, "tilec_whole_block", False):
        return True

    def apply_impl(self, input):
        results = _whole_block(self, input)
        return original(self, input) if results is None else results

    apply_impl.tilec_whole_block = True
    apply_impl.tilec_original = original
    ReduceOps.apply_impl = apply_impl
    return True
