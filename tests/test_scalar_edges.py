"""Edge values of every scalar op, compiled by tilec, against eager torch.

The test walks tilec's scalar op table (``tilec.scalar_ops``, whose Triton
forms live in ``tilec.codegen.triton_ops``) and runs each op, compiled with
``backend="tilec"``, on the values where implementations go wrong: signed
zeros, infinities, nan, the largest and smallest values of the dtype (integer
overflow and wraparound), shift amounts beyond the width, and bools.  Binary
ops see every pair of edge values.  Each dtype eager supports for the op is
tried; what eager rejects (a dtype, an integer division by zero) is left out
by asking eager.  One compiled function per (dtype, arity) computes every op,
so the whole table costs a few compilations.

Floats compare with the per-dtype tolerances of ``tests.compare``; nan must
be nan, and a zero or an infinity must have eager's sign.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

import tilec
from tests.compare import TOLERANCES
from tilec.codegen import triton_ops
from tilec.scalar_ops import BINARY, UNARY

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]

# Ops whose integer form divides: eager itself dies of SIGFPE on INT_MIN / -1
# (int32 truncating division), so that pair is never asked of it.
DIVISIONS = {"floordiv", "truncdiv", "remainder", "fmod"}


# The table pins maximum's and minimum's tie of -0.0 with 0.0; eager's is
# torch's own (which the edge values, a vectorized CPU path, agree with).
EAGER = BINARY | {
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}


def _c_remainder(a: float, b: float) -> float:
    """torch's remainder on a GPU: C's exact fmod, moved to the divisor's sign."""
    m = math.fmod(a, b)
    return m + b if m != 0 and (m < 0) != (b < 0) else m


# Eager's vectorized CPU kernels compute fmod and remainder through a
# quotient that overflows (fmod(3.4e38, 0.5) is nan there; 0 in C, on a GPU
# and in eager's own scalar tail loop): for floats these follow C's fmod.
FLOAT_REFERENCES: dict[str, Callable[[float, float], float]] = {
    "fmod": math.fmod,
    "remainder": _c_remainder,
}


def _reference(op: str, fn: Callable) -> Callable:
    """Eager's ``fn``, or for floats where eager's CPU kernel is wrong, the
    exact value computed element by element."""
    if op not in FLOAT_REFERENCES:
        return fn

    def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not a.is_floating_point():
            return fn(a, b)
        values = [_nan_safe(FLOAT_REFERENCES[op], x, y) for x, y in zip(a.tolist(), b.tolist())]
        return torch.tensor(values, dtype=a.dtype)

    return reference


def _nan_safe(f: Callable[[float, float], float], a: float, b: float) -> float:
    """``f(a, b)``, nan where C's fmod is nan (an infinite dividend, a zero divisor)."""
    if math.isinf(a) or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return f(a, b)


def edge_values(dtype: torch.dtype) -> list[bool | int | float]:
    """The values of ``dtype`` where scalar ops tend to go wrong."""
    if dtype == torch.bool:
        return [False, True]
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -2.5, 3.0, -7.0, info.tiny, -info.tiny,
                info.max, -info.max, math.inf, -math.inf, math.nan]  # fmt: skip
    info = torch.iinfo(dtype)
    candidates = [0, 1, -1, 2, -3, 7, -8, 31, 64, info.max, info.min, info.max - 1, info.min + 1]
    return list(dict.fromkeys(v for v in candidates if info.min <= v <= info.max))


def _eager_accepts(fn: Callable, *args: torch.Tensor) -> bool:
    try:
        fn(*args)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _pairs(op: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every pair of edge values eager accepts for binary ``op`` (None: none)."""
    values = edge_values(dtype)
    pairs = list(itertools.product(values, values))
    if not dtype.is_floating_point and dtype != torch.bool and op in DIVISIONS:
        pairs = [(a, b) for a, b in pairs if (a, b) != (torch.iinfo(dtype).min, -1)]
    fn = EAGER[op]
    pairs = [
        (a, b)
        for a, b in pairs
        if _eager_accepts(fn, torch.tensor([a], dtype=dtype), torch.tensor([b], dtype=dtype))
    ]
    if not pairs:
        return None
    a, b = zip(*pairs)
    return torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)


def mismatch(actual: torch.Tensor, expected: torch.Tensor, inputs: list[torch.Tensor]) -> str:
    """What differs between ``actual`` and eager's ``expected`` ('' if nothing)."""
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if expected.is_floating_point():
        atol, rtol = TOLERANCES[expected.dtype]
        a, e = actual.double(), expected.double()
        bad = ~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)
        # A zero or an infinity of the wrong sign is within any tolerance of 0 / equal in isclose.
        signed = (e == 0) | e.isinf()
        bad |= signed & (torch.signbit(a) != torch.signbit(e))
    else:
        bad = actual != expected
    if not bad.any():
        return ""
    shown = [
        f"{tuple(t[k].item() for t in inputs)} -> {actual[k].item()} (eager {expected[k].item()})"
        for k in bad.nonzero().flatten()[:4].tolist()
    ]
    return "; ".join(shown)


def _compare_all(
    fns: dict[str, Callable], inputs: dict[str, list[torch.Tensor]], dtype: torch.dtype
) -> None:
    """Compile one function computing every op of ``fns`` and compare each
    result with eager; the failure lists every op that differs."""
    names = list(fns)

    def program(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out, k = [], 0
        for name in names:
            n = len(inputs[name])
            out.append(fns[name](*flat[k : k + n]))
            k += n
        return tuple(out)

    flat = [t for name in names for t in inputs[name]]
    expected = [_reference(name, fns[name])(*inputs[name]) for name in names]
    actual = torch.compile(program, backend="tilec")(*flat)
    # Kernels computed every op, except those only a GPU's libdevice has,
    # integer pow and float64 erfc, which fall back on purpose
    # (``lower_ops.pow_``, ``lower_ops._unary``).
    allowed = triton_ops.GPU_ONLY | (set() if dtype.is_floating_point else {"pow"})
    allowed |= {"erfc"} if dtype == torch.float64 else set()
    fallbacks = {name.split(".")[1] for name in tilec.stats()["fallbacks"]}
    assert fallbacks <= allowed, f"not lowered: {fallbacks - allowed}"
    problems = {name: mismatch(a, e, inputs[name]) for name, a, e in zip(names, actual, expected)}
    problems = {name: text for name, text in problems.items() if text}
    assert not problems, f"{dtype}: " + "\n".join(f"{k}: {v}" for k, v in problems.items())


def test_table_has_a_triton_form_for_every_op() -> None:
    """The walk below covers the whole table: every op has a Triton form."""
    forms = {
        *triton_ops.UNARY,
        *triton_ops.BINARY,
        *(triton_ops.INT_FORMS.keys() & triton_ops.FLOAT_FORMS.keys()),
    }
    assert set(UNARY) | set(BINARY) <= forms


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unary_edge_values(dtype: torch.dtype) -> None:
    x = torch.tensor(edge_values(dtype), dtype=dtype)
    fns = {op: fn for op, fn in UNARY.items() if _eager_accepts(fn, x)}
    _compare_all(fns, {op: [x] for op in fns}, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_binary_edge_values(dtype: torch.dtype) -> None:
    inputs = {op: _pairs(op, dtype) for op in BINARY}
    inputs = {op: list(pair) for op, pair in inputs.items() if pair is not None}
    _compare_all({op: EAGER[op] for op in inputs}, inputs, dtype)


# ------------------------------------------------ constants known at compile time


def assert_same_as_eager(fn: Callable, *inputs: torch.Tensor) -> None:
    """``fn`` through tilec's kernels and its IR interpreter equals eager,
    with nan as nan and zeros by sign."""
    expected = fn(*(t.clone() for t in inputs))
    for options in ({}, {"interpret": True}):
        torch._dynamo.reset()
        actual = torch.compile(fn, backend="tilec", options=options)(*(t.clone() for t in inputs))
        problem = mismatch(actual, expected, list(inputs))
        assert not problem, f"{options}: {problem}"


X = torch.tensor([1.0, -2.0, 0.5, -0.0, 0.0])


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x / -0.0,
        lambda x: x * -0.0,
        lambda x: x - -0.0,
        lambda x: torch.where(x > 5, x, -0.0),
        # Inlined into one kernel: a fill times a literal, then plus -0.0.
        lambda x: torch.zeros(5) * -1.0 + -0.0 + x * 0,
        lambda x: torch.full((5,), -0.0) + x * 0,
    ],
    ids=["div", "mul", "sub", "where", "fill_mul_add", "fill"],
)
def test_negative_zero_constants(fn: Callable) -> None:
    """-0.0 keeps its sign through lowering, simplification (x - -0.0 is not
    x), CSE of constants (-0.0 is not 0.0) and kernel text (Triton turns a
    -0.0 literal into +0.0)."""
    assert_same_as_eager(fn, X)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x + torch.zeros(5) / 0.0,
        lambda x: torch.zeros_like(x) / 0.0,
        lambda x: x + 1.0 / torch.zeros(5),
        lambda x: x + -1.0 / torch.zeros(5),
        lambda x: x + torch.zeros(5, dtype=torch.int64) / 0,
        lambda x: x + torch.zeros(5) % 0.0,
        lambda x: x + torch.zeros(5) ** -1,
        lambda x: x + torch.full((5,), float("inf")) * 0,
        lambda x: x * torch.full((5,), float("nan")),
    ],
    ids=[
        "zeros_div",
        "zeros_like_div",
        "one_div",
        "minus_one_div",
        "int_div",
        "mod",
        "pow",
        "inf_times_zero",
        "nan",
    ],  # fmt: skip
)
def test_constant_arithmetic_is_ieee(fn: Callable) -> None:
    """Arithmetic on constants that meet in a kernel is computed with IEEE
    semantics (nan, +-inf), never left as kernel text that Python evaluates
    (``0.0 / 0.0`` raised ZeroDivisionError in the interpreter)."""
    assert_same_as_eager(fn, X)


def test_sign_of_bool() -> None:
    assert_same_as_eager(torch.sign, torch.tensor([True, False, True]))


@pytest.mark.parametrize("op", ["ceil", "floor", "round", "trunc"])
def test_rounding_an_integer_is_the_identity(op: str) -> None:
    """Rounding ops on integers (a 0-d int64 here, read before an in-place
    update) are identities: Triton's floor and ceil take floats only."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        t = getattr(x, op)()
        x.add_(10)
        return t

    assert_same_as_eager(fn, torch.tensor(3))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.clamp(-0.0, 0.0),
        lambda x: x.clamp(min=0.0),
        lambda x: x.clamp(max=-0.0),
        torch.relu,
        lambda x: torch.fmax(x, torch.zeros(5)),
        lambda x: torch.fmin(x, torch.full((5,), -0.0)),
        lambda x: torch.fmax(torch.full((5,), -0.0), x),
    ],
    ids=["clamp", "clamp_min", "clamp_max", "relu", "fmax", "fmin", "fmax_zero_first"],
)
def test_ties_of_signed_zeros_keep_the_value(fn: Callable) -> None:
    """clamp, relu, fmax and fmin give eager's operand on a tie of -0.0 with
    0.0 (x for clamp and relu, the first operand for fmax and fmin), in both
    of eager's CPU paths (maximum's own tie differs between them)."""
    assert_same_as_eager(fn, X)
