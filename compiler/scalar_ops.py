"""The scalar ops a pointwise or reduction body may call, with torch semantics.

One table: op name -> torch function on tensors of the op's compute dtype.
The lowering only emits names from this table, the interpreter runs them with
these functions, and codegen has a Triton form for each name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tilec import rng

UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "exp2": torch.exp2,
    "expm1": torch.expm1,
    "log": torch.log,
    "log2": torch.log2,
    "log10": torch.log10,
    "log1p": torch.log1p,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "sin": torch.sin,
    "cos": torch.cos,
    "tan": torch.tan,
    "asin": torch.asin,
    "acos": torch.acos,
    "atan": torch.atan,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "tanh": torch.tanh,
    "asinh": torch.asinh,
    "acosh": torch.acosh,
    "atanh": torch.atanh,
    "erf": torch.erf,
    "erfc": torch.erfc,
    "sigmoid": torch.sigmoid,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "round": torch.round,
    "trunc": torch.trunc,
    "sign": torch.sign,
    "reciprocal": torch.reciprocal,
    "logical_not": torch.logical_not,
    "bitwise_not": torch.bitwise_not,
    "isnan": torch.isnan,
    "isinf": torch.isinf,
}

BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "truediv": torch.true_divide,
    "floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "truncdiv": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "remainder": torch.remainder,
    "fmod": torch.fmod,
    "pow": torch.pow,
    # nan propagates, and a tie (-0.0 with 0.0) gives the second operand, as
    # in the kernels: eager's choice differs between its CPU paths.
    "maximum": lambda a, b: torch.where((a != a) | (a > b), a, b),
    "minimum": lambda a, b: torch.where((a != a) | (a < b), a, b),
    "atan2": torch.atan2,
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor,
    "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or,
    "bitwise_xor": torch.bitwise_xor,
    # Both operands have the result's integer dtype.  A shift by a negative
    # amount or by the bit width or more is defined: 0 to the left, the sign
    # fill (0 when unsigned) to the right.
    "bitwise_left_shift": torch.bitwise_left_shift,
    "bitwise_right_shift": torch.bitwise_right_shift,
}

# (int64 seed, int64 offset) -> float32 in [0, 1): Triton's Philox
# (``tl.rand``), see ``tilec.rng``.  Apart from ``BINARY``: not arithmetic
# on its operands' values (the edge-value sweeps of BINARY do not apply).
RANDOM: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"rand": rng.uniform}

# Three operands.  ``fma(a, b, c)`` is ``a * b + c`` rounded once (torch's
# ``prims.fma``, which Dynamo writes for ``addcmul_``/``addcdiv_`` with a
# ``value`` and ``add_`` with a tensor ``alpha``): here the product and the
# sum in float64, then rounded to the result's dtype (exact for float32 and
# narrower operands up to float64's own rounding of the sum).
TERNARY: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "fma": lambda a, b, c: (
        a.double() * b.double() + c.double() if a.is_floating_point() else a * b + c
    ),
}

# Ops whose result is bool whatever their operands are.
PREDICATES = {"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf"} | {
    "logical_not",
    "logical_and",
    "logical_or",
    "logical_xor",
}

REDUCTIONS = ("sum", "prod", "max", "min", "argmax", "argmin", "any", "all")


def run_call(op: str, args: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Apply scalar op ``op`` elementwise; the result has ``dtype``."""
    if op == "cast":
        return args[0].to(dtype)
    if op == "where":
        return torch.where(args[0], args[1], args[2]).to(dtype)
    if op in UNARY:
        return UNARY[op](args[0]).to(dtype)
    if op in BINARY:
        return BINARY[op](args[0], args[1]).to(dtype)
    if op in RANDOM:
        return RANDOM[op](args[0], args[1]).to(dtype)
    if op in TERNARY:
        return TERNARY[op](args[0], args[1], args[2]).to(dtype)
    raise KeyError(f"unknown scalar op {op!r}")


def run_on_constants(
    op: str, values: Sequence[bool | int | float], dtypes: Sequence[torch.dtype], dtype: torch.dtype
) -> bool | int | float:
    """``op`` on constant operands (``values`` of ``dtypes``) as a Python
    number of ``dtype``: computed by torch in those dtypes, so compile-time
    arithmetic follows IEEE (``0.0 / 0.0`` is nan, ``1.0 / -0.0`` is -inf),
    never Python's (a ZeroDivisionError)."""
    tensors = [torch.tensor(v, dtype=t) for v, t in zip(values, dtypes)]
    return run_call(op, tensors, dtype).item()


def run_reduction(op: str, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reduce the last dimension of ``values`` with ``op``; result has ``dtype``."""
    if op == "sum":
        return values.sum(-1).to(dtype)
    if op == "prod":
        return values.prod(-1).to(dtype)
    if op == "any":
        return values.bool().any(-1).to(dtype)
    if op == "all":
        return values.bool().all(-1).to(dtype)
    if op == "max":
        return values.amax(-1).to(dtype) if values.shape[-1] else _empty_reduce_error(op)
    if op == "min":
        return values.amin(-1).to(dtype) if values.shape[-1] else _empty_reduce_error(op)
    if op == "argmax":
        return values.argmax(-1).to(dtype)
    if op == "argmin":
        return values.argmin(-1).to(dtype)
    raise KeyError(f"unknown reduction {op!r}")


def _empty_reduce_error(op: str) -> torch.Tensor:
    raise ValueError(f"{op} over an empty dimension has no identity")
