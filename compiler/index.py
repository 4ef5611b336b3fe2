"""Index math on sympy expressions: symbols, row-major layouts, simplification.

Every index in the IR is a sympy expression over non-negative integer symbols:
``i0, i1, ...`` for the dimensions of the value a node computes and
``r0, r1, ...`` for the dimensions a reduction runs over.  Division is always
written ``floor(a / b)`` and remainder ``Mod(a, b)``; both are only applied to
non-negative operands, so C-style and Python-style semantics agree.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import sympy
import torch

Shape = tuple[int, ...]


@functools.cache
def index_symbol(prefix: str, k: int) -> sympy.Symbol:
    return sympy.Symbol(f"{prefix}{k}", integer=True, nonnegative=True)


def out_symbols(rank: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_symbol("i", k) for k in range(rank))


def reduce_symbols(rank: int) -> tuple[sympy.Symbol, ...]:
    return tuple(index_symbol("r", k) for k in range(rank))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(strides))


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


def symbol_ranges(shape: Sequence[int], rshape: Sequence[int] = ()) -> dict[sympy.Symbol, int]:
    """Exclusive upper bounds of the index symbols of a (reduction) node."""
    ranges = {index_symbol("i", k): int(s) for k, s in enumerate(shape)}
    ranges.update({index_symbol("r", k): int(s) for k, s in enumerate(rshape)})
    return ranges


def _bounds(expr: sympy.Expr, ranges: dict[sympy.Symbol, int]) -> tuple[int, int] | None:
    """Inclusive (min, max) of a linear, non-negative-coefficient expression."""
    lo = hi = 0
    for term in sympy.Add.make_args(expr):
        coeff, rest = term.as_coeff_Mul()
        if not coeff.is_Integer:
            return None
        if rest == 1:
            lo += int(coeff)
            hi += int(coeff)
        elif rest in ranges:
            span = int(coeff) * (ranges[rest] - 1)
            lo, hi = lo + min(0, span), hi + max(0, span)
        else:
            return None
    return lo, hi


def _fraction(expr: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """(numerator, denominator) of a floor's argument.

    Expanded first: ``together`` leaves ``(i0 + 1)/2`` in sympy's ``Mul(1/2, i0 + 1)``
    form as ``i0/2 + 1/2`` over 1, which no integer arithmetic can evaluate.
    """
    return sympy.fraction(sympy.together(sympy.expand(expr)))


def _split_divisible(expr: sympy.Expr, divisor: int) -> tuple[sympy.Expr, sympy.Expr]:
    """Split a sum into the terms that are multiples of ``divisor`` and the rest."""
    multiple, rest = [], []
    for term in sympy.Add.make_args(expr):
        coeff, _ = term.as_coeff_Mul()
        (multiple if coeff.is_Integer and int(coeff) % divisor == 0 else rest).append(term)
    return sympy.Add(*multiple), sympy.Add(*rest)


def simplify_index(expr: sympy.Expr, ranges: dict[sympy.Symbol, int]) -> sympy.Expr:
    """Remove divisions and remainders that the symbol ranges make redundant.

    ``floor((a*k + b) / k)`` becomes ``a`` and ``Mod(a*k + b, k)`` becomes ``b``
    when ``0 <= b < k``; a remainder of a value already below its modulus
    disappears.  This is what turns a reshape of a reshape back into plain
    strides, and it keeps integer division out of generated kernels.
    """

    def visit(e: sympy.Expr) -> sympy.Expr:
        if not e.args:
            return e
        e = e.func(*(visit(a) for a in e.args))
        if isinstance(e, sympy.floor):
            num, den = _fraction(e.args[0])
            if den.is_Integer and int(den) > 1:
                d = int(den)
                num = sympy.expand(num)
                multiple, rest = _split_divisible(num, d)
                b = _bounds(rest, ranges)
                if b is not None and 0 <= b[0] and b[1] < d:
                    return sympy.expand(multiple / d)
                if b is not None and b == (0, 0):
                    return sympy.expand(multiple / d)
        if isinstance(e, sympy.Mod):
            num, mod = sympy.expand(e.args[0]), e.args[1]
            if mod.is_Integer:
                m = int(mod)
                _, rest = _split_divisible(num, m)
                b = _bounds(rest, ranges)
                if b is not None and 0 <= b[0] and b[1] < m:
                    return rest
                b_all = _bounds(num, ranges)
                if b_all is not None and 0 <= b_all[0] and b_all[1] < m:
                    return num
        return e

    return visit(sympy.expand(expr))


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
    if isinstance(expr, sympy.Min):
        return functools.reduce(_torch_min, args)
    if isinstance(expr, sympy.Max):
        return functools.reduce(_torch_max, args)
    raise NotImplementedError(f"index expression {expr!r} ({type(expr).__name__})")


def _torch_min(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))


def _torch_max(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))


def print_index(expr: sympy.Expr, name: Callable[[sympy.Symbol], str] = str) -> str:
    """Print an index expression as Python/Triton integer arithmetic."""
    if expr.is_Integer:
        return str(int(expr))
    if expr.is_Symbol:
        return name(expr)
    if isinstance(expr, sympy.Add):
        return "(" + " + ".join(print_index(a, name) for a in expr.args) + ")"
    if isinstance(expr, sympy.Mul):
        return "(" + " * ".join(print_index(a, name) for a in expr.args) + ")"
    if isinstance(expr, sympy.Mod):
        return f"({print_index(expr.args[0], name)} % {print_index(expr.args[1], name)})"
    if isinstance(expr, sympy.floor):
        num, den = _fraction(expr.args[0])
        return f"({print_index(num, name)} // {print_index(den, name)})"
    raise NotImplementedError(f"cannot print index expression {expr!r}")


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)
