"""Floats and bools computed from symbolic sizes, as scalar IR expressions.

In the generic variant of a dynamic graph, a Python float or bool that the
traced program derives from sizes (``x / x.shape[0]``, label smoothing's
``eps / num_classes``, an attention scale ``1 / math.sqrt(head_dim)``, a
comparison of two sizes) reaches lowering as a SymFloat or SymBool: a sympy
expression over the size symbols in the vocabulary of torch's shape
environment (``ToFloat``, ``FloatTrueDiv``, ``OpaqueUnaryFn_sqrt``,
relations).  Kernels already take the sizes as integer arguments, so such a
value is computed in the kernel from them (:func:`scalar_expr`): integer
parts become ``Index`` expressions of the size arguments, the rest ``Call`` s
of :mod:`tilec.scalar_ops` in float64, the precision Python computes in, and
the op that reads the value rounds it once to its own dtype, as eager rounds
a Python float.  The value varies along no axis, so a kernel computes it once.

Precision: +, -, *, / and sqrt are correctly rounded in float64 both here and
in Python, so those values are bit-identical to eager's.  exp, log, pow and
the trigonometric functions may differ from CPython's libm in the last bit of
the double, which rounding to float32 almost always hides; and sympy folds
float constants as it builds the expression (``(x * 2.0) * 3.0`` is
``6.0 * x``), which rounds once where Python rounds twice.
"""

from __future__ import annotations

import functools

import sympy
import torch
import torch.utils._sympy.functions as torch_sympy
from sympy.logic.boolalg import BooleanAtom, BooleanFunction

from tilec import index as ix
from tilec.ir import Call, Const, Expr, Index

FLOAT, INT, BOOL = torch.float64, torch.int64, torch.bool

# torch's float-valued functions -> the scalar op computing them in float64.
FLOAT_OPS = {
    torch_sympy.FloatTrueDiv: "truediv",
    torch_sympy.IntTrueDiv: "truediv",
    torch_sympy.FloatPow: "pow",
    torch_sympy.TruncToFloat: "trunc",
}
# ``OpaqueUnaryFn_<op>`` (math.sqrt, math.exp, ... of a SymFloat), by op name:
# torch makes a new class per use, so they are told apart by name.  Only ops
# with a Triton form that runs in the interpreter too.
OPAQUE_PREFIX = "OpaqueUnaryFn_"
OPAQUE_OPS = {"sqrt", "exp", "log", "log2", "sin", "cos", "tan", "sinh", "cosh", "tanh", "asinh"}
# Integer-valued functions of a float: the float op, then a cast.
TO_INT_OPS = {
    torch_sympy.FloorToInt: "floor",
    torch_sympy.CeilToInt: "ceil",
    torch_sympy.TruncToInt: "trunc",
    torch_sympy.RoundToInt: "round",
}
# Ops on operands of one kind: float if any operand is a float, as in Python.
ARITHMETIC_OPS = {sympy.Add: "add", sympy.Mul: "mul", sympy.Max: "maximum", sympy.Min: "minimum"}
RELATIONS = {
    sympy.Eq: "eq",
    sympy.Ne: "ne",
    sympy.StrictLessThan: "lt",
    sympy.LessThan: "le",
    sympy.StrictGreaterThan: "gt",
    sympy.GreaterThan: "ge",
}
LOGIC_OPS = {sympy.And: "logical_and", sympy.Or: "logical_or", sympy.Not: "logical_not"}


@functools.cache
def kind(expr: sympy.Basic) -> torch.dtype:
    """The Python type of ``expr``'s value as a dtype: float64 (a float),
    int64 (an int) or bool."""
    # Not sympy's Boolean: a Symbol is one (for logic), and ours are sizes.
    if isinstance(expr, BooleanAtom | BooleanFunction) or type(expr) in RELATIONS:
        return BOOL
    if expr.is_Float:
        return FLOAT
    if expr.is_Symbol or expr.is_Integer:
        if not expr.is_integer:
            raise NotImplementedError(f"symbol {expr} is not a size")
        return INT
    func = type(expr)
    if func is torch_sympy.ToFloat or func in FLOAT_OPS or func.__name__.startswith(OPAQUE_PREFIX):
        return FLOAT
    if func in TO_INT_OPS or _integer_division(expr):
        return INT
    if func is sympy.Pow and expr.exp.is_negative:  # sympy's 1 / x
        return FLOAT
    if func is torch_sympy.Where:
        return _common(expr.args[1:])
    return _common(expr.args)


def _common(args: tuple[sympy.Basic, ...]) -> torch.dtype:
    return FLOAT if any(kind(a) == FLOAT for a in args) else INT


def scalar_expr(expr: sympy.Basic) -> Expr:
    """The IR expression computing ``expr`` from the size arguments: float64
    for a float, int64 for an int, bool for a bool."""
    dtype = kind(expr)
    if dtype == INT and not _has_float(expr):
        return Const(int(expr), INT) if expr.is_Integer else Index(ix.size(expr))
    if dtype == BOOL and expr.is_Atom:
        return Const(bool(expr), BOOL)
    if expr.is_Float:
        return Const(float(expr), FLOAT)
    func, args = type(expr), [scalar_expr(a) for a in expr.args]
    if func is torch_sympy.ToFloat:
        return _as(args[0], FLOAT)
    if func in FLOAT_OPS or func.__name__.startswith(OPAQUE_PREFIX):
        op = FLOAT_OPS.get(func) or func.__name__.removeprefix(OPAQUE_PREFIX)
        if op not in OPAQUE_OPS | set(FLOAT_OPS.values()):
            raise NotImplementedError(f"symbolic float {expr}: no kernel form for {op}")
        return Call(op, tuple(_as(a, FLOAT) for a in args), FLOAT)
    if func in TO_INT_OPS:
        return _as(Call(TO_INT_OPS[func], (_as(args[0], FLOAT),), FLOAT), INT)
    if func is sympy.Pow:
        base = _as(args[0], dtype)
        if expr.exp == -1:  # sympy's 1 / x
            return Call("truediv", (Const(1.0, FLOAT), base), FLOAT)
        if dtype == INT:  # a power of an integer: a positive integer exponent
            return functools.reduce(lambda a, b: Call("mul", (a, b), INT), [base] * int(expr.exp))
        return Call("pow", (base, _as(args[1], FLOAT)), FLOAT)
    if func in ARITHMETIC_OPS or func in LOGIC_OPS:
        op = ARITHMETIC_OPS.get(func) or LOGIC_OPS[func]
        operands = [_as(a, dtype) for a in args]
        if len(operands) == 1:  # Not
            return Call(op, (operands[0],), dtype)
        return functools.reduce(lambda a, b: Call(op, (a, b), dtype), operands)
    if func in RELATIONS:
        common = _common(expr.args)
        return Call(RELATIONS[func], tuple(_as(a, common) for a in args), BOOL)
    if func is torch_sympy.Where:
        return Call("where", (_as(args[0], BOOL), *(_as(a, dtype) for a in args[1:])), dtype)
    raise NotImplementedError(f"symbolic {dtype} {expr} ({func.__name__})")


def _has_float(expr: sympy.Basic) -> bool:
    """Whether computing ``expr`` takes a float anywhere (an integer division,
    :func:`_integer_division`, is an index expression's own floor)."""
    if _integer_division(expr):
        return False
    return expr.is_Float or kind(expr) == FLOAT or any(_has_float(a) for a in expr.args)


def _integer_division(expr: sympy.Basic) -> bool:
    """``floor`` or ``ceiling`` of a ratio of integer expressions: how
    ``ix.size`` writes torch's ``FloorDiv`` and ``CeilDiv`` of sizes (its
    ``1 / s`` is no float; ``print_index`` writes it as ``//``)."""
    if type(expr) not in (sympy.floor, sympy.ceiling):
        return False
    # Every atom an integer (no Float, no Rational) and every power integral.
    return all(
        e.is_integer if e.is_Atom else e.exp.is_integer
        for e in sympy.preorder_traversal(expr.args[0])
        if e.is_Atom or type(e) is sympy.Pow
    )


def _as(e: Expr, dtype: torch.dtype) -> Expr:
    """``e`` converted as Python converts a value of its kind (an int or bool
    used as a float, a float truncated by ``int``, a value tested for truth)."""
    if e.dtype == dtype:
        return e
    if isinstance(e, Const):
        return Const({FLOAT: float, INT: int, BOOL: bool}[dtype](e.value), dtype)
    return Call("cast", (e,), dtype)
