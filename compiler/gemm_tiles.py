"""Tiles of the GEMM template: its heuristic configuration per problem.

Shared by codegen (the launch of a GEMM kernel, ``codegen/gemm.py``) and by
the cost model (``compiler/cost.py``: a template's tiles decide its wave
quantization), so the compiler prices the tiles the kernel will run with.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tilec.target import Target

if TYPE_CHECKING:
    from tilec.codegen.launch import LaunchConfig

# Software-pipelining stages of a GEMM's K loop (``tl.range``'s ``num_stages``).
STAGES = 3
# Products with at most this many rows (a decode step) get the small-M tiles.
SMALL_M = 16


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = STAGES

    @classmethod
    def of(cls, launch: LaunchConfig) -> GemmConfig:
        """The configuration a GEMM kernel's launch uses."""
        c = launch.constexprs
        return cls(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], launch.num_warps, launch.num_stages)

    def __str__(self) -> str:
        return (
            f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} "
            f"warps={self.num_warps} stages={self.num_stages}"
        )


def gemm_config(target: Target, m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """Tiles for an ``m x k @ k x n`` product of ``dtype`` operands (sizes at
    their hints).  ``tl.dot`` needs every tile side to be at least 16.
    ``BLOCK_K`` is the same on every target: whether K needs masks is part of
    the kernel's source, which must not depend on the target."""
    if target.interpret:
        return GemmConfig(_fit(m, 64), _fit(n, 64), _block_k(m, k, dtype), 4, 1)
    return gpu_gemm_config(m, n, k, dtype)


def gpu_gemm_config(m: int, n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """:func:`gemm_config`'s tiles on a GPU."""
    fit, block_k = _fit, _block_k(m, k, dtype)
    if dtype.itemsize >= 4:
        # fp32 operands multiply without tensor cores (torch's default: no
        # TF32): the FMA dot keeps operand slices in registers, and larger
        # tiles or K steps spill on sm_90 once a prologue adds registers.
        return GemmConfig(16 if m <= SMALL_M else fit(m, 64), fit(n, 64), block_k, 4, 4)
    if m <= SMALL_M:
        return GemmConfig(16, fit(n, 64), block_k, 4, 4)
    if m <= 64:
        return GemmConfig(fit(m, 64), fit(n, 128), block_k, 4)
    return GemmConfig(128, fit(n, 128), block_k, 8)


def _fit(size: int, cap: int) -> int:
    """A tile side for ``size``: its next power of two, within 16 (``tl.dot``'s
    minimum) and ``cap``."""
    return max(16, min(next_pow2(size), cap))


def _block_k(m: int, k: int, dtype: torch.dtype) -> int:
    """``BLOCK_K``, the same on every target: 16 for fp32 operands; for
    16-bit ones up to 64, or 128 (fewer, longer steps) for few rows."""
    if dtype.itemsize >= 4:
        return _fit(k, 16)
    return _fit(k, 128 if m <= SMALL_M else 64)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())
