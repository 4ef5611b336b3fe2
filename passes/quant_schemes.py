"""Weight quantization schemes: how a weight is stored, and the IR that reads it back.

A scheme takes a linear layer's float weight as ``[N, K]`` (output channels
by input features) and returns a :class:`Quantized`: the constants that
replace the weight, and a function that builds the scalar expression of the
dequantized element ``(n, k)`` over loads of those constants.  The
quantization pass (:mod:`tilec.passes.quantize`) makes that expression the
body of a pointwise node in place of the weight, so the dequantization is
ordinary IR: the reference interpreter runs it, a kernel computes it before
a library matmul, a GEMM template can take it as its prologue.  A scheme may
refuse a weight by returning the reason (a string) instead.

A new scheme is a function of this shape and an entry in ``SCHEMES``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy
import torch

from tilec.ir import Call, Const, Expr, Index, Load

# The dequantized element (n, k), as float32, over loads of the constants
# (``Load(j, ...)`` reads the j-th constant of ``Quantized.constants``).
Dequantize = Callable[[sympy.Expr, sympy.Expr], Expr]


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A weight in quantized form: named constants (``(suffix, tensor)``, in
    the order the dequantization loads them) and its dequantization."""

    constants: tuple[tuple[str, torch.Tensor], ...]
    dequantize: Dequantize


Scheme = Callable[[torch.Tensor, int], "Quantized | str"]

F32 = torch.float32
I32 = torch.int32


def int8_weight_only(weight: torch.Tensor, group_size: int) -> Quantized:
    """Symmetric, per output channel: ``scale[n] = max|W[n, :]| / 127``
    (1 for an all-zero row), ``q = round(W / scale)`` in [-127, 127] as int8,
    scales in float32; dequantized as ``float32(q[n, k]) * scale[n]``.
    ``group_size`` is not used (one group per row)."""
    w = weight.float()
    scale = _nonzero(w.abs().amax(1) / 127)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)

    def dequantize(n: sympy.Expr, k: sympy.Expr) -> Expr:
        value = Call("cast", (Load(0, (n, k), torch.int8),), F32)
        return Call("mul", (value, Load(1, (n,), F32)), F32)

    return Quantized((("int8", q), ("scale", scale)), dequantize)


def int4_weight_only(weight: torch.Tensor, group_size: int) -> Quantized | str:
    """Symmetric, per group of ``group_size`` consecutive input features of a
    row: ``scale[n, g] = max|W[n, group g]| / 7.5`` (1 for an all-zero
    group), ``q = round(W / scale)`` clamped to [-8, 7] (the 16 levels of a
    signed nibble; the largest magnitude lands on -8 or 7), scales in float32.
    Packed two to a byte as ``q + 8`` in [0, 15]: byte ``[n, j]`` holds
    feature ``2j`` in its low nibble and ``2j + 1`` in its high nibble, a
    uint8 constant of shape ``[N, K / 2]``.  Unpacked as ``(byte >> 4 * (k %
    2)) & 15``.  Needs ``K % group_size == 0``
    (so ``K`` is even: group sizes are even); other weights are refused."""
    rows, cols = weight.shape
    if cols % group_size:
        return f"input features {cols} not a multiple of the group size {group_size}"
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    scale = _nonzero(groups.abs().amax(2) / 7.5)
    q = torch.round(groups / scale[..., None]).clamp(-8, 7).reshape(rows, cols)
    nibbles = (q + 8).to(torch.uint8)
    packed = nibbles[:, 0::2] + nibbles[:, 1::2] * 16

    def dequantize(n: sympy.Expr, k: sympy.Expr) -> Expr:
        byte = Call("cast", (Load(0, (n, sympy.floor(k / 2)), torch.uint8),), I32)
        shift = Call("cast", (Index(4 * sympy.Mod(k, 2)),), I32)  # 0, or 4 for odd k
        nibble = Call(
            "bitwise_and",
            (Call("bitwise_right_shift", (byte, shift), I32), Const(15, I32)),
            I32,
        )
        value = Call("cast", (Call("sub", (nibble, Const(8, I32)), I32),), F32)
        return Call("mul", (value, Load(1, (n, sympy.floor(k / group_size)), F32)), F32)

    return Quantized((("int4", packed), ("scale", scale)), dequantize)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """Scales with 1 where a row or group is all zeros (its values quantize to 0)."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# Scheme name (the ``quantize`` option) -> scheme.  ``fp8`` quantizes the
# activations too, so it is not a weight scheme: see :mod:`tilec.passes.fp8`.
SCHEMES: dict[str, Scheme] = {
    "int8_weight_only": int8_weight_only,
    "int4_weight_only": int4_weight_only,
}
