"""The interpreter's whole-block reductions of tilec's combine functions
(tilec.codegen.interpreter_reduce) against the interpreter's own
element-by-element reduction and against torch."""

import contextlib

import pytest
import torch

from tilec.codegen import interpreter_reduce
from tilec.codegen.cache import load_module, write_source
from tilec.codegen.triton_ops import PRELUDE

# Each reduction of a [ROWS, COLS] block along its columns, in one kernel.
ROWS, COLS = 8, 16
KERNEL = (
    "import triton\nimport triton.language as tl\n"
    + PRELUDE
    + """

@triton.jit
def reduce_rows(x, out_sum, out_prod, out_max, out_min, out_amax, out_imax, out_amin, out_imin,
                R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    cols = tl.arange(0, C)[None, :]
    v = tl.load(x + rows * C + cols)
    r = tl.arange(0, R)
    tl.store(out_sum + r, tl.reduce(v, 1, _add))
    tl.store(out_prod + r, tl.reduce(v, 1, _mul))
    tl.store(out_max + r[:, None], tl.reduce(v, 1, _maximum, keep_dims=True))
    tl.store(out_min + r, tl.reduce(v, 1, _minimum))
    index = tl.broadcast_to(cols, (R, C))
    amax, imax = tl.reduce((v, index), 1, _argmax_combine)
    tl.store(out_amax + r, amax)
    tl.store(out_imax + r, imax)
    amin, imin = tl.reduce((v, index), 1, _argmin_combine)
    tl.store(out_amin + r, amin)
    tl.store(out_imin + r, imin)
"""
)
NAMES = ("sum", "prod", "max", "min", "amax", "imax", "amin", "imin")


@contextlib.contextmanager
def element_by_element():
    """The interpreter's own reduction, for the duration."""
    from triton.runtime.interpreter import ReduceOps

    installed = ReduceOps.apply_impl
    ReduceOps.apply_impl = installed.tilec_original
    try:
        yield
    finally:
        ReduceOps.apply_impl = installed


def block(dtype: torch.dtype) -> torch.Tensor:
    """Values with ties in every row; floats also with a NaN in rows 1 and 5,
    an infinity in row 2, and a row of equal values."""
    torch.manual_seed(0)
    x = torch.randint(-3, 4, (ROWS, COLS)).to(dtype)
    if dtype.is_floating_point:
        x = x + torch.randint(0, 2, (ROWS, COLS)).to(dtype) * 0.5
        x[1, 3] = x[5, 0] = x[5, 9] = float("nan")
        x[2, 7] = float("inf")
        x[3] = 1.5
    return x


def run(kernel, x: torch.Tensor) -> dict[str, torch.Tensor]:
    outs = {
        name: torch.empty(ROWS, dtype=torch.int32 if name[0] == "i" else x.dtype) for name in NAMES
    }
    kernel[(1,)](x, *outs.values(), ROWS, COLS)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int64], ids=str)
def test_whole_block_reductions_match_the_interpreters_own_and_torch(dtype):
    kernel = load_module(write_source(KERNEL), interpret=True).reduce_rows
    from triton.runtime.interpreter import ReduceOps

    assert getattr(ReduceOps.apply_impl, "tilec_whole_block", False), "not installed"
    x = block(dtype)
    fast = run(kernel, x)
    with element_by_element():
        slow = run(kernel, x)

    values, indices = x.max(1)
    low, low_indices = x.min(1)
    exact = {
        "max": x.amax(1),
        "min": x.amin(1),
        "amax": values,
        "imax": indices,
        "amin": low,
        "imin": low_indices,
    }
    for name, want in exact.items():
        torch.testing.assert_close(
            fast[name].to(want.dtype), want, rtol=0, atol=0, equal_nan=True, msg=name
        )
        torch.testing.assert_close(fast[name], slow[name], rtol=0, atol=0, equal_nan=True, msg=name)
    for name, want in {"sum": x.double().sum(1), "prod": x.double().prod(1)}.items():
        tolerance = 1e-2 if dtype == torch.float16 else 1e-6
        torch.testing.assert_close(
            fast[name].double(), want, rtol=tolerance, atol=0, equal_nan=True, msg=name
        )
        torch.testing.assert_close(
            fast[name], slow[name], rtol=tolerance, atol=0, equal_nan=True, msg=name
        )


def _add(a, b):
    """A combine function with a tilec name that no tilec kernel module defined."""
    return a - b


@pytest.mark.parametrize("module", ["tilec_kernels.k_test", __name__])
def test_only_tilec_kernel_modules_combine_functions_are_taken(module):
    """The same function is reduced whole-block when a tilec kernel module
    defines it, and left to the interpreter's own code otherwise."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import ReduceOps

    combine = type(_add)(_add.__code__, {"__name__": module}, "_add")
    reduction = ReduceOps(1, type("Jit", (), {"fn": staticmethod(combine)})(), False)
    x = reduction.to_tensor(np.arange(8, dtype=np.float32).reshape(2, 4), tl.float32)
    result = interpreter_reduce._whole_block(reduction, (x,))
    if module.startswith(interpreter_reduce.KERNEL_MODULES):
        assert result[0].handle.data.tolist() == [6.0, 22.0]
    else:
        assert result is None
