"""Index simplification (``compiler/index.py``): a position split into
quotients and remainders and put back together, against the expression it
came from, evaluated at every position."""

from __future__ import annotations

import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from tilec import index as ix

I0, I1 = ix.out_symbols(2)


def _values(expr: sympy.Expr, extent: int, width: int) -> list[int]:
    """``expr`` at every position ``(i0, i1)`` below ``(extent, width)``."""
    return [int(expr.subs({I0: a, I1: b})) for a in range(extent) for b in range(width)]


def test_a_row_split_over_images_rows_and_columns_is_the_row() -> None:
    """ConvNeXt's MLP at two images: a row of the (2 * 56 * 56, C) product
    read through its (2, 56, 56, C) NHWC view is ``3136 * floor(i0 /
    3136) + 56 * Mod(floor(i0 / 56), 56) + Mod(i0, 56)``: the row itself
    (before, a division two levels deep was not seen through, and the
    product's GELU stayed out of its kernel)."""
    split = (
        3136 * sympy.floor(I0 / 3136) + 56 * sympy.Mod(sympy.floor(I0 / 56), 56) + sympy.Mod(I0, 56)
    )
    assert ix.simplify_index(split, {I0: 6272, I1: 384}) == I0
    assert ix.simplify_index(split + 7 * I1, {I0: 6272, I1: 384}) == I0 + 7 * I1


def test_a_partial_split_keeps_its_remainders() -> None:
    """Without the outermost quotient the sum is ``Mod(i0, 3136)``: taken
    apart it would be ``i0 - 3136 * floor(i0 / 3136)``, which bounds
    loosely, so it stays as written."""
    split = 56 * sympy.Mod(sympy.floor(I0 / 56), 56) + sympy.Mod(I0, 56)
    assert ix.simplify_index(split, {I0: 6272}) == split


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 5), min_size=2, max_size=4),
    coefficient=st.integers(0, 3),
    outer=st.booleans(),
)
def test_recombined_positions_equal_their_expression(
    sizes: list[int], coefficient: int, outer: bool
) -> None:
    """``i0`` unflattened over ``sizes`` (innermost last) and flattened
    again, optionally without the outermost quotient, plus ``coefficient *
    i1``: the simplified expression has the same value at every position,
    and no more divisions than the one it came from."""
    extent = 1
    for s in sizes:
        extent *= s
    extent *= 2  # the outermost quotient runs over two
    expr, stride = coefficient * I1, 1
    for s in reversed(sizes):
        expr += stride * sympy.Mod(sympy.floor(I0 / stride), s)
        stride *= s
    if outer:
        expr += stride * sympy.floor(I0 / stride)
    simplified = ix.simplify_index(expr, {I0: extent, I1: 3})
    assert _values(simplified, extent, 3) == _values(expr, extent, 3)
    divisions = lambda e: len(e.atoms(sympy.floor, sympy.Mod))  # noqa: E731
    assert divisions(simplified) <= divisions(expr)
    if outer:
        assert simplified == I0 + coefficient * I1
