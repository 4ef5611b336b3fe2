"""Compile-and-compare helpers shared by the test modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def run_tilec(fn: Callable, *inputs: Any, options: dict | None = None, **compile_kwargs) -> Any:
    compiled = torch.compile(fn, backend="tilec", options=options, **compile_kwargs)
    with torch.no_grad():
        return compiled(*inputs)


def assert_close_tree(
    actual: Any, expected: Any, atol: float | None = None, rtol: float | None = None
) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual)}"
        assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
        a, r = TOLERANCES.get(expected.dtype, (0, 0))
        torch.testing.assert_close(
            actual,
            expected,
            atol=a if atol is None else atol,
            rtol=r if rtol is None else rtol,
            equal_nan=True,
        )
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for x, y in zip(actual, expected):
            assert_close_tree(x, y, atol, rtol)
    else:
        assert actual == expected


def assert_matches_eager(
    fn: Callable,
    *inputs: Any,
    options: dict | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    **compile_kwargs,
) -> Any:
    """Run ``fn`` eagerly and through tilec (no_grad) and compare outputs."""
    with torch.no_grad():
        expected = fn(*inputs)
    actual = run_tilec(fn, *inputs, options=options, **compile_kwargs)
    assert_close_tree(actual, expected, atol, rtol)
    return actual
