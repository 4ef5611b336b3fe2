"""Bit shifts lowered natively, against eager torch on every integer dtype.

torch defines every shift amount: shifting left by a negative amount or by
the bit width or more gives 0; shifting right by such an amount fills with
the sign bit (0 for unsigned; for signed types from width - 1 on).  LLVM
leaves those shifts undefined, so the kernels guard them: these tests cross
each dtype's extreme values with amounts around 0 and the width.  ``check``
runs the kernels and the IR interpreter, and asserts that nothing fell back.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.compare import assert_matches_eager
from tests.test_lowering import check

DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]


def _values_and_amounts(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pair of an edge value and an edge amount of ``dtype``, as two tensors."""
    info = torch.iinfo(dtype)
    values = {info.min, -5, -1, 0, 1, 5, 100, info.max}
    bits = info.bits
    amounts = {-100, -bits - 1, -bits, -1, 0, 1, 3, bits - 2, bits - 1, bits, bits + 1, 100, 200}
    pairs = itertools.product(
        sorted(v for v in values if info.min <= v <= info.max),
        sorted(s for s in amounts if info.min <= s <= info.max),
    )
    a, b = zip(*pairs)
    return torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_amounts_at_the_edges(dtype):
    a, b = _values_and_amounts(dtype)
    check(lambda a, b: (a << b, a >> b), a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scalar_amounts_and_scalar_values(dtype):
    """The Tensor_Scalar and Scalar_Tensor overloads; scalars wrap into the
    tensor's dtype as in eager (int8 << 260 shifts by 4)."""
    a, b = _values_and_amounts(dtype)
    bits = torch.iinfo(dtype).bits
    check(
        lambda a, b: (
            a << 3,
            a >> 3,
            torch.bitwise_left_shift(a, bits),
            torch.bitwise_right_shift(a, bits - 1),
            a << -1,
            a >> -2,
            a << 260,
            torch.bitwise_left_shift(3, b),
            -100 >> b,
        ),
        a,
        b,
    )


def test_result_dtype_by_type_promotion():
    a, b = _values_and_amounts(torch.int8)
    u, s = (
        torch.tensor([1, 128, 255], dtype=torch.uint8),
        torch.tensor([1, -1, 7], dtype=torch.int8),
    )
    check(
        lambda a, b, u, s: (
            a << b.long(),  # int8 << int64 -> int64, shifted within 64 bits
            a.int() >> b,  # int32 >> int8 -> int32
            u >> s,  # uint8 >> int8 -> int16: arithmetic, 255 stays positive
            a << torch.tensor(2),  # a 0-d int64 amount keeps int8
        ),
        a,
        b,
        u,
        s,
    )


def test_int4_pack_and_unpack():
    """The int4 quantization's use: two nibbles per byte, unpacked with a
    logical shift (unsigned) or sign-extended by shifting left, then
    arithmetically right."""

    def pack_unpack(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, ...]:
        packed = (hi.to(torch.uint8) << 4) | (lo.to(torch.uint8) & 0xF)
        signed = packed.to(torch.int8)
        return packed, packed >> 4, (signed << 4) >> 4, signed >> 4

    lo = torch.tensor([-8, -1, 0, 7, 3, -5], dtype=torch.int8)
    hi = torch.tensor([7, -8, 1, -2, 0, 4], dtype=torch.int8)
    check(pack_unpack, lo, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_amounts_at_the_edges_on_cuda(dtype):
    """The CPU tiers cannot tell whether the kernels' guards work: the Triton
    interpreter shifts with numpy, which defines out-of-range amounts as torch
    does.  Compiled for the GPU, LLVM would not."""
    a, b = _values_and_amounts(dtype)
    assert_matches_eager(lambda a, b: (a << b, a >> b, a << 70, a >> 70), a.cuda(), b.cuda())
