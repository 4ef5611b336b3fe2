"""Lowering rules, one per ATen op: the table ``RULES``.

Each rule takes the lowering context and the op's schema-bound arguments and
returns IR nodes (or raises :class:`Unsupported`).  Pointwise ops build a
scalar body; reductions a reduction node; view ops a view node; gathers,
concatenation and padding become pointwise nodes with computed (indirect or
masked) loads; matmul and convolution become library calls.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from tilec import index as ix
from tilec import symbolic_scalars
from tilec.ir import AT, Call, Const, Expr, Index, Load, Node, View, check_index
from tilec.lower import (
    Lowering,
    Unsupported,
    broadcast_index,
    call_extern,
    cast,
    compute_dtype,
    fallback_with,
    load,
    out_index,
    scalar,
    storage_base,
)
from tilec.scalar_ops import PREDICATES
from tilec.target import GPU_ATOMICS

aten = torch.ops.aten
prims = torch.ops.prims
RULES: dict[Any, Any] = {}


def rule(*targets):
    def register(fn):
        for t in targets:
            RULES[t] = fn
        return fn

    return register


def _meta_like(a: Any) -> Any:
    if isinstance(a, Node):
        # Promotion only tells zero-dim tensors from others: sizes do not matter.
        return torch.empty([1] * len(a.shape), dtype=a.dtype, device="meta")
    if isinstance(a, sympy.Basic):
        # A symbolic size, or a float or bool computed from sizes: its Python
        # type is what promotion needs.
        return {torch.int64: 2, torch.float64: 2.0, torch.bool: True}[symbolic_scalars.kind(a)]
    return a


def _out(ctx: Lowering) -> tuple[tuple[int, ...], torch.dtype]:
    val = ctx.meta()
    return ctx.sizes(val.shape), val.dtype


# ------------------------------------------------------------- pointwise ops


# Ops whose CUDA kernels take a Python number next to a half or bfloat16
# tensor in their computation dtype (``opmath``, float32), not rounded to
# the tensor's: ``x * 0.3`` multiplies by 0.3 in float32, not by 0.30078125
# (0.3 in bfloat16), a bias of 0.26 % on every element.  Comparisons round
# it to the tensor's dtype first (their functors take the tensor's type).
OPMATH_SCALAR_OPS = frozenset({"add", "sub", "mul", "truediv"})


def elementwise(ctx: Lowering, op: str, *args: Any) -> Node:
    """``op`` applied to broadcast tensor/scalar arguments, dtypes as eager's."""
    shape, out_dtype = _out(ctx)
    # (computation dtype, result dtype): the second is the operands' common dtype.
    _, promoted = elementwise_dtypes(
        *map(_meta_like, args), type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
    )
    work = compute_dtype(promoted if op in PREDICATES else out_dtype)
    tensors = [a for a in args if isinstance(a, Node)]
    idx = out_index(shape)
    # Operands meet in the promoted dtype, as in eager (a 0-d float32 tensor next
    # to a half tensor is rounded to half, and so is a Python float it is
    # compared with), then are computed in ``work``; a Python float that
    # :data:`OPMATH_SCALAR_OPS` take is a constant of ``work``.
    opmath = op in OPMATH_SCALAR_OPS and promoted.is_floating_point
    operands = [
        cast(cast(load(tensors.index(a), a, idx), promoted), work)
        if isinstance(a, Node)
        else cast(scalar(a, work if opmath else promoted), work)
        for a in args
    ]
    result_dtype = torch.bool if op in PREDICATES else work
    body = Call(op, tuple(operands), result_dtype)
    return ctx.pointwise(shape, out_dtype, _unique(tensors), body, ctx.out_stride())


def _unique(nodes: Sequence[Node]) -> list[Node]:
    seen: dict[str, Node] = {}
    for n in nodes:
        seen.setdefault(n.name, n)
    return list(seen.values())


def _elementwise_with_positions(ctx: Lowering, build, *args: Any) -> Node:
    """Like :func:`elementwise` with a custom body: ``build(operands, work)``."""
    shape, out_dtype = _out(ctx)
    work = compute_dtype(out_dtype)
    tensors = _unique([a for a in args if isinstance(a, Node)])
    names = [t.name for t in tensors]
    idx = out_index(shape)
    operands = [
        cast(load(names.index(a.name), a, idx), work) if isinstance(a, Node) else a for a in args
    ]
    return ctx.pointwise(shape, out_dtype, tensors, build(operands, work), ctx.out_stride())


UNARY_RULES = {
    aten.abs: "abs",
    aten.neg: "neg",
    aten.exp: "exp",
    aten.exp2: "exp2",
    aten.expm1: "expm1",
    aten.log: "log",
    aten.log2: "log2",
    aten.log10: "log10",
    aten.log1p: "log1p",
    aten.sqrt: "sqrt",
    aten.rsqrt: "rsqrt",
    aten.sin: "sin",
    aten.cos: "cos",
    aten.tan: "tan",
    aten.asin: "asin",
    aten.acos: "acos",
    aten.atan: "atan",
    aten.sinh: "sinh",
    aten.cosh: "cosh",
    aten.tanh: "tanh",
    aten.asinh: "asinh",
    aten.acosh: "acosh",
    aten.atanh: "atanh",
    aten.erf: "erf",
    aten.erfc: "erfc",
    aten.sigmoid: "sigmoid",
    aten.floor: "floor",
    aten.ceil: "ceil",
    aten.round: "round",
    aten.trunc: "trunc",
    aten.sign: "sign",
    aten.sgn: "sign",
    aten.reciprocal: "reciprocal",
    aten.logical_not: "logical_not",
    aten.bitwise_not: "bitwise_not",
    aten.isnan: "isnan",
    aten.isinf: "isinf",
}

BINARY_RULES = {
    aten.mul: "mul",
    aten.maximum: "maximum",
    aten.minimum: "minimum",
    aten.atan2: "atan2",
    aten.remainder: "remainder",
    aten.fmod: "fmod",
    aten.eq: "eq",
    aten.ne: "ne",
    aten.lt: "lt",
    aten.le: "le",
    aten.gt: "gt",
    aten.ge: "ge",
    aten.logical_and: "logical_and",
    aten.logical_or: "logical_or",
    aten.logical_xor: "logical_xor",
    aten.bitwise_and: "bitwise_and",
    aten.bitwise_or: "bitwise_or",
    aten.bitwise_xor: "bitwise_xor",
    aten.bitwise_left_shift: "bitwise_left_shift",
    aten.__lshift__: "bitwise_left_shift",
    aten.bitwise_right_shift: "bitwise_right_shift",
    aten.__rshift__: "bitwise_right_shift",
    aten.floor_divide: "floordiv",
}


def _register_table() -> None:
    for target, op in UNARY_RULES.items():
        RULES[target] = lambda ctx, x, *_, op=op: _unary(ctx, op, x)
    for target, op in BINARY_RULES.items():
        RULES[target] = lambda ctx, a, b, *_, op=op: elementwise(ctx, op, a, b)


def _unary(ctx: Lowering, op: str, x: Any) -> Node:
    if ctx.current.target._overloadname == "decimals":
        raise Unsupported("round with decimals")
    if op == "bitwise_not" and isinstance(x, Node) and x.dtype == torch.bool:
        op = "logical_not"
    if op == "erfc" and _out(ctx)[1] == torch.float64:
        # The prelude's _erfc is a fit good to float32 (1.2e-7 relative).
        raise Unsupported("float64 erfc")
    return elementwise(ctx, op, x)


_register_table()


@rule(aten.add, aten.sub)
def add_sub(ctx: Lowering, a: Any, b: Any, alpha: Any = 1) -> Node:
    op = "add" if ctx.current.target.overloadpacket is aten.add else "sub"
    if alpha == 1:
        return elementwise(ctx, op, a, b)

    def build(ops: list[Expr], work: torch.dtype) -> Expr:
        x, y = (o if not isinstance(o, (int, float, bool)) else scalar(o, work) for o in ops)
        return Call(op, (x, Call("mul", (y, scalar(alpha, work)), work)), work)

    return _elementwise_with_positions(ctx, build, a, b)


@rule(prims.fma)
def fma(ctx: Lowering, a: Any, b: Any, c: Any) -> Node:
    """``a * b + c`` rounded once (``scalar_ops.TERNARY``)."""
    return elementwise(ctx, "fma", a, b, c)


@rule(aten.rsub)
def rsub(ctx: Lowering, a: Any, b: Any, alpha: Any = 1) -> Node:
    if alpha != 1:
        raise Unsupported("rsub alpha")
    return elementwise(ctx, "sub", b, a)


@rule(aten.div, aten.true_divide)
def div(ctx: Lowering, a: Any, b: Any, rounding_mode: str | None = None) -> Node:
    op = {None: "truediv", "floor": "floordiv", "trunc": "truncdiv"}[rounding_mode]
    return elementwise(ctx, op, a, b)


@rule(aten.pow)
def pow_(ctx: Lowering, a: Any, b: Any) -> Node:
    """Small constant exponents become the exact cheaper ops eager uses; integer pow falls back
    (the float formula is not exact for large integers)."""
    _, out_dtype = _out(ctx)
    if isinstance(a, Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if b == 2:
            return _elementwise_with_positions(
                ctx, lambda ops, work: Call("mul", (ops[0], ops[0]), work), a
            )
        if out_dtype.is_floating_point and b in (0.5, -0.5, -1):
            return elementwise(ctx, {0.5: "sqrt", -0.5: "rsqrt", -1: "reciprocal"}[b], a)
        if out_dtype.is_floating_point and b in (3, -2):
            # Exact products, as eager computes these exponents.
            def build(ops: list[Expr], work: torch.dtype) -> Expr:
                square = Call("mul", (ops[0], ops[0]), work)
                if b == 3:
                    return Call("mul", (square, ops[0]), work)
                return Call("truediv", (scalar(1, work), square), work)

            return _elementwise_with_positions(ctx, build, a)
    if not out_dtype.is_floating_point:
        raise Unsupported("integer pow")
    return elementwise(ctx, "pow", a, b)


@rule(aten.fmax, aten.fmin)
def fmax_fmin(ctx: Lowering, a: Any, b: Any) -> Node:
    """Like maximum/minimum, but a NaN loses to a number."""
    op = "maximum" if ctx.current.target.overloadpacket is aten.fmax else "minimum"

    def build(ops: list[Any], work: torch.dtype) -> Expr:
        x, y = (scalar(o, work) if isinstance(o, (int, float, bool)) else o for o in ops)
        # y first: on a tie (-0.0 with 0.0) the kernels' maximum and minimum
        # give their second operand, and eager's fmax and fmin give x.
        both = Call(op, (y, x), work)
        if not work.is_floating_point:
            return both
        nan_y = Call("where", (Call("isnan", (y,), torch.bool), x, both), work)
        return Call("where", (Call("isnan", (x,), torch.bool), y, nan_y), work)

    return _elementwise_with_positions(ctx, build, a, b)


@rule(aten.relu)
def relu(ctx: Lowering, x: Node) -> Node:
    # 0 first: relu(-0.0) is -0.0 in eager (see clamp).
    return elementwise(ctx, "maximum", 0, x)


@rule(aten.where)
def where(ctx: Lowering, cond: Any, a: Any, b: Any) -> Node:
    def build(ops: list[Any], work: torch.dtype) -> Expr:
        c, x, y = (o if not isinstance(o, (int, float, bool)) else scalar(o, work) for o in ops)
        return Call("where", (cast(c, torch.bool), cast(x, work), cast(y, work)), work)

    shape, out_dtype = _out(ctx)
    tensors = _unique([t for t in (cond, a, b) if isinstance(t, Node)])
    names = [t.name for t in tensors]
    idx = out_index(shape)
    ops = [load(names.index(t.name), t, idx) if isinstance(t, Node) else t for t in (cond, a, b)]
    return ctx.pointwise(
        shape, out_dtype, tensors, build(ops, compute_dtype(out_dtype)), ctx.out_stride()
    )


@rule(aten.clamp, aten.clamp_min, aten.clamp_max)
def clamp(ctx: Lowering, x: Node, lo: Any = None, hi: Any = None) -> Node:
    if ctx.current.target.overloadpacket is aten.clamp_max:
        lo, hi = None, lo

    def build(ops: list[Any], work: torch.dtype) -> Expr:
        v, low, high = (
            scalar(o, work) if isinstance(o, int | float | bool | sympy.Basic) else o for o in ops
        )
        # The bound first: on a tie (-0.0 with 0.0) the kernels' maximum and
        # minimum give their second operand, and eager's clamp gives x.
        if low is not None:
            v = Call("maximum", (cast(low, work), v), work)
        if high is not None:
            v = Call("minimum", (cast(high, work), v), work)
        return v

    return _elementwise_with_positions(ctx, build, x, lo, hi)


@rule(aten._to_copy, aten.clone, aten.lift_fresh_copy, prims.convert_element_type)
def copy_cast(ctx: Lowering, x: Node, *_: Any) -> Node:
    shape, out_dtype = _out(ctx)
    body = cast(load(0, x, out_index(shape)), out_dtype)
    if ctx.meta().device != torch.device("meta") and ctx.current.kwargs.get("device") not in (
        None,
        ctx.meta().device,
    ):
        raise Unsupported("device copy")
    return ctx.pointwise(shape, out_dtype, [x], body, ctx.out_stride())


@rule(aten.copy)
def copy(ctx: Lowering, dst: Node, src: Node, non_blocking: bool = False) -> Node:
    shape, out_dtype = _out(ctx)
    body = cast(load(0, src, out_index(shape)), out_dtype)
    return ctx.pointwise(shape, out_dtype, [src], body, ctx.out_stride())


@rule(aten.alias)
def alias(ctx: Lowering, x: Node) -> Node:
    return x


# ------------------------------------------------------------------ creation


@rule(
    aten.full,
    aten.scalar_tensor,
    aten.empty,
    aten.empty_strided,
    aten.empty_permuted,
    aten.zeros,
    aten.ones,
)
def full(ctx: Lowering, *args: Any) -> Node:
    shape, out_dtype = _out(ctx)
    packet = ctx.current.target.overloadpacket
    value = {aten.full: lambda: args[1], aten.scalar_tensor: lambda: args[0]}.get(
        packet, lambda: 1 if packet is aten.ones else 0
    )()
    return ctx.pointwise(shape, out_dtype, [], scalar(value, out_dtype), ctx.out_stride())


@rule(aten.full_like, aten.zeros_like, aten.ones_like, aten.empty_like, aten.new_empty_strided)
def full_like(ctx: Lowering, x: Node, *args: Any) -> Node:
    """A tensor of one value with the size, dtype and strides of eager's
    result (an uninitialised one, ``empty_like`` or ``new_empty_strided``
    in an AOTAutograd backward: zeros, as ``empty`` above)."""
    shape, out_dtype = _out(ctx)
    packet = ctx.current.target.overloadpacket
    value = args[0] if packet is aten.full_like else (1 if packet is aten.ones_like else 0)
    return ctx.pointwise(shape, out_dtype, [], scalar(value, out_dtype), ctx.out_stride())


@rule(aten.arange)
def arange(ctx: Lowering, *args: Any) -> Node:
    shape, out_dtype = _out(ctx)
    # Schema-bound: (end, ...), (start, end, ...) or (start, end, step, ...).
    bounds = {"default": (0, 1), "start": (args[0], 1), "start_step": (args[0], args[2])}
    name = ctx.current.target._overloadname
    if name not in bounds:
        raise Unsupported(f"arange overload {name}")
    start, step = bounds[name]
    return _iota(ctx, shape, out_dtype, start, step)


@rule(prims.iota)
def iota(ctx: Lowering, length: int, start: int, step: int, *_: Any) -> Node:
    shape, out_dtype = _out(ctx)
    return _iota(ctx, shape, out_dtype, start, step)


def _iota(ctx: Lowering, shape, dtype: torch.dtype, start, step) -> Node:
    (i0,) = out_index(shape)
    if not dtype.is_floating_point:
        # Ints (float bounds truncated, as eager does) or sizes (generic variant).
        first, stride = (v if isinstance(v, sympy.Basic) else int(v) for v in (start, step))
        if any(
            isinstance(v, sympy.Basic) and symbolic_scalars.kind(v) != torch.int64
            for v in (first, stride)
        ):
            raise Unsupported("integer arange from floats computed from sizes")
        return ctx.pointwise(shape, dtype, [], Index(first + stride * i0))
    # Like eager: start + i * step in double precision, rounded once.
    i = Call("cast", (Index(i0),), torch.float64)
    v = Call(
        "add",
        (
            scalar(start, torch.float64),
            Call("mul", (i, scalar(step, torch.float64)), torch.float64),
        ),
        torch.float64,
    )
    return ctx.pointwise(shape, dtype, [], v)


# ---------------------------------------------------------------- reductions


def _dims(dims: Any, rank: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % rank for d in dims}) if rank else []


def reduce(
    ctx: Lowering,
    x: Node,
    dims: Any,
    keepdim: bool,
    op: str,
    out_dtype: torch.dtype,
    body_of=None,
    extra: Sequence[Node] = (),
) -> Node:
    """``op`` over ``dims`` of ``x``; ``body_of(load, outer_index)`` may rewrite the value."""
    rank = len(x.shape)
    dims = _dims(dims, rank)
    outer = [d for d in range(rank) if d not in dims]
    out_shape = [x.shape[d] for d in outer]
    rshape = [x.shape[d] for d in dims]
    i_syms, r_syms = ix.out_symbols(len(outer)), ix.reduce_symbols(len(dims))
    index: list[sympy.Expr] = [sympy.Integer(0)] * rank
    for d, s in zip(outer, i_syms):
        index[d] = s
    for d, s in zip(dims, r_syms):
        index[d] = s
    acc = torch.int64 if op in ("argmax", "argmin") else compute_dtype(out_dtype)
    value: Expr = Load(0, tuple(index), x.dtype)
    if op in ("argmax", "argmin"):
        value = cast(value, compute_dtype(x.dtype))
    elif op in ("any", "all"):
        value = cast(value, torch.bool)
    else:
        value = cast(value, acc)
    if body_of is not None:
        value = body_of(value, i_syms)
    node = ctx.reduction(out_shape, out_dtype, [x, *extra], value, op, rshape)
    if keepdim:
        kept = [1 if d in dims else x.shape[d] for d in range(rank)]
        node = ctx.view(node, View("reshape", (tuple(kept),)), kept)
    return node


@rule(aten.sum, aten.prod)
def sum_prod(ctx: Lowering, x: Node, *args: Any) -> Node:
    op = "sum" if ctx.current.target.overloadpacket is aten.sum else "prod"
    _, out_dtype = _out(ctx)
    name = ctx.current.target._overloadname
    if name == "default":
        return reduce(ctx, x, None, False, op, out_dtype)
    dim, keepdim = args[0], args[1]
    return reduce(ctx, x, dim, keepdim, op, out_dtype)


@rule(aten.mean)
def mean(ctx: Lowering, x: Node, *args: Any) -> Node:
    _, out_dtype = _out(ctx)
    dims, keepdim = (None, False) if ctx.current.target._overloadname == "default" else args[:2]
    total = reduce(ctx, x, dims, keepdim, "sum", compute_dtype(out_dtype))
    count = ix.numel([x.shape[d] for d in _dims(dims, len(x.shape))])
    return _divide(ctx, total, count, out_dtype, float("nan"))


def _divide(
    ctx: Lowering, x: Node, count: float | sympy.Expr, dtype: torch.dtype, empty: float
) -> Node:
    """``x / count``, or ``x * empty`` when ``count`` is 0 (an empty mean is nan)."""
    work = compute_dtype(dtype)
    value = cast(load(0, x, out_index(x.shape)), work)
    if isinstance(count, int | float):
        body = Call("mul", (value, scalar(1.0 / count if count else empty, work)), work)
    else:
        # A count of symbolic sizes, computed in the kernel.  A variance's
        # ``n - correction`` may be 0 or less: eager divides by ``max(0, ...)``
        # (inf or nan).
        if not ix.always_positive(count):
            count = ix.size(sympy.Max(count, 0))
        body = Call("truediv", (value, scalar(count, work)), work)
    return ctx.pointwise(x.shape, dtype, [x], body)


@rule(aten.amax, aten.amin)
def amax_amin(ctx: Lowering, x: Node, dim: Any = (), keepdim: bool = False) -> Node:
    op = "max" if ctx.current.target.overloadpacket is aten.amax else "min"
    return reduce(ctx, x, dim, keepdim, op, x.dtype)


@rule(aten.max, aten.min)
def max_min(ctx: Lowering, x: Node, *args: Any) -> Any:
    is_max = ctx.current.target.overloadpacket is aten.max
    name = ctx.current.target._overloadname
    if name == "default":
        return reduce(ctx, x, None, False, "max" if is_max else "min", x.dtype)
    if name != "dim":
        raise Unsupported(f"max/min overload {name}")
    dim, keepdim = args[0], args[1]
    values = reduce(ctx, x, [dim], keepdim, "max" if is_max else "min", x.dtype)
    indices = reduce(ctx, x, [dim], keepdim, "argmax" if is_max else "argmin", torch.int64)
    return values, indices


@rule(aten.argmax, aten.argmin)
def argmax_argmin(ctx: Lowering, x: Node, dim: int | None = None, keepdim: bool = False) -> Node:
    op = "argmax" if ctx.current.target.overloadpacket is aten.argmax else "argmin"
    if dim is None:
        flat = ctx.view(x, View("reshape", ((math.prod(x.shape),),)), (math.prod(x.shape),))
        node = reduce(ctx, flat, [0], False, op, torch.int64)
        if keepdim:
            ones = (1,) * len(x.shape)
            node = ctx.view(node, View("reshape", (ones,)), ones)
        return node
    return reduce(ctx, x, [dim], keepdim, op, torch.int64)


@rule(aten.any, aten.all)
def any_all(ctx: Lowering, x: Node, *args: Any) -> Node:
    op = "any" if ctx.current.target.overloadpacket is aten.any else "all"
    name = ctx.current.target._overloadname
    dims, keepdim = (None, False) if name == "default" else (args[0], args[1])
    return reduce(ctx, x, dims, keepdim, op, torch.bool)


def _moments(ctx: Lowering, x: Node, dims: Any, correction: Any, keepdim: bool):
    """(variance, mean) as two reductions over the same rows."""
    work = compute_dtype(x.dtype)
    rank = len(x.shape)
    dims = _dims(dims, rank)
    n = ix.numel([x.shape[d] for d in dims])
    correction = 1 if correction is None else correction
    if isinstance(correction, float) and correction.is_integer():
        correction = int(correction)  # keeps a symbolic count integer
    total = reduce(ctx, x, dims, False, "sum", work)
    mean = _divide(ctx, total, n, work, float("nan"))

    def centered(value: Expr, i_syms) -> Expr:
        return Call("sub", (value, Load(1, tuple(i_syms), work)), work)

    def centered_square(value: Expr, i_syms) -> Expr:
        d = centered(value, i_syms)
        return Call("mul", (d, d), work)

    # The corrected two-pass form: sum((x - m)^2) - sum(x - m)^2 / n.  The
    # mean m is off by the sum's rounding (about 0.1 at 1e6 + randn over
    # 1e5), which adds its square, n times, to the plain sum of squares:
    # the variance was 0.5 % off there, eager's (Welford) 5e-8.  The second
    # sum takes that error back out; both share one pass over x.
    squares = reduce(ctx, x, dims, False, "sum", work, centered_square, extra=[mean])
    offsets = reduce(ctx, x, dims, False, "sum", work, centered, extra=[mean])
    here = out_index(squares.shape)
    s2, s1 = load(0, squares, here), load(1, offsets, here)
    if isinstance(n, int):  # an empty sum is 0: no correction
        inverse = scalar(1.0 / n if n else 0.0, work)
    else:
        inverse = Call("truediv", (scalar(1, work), scalar(n, work)), work)
    drift = Call("mul", (Call("mul", (s1, s1), work), inverse), work)
    # At most the sum of squares (as it is exactly, so the variance is never
    # negative), and none where that sum overflowed to inf (inf - inf is nan;
    # eager's is inf).  nan stays nan.
    finite = Call("lt", (s2, scalar(float("inf"), work)), torch.bool)
    cap = Call("where", (finite, s2, scalar(0, work)), work)
    drift = Call("where", (Call("lt", (drift, s2), torch.bool), drift, cap), work)
    squares = ctx.pointwise(squares.shape, work, [squares, offsets], Call("sub", (s2, drift), work))
    denom = max(n - correction, 0) if isinstance(n, int) else n - correction
    var = _divide(ctx, squares, denom, x.dtype, float("inf"))
    mean_out = ctx.pointwise(mean.shape, x.dtype, [mean], load(0, mean, out_index(mean.shape)))
    if keepdim:
        kept = tuple(1 if d in dims else x.shape[d] for d in range(rank))
        var = ctx.view(var, View("reshape", (kept,)), kept)
        mean_out = ctx.view(mean_out, View("reshape", (kept,)), kept)
    return var, mean_out


@rule(aten.var)
def var(ctx: Lowering, x: Node, dims: Any = None, *args: Any) -> Node:
    if ctx.current.target._overloadname != "correction":
        raise Unsupported("var overload")
    correction, keepdim = args[0], args[1]
    if not x.dtype.is_floating_point:
        raise Unsupported("var of integers")
    return _moments(ctx, x, dims, correction, keepdim)[0]


@rule(aten.var_mean)
def var_mean(ctx: Lowering, x: Node, dims: Any = None, *args: Any) -> Any:
    if ctx.current.target._overloadname != "correction":
        raise Unsupported("var_mean overload")
    return _moments(ctx, x, dims, args[0], args[1])


# --------------------------------------------------------------------- views


@rule(aten.view, aten._unsafe_view, aten.reshape, aten.squeeze, aten.unsqueeze)
def reshape(ctx: Lowering, x: Node, *_: Any) -> Node:
    shape, dtype = _out(ctx)
    if dtype != x.dtype:
        raise Unsupported("view as another dtype reinterprets bits")
    return ctx.view(x, View("reshape", (shape,)), shape)


@rule(aten.permute)
def permute(ctx: Lowering, x: Node, dims: Sequence[int]) -> Node:
    shape, _ = _out(ctx)
    rank = len(x.shape)
    return ctx.view(x, View("permute", (tuple(d % rank for d in dims),)), shape)


@rule(aten.expand)
def expand(ctx: Lowering, x: Node, *_: Any) -> Node:
    shape, _ = _out(ctx)
    return ctx.view(x, View("expand", (shape,)), shape)


@rule(aten.slice)
def slice_(
    ctx: Lowering, x: Node, dim: int = 0, start: Any = None, end: Any = None, step: int = 1
) -> Node:
    shape, _ = _out(ctx)
    dim %= len(x.shape)
    size = x.shape[dim]
    start = 0 if start is None else start
    if isinstance(start, int) and isinstance(size, int):
        start = min(max(start + size if start < 0 else start, 0), size)
    else:  # a symbolic size or start: clamped by sympy (Min/Max kept where needed)
        if isinstance(start, int) and start < 0:
            start = start + size
        elif not isinstance(start, int) and not ix.always_positive(start + 1):
            raise Unsupported(f"slice start {start} of unknown sign")
        start = ix.size(sympy.Min(sympy.Max(start, 0), size))
    return ctx.view(x, View("slice", (dim, start, step)), shape)


@rule(aten.select)
def select(ctx: Lowering, x: Node, dim: int, index: int) -> Node:
    shape, _ = _out(ctx)
    dim %= len(x.shape)
    if not isinstance(index, int) and not ix.always_positive(index + 1):
        raise Unsupported(f"select index {index} of unknown sign")
    index = index + x.shape[dim] if isinstance(index, int) and index < 0 else index
    return ctx.view(x, View("select", (dim, index)), shape)


@rule(aten.as_strided)
def as_strided(
    ctx: Lowering, x: Node, size: Sequence[int], stride: Sequence[int], offset: Any = None
) -> Node:
    """torch's ``as_strided`` addresses the storage of its input, not its
    elements: element ``i`` is ``storage[offset + sum(i_k * stride_k)]``,
    ``offset`` defaulting to the input's own storage offset.  The storage
    belongs to the buffer the input is a view of (its base, found through
    the chain of views); the node reads the base's element stored there,
    by eager's layout of the base, so it holds whatever layout tilec later
    gives the base.  Falls back to ATen where that element is not known at
    compile time: an absolute offset into a graph input (Dynamo does not
    guard on storage offsets; ATen runs it on the input), a base whose
    layout is not dense, or positions outside the base's elements."""
    shape, out_dtype = _out(ctx)
    viewed = ctx.current.args[0]
    base_fx = storage_base(viewed)
    base, base_val = ctx.values[base_fx], base_fx.meta["val"]
    if base_fx.op == "placeholder" and offset is not None:
        # Only the real input knows it: the same call on the input itself
        # (tilec may hold the viewed tensor as a copy: a diagonal).
        return fallback_with(ctx, (base, size, stride, offset))
    if offset is None:
        offset = ctx.sizes((viewed.meta["val"].storage_offset(),))[0]
    idx = out_index(shape)
    start = offset - ctx.sizes((base_val.storage_offset(),))[0]
    flat = ix.size(start + sum((i * s for i, s in zip(idx, stride)), sympy.Integer(0)))
    if not ix.in_bounds((flat,), (ix.numel(base.shape),), ix.symbol_ranges(shape)):
        raise Unsupported("as_strided of positions outside its base's elements")
    layout = ctx.sizes(base_val.stride())
    if ix.dense_order(base.shape, layout) is None:
        # Its gaps hold what eager left there.
        raise Unsupported("as_strided of a base whose layout is not dense")
    src = ix.storage_index(flat, base.shape, layout)
    return ctx.pointwise(shape, out_dtype, [base], Load(0, src, base.dtype), ctx.out_stride())


@rule(aten.diagonal)
def diagonal(ctx: Lowering, x: Node, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Node:
    shape, out_dtype = _out(ctx)
    rank = len(x.shape)
    dim1, dim2 = dim1 % rank, dim2 % rank
    idx = out_index(shape)
    rest = iter(idx[:-1])
    src = [next(rest) if d not in (dim1, dim2) else None for d in range(rank)]
    src[dim1] = idx[-1] + max(-offset, 0)
    src[dim2] = idx[-1] + max(offset, 0)
    return ctx.pointwise(shape, out_dtype, [x], Load(0, tuple(src), x.dtype), ctx.out_stride())


@rule(aten.split, aten.split_with_sizes)
def split(ctx: Lowering, x: Node, sizes: Any, dim: int = 0) -> tuple[Node, ...]:
    dim %= len(x.shape)
    vals = ctx.meta()
    out, start = [], 0
    for val in vals:
        shape = ctx.sizes(val.shape)
        out.append(ctx.view(x, View("slice", (dim, start, 1)), shape))
        start += shape[dim]
    return tuple(out)


@rule(aten.unbind)
def unbind(ctx: Lowering, x: Node, dim: int = 0) -> tuple[Node, ...]:
    dim %= len(x.shape)
    shape = x.shape[:dim] + x.shape[dim + 1 :]
    return tuple(ctx.view(x, View("select", (dim, k)), shape) for k in range(x.shape[dim]))


# ---------------------------------------------- concatenation, padding, gather


@rule(aten.cat)
def cat(ctx: Lowering, tensors: Sequence[Node], dim: int = 0) -> Node:
    shape, out_dtype = _out(ctx)
    dim %= len(shape)
    # Empty parts are left out; a symbolic size that may be 0 (a ViT's
    # floor(s / 16) ** 2 patches) is kept: its masks then select nothing.
    parts = [t for t in tensors if not (t.shape == (0,) and len(shape) != 1) and t.shape[dim] != 0]
    work = compute_dtype(out_dtype)
    idx = out_index(shape)
    offsets, start = [], 0
    for t in parts:
        offsets.append(start)
        start += t.shape[dim]
    body: Expr | None = None
    for k in reversed(range(len(parts))):
        shifted = list(idx)
        shifted[dim] = idx[dim] - offsets[k]
        last = body is None
        below_end = Call(
            "lt",
            (Index(idx[dim]), Const(offsets[k] + parts[k].shape[dim], torch.int64)),
            torch.bool,
        )
        after_start = Call("ge", (Index(idx[dim]), Const(offsets[k], torch.int64)), torch.bool)
        # Every part is evaluated everywhere and selected by the where chain, so
        # each load is masked to its own part's range (no out-of-bounds reads).
        mask = _all(([after_start] if offsets[k] != 0 else []) + ([] if last else [below_end]))
        value = cast(Load(k, tuple(shifted), parts[k].dtype, mask=mask), work)
        body = value if last else Call("where", (below_end, value, body), work)
    if body is None:
        body = scalar(0, work)
    return ctx.pointwise(shape, out_dtype, parts, body, ctx.out_stride())


@rule(aten.slice_scatter)
def slice_scatter(
    ctx: Lowering,
    x: Node,
    src: Node,
    dim: int = 0,
    start: Any = None,
    end: Any = None,
    step: int = 1,
) -> Node:
    """``x`` with ``x[..., start:end:step, ...] = src`` along ``dim`` (the
    backward of a slice, a rotary embedding's halves): ``src`` where the
    position is in the slice, ``x`` elsewhere; ``src``'s load masked to it."""
    shape, out_dtype = _out(ctx)
    dim %= len(shape)
    size = shape[dim]
    if not all(isinstance(v, int) for v in (size, step)) or step < 1:
        raise Unsupported("slice_scatter with a symbolic size or step")
    lo, hi, _ = slice(start, end, step).indices(size)
    if not all(isinstance(v, int) for v in (lo, hi)):
        raise Unsupported("slice_scatter with a symbolic bound")
    work = compute_dtype(out_dtype)
    idx = out_index(shape)
    i = idx[dim]
    conds = [Call("ge", (Index(i), Const(lo, torch.int64)), torch.bool)] if lo > 0 else []
    if hi < size:
        conds.append(Call("lt", (Index(i), Const(hi, torch.int64)), torch.bool))
    if step > 1:
        on_step = Call("eq", (Index(sympy.Mod(i - lo, step)), Const(0, torch.int64)), torch.bool)
        conds.append(on_step)
    inside = _all(conds)
    src_idx = list(idx)
    src_idx[dim] = (i - lo) if step == 1 else sympy.floor((i - lo) / step)
    value = cast(Load(1, tuple(src_idx), src.dtype, mask=inside), work)
    if inside is None:
        body = value
    else:
        body = Call("where", (inside, value, cast(Load(0, idx, x.dtype), work)), work)
    return ctx.pointwise(shape, out_dtype, [x, src], body, ctx.out_stride())


@rule(aten.native_dropout)
def native_dropout(ctx: Lowering, x: Node, p: float, train: bool | None) -> tuple[Node, Node]:
    """Dropout in training: ``(x * keep / (1 - p), keep)`` with ``keep``
    true where the element's uniform number (``tilec.rng``, at its flat
    position) is below ``1 - p``; returns ``(x, all true)`` out of training."""
    shape = x.shape
    idx = out_index(shape)
    if train is False or p == 0:
        keep = ctx.pointwise(shape, torch.bool, [], Const(True, torch.bool), None)
        return x, keep
    if not all(isinstance(s, int) for s in shape) or math.prod(shape) >= 2**31:
        raise Unsupported("dropout over symbolic sizes or 2**31 elements or more")
    seed, stream = ctx.random_stream()
    flat = sum((i * math.prod(shape[d + 1 :]) for d, i in enumerate(idx)), sympy.Integer(0))
    seed_value = Call("add", (Load(0, (), torch.int64), Const(stream, torch.int64)), torch.int64)
    uniform = Call("rand", (seed_value, Index(flat)), torch.float32)
    keep_expr = Call("lt", (uniform, Const(1.0 - p, torch.float32)), torch.bool)
    keep = ctx.pointwise(shape, torch.bool, [seed], keep_expr, None)
    work = compute_dtype(x.dtype)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    value = Call("mul", (cast(Load(1, idx, x.dtype), work), Const(scale, work)), work)
    body = Call("where", (Load(0, idx, torch.bool), value, Const(0.0, work)), work)
    out = ctx.pointwise(shape, x.dtype, [keep, x], body, None)
    return out, keep


@rule(aten.constant_pad_nd)
def constant_pad(ctx: Lowering, x: Node, pad: Sequence[int], value: Any = 0) -> Node:
    shape, out_dtype = _out(ctx)
    work = compute_dtype(out_dtype)
    idx = list(out_index(shape))
    conds: list[Expr] = []
    src = list(idx)
    for k in range(len(pad) // 2):
        d = len(shape) - 1 - k
        before = pad[2 * k]
        src[d] = idx[d] - before
        # A mask is left out only where it provably selects everything (pad
        # amounts may be symbolic in the generic variant).
        if not ix.always_positive(1 - before):  # before may be > 0
            conds.append(Call("ge", (Index(idx[d]), Const(before, torch.int64)), torch.bool))
        if not ix.always_positive(before + x.shape[d] - shape[d] + 1):  # may end early
            conds.append(
                Call("lt", (Index(idx[d]), Const(before + x.shape[d], torch.int64)), torch.bool)
            )
    mask = _all(conds)
    value_expr = cast(Load(0, tuple(src), x.dtype, mask=mask), work)
    body = (
        value_expr if mask is None else Call("where", (mask, value_expr, scalar(value, work)), work)
    )
    return ctx.pointwise(shape, out_dtype, [x], body, ctx.out_stride())


def _all(conds: Sequence[Expr]) -> Expr | None:
    out = None
    for c in conds:
        out = c if out is None else Call("logical_and", (out, c), torch.bool)
    return out


@rule(aten.flip)
def flip(ctx: Lowering, x: Node, dims: Sequence[int]) -> Node:
    shape, out_dtype = _out(ctx)
    idx = list(out_index(shape))
    for d in {d % len(shape) for d in dims} if shape else ():
        idx[d] = shape[d] - 1 - idx[d]
    return ctx.pointwise(shape, out_dtype, [x], Load(0, tuple(idx), x.dtype), ctx.out_stride())


@rule(aten.repeat)
def repeat(ctx: Lowering, x: Node, repeats: Sequence[int]) -> Node:
    """Output element ``i`` reads ``x`` at ``i mod size`` in each of its
    dimensions (0 where the size is 1, or 0 and there is no element; a
    symbolic size, BLOOM's alibi under ``dynamic=True``, keeps the
    ``mod``)."""
    shape, out_dtype = _out(ctx)
    idx = out_index(shape)
    lead = len(shape) - len(x.shape)
    src = tuple(
        sympy.Integer(0) if size in (0, 1) else sympy.Mod(idx[k + lead], size)
        for k, size in enumerate(x.shape)
    )
    body = Load(0, tuple(src), x.dtype)
    return ctx.pointwise(shape, out_dtype, [x], body, ctx.out_stride())


def _data_index(ctx: Lowering, value: Expr, size: ix.Size, dim: int, wrap: bool) -> Expr:
    """An index into dimension ``dim`` (of ``size``) of the current op's operand
    read from data, checked (``ir.check_index``: an error where it is out of
    bounds, as in eager).  ``wrap``: Python-style negative indices, ``v + size``
    where ``v < 0`` (advanced indexing, index_put); gather, index_select,
    embedding and scatter take none."""
    v = cast(value, torch.int64)
    if wrap:
        neg = Call("lt", (v, Const(0, torch.int64)), torch.bool)
        v = Call(
            "where", (neg, Call("add", (v, Const(size, torch.int64)), torch.int64), v), torch.int64
        )
    return check_index(v, size, dim, str(ctx.current.target.overloadpacket))


@rule(aten.embedding)
def embedding(ctx: Lowering, weight: Node, indices: Node, *_: Any) -> Node:
    shape, out_dtype = _out(ctx)
    idx = out_index(shape)
    row = Load(1, tuple(idx[:-1]), indices.dtype)
    body = Load(0, (_data_index(ctx, row, weight.shape[0], 0, False), idx[-1]), weight.dtype)
    return ctx.pointwise(shape, out_dtype, [weight, indices], body, ctx.out_stride())


@rule(aten.index_select)
def index_select(ctx: Lowering, x: Node, dim: int, index: Node) -> Node:
    shape, out_dtype = _out(ctx)
    dim %= max(len(x.shape), 1)
    idx = out_index(shape)
    if not x.shape:
        raise Unsupported("index_select of a scalar")
    pos = Load(1, (idx[dim],) if index.shape else (), index.dtype)
    src: list = list(idx)
    src[dim] = _data_index(ctx, pos, x.shape[dim], dim, False)
    return ctx.pointwise(
        shape, out_dtype, [x, index], Load(0, tuple(src), x.dtype), ctx.out_stride()
    )


@rule(aten.gather)
def gather(ctx: Lowering, x: Node, dim: int, index: Node, sparse_grad: bool = False) -> Node:
    shape, out_dtype = _out(ctx)
    if len(x.shape) == 0:
        raise Unsupported("gather of a scalar")
    dim %= len(x.shape)
    idx = out_index(shape)
    pos = Load(1, tuple(idx), index.dtype)
    src: list = list(idx)
    src[dim] = _data_index(ctx, pos, x.shape[dim], dim, False)
    return ctx.pointwise(
        shape, out_dtype, [x, index], Load(0, tuple(src), x.dtype), ctx.out_stride()
    )


def _advanced_index(
    ctx: Lowering, x: Node, indices: Sequence[Node | None], first_src: int
) -> tuple[ix.Shape, tuple[sympy.Expr | Expr, ...], list[Node]]:
    """``x[indices]`` with index tensors (None: a whole dimension), as torch
    indexes: the result's shape, the position in ``x`` its element
    ``(i0, i1, ...)`` reads, and the index tensors, loaded as inputs
    ``first_src, first_src + 1, ...``.  The index tensors broadcast against
    each other; their dimensions replace the indexed ones where those are
    adjacent, and come first where they are not."""
    if any(i is not None and i.dtype == torch.bool for i in indices):
        raise Unsupported("boolean mask indexing: the positions depend on the data")
    positions = [k for k, i in enumerate(indices) if i is not None]
    if not positions:
        raise Unsupported("indexing without an index tensor")
    tensors = [indices[k] for k in positions]
    bshape = ix.broadcast_shapes(*(t.shape for t in tensors))
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    kept = [d for d in range(len(x.shape)) if d not in positions]
    if adjacent:
        before = [d for d in kept if d < positions[0]]
        shape = (*(x.shape[d] for d in before), *bshape, *(x.shape[d] for d in kept[len(before) :]))
        first = len(before)
    else:
        shape, first = (*bshape, *(x.shape[d] for d in kept)), 0
    idx = out_index(shape)
    bidx = idx[first : first + len(bshape)]
    rest = iter(idx[:first] + idx[first + len(bshape) :])
    src: list[sympy.Expr | Expr] = []
    for d in range(len(x.shape)):
        if d in positions:
            t = indices[d]
            pos = Load(first_src + tensors.index(t), broadcast_index(t.shape, bidx), t.dtype)
            src.append(_data_index(ctx, pos, x.shape[d], d, True))
        else:
            src.append(next(rest))
    return shape, tuple(src), tensors


@rule(aten.index)
def index_tensor(ctx: Lowering, x: Node, indices: Sequence[Node | None]) -> Node:
    shape, out_dtype = _out(ctx)
    _, src, tensors = _advanced_index(ctx, x, indices, 1)
    inputs = [x, *tensors]
    return ctx.pointwise(shape, out_dtype, inputs, Load(0, src, x.dtype), ctx.out_stride())


# ----------------------------------------------------------- indexed stores

# The atomics of a target (``Target.atomics``): (combine, dtype) pairs.
Atomics = frozenset[tuple[str, torch.dtype]]


def indexed_store(
    ctx: Lowering,
    base: Node,
    sources: Sequence[Node],
    space: ix.Shape,
    value: Expr,
    position: Sequence[sympy.Expr | Expr],
    combine: str | None,
    atomics: Atomics,
) -> Node:
    """A scatter node: ``base`` with ``value`` stored (or combined, ``combine``)
    at ``position`` for every point of ``space``; loads in ``value`` and
    ``position`` read ``sources`` as inputs 1, 2, ... (input 0 is the base).
    ``atomics``: the (combine, element type) pairs the target has an atomic for."""
    shape, out_dtype = _out(ctx)
    if combine is not None and (combine, out_dtype) not in atomics:
        raise Unsupported(f"no atomic {combine} of {out_dtype} for a scatter")
    where = tuple(Index(c) if isinstance(c, sympy.Expr) else c for c in position)
    node = Node(
        ctx.fresh(ctx.hint()),
        "scatter",
        tuple(ix.size(s) for s in shape),
        out_dtype,
        inputs=(base.name, *(n.name for n in sources)),
        body=Call(AT, (cast(value, out_dtype), *where), out_dtype),
        reduce_op=combine,
        stride=ctx.out_stride(),
        update_shape=tuple(ix.size(s) for s in space),
    )
    return ctx.add(node)


@rule(aten.index_put)
def index_put(
    ctx: Lowering,
    x: Node,
    indices: Sequence[Node | None],
    values: Node,
    accumulate: bool = False,
    *,
    atomics: Atomics = GPU_ATOMICS,
) -> Node:
    """``x[indices] = values`` (``+=`` with ``accumulate``): the values,
    broadcast to the shape of ``x[indices]``, stored at the positions that
    indexing would read.  Duplicate positions: one value wins, or with
    ``accumulate`` all are added (atomically)."""
    space, position, tensors = _advanced_index(ctx, x, indices, 2)
    value = load(1, values, out_index(space))
    combine = "sum" if accumulate else None
    return indexed_store(ctx, x, [values, *tensors], space, value, position, combine, atomics)


@rule(aten.as_strided_scatter)
def as_strided_scatter(
    ctx: Lowering,
    x: Node,
    src: Node,
    size: Sequence[int],
    stride: Sequence[int],
    offset: Any = None,
) -> Node:
    """``x`` copied with its layout (storage offset, strides and gaps, as
    eager copies it unless its elements overlap), then ``src`` stored at the
    storage positions ``as_strided(size, stride, offset)`` addresses in the
    copy (``offset`` defaulting to the copy's storage offset): a scatter
    node whose positions are those storage positions as indices of ``x``,
    outside it where no element is stored there.  An absolute offset into
    (a view of) a graph input depends on its storage offset, which Dynamo
    does not guard: ATen runs it."""
    viewed = ctx.current.args[0]
    val = viewed.meta["val"]
    layout = ctx.sizes(val.stride())
    if any(s == 0 and n != 1 for n, s in zip(x.shape, layout)):
        # An expanded tensor: eager copies it contiguously, from storage offset 0.
        layout, start = ix.contiguous_strides(x.shape), 0
    elif not ix.non_overlapping(x.shape, layout):
        raise Unsupported("as_strided_scatter of overlapping elements or symbolic gaps")
    elif offset is not None and storage_base(viewed).op == "placeholder":
        raise Unsupported("as_strided_scatter at an absolute storage offset of a graph input")
    else:
        start = ctx.sizes((val.storage_offset(),))[0]
    space = tuple(ix.size(s) for s in size)
    idx = out_index(space)
    rel = (0 if offset is None else offset - start) + sum(
        (i * s for i, s in zip(idx, stride)), sympy.Integer(0)
    )
    position = ix.storage_index(ix.size(rel), x.shape, layout)
    value = load(1, src, idx)
    return indexed_store(ctx, x, [src], space, value, position, None, frozenset())


# scatter's ``reduce`` names, and scatter_reduce's, as the combine ops of a scatter node.
SCATTER_REDUCE = {"add": "sum", "multiply": "prod", "sum": "sum", "prod": "prod"}
SCATTER_REDUCE |= {"amax": "max", "amin": "min"}


@rule(aten.scatter, aten.scatter_add, aten.scatter_reduce)
def scatter(
    ctx: Lowering,
    x: Node,
    dim: int,
    index: Node,
    src: Any,
    reduce: str | None = None,
    include_self: bool = True,
    *,
    atomics: Atomics = GPU_ATOMICS,
) -> Node:
    """``out[..., index[i], ...] = src[i]`` along ``dim`` for every position
    ``i`` of ``index`` (``src`` a tensor at least as large, or a number);
    scatter_add and the ``reduce`` forms combine instead of replacing."""
    if ctx.current.target.overloadpacket is aten.scatter_add:
        reduce = "add"
    if reduce is not None and reduce not in SCATTER_REDUCE:
        raise Unsupported(f"scatter reduce={reduce!r}: needs a count per position")
    if not include_self:
        raise Unsupported("scatter_reduce include_self=False: which positions are hit is data")
    if not x.shape or len(index.shape) != len(x.shape):
        raise Unsupported("scatter of a scalar or with an index of another rank")
    dim %= len(x.shape)
    _, out_dtype = _out(ctx)
    idx = out_index(index.shape)
    position: list[sympy.Expr | Expr] = list(idx)
    position[dim] = _data_index(ctx, Load(1, tuple(idx), index.dtype), x.shape[dim], dim, False)
    sources = [index]
    if isinstance(src, Node):
        sources.append(src)
        value = Load(2, tuple(idx), src.dtype)  # src is at least as large as index
    else:
        value = scalar(src, out_dtype)
    combine = None if reduce is None else SCATTER_REDUCE[reduce]
    return indexed_store(ctx, x, sources, index.shape, value, position, combine, atomics)


def with_atomics(rules: dict, atomics: Atomics) -> dict:
    """``rules`` with the indexed stores that may combine atomically bound to
    a target's ``atomics`` (the table's own are a GPU's)."""
    return rules | {
        op: functools.partial(fn, atomics=atomics)
        for op, fn in rules.items()
        if fn in (index_put, scatter)
    }


# ------------------------------------------------------------ library calls


@rule(
    aten.mm,
    aten.bmm,
    aten.addmm,
    aten.convolution,
    aten.convolution_backward,
    aten.baddbmm,
    # Attention kernels (flash, memory-efficient, cuDNN) and their backwards.
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention,
    aten._scaled_dot_product_cudnn_attention_backward,
)
def library_call(ctx: Lowering, *args: Any) -> Any:
    schema = ctx.current.target._schema.arguments
    positional = [a for a, s in zip(args, schema) if not s.kwarg_only]
    keywords = {s.name: a for a, s in zip(args, schema) if s.kwarg_only}
    return call_extern(ctx, ctx.current.target, positional, keywords, ctx.meta(), "library")


# ------------------------------------------------------------------ pooling

# Unrolled window elements (those that can fall inside the input); larger
# windows fall back.
MAX_POOL_WINDOW = 64


@rule(aten.max_pool2d_with_indices)
def max_pool2d(
    ctx: Lowering,
    x: Node,
    kernel: Sequence[int],
    stride: Sequence[int] = (),
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> tuple[Node, Node]:
    """Values and flat in-plane indices of each window's maximum, the window
    unrolled into masked loads (padding and ragged edges never win).  As in
    eager, a NaN wins and the first maximum's index is kept."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _window(x, kernel, stride, padding, dilation)
    val = ctx.meta()[0]
    shape = ctx.sizes(val.shape)
    width = x.shape[-1]
    work = compute_dtype(x.dtype)
    idx = out_index(shape)
    window: list[tuple[Expr, Expr, Expr]] = []  # (inside, value, flat position)
    for (h, w), inside in _window_elements(idx, shape, (kh, kw), (sh, sw), (ph, pw), (dh, dw), x):
        loaded = cast(Load(0, (*idx[:-2], h, w), x.dtype, mask=inside), work)
        value = Call("where", (inside, loaded, scalar(float("-inf"), work)), work)
        window.append((inside, value, Index(h * width + w)))
    # A chain, never a tree that repeats its prefix: maximum propagates NaN.
    best: Expr = window[0][1]
    for _, value, _ in window[1:]:
        best = Call("maximum", (value, best), work)
    values = ctx.pointwise(shape, x.dtype, [x], best, ctx.sizes(val.stride()))
    # The index of the first element equal to the maximum (or the first NaN).
    top = cast(load(1, values, idx), work)
    at: Expr = window[-1][2]
    for inside, value, position in reversed(window[:-1]):
        hit = Call(
            "logical_or",
            (Call("eq", (value, top), torch.bool), Call("isnan", (value,), torch.bool)),
            torch.bool,
        )
        hit = Call("logical_and", (inside, hit), torch.bool)
        at = Call("where", (hit, position, at), torch.int64)
    indices = ctx.pointwise(shape, torch.int64, [x, values], at, ctx.sizes(ctx.meta()[1].stride()))
    return values, indices


@rule(aten.max_pool2d_with_indices_backward)
def max_pool2d_backward(
    ctx: Lowering,
    grad: Node,
    x: Node,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Any,
    dilation: Any,
    ceil_mode: bool,
    indices: Node,
) -> Node:
    """The gradient of :func:`max_pool2d` gathered, not scattered: each input
    position sums the output gradients of the windows holding it
    (:func:`_windows_holding`) whose maximum it was.  Eager accumulates in
    window order, this in window-element order."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _window(grad, kernel, stride, padding, dilation)
    shape, out_dtype = _out(ctx)
    work = compute_dtype(out_dtype)
    idx = out_index(shape)
    flat = Index(idx[-2] * x.shape[-1] + idx[-1])
    total: Expr = scalar(0.0, work)
    for at, window in _windows_holding(idx, shape, grad, (kh, kw), (sh, sw), (ph, pw), (dh, dw)):
        hit = Call("eq", (Load(1, at, indices.dtype, mask=window), flat), torch.bool)
        hit = Call("logical_and", (window, hit), torch.bool)
        value = cast(Load(0, at, grad.dtype, mask=window), work)
        total = Call("add", (total, Call("where", (hit, value, scalar(0.0, work)), work)), work)
    return ctx.pointwise(shape, out_dtype, [grad, indices], total, ctx.out_stride())


@dataclasses.dataclass(frozen=True)
class _AvgPool:
    """An average pool's window (``avg_pool2d``'s arguments) over an input of
    ``height`` x ``width``."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    count_include_pad: bool
    divisor_override: int | None
    height: Any
    width: Any

    @staticmethod
    def of(x: Node, kernel: Any, stride: Any, padding: Any, count_pad: bool, divisor: Any):
        kernels, strides, paddings, _ = _window(x, kernel, stride, padding, 1)
        height, width = x.shape[-2:]
        return _AvgPool(kernels, strides, paddings, count_pad, divisor, height, width)

    def clipped(self, oh: sympy.Expr, ow: sympy.Expr) -> list[tuple[sympy.Expr, sympy.Expr]]:
        """Rows and columns of output (oh, ow)'s window inside the input, as
        [start, end) pairs."""
        spans = []
        for o, k, s, p, size in zip(
            (oh, ow), self.kernel, self.stride, self.padding, (self.height, self.width)
        ):
            start = o * s - p
            spans.append((sympy.Max(start, 0), sympy.Min(start + k, size)))
        return spans

    def divisor(self, oh: sympy.Expr, ow: sympy.Expr) -> sympy.Expr:
        """What eager divides output (oh, ow)'s sum by: ``divisor_override``;
        else the window's size, with the padding it covers (``count_include_pad``:
        clipped at the padded input's end) or without."""
        if self.divisor_override:
            return sympy.Integer(self.divisor_override)
        if not self.count_include_pad:
            (h0, h1), (w0, w1) = self.clipped(oh, ow)
            return (h1 - h0) * (w1 - w0)
        size = 1
        for o, k, s, p, n in zip(
            (oh, ow), self.kernel, self.stride, self.padding, (self.height, self.width)
        ):
            start = o * s - p
            size *= sympy.Min(start + k, n + p) - start
        return size


@rule(aten.avg_pool2d)
def avg_pool2d(
    ctx: Lowering,
    x: Node,
    kernel: Sequence[int],
    stride: Sequence[int] = (),
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Node:
    """Each window's sum of the elements inside the input (masked loads) over
    eager's divisor (:meth:`_AvgPool.divisor`).  No window is empty: torch
    takes padding of at most half the window, and with ``ceil_mode`` drops
    a last window that would start in the right padding."""
    pool = _AvgPool.of(x, kernel, stride, padding, count_include_pad, divisor_override)
    shape, out_dtype = _out(ctx)
    work = compute_dtype(out_dtype)
    idx = out_index(shape)
    oh, ow = idx[-2], idx[-1]
    total: Expr | None = None
    elements = _window_elements(idx, shape, pool.kernel, pool.stride, pool.padding, (1, 1), x)
    for (h, w), inside in elements:
        value = cast(Load(0, (*idx[:-2], h, w), x.dtype, mask=inside), work)
        value = Call("where", (inside, value, scalar(0.0, work)), work)
        total = value if total is None else Call("add", (total, value), work)
    body = Call("truediv", (total, cast(Index(pool.divisor(oh, ow)), work)), work)
    return ctx.pointwise(shape, out_dtype, [x], body, ctx.out_stride())


@rule(aten.avg_pool2d_backward)
def avg_pool2d_backward(
    ctx: Lowering,
    grad: Node,
    x: Node,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Any,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Node:
    """The gradient of :func:`avg_pool2d` gathered: each input position sums
    the output gradients of the windows holding it (:func:`_windows_holding`),
    each over its divisor."""
    pool = _AvgPool.of(x, kernel, stride, padding, count_include_pad, divisor_override)
    shape, out_dtype = _out(ctx)
    work = compute_dtype(out_dtype)
    idx = out_index(shape)
    total: Expr = scalar(0.0, work)
    geometry = (pool.kernel, pool.stride, pool.padding, (1, 1))
    for at, window in _windows_holding(idx, shape, grad, *geometry):
        value = cast(Load(0, at, grad.dtype, mask=window), work)
        share = Call("truediv", (value, cast(Index(pool.divisor(*at[-2:])), work)), work)
        total = Call("add", (total, Call("where", (window, share, scalar(0.0, work)), work)), work)
    return ctx.pointwise(shape, out_dtype, [grad], total, ctx.out_stride())


def _window(
    x: Node, kernel: Any, stride: Any, padding: Any, dilation: Any
) -> tuple[tuple[int, int], ...]:
    """A 2-d pool's kernel, stride (the kernel's where empty), padding and
    dilation over ``x`` as (rows, columns) pairs; an integer ``x`` is
    unsupported."""
    kh, kw = _pair(kernel)
    if not x.dtype.is_floating_point:
        raise Unsupported("pool over integers")
    return (kh, kw), _pair(stride) if stride else (kh, kw), _pair(padding), _pair(dilation)


def _offsets(
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    inputs: Sequence[Any],
    outputs: Sequence[Any],
) -> tuple[list[int], list[int]]:
    """A 2-d pool's window element offsets, rows and columns, that fall
    inside the input (of ``inputs`` rows and columns) for some output
    position (of ``outputs``): element ``a`` of output ``o`` is input
    ``o * s - p + a * d``.  The rest only ever read padding, as a window
    larger than its input does (EfficientNet's global pool: a 2560-wide
    window over a few pixels).  All of them where a size is symbolic."""
    found = []
    for k, s, p, d, n, o in zip(kernel, stride, padding, dilation, inputs, outputs):
        if isinstance(n, (int, sympy.Integer)) and isinstance(o, (int, sympy.Integer)):
            n, o = int(n), int(o)
            found.append([a for a in range(k) if a * d - p < n and (o - 1) * s + a * d - p >= 0])
        else:
            found.append(list(range(k)))
    return found[0], found[1]


def _unrolled(count: int) -> None:
    """A pool unrolls ``count`` window taps: more than
    :data:`MAX_POOL_WINDOW` is unsupported."""
    if count > MAX_POOL_WINDOW:
        raise Unsupported("pool window too large")


def _window_elements(
    idx: Sequence[sympy.Expr],
    shape: Sequence[Any],
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    x: Node,
) -> Iterator[tuple[tuple[sympy.Expr, sympy.Expr], Expr | None]]:
    """For output position ``idx`` (of ``shape``) of a 2-d pool over ``x``,
    per window element (a, b) that can fall inside ``x`` (:func:`_offsets`):
    its input row and column, ``idx * stride - padding + (a, b) *
    dilation``, and where they are inside ``x`` (not padding)."""
    zero = Const(0, torch.int64)
    rows, cols = _offsets(kernel, stride, padding, dilation, x.shape[-2:], shape[-2:])
    _unrolled(len(rows) * len(cols))
    for a in rows:
        for b in cols:
            at = [
                o * s - p + e * d
                for o, s, p, e, d in zip(idx[-2:], stride, padding, (a, b), dilation)
            ]
            conds = []
            for i, size in zip(at, x.shape[-2:]):
                conds += [
                    Call("ge", (Index(i), zero), torch.bool),
                    Call("lt", (Index(i), Const(size, torch.int64)), torch.bool),
                ]
            yield (at[0], at[1]), _all(conds)


def _windows_holding(
    idx: Sequence[sympy.Expr],
    shape: Sequence[Any],
    grad: Node,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> Iterator[tuple[tuple[sympy.Expr, ...], Expr]]:
    """For the input position ``idx`` (of ``shape``) of a 2-d pool's
    gradient, per window element (a, b) that can fall inside the input
    (:func:`_offsets`): the position in ``grad`` (the output's gradient) of the
    window holding ``idx`` there, and where there is one.  Element (a, b) of
    output (oh, ow) is input (oh * sh - ph + a * dh, ...), so there is at most
    one: ``oh = (h + ph - a * dh) / sh`` where that divides exactly and is an
    output row (and so for columns)."""
    rows, cols = grad.shape[-2:]
    zero = Const(0, torch.int64)
    offsets = _offsets(kernel, stride, padding, dilation, shape[-2:], (rows, cols))
    taps = len(offsets[0]) * len(offsets[1])
    windows = [-(-k // s) for k, s in zip(kernel, stride)]  # ceil(kernel / stride)
    if dilation == (1, 1) and math.prod(windows) < taps:
        _unrolled(math.prod(windows))
        yield from _holding_windows(idx, grad, kernel, stride, padding, windows)
        return
    _unrolled(taps)
    for a in offsets[0]:
        for b in offsets[1]:
            n = [i + p - e * d for i, p, e, d in zip(idx[-2:], padding, (a, b), dilation)]
            out = [sympy.floor(v / s) for v, s in zip(n, stride)]
            conds = [Call("ge", (Index(v), zero), torch.bool) for v in n]
            conds += [
                Call("lt", (Index(o), Const(size, torch.int64)), torch.bool)
                for o, size in zip(out, (rows, cols))
            ]
            conds += [
                Call("eq", (Index(sympy.Mod(v, s)), zero), torch.bool)
                for v, s in zip(n, stride)
                if s > 1
            ]
            yield (*idx[:-2], *out), _all(conds)


def _holding_windows(
    idx: Sequence[sympy.Expr],
    grad: Node,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    windows: list[int],
) -> Iterator[tuple[tuple[sympy.Expr, ...], Expr]]:
    """:func:`_windows_holding` by window rather than by window element
    (undilated pools, where fewer windows than elements can hold a position:
    a global pool's one): ``windows`` per dimension, ``ceil(kernel /
    stride)``, are the rows ``o = floor((h + ph) / sh) - t`` for ``t`` below
    it, each holding input row ``h`` where ``o >= 0``, ``o`` is an output
    row and ``h + ph - o * sh`` is inside the kernel (and so for columns)."""
    zero = Const(0, torch.int64)
    per_dim = []
    for i, k, s, p, n, most in zip(idx[-2:], kernel, stride, padding, grad.shape[-2:], windows):
        last = sympy.floor((i + p) / s)
        found = []
        for t in range(most):
            o = last - t
            conds = [
                Call("ge", (Index(o), zero), torch.bool),
                Call("lt", (Index(o), Const(n, torch.int64)), torch.bool),
                Call("lt", (Index(i + p - o * s), Const(k, torch.int64)), torch.bool),
            ]
            found.append((o, conds))
        per_dim.append(found)
    for oh, row in per_dim[0]:
        for ow, col in per_dim[1]:
            yield (*idx[:-2], oh, ow), _all(row + col)


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    """A pooling argument given as one int, ``[n]`` or ``[h, w]``."""
    if isinstance(value, int):
        return value, value
    return (value[0], value[0]) if len(value) == 1 else (value[0], value[1])
