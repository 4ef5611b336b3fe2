"""How a kernel is launched: block sizes, grid, warps and stages.

A kernel's source does not depend on where it runs; its launch does.  The
tiling templates (``codegen/templates.py``) choose a :class:`LaunchConfig`
for the :class:`Target`, and everything that launches or compiles the kernel
reads it from ``KernelSource.launch``: the runtime's ``Program``, the kernel
records of the PTX tier (``codegen/record.py``) and the sm_90 compile of the
static report (``benchmarks/sm90.py``), so all three launch the same thing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import sympy

from tilec import index as ix
from tilec.ir import Graph

# Index math is 32-bit while every size stays within this.
INT32_LIMIT = 2**31 - 1

# Rows up to this many elements are reduced in registers in one pass.
MAX_PERSISTENT = 4096

# Bytes a thread should move per access: one 128-bit load or store.
VECTOR_BYTES = 16

# Software-pipelining stages: Triton's default for sm_90, stated so that a
# launch and an ahead-of-time compile of the same kernel agree.
NUM_STAGES = 3


# Compile options of every kernel.  Triton keeps device asserts (the bounds
# checks of indices read from data, ``ir.check_index``) only with ``debug``;
# the overflow checks ``debug`` would add to every 32-bit integer op stay off,
# as Inductor does.
CHECKED = {"debug": True, "sanitize_overflow": False}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The launch parameters of one kernel."""

    # Values of the kernel's ``tl.constexpr`` parameters, in signature order.
    constexprs: dict[str, int]
    # Programs per grid dimension: ints, or for a graph of symbolic sizes
    # expressions in the size symbols (evaluated per call by the runtime).
    grid: tuple[ix.Size, ...]
    num_warps: int
    num_stages: int

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments of a launch (``kernel[grid](*args, **options)``)."""
        return {
            **self.constexprs,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **CHECKED,
        }


@contextlib.contextmanager
def interpreter_checks() -> Iterator[None]:
    """Device asserts on in the Triton interpreter while the block runs.

    A launch's ``debug`` does not reach the interpreter, which reads it from
    its one builder's options (the same field on triton 3.6 to 3.8): tilec's
    programs turn it on around their calls only, not for other kernels of
    the process.  A failed assert raises ``AssertionError(message)``, which
    the interpreter re-raises as ``InterpreterError`` from it."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    previous = builder.options
    builder.options = dataclasses.replace(previous, **CHECKED)
    try:
        yield
    finally:
        builder.options = previous


def program_id(graph: Graph, points: ix.Size) -> str:
    """``tl.program_id(0)``, 64-bit when ``points`` (the iteration space) or a
    tensor of the graph is beyond 32-bit indices.  A graph of symbolic sizes
    is only run where this still holds (a guard)."""
    sizes = [ix.numel(n.shape) for n in graph.nodes.values() if n.kind != "view"]
    wide = max(ix.hint(s, graph.hints) for s in (points, *sizes)) > INT32_LIMIT
    return "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"


def programs(numel: ix.Size, block: int) -> ix.Size:
    """How many programs of ``block`` elements cover ``numel``: ceil(numel / block)."""
    return ix.size(sympy.floor((sympy.sympify(numel) + block - 1) / block))


@dataclasses.dataclass(frozen=True)
class Target:
    """Where kernels will run: the Triton interpreter or a GPU.

    The target only changes launch parameters (block sizes, warps), never the
    kernel source, so the sources the CPU test suite runs are exactly the ones
    a GPU compiles (and the PTX test tier checks)."""

    interpret: bool

    def blocks(self, xnumel: int, rnumel: int | None, itemsize: int = 4) -> tuple[int, int, int]:
        """(XBLOCK, RBLOCK, num_warps) for a kernel storing ``itemsize``-byte
        elements.  The interpreter pays per program, so it gets large blocks;
        a GPU gets blocks sized for occupancy and vector accesses."""
        if rnumel is None:
            cap = 16384 if self.interpret else 1024
            xblock = min(_pow2(xnumel), cap)
            return xblock, 1, _warps(xblock, itemsize)
        if rnumel <= MAX_PERSISTENT:
            rblock = _pow2(rnumel)
        else:
            rblock = 4096 if self.interpret else 1024
        budget = 16384 if self.interpret else 4096
        xblock = max(1, min(_pow2(xnumel), budget // rblock))
        return xblock, rblock, _warps(xblock * rblock, itemsize)


def _warps(tile: int, itemsize: int) -> int:
    """Warps for a tile of ``tile`` elements of ``itemsize`` bytes: 1 to 8,
    keeping enough elements per thread for 128-bit accesses (4 in fp32, 8 in
    16-bit types, at most 8: more costs registers).  4 warps on a 256-element
    tile would give each thread 2, and only 64-bit accesses."""
    per_thread = max(1, min(8, VECTOR_BYTES // itemsize))
    return max(1, min(8, tile // (32 * per_thread)))


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())
