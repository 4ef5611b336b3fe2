"""How a kernel is launched: block sizes, grid, warps and stages.

A kernel's source does not depend on where it runs; its launch does.  The
tiling templates (``codegen/templates.py``) choose a :class:`LaunchConfig`
for the :class:`~tilec.target.Target` (:func:`blocks`), and everything that launches or compiles the kernel
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
from tilec.gemm import next_pow2
from tilec.ir import Graph
from tilec.target import Target

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

# The first statements of a kernel launched with programmatic dependent
# launch (the option ``pdl``).  Such a launch may start its programs before
# the kernel it follows in the stream has finished.  ``gdc_wait`` blocks
# until that kernel has completed and its writes are visible, so placed
# before any load or store it keeps the stream's order for every buffer
# (inputs, reused arena buffers: reads after writes and writes after
# reads); what is won is the launch itself, which overlaps the previous
# kernel's last programs.  ``gdc_launch_dependents`` then lets the next
# kernel launch once every program of this one has started.  Both are
# ``griddepcontrol`` instructions of sm_90 PTX, no-ops in a kernel
# launched without the attribute.
DEPENDENT_START = (
    "tl.extra.cuda.gdc_wait()",
    "tl.extra.cuda.gdc_launch_dependents()",
)


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
    # Launched with programmatic dependent launch; the kernel starts with
    # :data:`DEPENDENT_START`.
    pdl: bool = False

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments of a launch (``kernel[grid](*args, **options)``)."""
        pdl = {"launch_pdl": True} if self.pdl else {}
        return {
            **self.constexprs,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **CHECKED,
            **pdl,
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


def blocks(
    target: Target, xnumel: int, rnumel: int | None, itemsize: int = 4
) -> tuple[int, int, int]:
    """(XBLOCK, RBLOCK, num_warps) on ``target`` for a kernel storing
    ``itemsize``-byte elements, within the target's largest blocks (the
    interpreter's are large: it pays per program).  A reduction's rows are
    reduced in registers whole (RBLOCK covers them) up to
    :data:`MAX_PERSISTENT` elements, in chunks of the target's looped block
    beyond."""
    rblock = 1
    if rnumel is not None:
        rblock = next_pow2(rnumel) if rnumel <= MAX_PERSISTENT else target.max_looped_rblock
    largest = target.max_pointwise_block if rnumel is None else target.max_reduction_tile
    xblock = max(1, min(next_pow2(xnumel), largest // rblock))
    if not target.interpret:
        # A small kernel spread over the SMs (``cost.fill``): rows per
        # program down to a tile of one warp of 128-bit accesses.
        warp = target.warp_size * max(1, VECTOR_BYTES // itemsize)
        spread = next_pow2(-(-xnumel // target.sm_count))
        xblock = min(xblock, max(next_pow2(-(-warp // rblock)), spread))
    return xblock, rblock, _warps(xblock * rblock, itemsize, target.warp_size)


def _warps(tile: int, itemsize: int, warp_size: int) -> int:
    """Warps for a tile of ``tile`` elements of ``itemsize`` bytes: 1 to 8,
    keeping enough elements per thread for 128-bit accesses (4 in fp32, 8 in
    16-bit types, at most 8: more costs registers).  4 warps on a 256-element
    tile would give each thread 2, and only 64-bit accesses."""
    per_thread = max(1, min(8, VECTOR_BYTES // itemsize))
    return max(1, min(8, tile // (warp_size * per_thread)))
