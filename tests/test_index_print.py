"""Index expressions printed as Triton: floor division and remainder keep
Python's (sympy's) semantics for operands of any sign.

Triton's ``//`` and ``%`` truncate toward zero; sympy's ``floor`` and ``Mod``
round toward minus infinity.  The property test builds random index
expressions whose values go negative (negative coefficients and offsets,
floors and remainders by constants and by size symbols), prints each with
tilec's own printer (:func:`tilec.index.print_index`, as the emitter calls it,
before and after :func:`tilec.index.simplify_index`), and evaluates the text
in one Triton-interpreter launch over every point of the index space, against
sympy's value at each point.
"""

from __future__ import annotations

import itertools

import sympy
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.compare import assert_matches_eager
from tilec import index as ix
from tilec.codegen.cache import load_module, write_source
from tilec.codegen.triton_ops import PRELUDE

INDICES = ix.out_symbols(2) + ix.reduce_symbols(1)
SIZES = tuple(sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1"))
DIVISORS = (2, 3, 5, *SIZES, 2 * SIZES[0])
# Each example launches one small interpreted kernel (~0.1 s).
EXAMPLES = 40


@st.composite
def signed_index_exprs(draw: st.DrawFn, depth: int = 2) -> sympy.Expr:
    """Index arithmetic that may be negative: signed sums of symbols, floors
    and remainders (by constants and by sizes)."""
    terms = []
    for _ in range(draw(st.integers(1, 3))):
        if depth > 0 and draw(st.booleans()):
            inner = draw(signed_index_exprs(depth - 1))
            k = draw(st.sampled_from(DIVISORS))
            atom = sympy.floor(inner / k) if draw(st.booleans()) else sympy.Mod(inner, k)
        else:
            atom = draw(st.sampled_from(INDICES + SIZES))
        terms.append(draw(st.integers(-5, 5).filter(bool)) * atom)
    expr = sympy.Add(draw(st.integers(-7, 7)), *terms)
    # sympy may fold Mod(a, k) * Mod(a, k) into a power: not an index the IR makes.
    assume(not expr.has(sympy.Pow))
    return expr


KERNEL = """
import triton
import triton.language as tl
{prelude}

@triton.jit
def index_values(i0_ptr, i1_ptr, r0_ptr, s0, s1, out, N: tl.constexpr, BLOCK: tl.constexpr):
    k = tl.arange(0, BLOCK)
    inside = k < N
    i0 = tl.load(i0_ptr + k, mask=inside, other=0)
    i1 = tl.load(i1_ptr + k, mask=inside, other=0)
    r0 = tl.load(r0_ptr + k, mask=inside, other=0)
    tl.store(out + k, {raw}, mask=inside)
    tl.store(out + N + k, {simple}, mask=inside)
"""


def triton_values(
    raw: str, simple: str, points: list[tuple[int, ...]], sizes: list[int]
) -> torch.Tensor:
    """The two printed expressions evaluated by the Triton interpreter at
    every point (i0, i1, r0), the sizes given: a (2, points) tensor."""
    path = write_source(KERNEL.format(prelude=PRELUDE, raw=raw, simple=simple))
    kernel = load_module(path, interpret=True).index_values
    columns = [torch.tensor(c, dtype=torch.int64) for c in zip(*points)]
    n = len(points)
    out = torch.empty(2 * n, dtype=torch.int64)
    kernel[(1,)](*columns, *sizes, out, N=n, BLOCK=max(16, 1 << (n - 1).bit_length()))
    return out.view(2, n)


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None)
@given(
    signed_index_exprs(),
    st.lists(st.integers(1, 4), min_size=3, max_size=3),
    st.lists(st.integers(2, 5), min_size=2, max_size=2),
)
def test_printed_index_floors_like_python(
    expr: sympy.Expr, extents: list[int], sizes: list[int]
) -> None:
    ranges = dict(zip(INDICES, extents))
    simple = ix.simplify_index(expr, ranges)
    raw_text = ix.print_index(expr, str, ix.TRITON, ranges)
    simple_text = ix.print_index(simple, str, ix.TRITON, ranges)
    points = list(itertools.product(*map(range, extents)))
    size_values = dict(zip(SIZES, map(sympy.Integer, sizes)))
    expected = torch.tensor(
        [
            int(expr.xreplace({**size_values, **dict(zip(INDICES, map(sympy.Integer, p)))}))
            for p in points
        ]
    )
    actual = triton_values(raw_text, simple_text, points, sizes)
    assert torch.equal(actual[0], expected), f"{expr} printed {raw_text}"
    assert torch.equal(actual[1], expected), f"{expr} -> {simple} printed {simple_text}"


def test_reversed_slice_of_a_reshaped_cat() -> None:
    """The reported case: the flat index of ``flip`` over a reshape of a
    concatenation simplifies to ``1 + floor(-i0 / 2)``, which Triton's ``//``
    computed as 1 - floor(i0 / 2) (the middle element was wrong)."""
    a, b = torch.randn(2, 1), torch.randn(2, 1, generator=torch.Generator().manual_seed(1))
    for options in ({}, {"interpret": True}):
        torch._dynamo.reset()
        assert_matches_eager(
            lambda a, b: torch.cat([a, b], 1).view(4)[0:3].flip(0), a, b, options=options
        )


def test_negative_integer_floor_division_and_remainder() -> None:
    """torch's floor_divide and remainder on integers, lowered to kernels:
    floor division and the divisor's sign, as in Python."""
    a = torch.tensor([-7, -6, -1, 0, 1, 5, 7, -8])
    b = torch.tensor([2, -2, 3, -3, 5, -5, -4, 3])
    assert_matches_eager(
        lambda a, b: (a // b, a % b, torch.div(a, b, rounding_mode="trunc"), a // 3, a % -3), a, b
    )
