"""Index math on sympy expressions: symbols, row-major layouts, simplification.

Every index in the IR is a sympy expression over non-negative integer symbols:
``i0, i1, ...`` for the dimensions of the value a node computes and
``r0, r1, ...`` for the dimensions a reduction runs over.  Division is always
written ``floor(a / b)`` and remainder ``Mod(a, b)``, with sympy's (Python's)
semantics: simplification may leave a negative operand (``floor(-i0 / 2)``
from a reversed view of a reshape), so printers keep floor semantics where
C's truncating operators could differ (:func:`print_index`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import sympy
import torch
import torch.utils._sympy.functions as _torch_functions

# A size is an int, or in a graph compiled for symbolic sizes a sympy
# expression over the size symbols (``s0``, ``s1``, ...) that Dynamo made.
Size = int | sympy.Expr
Shape = tuple[Size, ...]


# The integer functions of torch's shape environment, in this module's forms.
_FROM_TORCH = {
    _torch_functions.FloorDiv: lambda a, b: sympy.floor(a / b),
    _torch_functions.CleanDiv: lambda a, b: sympy.floor(a / b),
    _torch_functions.CeilDiv: lambda a, b: sympy.floor((a + b - 1) / b),
    _torch_functions.ModularIndexing: lambda a, d, m: sympy.Mod(sympy.floor(a / d), m),
    _torch_functions.PythonMod: sympy.Mod,
    _torch_functions.Mod: sympy.Mod,
    _torch_functions.PowByNatural: sympy.Pow,
    _torch_functions.Max: sympy.Max,
    _torch_functions.Min: sympy.Min,
}


def size(value: object) -> Size:
    """``value`` as a size: an int when it is a number, else a sympy expression
    in the forms this module works with (``floor`` and ``Mod``, not the
    integer-division functions of torch's shape environment)."""
    if type(value) is int:  # the common case, without sympy
        return value
    expr = sympy.sympify(value)
    if expr.is_Integer:
        return int(expr)
    if any(not (e.is_Atom or e.is_Add or e.is_Mul) for e in sympy.preorder_traversal(expr)):
        for torch_function, ours in _FROM_TORCH.items():
            expr = expr.replace(torch_function, ours)
        expr = expr.replace(lambda e: isinstance(e, sympy.Max | sympy.Min), _drop_bound)
        expr = expr.replace(_is_sum_with_mod, _rounded_up)
    return expr


def _is_sum_with_mod(e: sympy.Expr) -> bool:
    return isinstance(e, sympy.Add) and any(
        isinstance(t.as_coeff_Mul()[1], sympy.Mod) for t in e.args
    )


def _rounded_up(e: sympy.Add) -> sympy.Expr:
    """``a + Mod(-a, b)``, ``a`` rounded up to a multiple of ``b`` (a length
    padded to whole blocks, ``-n % block`` in Python: LongT5's local
    attention), as ``b * floor((a + b - 1) / b)``, the same integer for every
    integer ``a`` and positive ``b``.  In that form sympy divides it by
    ``b`` or by its number of blocks exactly: ``floor(P / floor(P / b))``,
    the block a reshape into blocks infers, is ``b``, where the padded form
    stayed a quotient of quotients and the index expressions of views over
    it grew to thousands of operations (a compile of minutes).  ``-a`` may
    show as ``(b - 1) * a`` for a number ``b``: any ``x`` with ``x + a`` a
    multiple of ``b``; the sum may be scaled (``c * a + c * Mod(-a, b)``:
    sympy spreads a division over the terms)."""
    for term in e.args:
        c, mod = term.as_coeff_Mul()
        if not isinstance(mod, sympy.Mod):
            continue
        x, b = mod.args
        a = sympy.expand((e - term) / c)
        if not (b.is_integer and b.is_positive and a.is_integer and x.is_integer):
            continue
        if (sympy.expand(x + a) / b).is_integer:
            return c * b * sympy.floor((a + b - 1) / b)
    return e


def _drop_bound(e: sympy.Expr) -> sympy.Expr:
    """``Max(1, floor(s0/2))`` is ``floor(s0/2)``: drop a Max/Min argument
    that never wins for sizes >= 2."""
    sign = 1 if isinstance(e, sympy.Max) else -1
    for keep in e.args:
        if all(always_positive(sign * (keep - a) + 1) for a in e.args if a is not keep):
            return keep
    return e


def is_static(sizes: Sequence[Size]) -> bool:
    """Whether every size is a number."""
    return all(isinstance(s, int) or sympy.sympify(s).is_Integer for s in sizes)


class IndexSymbol(sympy.Symbol):
    """A symbol that ranges over positions: an output or reduction dimension
    of a node, an axis of a kernel.  Every other symbol is a size.  The kind
    is the symbol's class, not its name, so any name may be used."""


class ValueSymbol(IndexSymbol):
    """A position read from data (a gathered index), which the inliner binds
    to the expression that loads it (``inline.Inliner.bindings``)."""


def size_symbols(expr: object) -> set[sympy.Symbol]:
    """The size symbols (not index symbols) an expression depends on."""
    return {s for s in sympy.sympify(expr).free_symbols if not isinstance(s, IndexSymbol)}


def gathered(expr: object) -> list[ValueSymbol]:
    """The positions read from data an index expression depends on, by name."""
    found = sympy.sympify(expr).free_symbols
    return sorted((s for s in found if isinstance(s, ValueSymbol)), key=str)


def always_positive(expr: object) -> bool:
    """Whether ``expr`` is positive for all size symbol values >= 2 (Dynamo
    specializes sizes 0 and 1, and the generic variant guards on it)."""
    expr = sympy.sympify(expr)
    if expr.is_positive:  # for every size >= 1 (sympy's assumptions), a number
        return True
    shifted = {
        s: sympy.Symbol(f"{s.name}_", integer=True, nonnegative=True) + 2
        for s in size_symbols(expr)
    }
    expr = expr.xreplace(shifted)
    # A floor of sizes that is at least 1 (``floor((n + 127) / 128)``, a
    # count of blocks), whose sign sympy leaves open, as any integer >= 1:
    # positive for all of them, the expression is positive for the floor too.
    counts = {}
    for k, f in enumerate(sorted(expr.atoms(sympy.floor), key=str)):
        if sympy.expand(f.args[0] - 1).is_nonnegative:
            counts[f] = sympy.Symbol(f"floor{k}_", integer=True, nonnegative=True) + 1
    # Expanded: sympy decides the sign of a sum of products it has multiplied out.
    return bool(sympy.expand(expr.xreplace(counts)).is_positive)


def hint(expr: object, hints: dict[sympy.Symbol, int]) -> int:
    """A symbolic size evaluated at the sizes a graph was compiled with."""
    if type(expr) is int:
        return expr
    return int(sympy.sympify(expr).xreplace(hints))


@functools.cache
def index_symbol(prefix: str, k: int) -> IndexSymbol:
    return IndexSymbol(f"{prefix}{k}", integer=True, nonnegative=True)


@functools.cache
def value_symbol(k: int) -> ValueSymbol:
    return ValueSymbol(f"v{k}", integer=True, nonnegative=True)


def out_symbols(rank: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_symbol("i", k) for k in range(rank))


def reduce_symbols(rank: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_symbol("r", k) for k in range(rank))


# Positions.  An index symbol that ranges over a size-1 dimension is always 0,
# and lowering reads such dimensions at index 0 (broadcasts): every question
# "is this the same position" pins those symbols to 0 first, here, so that a
# size-1 dimension (batch 1) never changes an answer that size 2 gives.


def unit_symbols(ranges: dict[sympy.Symbol, Size]) -> dict[sympy.Symbol, int]:
    """``{symbol: 0}`` for the symbols whose range is 1."""
    return {sym: 0 for sym, size in ranges.items() if size == 1}


def pin_unit_dims(
    index: Sequence[Size], rows: Sequence[Size], rshape: Sequence[Size] = ()
) -> tuple[sympy.Expr, ...]:
    """``index`` (over the iteration space ``rows`` x ``rshape``) with the
    symbols of size-1 dimensions replaced by 0."""
    zero = unit_symbols(symbol_ranges(rows, rshape))
    # Components that are not index arithmetic (a gathered value) stay as they are.
    return tuple(
        sympy.sympify(c).xreplace(zero) if isinstance(c, int | sympy.Basic) else c for c in index
    )


def own_position(shape: Sequence[Size]) -> tuple[sympy.Expr, ...]:
    """The index of the element at a node's own position: ``(i0, i1, ...)``,
    with 0 in size-1 dimensions."""
    return pin_unit_dims(out_symbols(len(shape)), shape)


def same_position(index: Sequence[Size], shape: Sequence[Size]) -> bool:
    """Whether ``index``, in a node (or iteration space) of ``shape``, is the
    node's own position."""
    return len(index) == len(shape) and pin_unit_dims(index, shape) == own_position(shape)


def contiguous_strides(shape: Sequence[Size]) -> tuple[Size, ...]:
    strides, running = [], 1
    for dim in reversed(shape):
        strides.append(running)
        # A symbolic size is at least 2 (Dynamo specializes sizes 0 and 1).
        running = running * (max(dim, 1) if isinstance(dim, int) else dim)
    return tuple(size(s) for s in reversed(strides))


def dense_order(shape: Sequence[Size], stride: Sequence[Size]) -> list[int] | None:
    """The dimensions (of size other than 1) from innermost to outermost when
    the layout covers exactly its elements without overlap; None otherwise.
    Found by chaining strides from 1 rather than by sorting them, so symbolic
    strides compare structurally (``s1`` then ``4*s1``) and never by value."""
    dims = [d for d, n in enumerate(shape) if n != 1]
    order: list[int] = []
    expected: Size = 1
    while dims:
        match = next((d for d in dims if stride[d] == expected), None)
        if match is None:
            return None
        dims.remove(match)
        order.append(match)
        # As torch strides: a size that may be 0 counts as 1 (Max(1, n), which
        # ``size`` drops where n >= 2 for every size).
        n = shape[match]
        expected = size(expected * (max(n, 1) if isinstance(n, int) else sympy.Max(1, n)))
    return order


def non_overlapping(shape: Sequence[Size], stride: Sequence[Size]) -> bool:
    """Whether no two elements of the layout share memory (gaps allowed);
    False where symbolic strides leave it open."""
    if dense_order(shape, stride) is not None:
        return True
    dims = [(st, n) for n, st in zip(shape, stride) if n != 1]
    if not all(isinstance(v, int) for d in dims for v in d):
        return False
    dims.sort()
    return all(inner * n <= outer for (inner, n), (outer, _) in zip(dims, dims[1:]))


def storage_index(
    offset: sympy.Expr, shape: Sequence[Size], stride: Sequence[Size]
) -> tuple[sympy.Expr, ...] | None:
    """The index of the element a layout stores ``offset`` elements past its
    first one; for an offset that is no element's (outside the layout, or in
    a gap between elements), an index outside ``shape``.  None where that
    cannot be written down: a layout that is neither dense
    (:func:`dense_order`) nor, with static strides, non-overlapping."""
    index = [sympy.Integer(0)] * len(shape)
    order = dense_order(shape, stride)
    if order is not None:
        for k, d in enumerate(order):
            part = sympy.floor(offset / stride[d]) if stride[d] != 1 else offset
            index[d] = part if k == len(order) - 1 else sympy.Mod(part, shape[d])
        return tuple(index)
    if not non_overlapping(shape, stride):
        return None
    order = sorted((d for d, n in enumerate(shape) if n != 1), key=lambda d: stride[d])
    rest = offset
    # Outermost first: each dimension takes its part of what the outer ones
    # left; a part past its dimension's end is a gap.
    for d in reversed(order):
        index[d] = sympy.floor(rest / stride[d])
        rest = sympy.Mod(rest, stride[d])
    # In a gap below the innermost stride: past the innermost dimension.
    inner = order[0]
    index[inner] += shape[inner] * sympy.floor((rest + stride[inner] - 1) / stride[inner])
    return tuple(index)


def broadcast_shapes(*shapes: Sequence[Size]) -> Shape:
    """numpy broadcasting of shapes that may hold symbolic sizes (a symbolic
    size is at least 2, so it is never the 1 that broadcasts)."""
    rank = max(map(len, shapes), default=0)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    return tuple(next((d for d in dims if d != 1), 1) for dims in zip(*padded))


def flatten_index(index: Sequence[sympy.Expr], shape: Sequence[int]) -> sympy.Expr:
    """Row-major flat position of ``index`` inside a tensor of ``shape``."""
    return sympy.Add(*(i * s for i, s in zip(index, contiguous_strides(shape))))


def flatten_strided(index: Sequence[sympy.Expr], strides: Sequence[int]) -> sympy.Expr:
    """Memory offset of ``index`` in a buffer with ``strides`` (in elements)."""
    return sympy.Add(*(i * s for i, s in zip(index, strides)))


def unflatten_index(flat: sympy.Expr, shape: Sequence[int]) -> tuple[sympy.Expr, ...]:
    """Inverse of :func:`flatten_index` (``flat`` must lie inside the shape)."""
    if 0 in shape:
        # An empty tensor is never read; any index will do (and Mod by 0 would raise).
        return tuple(sympy.Integer(0) for _ in shape)
    out = []
    strides = contiguous_strides(shape)
    for k, (size, stride) in enumerate(zip(shape, strides)):
        if size == 1:
            out.append(sympy.Integer(0))
            continue
        part = sympy.floor(flat / stride) if stride != 1 else flat
        out.append(part if k == 0 else sympy.Mod(part, size))
    return tuple(out)


def symbol_ranges(shape: Sequence[Size], rshape: Sequence[Size] = ()) -> dict[sympy.Symbol, Size]:
    """Exclusive upper bounds of the index symbols of a (reduction) node."""
    ranges = {index_symbol("i", k): size(s) for k, s in enumerate(shape)}
    ranges.update({index_symbol("r", k): size(s) for k, s in enumerate(rshape)})
    return ranges


def _bounds(expr: sympy.Expr, ranges: dict[sympy.Symbol, Size]) -> tuple[Size, Size] | None:
    """Inclusive (min, max) of a sum of terms, each an integer times at most
    one bounded factor (an index symbol of known range, or a floor or
    remainder of one: :func:`_factor_bounds`) times positive size symbols;
    the bounds are symbolic where sizes are."""
    lo: Size = 0
    hi: Size = 0
    for term in sympy.Add.make_args(expr):
        coeff, rest = term.as_coeff_Mul()
        if not coeff.is_Integer:
            return None
        # (A floor or remainder whose bounds cannot be told counts as a size.)
        factors = [
            (f, bounds)
            for f in sympy.Mul.make_args(rest)
            if (bounds := _factor_bounds(f, ranges)) is not None
        ]
        scale = rest / factors[0][0] if len(factors) == 1 else rest
        if len(factors) > 1 or not (scale == 1 or scale.is_positive):
            return None
        if not factors:
            lo, hi = lo + term, hi + term
            continue
        low, high = (coeff * scale * b for b in factors[0][1])
        lo, hi = (lo + low, hi + high) if coeff > 0 else (lo + high, hi + low)
    return size(lo), size(hi)


def _factor_bounds(f: sympy.Expr, ranges: dict[sympy.Symbol, Size]) -> tuple[Size, Size] | None:
    """Inclusive (min, max) of an index symbol (``0`` to its range less
    one), of ``floor(a / k)`` for a constant ``k`` and an ``a`` of constant
    bounds, or of ``Mod(a, k)`` (``0`` to ``k - 1``, or ``a``'s own bounds
    where they lie within: ``Mod(floor(i0 / 56), 56)`` is at most 55 when
    ``i0 < 3136``); None where they cannot be told."""
    if f in ranges:
        return 0, ranges[f] - 1
    if isinstance(f, sympy.floor):
        num, den = _fraction(f.args[0])
        inner = _bounds(sympy.expand(num), ranges) if den.is_Integer and den > 0 else None
        if inner is None or not all(isinstance(b, int) for b in inner):
            return None
        return inner[0] // int(den), inner[1] // int(den)
    if isinstance(f, sympy.Mod) and always_positive(f.args[1]):
        inner = _bounds(sympy.expand(f.args[0]), ranges)
        if inner is not None and _below(inner, f.args[1]):
            return inner
        return 0, f.args[1] - 1
    return None


def in_bounds(
    index: Sequence[sympy.Expr], shape: Sequence[Size], ranges: dict[sympy.Symbol, Size]
) -> bool:
    """Whether ``index`` stays inside ``shape`` for every value of the index
    symbols in ``ranges`` (False when that cannot be shown)."""
    return all(
        _below(_bounds(sympy.sympify(c), ranges), sympy.sympify(n)) for c, n in zip(index, shape)
    )


def _below(bounds: tuple[Size, Size] | None, limit: sympy.Expr) -> bool:
    """Whether ``0 <= min`` and ``max < limit`` hold for every size (>= 2)."""
    if bounds is None:
        return False
    lo, hi = bounds
    if isinstance(lo, int) and isinstance(hi, int) and limit.is_Integer:
        return 0 <= lo and hi < int(limit)
    return always_positive(sympy.sympify(lo) + 1) and always_positive(limit - hi)


def _fraction(expr: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(numerator, denominator) of a floor's argument.

    Expanded first: ``together`` leaves ``(i0 + 1)/2`` in sympy's ``Mul(1/2, i0 + 1)``
    form as ``i0/2 + 1/2`` over 1, which no integer arithmetic can evaluate.
    """
    return sympy.fraction(sympy.together(sympy.expand(expr)))


def _split_divisible(expr: sympy.Expr, divisor: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """Split a sum into the terms that are integer multiples of ``divisor`` and the rest."""
    multiple, rest = [], []
    for term in sympy.Add.make_args(expr):
        if divisor.is_Integer:
            coeff, _ = term.as_coeff_Mul()
            divides = coeff.is_Integer and int(coeff) % int(divisor) == 0
        else:
            divides = bool((term / divisor).is_integer)
        (multiple if divides else rest).append(term)
    return sympy.Add(*multiple), sympy.Add(*rest)


def simplify_index(expr: sympy.Expr, ranges: dict[sympy.Symbol, int]) -> sympy.Expr:
    """Remove divisions and remainders that the symbol ranges make redundant
    (:func:`_simplified`; remembered, as inlining asks for the same index
    many times: a fused kernel's loads, each merge fusion weighs).

    ``floor((a*k + b) / k)`` becomes ``a`` and ``Mod(a*k + b, k)`` becomes ``b``
    when ``0 <= b < k``; a remainder of a value already below its modulus
    disappears.  ``k`` may be a symbolic size (``i0*s1 + i1`` over ``s1``
    with ``i1 < s1``): sympy decides the bounds from the symbols'
    assumptions.  This is what turns a reshape of a reshape back into plain
    strides, and it keeps integer division out of generated kernels.
    """

    return _simplified(sympy.sympify(expr), tuple(ranges.items()))


@functools.lru_cache(maxsize=1 << 16)
def _simplified(expr: sympy.Expr, range_items: tuple[tuple[sympy.Symbol, int], ...]) -> sympy.Expr:
    """:func:`simplify_index` of ``expr`` over the ranges ``range_items``."""
    ranges = dict(range_items)

    def visit(e: sympy.Expr) -> sympy.Expr:
        if not e.args:
            return e
        e = e.func(*(visit(a) for a in e.args))
        if isinstance(e, sympy.floor):
            num, den = _fraction(e.args[0])
            if den != 1 and always_positive(den):
                num = sympy.expand(num)
                multiple, rest = _split_divisible(num, den)
                if _below(_bounds(rest, ranges), den):
                    return sympy.expand(multiple / den)
                inner = _divide_through(num, den, ranges)
                if inner is not None:
                    return visit(inner)
        if isinstance(e, sympy.Mod):
            num, mod = sympy.expand(e.args[0]), e.args[1]
            if always_positive(mod):
                _, rest = _split_divisible(num, mod)
                if _below(_bounds(rest, ranges), mod):
                    return rest
                if _below(_bounds(num, ranges), mod):
                    return num
        if isinstance(e, sympy.Add):
            return _recombine_divmod(e)
        return e

    # A symbol whose range is 1 (a size-1 dimension) is 0: equal positions
    # then print and compare equal.
    pinned = sympy.sympify(expr).xreplace(unit_symbols(ranges))
    return visit(sympy.expand(pinned))


def _divide_through(
    num: sympy.Expr, den: sympy.Expr, ranges: dict[sympy.Symbol, int]
) -> sympy.Expr | None:
    """``floor((c*x + r) / (c*q))`` as ``floor(x / q)`` when ``0 <= r < c``:
    the rest cannot carry into a multiple of ``c`` (a row index over 96
    columns, divided by 96 * 56).  None when no coefficient ``c`` does."""
    if not den.is_Integer:
        return None
    coefficients = {int(t.as_coeff_Mul()[0]) for t in sympy.Add.make_args(num)}
    for c in sorted(coefficients, reverse=True):
        if 1 < c < int(den) and int(den) % c == 0:
            multiple, rest = _split_divisible(num, sympy.Integer(c))
            if _below(_bounds(rest, ranges), sympy.Integer(c)):
                return sympy.floor(sympy.expand(multiple / c) / (int(den) // c))
    return None


def _recombine_divmod(e: sympy.Add) -> sympy.Expr:
    """``k * floor(x / k) + Mod(x, k)`` is ``x``: a position split into a
    quotient and a remainder and put back together (a view of a reshape).
    Split over more than two levels, the sum is taken apart whole
    (:func:`_without_remainders`): ``3136 * floor(x / 3136) + 56 *
    Mod(floor(x / 56), 56) + Mod(x, 56)`` is ``x`` (a row of a product of
    images' pixels read through their NHWC view)."""
    terms = list(e.args)
    for mod in [t for t in terms if isinstance(t, sympy.Mod)]:
        x, k = mod.args
        whole = sympy.expand(k * sympy.floor(x / k))
        if whole in terms:
            terms.remove(whole)
            terms.remove(mod)
            terms.append(x)
    out = sympy.Add(*terms) if len(terms) != len(e.args) else e
    if not (out.is_Add and out.has(sympy.Mod) and out.has(sympy.floor)):
        return out
    apart = _without_remainders(out)
    # Taken apart only where fewer divisions are left and none subtracted
    # (``x - k * floor(x / k)``, which bounds loosely, is ``Mod(x, k)``).
    subtracted = any(c < 0 and t.has(sympy.floor) for t, c in apart.as_coefficients_dict().items())
    return apart if _divisions(apart) < _divisions(out) and not subtracted else out


def _without_remainders(e: sympy.Expr) -> sympy.Expr:
    """``e`` with each ``Mod(x, k)`` of a positive integer ``k`` written
    ``x - k * floor(x / k)`` and each ``floor(floor(y) / b)`` as ``floor(y /
    b)`` (both exact for integers ``x`` and positive integers ``k``, ``b``),
    expanded, so that the quotients cancel."""
    e = e.replace(
        lambda t: isinstance(t, sympy.Mod) and t.args[1].is_Integer and t.args[1] > 0,
        lambda t: t.args[0] - t.args[1] * sympy.floor(t.args[0] / t.args[1]),
    )

    def flattened(t: sympy.floor) -> sympy.Expr:
        coeff, inner = t.args[0].as_coeff_Mul()
        if isinstance(inner, sympy.floor) and coeff.is_Rational and coeff.p == 1:
            return sympy.floor(inner.args[0] / coeff.q)
        return t

    return sympy.expand(e.replace(lambda t: isinstance(t, sympy.floor), flattened))


def _divisions(e: sympy.Expr) -> int:
    """How many quotients and remainders ``e`` takes."""
    return len(e.atoms(sympy.floor, sympy.Mod))


def evaluate_index(expr: sympy.Expr, env: dict[sympy.Symbol, torch.Tensor]) -> torch.Tensor | int:
    """Evaluate an index expression on int64 tensors (the interpreter's path)."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return env[expr]
    if isinstance(expr, sympy.floor):
        # Before evaluating the arguments: a floor's argument is a fraction.
        num, den = _fraction(expr.args[0])
        return evaluate_index(num, env) // evaluate_index(den, env)
    args = [evaluate_index(a, env) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return functools.reduce(lambda a, b: a + b, args)
    if isinstance(expr, sympy.Mul):
        return functools.reduce(lambda a, b: a * b, args)
    if isinstance(expr, sympy.Mod):
        return args[0] % args[1]
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        return args[0] ** int(expr.exp)
    if isinstance(expr, sympy.Min):
        return functools.reduce(_torch_min, args)
    if isinstance(expr, sympy.Max):
        return functools.reduce(_torch_max, args)
    raise NotImplementedError(f"index expression {expr!r} ({type(expr).__name__})")


def _torch_min(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


def _torch_max(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How a target language spells the functions of index arithmetic: its
    two-argument max and min, and floor division and remainder (``{0}``,
    ``{1}``: the operands) with Python's (sympy's) semantics for operands of
    any sign."""

    max: str
    min: str
    floordiv: str
    mod: str


PYTHON = Dialect("max", "min", "({0} // {1})", "({0} % {1})")
# Triton's ``//`` and ``%`` on integers truncate toward zero, as in C: for an
# operand that may be negative the kernel prelude's helpers floor instead
# (``codegen/triton_ops.py``).
TRITON = Dialect("tl.maximum", "tl.minimum", "_floordiv_int({0}, {1})", "_remainder_int({0}, {1})")


# Python forms of the functions of torch's shape environment that compute
# floats and bools from sizes (and integers from those), for the runtime: a
# library call may take such a value as an argument (``baddbmm(...,
# alpha=1 / math.sqrt(d))``), and a size may be one (``arange``'s
# ``ceil((end - start) / step)``).  Kernels compute these values as IR
# expressions (``tilec.symbolic_scalars``).
PYTHON_SCALAR_FORMS = {
    _torch_functions.ToFloat: "float({0})",
    _torch_functions.FloatTrueDiv: "({0} / {1})",
    _torch_functions.IntTrueDiv: "({0} / {1})",
    _torch_functions.FloatPow: "({0} ** {1})",
    _torch_functions.TruncToFloat: "float(math.trunc({0}))",
    _torch_functions.FloorToInt: "math.floor({0})",
    _torch_functions.CeilToInt: "math.ceil({0})",
    _torch_functions.TruncToInt: "math.trunc({0})",
    _torch_functions.RoundToInt: "round({0})",
    _torch_functions.Where: "({1} if {0} else {2})",
    sympy.Eq: "({0} == {1})",
    sympy.Ne: "({0} != {1})",
    sympy.StrictLessThan: "({0} < {1})",
    sympy.LessThan: "({0} <= {1})",
    sympy.StrictGreaterThan: "({0} > {1})",
    sympy.GreaterThan: "({0} >= {1})",
    sympy.Not: "(not {0})",
    sympy.And: "({0} and {1})",
    sympy.Or: "({0} or {1})",
}


def print_index(
    expr: sympy.Expr,
    name: Callable[[sympy.Symbol], str] = str,
    dialect: Dialect = PYTHON,
    ranges: dict[sympy.Symbol, Size] | None = None,
) -> str:
    """Print an index expression as Python/Triton integer arithmetic.  A
    division or remainder whose operands are not provably non-negative (from
    the symbols' assumptions and ``ranges``, their exclusive upper bounds) is
    printed in the dialect's floor form.  Python text also computes floats
    and bools from sizes; Triton text has none (the emitter computes them,
    and names them by symbols)."""

    def p(e: sympy.Expr) -> str:
        return print_index(e, name, dialect, ranges)

    def divmod_text(plain: str, form: str, a: sympy.Expr, b: sympy.Expr) -> str:
        # On non-negative operands truncation and floor agree: C's operators,
        # spelled as Python's, serve every dialect.
        nonnegative = _nonnegative(a, ranges) and _nonnegative(b, ranges)
        return (plain if nonnegative else form).format(p(a), p(b))

    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return name(expr)
    if isinstance(expr, sympy.Add):
        return "(" + " + ".join(map(p, expr.args)) + ")"
    if isinstance(expr, sympy.Mul):
        return "(" + " * ".join(map(p, expr.args)) + ")"
    if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) > 0:
        # Repeated products: Triton has no integer power.
        return "(" + " * ".join([p(expr.base)] * int(expr.exp)) + ")"
    if isinstance(expr, sympy.Mod):
        return divmod_text(PYTHON.mod, dialect.mod, *expr.args)
    if isinstance(expr, sympy.floor):
        return divmod_text(PYTHON.floordiv, dialect.floordiv, *_fraction(expr.args[0]))
    if isinstance(expr, sympy.Max | sympy.Min):
        fn = dialect.max if isinstance(expr, sympy.Max) else dialect.min
        return functools.reduce(lambda a, b: f"{fn}({a}, {b})", map(p, expr.args))
    if dialect == PYTHON:
        if expr.is_Float or isinstance(expr, sympy.logic.boolalg.BooleanAtom):
            return repr(float(expr) if expr.is_Float else bool(expr))
        func = type(expr)
        if func.__name__.startswith("OpaqueUnaryFn_"):  # math.sqrt, math.exp, ...
            return f"math.{func.__name__.removeprefix('OpaqueUnaryFn_')}({p(expr.args[0])})"
        if func in PYTHON_SCALAR_FORMS:
            form, args = PYTHON_SCALAR_FORMS[func], [p(a) for a in expr.args]
            if len(args) > 2 and "{2}" not in form:  # And, Or of several terms
                return functools.reduce(lambda a, b: form.format(a, b), args)
            return form.format(*args)
    raise NotImplementedError(f"cannot print index expression {expr!r}")


def _nonnegative(expr: sympy.Expr, ranges: dict[sympy.Symbol, Size] | None) -> bool:
    """Whether ``expr`` is >= 0 by its symbols' assumptions, or, for a sum of
    index terms, over the symbols' ``ranges``."""
    if expr.is_nonnegative:
        return True
    bounds = _bounds(expr, ranges) if ranges else None
    return bounds is not None and bool(sympy.sympify(bounds[0]).is_nonnegative)


@functools.cache
def size_function(expr: Size) -> Callable[[dict[str, int]], int | float | bool]:
    """``expr`` as a function of the size symbols' values (by name), for the
    runtime of a graph with symbolic sizes: plain integer arithmetic, and
    Python's own for floats and bools computed from sizes."""
    text = print_index(sympy.sympify(expr), lambda s: f"sizes[{s.name!r}]")
    return eval(f"lambda sizes: {text}", {"math": math})  # noqa: S307 - printed from sympy


def numel(shape: Sequence[Size]) -> Size:
    return size(math.prod(shape))
