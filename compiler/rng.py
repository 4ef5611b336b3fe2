"""Random numbers in kernels: dropout's mask, from a seed per call.

A graph that draws random numbers (``aten.native_dropout`` in training)
gets one library call, :func:`draw_seed`, that takes a seed from torch's
generator for the graph's device on every call (so ``torch.manual_seed``
makes runs repeatable, and each call differs), and its kernels compute
Triton's Philox generator (``tl.rand(seed, offset)``) at each element's
flat position, the ``k``-th random op of the graph with seed ``seed + k``.
The scalar op is ``rand`` (``scalar_ops``); :func:`uniform` is the same
generator in torch, bit for bit, for the IR interpreter and constant
folding.  The masks are not eager's (its CPU and CUDA generators draw
differently): the same distribution, not the same bits.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Triton's 32-bit Philox constants (triton/language/random.py).
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_ROUNDS = 10
# int32 to [0, 1): Triton's uint_to_uniform_float.
_SCALE = 4.6566127342e-10


def draw_seed(device: str) -> torch.Tensor:
    """A seed for this call's random numbers, from torch's generator of
    ``device`` (a 0-d int64 tensor there)."""
    return torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=device)


def uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offset)``: float32 in [0, 1) for int64 ``seed`` and
    ``offset`` tensors (broadcast), computed with int64 arithmetic on
    32-bit lanes."""
    seed, offset = torch.broadcast_tensors(seed.to(torch.int64), offset.to(torch.int64))
    c0, c1 = offset & _M32, (offset >> 32) & _M32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(_ROUNDS):
        c0, c1, c2, c3 = (
            _mulhi(_ROUND_B, c2) ^ c1 ^ k0,
            _mullo(_ROUND_B, c2),
            _mulhi(_ROUND_A, c0) ^ c3 ^ k1,
            _mullo(_ROUND_A, c0),
        )
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # as int32
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.int32).to(torch.float32) * torch.tensor(_SCALE, dtype=torch.float32)


def _mulhi(a: int, b: torch.Tensor) -> torch.Tensor:
    """The high 32 bits of ``a * b`` (both below 2**32) without overflowing
    int64: ``b`` in 16-bit halves."""
    low, high = a * (b & 0xFFFF), a * (b >> 16)
    return ((high + (low >> 16)) >> 16) & _M32


def _mullo(a: int, b: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of ``a * b``."""
    low, high = a * (b & 0xFFFF), a * (b >> 16)
    return (low + ((high & 0xFFFF) << 16)) & _M32
