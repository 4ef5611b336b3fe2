"""Triton text for every scalar op of :mod:`tilec.scalar_ops`.

Only Triton *builtins* are used (``tl.reduce``, ``tl.full``, ``tl.exp``, ...),
never the ``@triton.jit`` helpers of triton's standard library (``tl.sum``,
``tl.zeros``, ``tl.sigmoid``): those are decorated when triton is first
imported, which in a torch process happens before tilec can ask for the
interpreter, and the interpreter cannot call them.  Transcendental functions
that live in libdevice do not run in the Triton interpreter either, so most are written with core ``tl`` math (exp, log, sqrt, ...)
in forms that are accurate for float32; the helpers in :data:`PRELUDE` are
``@triton.jit`` functions, each emitted at the top of the kernel modules that
call it (:func:`prelude_for`).  The few
ops without such a form (:data:`GPU_ONLY`) use libdevice and are lowered only
when kernels are compiled for a GPU.
"""

from __future__ import annotations

import functools
import math
import re

import torch

TL_DTYPES = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.bool: "tl.int1",
    torch.float8_e4m3fn: "tl.float8e4nv",
}

# Ops with no interpreter-safe form: libdevice on the GPU, ATen fallback on CPU.
GPU_ONLY = {"asin", "acos", "atan", "atan2"}

UNARY = {
    "abs": "tl.abs({0})",
    "exp": "tl.exp({0})",
    "exp2": "tl.exp2({0})",
    "expm1": "_expm1({0})",
    "log": "tl.log({0})",
    "log2": "tl.log2({0})",
    "log10": "(tl.log({0}) * 0.4342944819032518)",
    "log1p": "_log1p({0})",
    "sqrt": "tl.sqrt({0})",
    "rsqrt": "tl.rsqrt({0})",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "tan": "(tl.sin({0}) / tl.cos({0}))",
    "asin": "libdevice.asin({0})",
    "acos": "libdevice.acos({0})",
    "atan": "libdevice.atan({0})",
    "sinh": "_sinh({0})",
    "cosh": "_cosh({0})",
    "tanh": "_tanh({0})",
    "asinh": "_asinh({0})",
    "acosh": "_acosh({0})",
    "atanh": "_atanh({0})",
    "erf": "tl.erf({0})",
    "erfc": "_erfc({0})",
    "sigmoid": "(1.0 / (1.0 + tl.exp(-{0})))",
    "sign": "_sign({0})",
    "reciprocal": "(1.0 / {0})",
    "logical_not": "({0} == 0)",
    "bitwise_not": "_bitwise_not({0})",
    "isnan": "({0} != {0})",
    "isinf": "(tl.abs({0}) == float('inf'))",
}

BINARY = {
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "truediv": "({0} / {1})",
    "fmod": "({0} % {1})",
    "pow": "_pow({0}, {1})",
    "maximum": "_maximum({0}, {1})",
    "minimum": "_minimum({0}, {1})",
    "atan2": "libdevice.atan2({0}, {1})",
    "eq": "({0} == {1})",
    "ne": "({0} != {1})",
    "lt": "({0} < {1})",
    "le": "({0} <= {1})",
    "gt": "({0} > {1})",
    "ge": "({0} >= {1})",
    "logical_and": "(({0} != 0) & ({1} != 0))",
    "logical_or": "(({0} != 0) | ({1} != 0))",
    "logical_xor": "(({0} != 0) ^ ({1} != 0))",
    "bitwise_and": "({0} & {1})",
    "bitwise_or": "({0} | {1})",
    "bitwise_xor": "({0} ^ {1})",
    "bitwise_left_shift": "_left_shift({0}, {1})",
    "bitwise_right_shift": "_right_shift({0}, {1})",
}

# Ops whose Triton form differs between integer and floating operands.
INT_FORMS = {
    "neg": "(-{0})",
    # Integers (and bools) are already whole: rounding is the identity, and
    # Triton's floor and ceil take floats only.
    "floor": "{0}",
    "ceil": "{0}",
    "round": "{0}",
    "trunc": "{0}",
    "floordiv": "_floordiv_int({0}, {1})",
    "truncdiv": "({0} // {1})",
    "remainder": "_remainder_int({0}, {1})",
}
FLOAT_FORMS = {
    # Triton's unary minus is 0 - x, which turns -0.0 into +0.0.
    "neg": "({0} * -1.0)",
    "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})",
    "round": "_round_half_even({0})",
    "trunc": "_trunc({0})",
    "floordiv": "_floordiv_float({0}, {1})",
    "truncdiv": "_trunc({0} / {1})",
    "remainder": "_remainder_float({0}, {1})",
}


# Ops counted as one floating-point/integer operation per element in roofline
# figures (casts, selects, comparisons and bit ops are not).
ARITHMETIC = {op for op in (*UNARY, *BINARY, *INT_FORMS, "fma")} - {
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
    "logical_not", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "bitwise_left_shift", "bitwise_right_shift", "isnan", "isinf", "abs", "sign",
}  # fmt: skip

# Ops written as @triton.jit helpers of PRELUDE rather than inline text.
JIT_HELPER_OPS = {
    "pow",
    "bitwise_not",
    "maximum",
    "minimum",
    "floordiv",
    "remainder",
    "truncdiv",
    "expm1",
    "log1p",
    "tanh",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "round",
    "trunc",
    "sign",
    "erfc",
    "bitwise_left_shift",
    "bitwise_right_shift",
}


def call_text(op: str, args: list[str], arg_dtypes: list[torch.dtype], dtype: torch.dtype) -> str:
    """Triton expression for scalar op ``op`` on already-emitted ``args``."""
    if op == "cast":
        return cast_text(args[0], arg_dtypes[0], dtype)
    if op == "where":
        return f"tl.where({args[0]}, {args[1]}, {args[2]})"
    if op == "rand":  # tilec.rng: Philox, as tl.rand (the prelude's _rand)
        seed, offset = (f"tl.full([], {a}, tl.int64)" if _is_literal(a) else a for a in args)
        return f"_rand({seed}, {offset})"
    if op == "fma":
        if not dtype.is_floating_point:
            return f"({args[0]} * {args[1]} + {args[2]})"
        # tl.fma takes tensors of one float dtype, literals included.
        args = [full_text(a, dtype) if _is_literal(a) else a for a in args]
        return f"tl.fma({args[0]}, {args[1]}, {args[2]})"
    if op in JIT_HELPER_OPS:
        # Helpers do tensor math on every operand: make literals typed tensors.
        args = [full_text(a, t) if _is_literal(a) else a for a, t in zip(args, arg_dtypes)]
    if op in UNARY:
        return UNARY[op].format(*args)
    if op in BINARY:
        return BINARY[op].format(*args)
    table = FLOAT_FORMS if arg_dtypes[0].is_floating_point else INT_FORMS
    if op in table:
        return table[op].format(*args)
    raise KeyError(f"no Triton form for scalar op {op!r}")


def cast_text(value: str, src: torch.dtype, dst: torch.dtype) -> str:
    if dst == torch.bool:
        return f"({value} != 0)"
    if _is_literal(value):
        return full_text(value, dst)
    if dst == torch.bfloat16 and src != torch.bfloat16:
        return f"_to_bf16({value}.to(tl.float32))"
    return f"{value}.to({TL_DTYPES[dst]})"


def full_text(value: str, dtype: torch.dtype, shape: str = "[]") -> str:
    """``tl.full`` of the literal ``value`` (:func:`literal`'s text) in
    ``dtype``.  A bfloat16 constant is made in float32 and cast: the
    interpreter has no bfloat16 constants (``tl.full(..., tl.bfloat16)``
    fails there), and its casts to bfloat16 truncate, so a number is
    rounded to bfloat16 here first, as torch rounds it, and the cast is
    exact on every target."""
    if dtype != torch.bfloat16:
        return f"tl.full({shape}, {value}, {TL_DTYPES[dtype]})"
    if _is_number(value):
        rounded = float(torch.tensor(float(value), dtype=torch.bfloat16))
        # Triton makes a constant 0 its type's +0.0 (see literal).
        value = literal(rounded, torch.float32) if rounded != 0 else "0.0"
    return f"tl.full({shape}, {value}, tl.float32).to(tl.bfloat16)"


def _is_literal(text: str) -> bool:
    return text in ("True", "False") or text.startswith(("float(", "-float(")) or _is_number(text)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def literal(value: bool | int | float, dtype: torch.dtype) -> str:
    """A Python literal Triton reads as a constant of (a type close to) ``dtype``."""
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        v = float(value)
        if v != v:
            return "float('nan')"
        if v in (float("inf"), float("-inf")):
            return "float('inf')" if v > 0 else "-float('inf')"
        if v == 0 and math.copysign(1.0, v) < 0:
            # Triton makes every constant equal to 0 its type's null value,
            # +0.0: -0.0 is written as its bits (the sign bit alone).
            bits = dtype.itemsize * 8
            return f"tl.full([], {-(1 << (bits - 1))}, tl.int{bits}).to({TL_DTYPES[dtype]}, bitcast=True)"
        return repr(v)
    return str(int(value))


PRELUDE = """
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _chain_wait(finished, count):
    # A chain's stage (passes/chain.py) waits until ``count`` programs have
    # finished: those of the stages before it, which took lower tickets.
    # Acquire: their stores are seen; the barrier orders every thread's
    # loads after the one thread's atomic.
    seen = tl.atomic_add(finished, 0, sem='acquire', scope='gpu')
    while seen < count:
        seen = tl.atomic_add(finished, 0, sem='acquire', scope='gpu')
    tl.debug_barrier()


@triton.jit
def _chain_done(sync, programs):
    # A chain's program counts itself finished, after all its threads'
    # stores (the barrier; release publishes them); the last of the
    # ``programs`` sets the tickets and the count back to 0 for the next
    # launch: every other program has ended by then.
    tl.debug_barrier()
    finished = tl.atomic_add(sync + 1, 1, sem='acq_rel', scope='gpu')
    if finished == programs - 1:
        tl.atomic_xchg(sync, 0, sem='relaxed', scope='gpu')
        tl.atomic_xchg(sync + 1, 0, sem='relaxed', scope='gpu')


@triton.jit
def _maximum(a, b):
    # NaN propagates.  Nested wheres, not `|`: one side may be a 0-d literal,
    # and the interpreter cannot or a block with a 0-d bool.
    return tl.where(a != a, a, tl.where(a > b, a, b))


@triton.jit
def _minimum(a, b):
    return tl.where(a != a, a, tl.where(a < b, a, b))


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _argmax_combine(va, ia, vb, ib):
    take_a = (va > vb) | ((va != va) & (vb == vb)) | (((va == vb) | ((va != va) & (vb != vb))) & (ia < ib))
    return tl.where(take_a, va, vb), tl.where(take_a, ia, ib)


@triton.jit
def _argmin_combine(va, ia, vb, ib):
    take_a = (va < vb) | ((va != va) & (vb == vb)) | (((va == vb) | ((va != va) & (vb != vb))) & (ia < ib))
    return tl.where(take_a, va, vb), tl.where(take_a, ia, ib)


@triton.jit
def _trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def _round_half_even(x):
    # x - floor(x) is exact (floor(x + 0.5) is not: x + 0.5 rounds above 2**23).
    r = tl.floor(x)
    d = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
    y = tl.where(tl.where(d == 0.5, odd, d > 0.5), r + 1.0, r)
    # -0.3 rounds to -0.0, as in torch.
    return tl.where(y == 0, x * 0.0, y)


@triton.jit
def _sign(x):
    # The difference in int8, then converted: bools cannot be subtracted.
    # nan and -0.0 give 0.0, as in torch.
    return ((x > 0).to(tl.int8) - (x < 0).to(tl.int8)).to(x.dtype)


@triton.jit
def _bitwise_not(x):
    # Triton's ~ xors with -1 of x's type, which the interpreter cannot build
    # for an unsigned type: there, all ones is the largest value.
    if x.dtype.is_int_unsigned():
        return x ^ (2**x.dtype.primitive_bitwidth - 1)
    return ~x


@triton.jit
def _with_sign_of(y, x):
    # y >= 0, computed from |x| by an odd function: -y where x < 0, and x
    # itself where x is a zero (keeping its sign) or nan.
    return tl.where(x < 0, y * -1.0, tl.where(x > 0, y, x))


@triton.jit
def _expm1(x):
    # Kahan: (u - 1) * x / log(u) cancels the rounding error of u = exp(x) near 0.
    u = tl.exp(x)
    um1 = u - 1.0
    y = tl.where(um1 == 0, x, um1 * (x / tl.log(u)))
    y = tl.where(um1 == -1.0, -1.0, y)
    return tl.where(u == float('inf'), u, y)


@triton.jit
def _log1p(x):
    # Goldberg: log(u) * x / (u - 1) corrects the rounding of u = 1 + x.
    u = 1.0 + x
    d = u - 1.0
    y = tl.where(d == 0, x, tl.log(u) * (x / d))
    return tl.where(u == float('inf'), u, y)


@triton.jit
def _tanh(x):
    # float64: -e / (2 + e), e = expm1(-2|x|), accurate near 0 and saturating
    # to +-1 without overflow.  Below float64, no log (which _expm1, Kahan's
    # form, takes, and which made GEMM epilogues computing tanh spill on
    # sm_90): tanh's odd Taylor series to x**21 where |x| < 0.7 (the next
    # term is under a fifth of an ulp there), and 1 - 2q / (1 + q),
    # q = exp(-2|x|), beyond, where 2q / (1 + q) <= 0.4 so its rounding
    # moves the result by under an ulp.  Against float64's tanh rounded to
    # float32, in the interpreter (numpy's float32 exp, itself up to 2.5
    # ulp): at most 1.52 ulp, mean 0.27 (tests/test_lowering.py).
    a = tl.abs(x)
    if x.dtype == tl.float64:
        e = _expm1(-2.0 * a)
        y = -e / (2.0 + e)
    else:
        a2 = a * a
        p = 9.691537956929451e-05
        p = -0.00023912911424355248 + a2 * p
        p = 0.000590027440945586 + a2 * p
        p = -0.0014558343870513183 + a2 * p
        p = 0.003592128036572481 + a2 * p
        p = -0.008863235529902197 + a2 * p
        p = 0.021869488536155203 + a2 * p
        p = -0.05396825396825397 + a2 * p
        p = 0.13333333333333333 + a2 * p
        p = -0.3333333333333333 + a2 * p
        q = tl.exp(-2.0 * a)
        y = tl.where(a < 0.7, a + a * (a2 * p), 1.0 - 2.0 * q / (1.0 + q))
    return _with_sign_of(y, x)


@triton.jit
def _sinh(x):
    # From expm1 near 0; for large a, _half_exp (e^a / 2).
    a = tl.abs(x)
    e = _expm1(a)
    y = tl.where(a > 20.0, _half_exp(a), 0.5 * (e + e / (e + 1.0)))
    return _with_sign_of(y, x)


@triton.jit
def _cosh(x):
    a = tl.abs(x)
    e = tl.exp(a)
    return tl.where(a > 20.0, _half_exp(a), 0.5 * (e + 1.0 / e))


@triton.jit
def _half_exp(a):
    # e^a / 2 as (e^(a/2) / 2) e^(a/2): finite wherever the result is (a up
    # to 89.4 in float32, where e^a alone overflows past 88.7), and within a
    # few ulp: a / 2 and the halving are exact, where exp(a - ln 2) rounded
    # a - ln 2 first (1.5e-6 off at a = 80, past torch's float32 tolerance).
    h = tl.exp(0.5 * a)
    return (0.5 * h) * h


@triton.jit
def _asinh(x):
    # log1p form near 0; log(2a) where a * a would overflow.
    a = tl.abs(x)
    small = _log1p(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    y = tl.where(a > 1e18, tl.log(a) + 0.6931471805599453, small)
    return _with_sign_of(y, x)


@triton.jit
def _acosh(x):
    # log1p(t + sqrt(2t + t^2)) with t = x - 1 is accurate near 1.
    t = x - 1.0
    y = _log1p(t + tl.sqrt(2.0 * t + t * t))
    y = tl.where(x > 1e18, tl.log(x) + 0.6931471805599453, y)
    # Below 1 (where t * t may overflow to inf) there is no real result.
    return tl.where(x < 1.0, float('nan'), y)


@triton.jit
def _atanh(x):
    # 0.5 * log1p(2a / (1 - a)) of a = |x|, its sign restored: on x's own
    # sign, near -1 log1p's argument nears -1, where it cancels (287 ulp
    # off at x = -0.9992 in float32).
    a = tl.abs(x)
    return _with_sign_of(0.5 * _log1p(2.0 * a / (1.0 - a)), x)


@triton.jit
def _pow(a, b):
    # Nested wheres, not `&`: the interpreter cannot and a block with a 0-d bool.
    # exp2(b * log2|a|) is off by about |b * log2|a|| ulps of its result
    # (61 in float32 at 1.9e-8 ** 2.5): below float64 it is computed in
    # float64 and rounded once.  Exponents that models use often (2, 3, -2,
    # 0.5, -0.5, -1) are not computed here (lower_ops.pow_).
    if a.dtype == tl.float64:
        mag = tl.exp2(b * tl.log2(tl.abs(a)))
    else:
        wide = tl.exp2(b.to(tl.float64) * tl.log2(tl.abs(a).to(tl.float64)))
        mag = wide.to(a.dtype)
    b_int = tl.floor(b) == b
    half = b * 0.5
    b_odd = tl.where(b_int, tl.floor(half) != half, False)
    # A negative base needs an integer exponent, except -inf, which behaves like +inf.
    neg_base = tl.where(b_int, tl.where(b_odd, mag * -1.0, mag), tl.where(a == -float('inf'), mag, float('nan')))
    y = tl.where(a < 0, neg_base, mag)
    # A zero base keeps its sign under odd exponents: (-0) ** 3 = -0, (-0) ** -1 = -inf.
    pos_b = tl.where(b_odd, a, 0.0)
    neg_b = tl.where(b_odd, 1.0 / a, tl.where(b < 0, float('inf'), float('nan')))
    y = tl.where(a == 0, tl.where(b > 0, pos_b, neg_b), y)
    # Exact where exp2(b * log2|a|) is not: a ** 1 near the largest float
    # (the product rounds up and overflows), and (-1) ** +-inf, which is 1.
    y = tl.where(b == 1, a, y)
    y = tl.where(tl.abs(b) == float('inf'), tl.where(a == -1, 1.0, y), y)
    y = tl.where(b == 0, 1.0, y)
    return tl.where(a == 1, 1.0, y)


@triton.jit
def _floordiv_int(a, b):
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def _remainder_int(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _remainder_float(a, b):
    # From fmod (exact), as torch does; a - b * floor(a / b) loses the remainder
    # when a / b rounds.
    m = a % b
    return tl.where(m != 0, tl.where((m < 0) != (b < 0), m + b, m), m)


@triton.jit
def _floordiv_float(a, b):
    # torch's formula: the quotient of the exact a - fmod(a, b), corrected to
    # the nearest integer; floor(a / b) is off by one when a / b rounds up.
    m = a % b
    q = (a - m) / b
    q = tl.where(m != 0, tl.where((m < 0) != (b < 0), q - 1.0, q), q)
    f = tl.floor(q)
    f = tl.where(q - f > 0.5, f + 1.0, f)
    f = tl.where(q == 0, (a / b) * 0.0, f)
    return tl.where(b == 0, a / b, f)


@triton.jit
def _left_shift(a, b):
    # torch gives 0 for an amount that is negative or at least the bit width,
    # where LLVM's shl is poison: the shift itself only sees amounts in range.
    width = a.dtype.primitive_bitwidth
    inside = (b >= 0) & (b < width)
    return tl.where(inside, a << tl.where(inside, b, 0), 0)


@triton.jit
def _right_shift(a, b):
    # torch fills with the sign bit (0 for unsigned) for an amount that is
    # negative or at least the bit width, where LLVM's shift is poison; two
    # shifts in range give that fill (arithmetic if signed, logical if not).
    width = a.dtype.primitive_bitwidth
    inside = (b >= 0) & (b < width)
    return tl.where(inside, a >> tl.where(inside, b, 0), (a >> (width - 1)) >> 1)


@triton.jit
def _erfc(x):
    # 1 - erf(x) cancels to 0 for large x.  There: a Chebyshev fit of
    # erfc(z) * exp(z * z) (Numerical Recipes' erfcc, relative error < 1.2e-7).
    # exp(-z * z) as exp(-s * s) * exp((s - z) * (s + z)), s = z with the low
    # half of its mantissa cleared, so that s * s is exact: exp's argument
    # rounded to float32 near -64 was 4e-6 off, 145 ulp of erfc(8).
    # The fit is float32's: float64 erfc runs in ATen (lower_ops._unary).
    z = tl.abs(x)
    s = (z.to(tl.uint32, bitcast=True) & 0xFFFFF000).to(tl.float32, bitcast=True)
    t = 1.0 / (1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    # s == z where z has no low bits (and at inf, where z - s would be nan).
    low = tl.where(s == z, 0.0, (s - z) * (s + z))
    tail = t * tl.exp(-s * s) * tl.exp(low - 1.26551223 + t * p)
    tail = tl.where(x < 0, 2.0 - tail, tail)
    return tl.where(tl.abs(x) < 0.5, 1.0 - tl.erf(x), tail)


@triton.jit
def _to_bf16(x):
    # Round to nearest even by hand: the interpreter truncates in .to(tl.bfloat16).
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    y = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), y)


@triton.jit
def _rand(seed, offset):
    # A float32 in [0, 1) for each (seed, offset): Philox-4x32, 10 rounds,
    # key = the seed's two 32-bit halves, counter = (offset's halves, 0, 0);
    # the counter's first word, as tl.rand maps it (tilec.rng.uniform is
    # the same in torch).  Here rather than tl.rand: a library @jit function
    # does not run in a kernel module loaded for the interpreter.
    seed = seed.to(tl.int64)
    offset = offset.to(tl.int64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    a = tl.full([], 0xD2511F53, tl.uint32)
    b = tl.full([], 0xCD9E8D57, tl.uint32)
    for _ in tl.static_range(10):
        n0 = tl.umulhi(b, c2) ^ c1 ^ k0
        n2 = tl.umulhi(a, c0) ^ c3 ^ k1
        c1 = b * c2
        c3 = a * c0
        c0 = n0
        c2 = n2
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    x = c0.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, -x - 1, x)
    return x.to(tl.float32) * 4.6566127342e-10
"""


@functools.cache
def _helpers() -> dict[str, str]:
    """PRELUDE's helpers by name, each its text, in PRELUDE's order."""
    blocks = PRELUDE.strip().split("@triton.jit\n")[1:]
    return {re.match(r"def (\w+)\(", b).group(1): "@triton.jit\n" + b.strip() for b in blocks}


def _called(text: str) -> set[str]:
    return set(re.findall(r"\b_\w+\b", text)) & _helpers().keys()


def prelude_for(text: str) -> str:
    """The helpers of PRELUDE that ``text`` (a kernel) names, and the ones
    they name in turn.  Each ``@triton.jit`` function a module defines costs
    its loading (a GPU's JIT reads every function's source: 17 ms for the
    whole prelude, against about 1 ms for a kernel alone), and a person
    reading a kernel reads only what it calls."""
    wanted, new = set(), _called(text)
    while new:
        wanted |= new
        new = set().union(*(_called(_helpers()[name]) for name in new)) - wanted
    return "\n\n\n".join(body for name, body in _helpers().items() if name in wanted)


NEUTRAL = {"sum": 0, "prod": 1, "any": False, "all": True}
# Combine functions of the reductions that ``tl.reduce`` does directly (PRELUDE's).
COMBINE = {"sum": "_add", "prod": "_mul", "max": "_maximum", "min": "_minimum"}


def neutral(op: str, dtype: torch.dtype) -> str:
    """The value a reduction ``op`` over ``dtype`` values starts from."""
    if op in NEUTRAL:
        return literal(NEUTRAL[op], dtype)
    if dtype.is_floating_point:
        sign = "-" if op in ("max", "argmax") else ""
        return f"{sign}float('inf')"
    if dtype == torch.bool:
        return "False" if op in ("max", "argmax") else "True"
    info = torch.iinfo(dtype)
    return str(info.min if op in ("max", "argmax") else info.max)
