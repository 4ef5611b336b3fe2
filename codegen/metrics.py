"""Traffic and work of one kernel, for roofline reports.

Counted from what the kernel body computes, the emitter's table of named
values (each distinct expression once per scope, as the kernel computes it:
a value recomputed in a second loop over the row counts twice), and from the
tiling's axes, so the numbers follow the code and not a model of it.
"""

from __future__ import annotations

import dataclasses
import math

import sympy

from tilec import index as ix
from tilec.codegen.emit import Emitter
from tilec.codegen.triton_ops import ARITHMETIC
from tilec.inline import Bound, BufferLoad, InlinedExpr
from tilec.ir import Call, Graph, Group, Index


@dataclasses.dataclass(frozen=True)
class Metrics:
    # Bytes of distinct elements the loads touch, per buffer read.
    reads: dict[str, int]
    # Bytes the stores write.
    bytes_written: int
    # Arithmetic ops over the iteration space.
    flops: int


def kernel_metrics(
    graph: Graph,
    group: Group,
    body: Emitter,
    recomputed: dict[str, ix.Size] | None = None,
    reduction_flops: ix.Size | None = None,
) -> Metrics:
    """Bytes read and written and FLOPs of the kernel ``body`` for ``group``.

    ``recomputed``: a value varying along the named axis is computed this many
    times at each of its points (a GEMM recomputes its prologue for every
    tile of the other operand's side); ``reduction_flops``: the FLOPs of the
    group's reductions, where not one op per point of every axis (a GEMM's
    two per multiply-add)."""

    def hint(size: ix.Size) -> int:
        return ix.hint(size, graph.hints)

    def points(axes: frozenset[str]) -> int:
        """Iteration points a value varying along ``axes`` is computed at."""
        return math.prod(
            hint(axis.numel) * hint((recomputed or {}).get(axis.name, 1))
            for axis in body.axes
            if axis.name in axes
        )

    everywhere = frozenset(axis.name for axis in body.axes)
    reductions = sum(1 for n in group.nodes if graph.nodes[n].kind == "reduction")
    flops = reductions * points(everywhere) if reduction_flops is None else hint(reduction_flops)
    touched: dict[str, int] = {}
    for value in body.values.values():
        e = value.expr
        if isinstance(e, Call) and e.op in ARITHMETIC:
            flops += points(value.axes)
        elif isinstance(e, BufferLoad):
            touched[e.buffer] = touched.get(e.buffer, 0) + _positions(e.index, body, hint)
    reads = {
        b: min(n, hint(ix.numel(graph.nodes[b].shape))) * graph.nodes[b].dtype.itemsize
        for b, n in touched.items()
    }
    for b, n in body.extra_reads.items():
        reads[b] = reads.get(b, 0) + n
    written = sum(hint(_bytes_stored(graph, group, n)) for n in group.stored) + body.extra_written
    return Metrics(reads, written, flops)


def _bytes_stored(graph: Graph, group: Group, name: str) -> ix.Size:
    """Bytes a kernel of ``group`` writes into node ``name``: a scatter's own
    kernel writes one element per update (its init kernel, every element)."""
    node = graph.nodes[name]
    if node.kind == "scatter" and not group.init:
        return ix.numel(node.update_shape) * node.dtype.itemsize
    return node.nbytes


def _positions(index: tuple[sympy.Expr, ...], body: Emitter, hint) -> int:
    """Distinct positions an index reaches: the product of the ranges of the
    loop indices it depends on (through gathered values too)."""
    bindings = body.inliner.bindings
    seen: set[sympy.Symbol] = set()
    todo = [s for c in index for s in sympy.sympify(c).free_symbols]
    while todo:
        sym = todo.pop()
        if sym in seen:
            continue
        seen.add(sym)
        if sym in bindings:
            todo += _free_symbols(bindings[sym])
    return math.prod(hint(body.ranges[s]) for s in seen if s in body.ranges)


def _free_symbols(expr: InlinedExpr) -> list[sympy.Symbol]:
    """Index symbols an inlined expression depends on (loads, masks, indices)."""
    if isinstance(expr, Index):
        return list(sympy.sympify(expr.expr).free_symbols)
    if isinstance(expr, Bound):
        return [expr.symbol]
    if isinstance(expr, BufferLoad):
        out = [s for c in expr.index for s in sympy.sympify(c).free_symbols]
        return out + (_free_symbols(expr.mask) if expr.mask is not None else [])
    if isinstance(expr, Call):
        return [s for a in expr.args for s in _free_symbols(a)]
    return []
