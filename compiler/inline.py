"""Inlining: a node's value at an index, as one expression over buffer loads.

Fusion and codegen both need to know what a fused group really reads.  Starting
from a node and an index, :class:`Inliner` substitutes the bodies of the
group's pointwise nodes (and of every pointwise node that reads no tensor,
see ``Graph.recomputed``) into their readers and folds views into index math,
until only loads from real buffers remain (:class:`BufferLoad`): inputs,
constants, library-call results, nodes stored by other kernels, and the
group's own reductions.

Index components that are not affine in the loop indices (a gathered index
loaded from memory, a clamped position) are bound to fresh symbols ``v0,
v1, ...``; ``Inliner.bindings`` maps them to their expressions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import sympy
import torch

from tilec import index as ix
from tilec.ir import CHECK_INDEX, Call, Const, Expr, Graph, Index, Load, Node, walk
from tilec.scalar_ops import REDUCTIONS


@dataclass(frozen=True)
class BufferLoad:
    """A load from a materialized buffer at an index in that buffer's shape."""

    buffer: str
    index: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    mask: InlinedExpr | None = None


@dataclass(frozen=True)
class Bound:
    """A non-affine index value bound to a symbol (see ``Inliner.bindings``)."""

    symbol: sympy.Symbol
    dtype: torch.dtype = torch.int64


InlinedExpr = BufferLoad | Const | Index | Call | Bound


class Inliner:
    """Inline the pointwise nodes of ``group`` (names) into their readers."""

    def __init__(self, graph: Graph, group: set[str], ranges: dict[sympy.Symbol, int]):
        self.graph = graph
        self.group = group
        self.ranges = dict(ranges)
        self.bindings: dict[sympy.Symbol, InlinedExpr] = {}
        self._bound: dict[InlinedExpr, sympy.Symbol] = {}

    def value(
        self, name: str, index: tuple[sympy.Expr, ...], mask: InlinedExpr | None = None
    ) -> InlinedExpr:
        """Value of node ``name`` at ``index`` (in that node's own shape)."""
        node = self.graph.nodes[name]
        while node.kind == "view":
            src = self.graph.nodes[node.inputs[0]]
            index = node.view.source_index(index, src.shape)
            node = src
        index = tuple(ix.simplify_index(sympy.sympify(e), self.ranges) for e in index)
        if mask is not None and ix.in_bounds(index, node.shape, self.ranges):
            # A mask guards a position that may fall outside (a pooling
            # window's padding); an index inside the buffer everywhere (a
            # per-channel parameter) needs none, and its load is then shared
            # by every window tap.
            mask = None
        if node.kind == "pointwise" and (
            node.name in self.group or node.name in self.graph.recomputed()
        ):
            subst = dict(zip(ix.out_symbols(len(node.shape)), index))
            return self.body(node, subst, mask)
        return BufferLoad(node.name, index, node.dtype, mask)

    def body(
        self, node: Node, subst: dict[sympy.Symbol, sympy.Expr], mask: InlinedExpr | None = None
    ) -> InlinedExpr:
        """``node.body`` with its index symbols replaced by ``subst``."""

        def visit(e: Expr, mask: InlinedExpr | None) -> InlinedExpr:
            if isinstance(e, Const):
                return e
            if isinstance(e, Index):
                return Index(sympy.sympify(e.expr).xreplace(subst), e.dtype)
            if isinstance(e, Call):
                args = tuple(visit(a, mask) for a in e.args)
                if e.op == CHECK_INDEX and mask is not None:
                    # Checked only where the load it indexes is not masked off
                    # (a cat's part, a window's padding): a fourth argument.
                    args += (mask,)
                return Call(e.op, args, e.dtype)
            assert isinstance(e, Load)
            inner = mask
            if e.mask is not None:
                own = visit(e.mask, mask)
                inner = own if mask is None else Call("logical_and", (mask, own), torch.bool)
            comps = tuple(
                sympy.sympify(c).xreplace(subst)
                if isinstance(c, sympy.Expr)
                else self._index_component(visit(c, inner))
                for c in e.index
            )
            return self.value(node.inputs[e.src], comps, inner)

        return visit(node.body, mask)

    def scatter(self, node: Node) -> tuple[InlinedExpr, tuple[sympy.Expr, ...]]:
        """A scatter node's value and destination position over the index
        symbols of its updates; gathered components are bound symbols."""
        body = self.body(node, {})
        assert isinstance(body, Call)
        value, *position = body.args
        return value, tuple(self._index_component(c) for c in position)

    def loads(self, *values: InlinedExpr) -> list[BufferLoad]:
        """Every load inside ``values`` and inside the index values bound so far."""
        return [load for v in (*values, *self.bindings.values()) for load in buffer_loads(v)]

    def _index_component(self, e: InlinedExpr) -> sympy.Expr:
        if isinstance(e, Index):
            return e.expr
        if isinstance(e, Bound):
            return e.symbol
        if e not in self._bound:
            sym = ix.value_symbol(len(self._bound))
            self._bound[e] = sym
            self.bindings[sym] = e
        return self._bound[e]


def tile_indices(
    graph: Graph, members: set[str], rows: tuple[int, ...], rshape: tuple[int, ...]
) -> dict[tuple[int, ...], tuple[sympy.Expr, ...]]:
    """Where, in a reduction kernel's row x reduction tile, each full-size shape lives.

    ``rows + rshape`` is the tile itself.  A reduction over dims other than the
    last reads its operand in another order (a softmax over dim 0 reads
    ``x[r0, i0]``); a fused kernel computes and stores full-size values of that
    operand's shape at the tile position the reduction reads them from, so one
    pass over the tile serves the reduction and the stores.  Only bijections
    count: every index component a distinct symbol whose range is that dim.
    """
    ranges = ix.symbol_ranges(rows, rshape)
    wide = {s for s, n in ranges.items() if n != 1}  # symbolic sizes are >= 2
    tiles = {rows + rshape: ix.out_symbols(len(rows)) + ix.reduce_symbols(len(rshape))}
    for name in members:
        node = graph.nodes[name]
        if node.kind != "reduction":
            continue
        for src, index in _direct_reads(graph, node):
            index = tuple(ix.simplify_index(sympy.sympify(c), ranges) for c in index)
            if src.shape not in tiles and _is_tile_bijection(index, src.shape, ranges, wide):
                tiles[src.shape] = index
    for name in sorted(members):
        node = graph.nodes[name]
        if node.kind == "pointwise" and node.shape not in tiles:
            index = _permuted_index(graph, node, tiles)
            if index is not None:
                tiles[node.shape] = index
    return tiles


def _direct_reads(graph: Graph, node: Node) -> Iterator[tuple[Node, tuple[sympy.Expr, ...]]]:
    """(buffer, index in its shape) for each of ``node``'s loads at an affine
    index, looking through views."""
    for load in walk(node.body):
        if not isinstance(load, Load) or not all(isinstance(c, sympy.Expr) for c in load.index):
            continue
        src, index = graph.nodes[node.inputs[load.src]], load.index
        while src.kind == "view":
            base = graph.nodes[src.inputs[0]]
            index, src = src.view.source_index(index, base.shape), base
        yield src, index


def _permuted_index(
    graph: Graph, node: Node, tiles: dict[tuple[int, ...], tuple[sympy.Expr, ...]]
) -> tuple[sympy.Expr, ...] | None:
    """A tile position for ``node`` when it reads a tile-shaped value through
    a permutation (a transposed copy, e.g. attention's ``q.transpose(0, 1)``
    made contiguous): dim ``k`` of ``node`` takes the tile symbol of the dim
    it reads.  Every dim of size > 1 must map to a distinct dim of the same
    size, so the position is a bijection and the kernel stores every element
    once; None otherwise."""
    own = ix.out_symbols(len(node.shape))
    for src, index in _direct_reads(graph, node):
        if src.shape not in tiles:
            continue
        index = ix.pin_unit_dims(index, node.shape)
        place: dict[sympy.Expr, sympy.Expr] = {}
        for c, size, tile_symbol in zip(index, src.shape, tiles[src.shape]):
            if size == 1:
                continue
            if c not in own or c in place or node.shape[own.index(c)] != size:
                break
            place[c] = tile_symbol
        else:
            if all(sym in place or size == 1 for sym, size in zip(own, node.shape)):
                return tuple(place.get(sym, sympy.Integer(0)) for sym in own)
    return None


def _is_tile_bijection(
    index: tuple[sympy.Expr, ...],
    shape: tuple[int, ...],
    ranges: dict[sympy.Symbol, int],
    wide: set[sympy.Symbol],
) -> bool:
    used = []
    for c, size in zip(index, shape):
        if size == 1:
            if not (c == 0 or ranges.get(c) == 1):
                return False
        elif ranges.get(c) != size:
            return False
        else:
            used.append(c)
    return len(used) == len(set(used)) and set(used) == wide


def kernel_loads(
    graph: Graph,
    members: Sequence[str],
    stored: Sequence[str],
    rows: tuple[int, ...],
    rshape: tuple[int, ...] = (),
) -> list[BufferLoad]:
    """Every buffer load of the kernel that computes ``members`` (in graph
    order) over ``rows`` (by ``rshape`` for a reduction) and stores ``stored``:
    the reductions' operands, each stored value at the tile position it is
    written from (see :func:`tile_indices`), and the index values they bind.

    This is what fusion legality, layout choice and in-place reuse ask of a
    kernel: which buffer it reads where."""
    inliner = Inliner(graph, set(members), ix.symbol_ranges(rows, rshape))
    values = _row_values(graph, inliner, members, stored, rows, rshape)
    statistics = row_statistics(graph, members, rows, inliner.loads(*values))
    # Row statistics where they are read; other reductions (a GEMM's
    # prologue: its anchor places them) at their own positions.
    values += [
        inliner.body(graph.nodes[m], statistics.get(m, {}))
        for m in members
        if graph.nodes[m].kind == "reduction" and graph.nodes[m].shape != rows
    ]
    return inliner.loads(*values)


def row_loads(
    graph: Graph,
    members: Sequence[str],
    stored: Sequence[str],
    rows: tuple[int, ...],
    rshape: tuple[int, ...],
) -> list[BufferLoad]:
    """The loads of :func:`kernel_loads` less those its row statistics add:
    those of what the kernel computes over its rows."""
    inliner = Inliner(graph, set(members), ix.symbol_ranges(rows, rshape))
    return inliner.loads(*_row_values(graph, inliner, members, stored, rows, rshape))


def _row_values(
    graph: Graph,
    inliner: Inliner,
    members: Sequence[str],
    stored: Sequence[str],
    rows: tuple[int, ...],
    rshape: tuple[int, ...],
) -> list[InlinedExpr]:
    """What a kernel over ``rows`` computes and stores, inlined: its
    reductions over those rows (not its row statistics) and its stored
    values, each at the tile position it is written from."""
    tiles = tile_indices(graph, set(members), rows, rshape)
    values = [
        inliner.body(graph.nodes[m], {})
        for m in members
        if graph.nodes[m].kind == "reduction" and graph.nodes[m].shape == rows
    ]
    row = ix.out_symbols(len(rows))
    for name in stored:
        node = graph.nodes[name]
        if node.kind == "scatter":  # its value and position, over ``rows`` (its updates)
            values.append(inliner.body(node, {}))
        elif node.kind != "reduction":  # a reduction's loads are its operand's
            index = tiles.get(node.shape) or row_position(rows, node.shape, inliner.ranges)
            values.append(inliner.value(name, row if node.shape == rows else index))
    return values


def row_statistics(
    graph: Graph,
    members: Sequence[str],
    rows: tuple[int, ...],
    loads: list[BufferLoad],
) -> dict[str, dict[sympy.Symbol, sympy.Expr]]:
    """The row statistics of a reduction kernel computing ``members`` over
    ``rows``, from the ``loads`` of what it computes over those rows
    (:func:`row_loads`): its reductions over other rows than the kernel's
    (an RMS norm's mean square, one value for the whole row that a decode
    GEMV's sum reduction reads), each with where the kernel reads it, as a
    substitution of its index symbols by that position.  The kernel
    computes each at that position, over the same reduction elements,
    before the reductions that read it (``codegen/templates.py``); fusion
    admits one only where that reads nothing more (``passes/fuse.py``).  A
    reduction read at more than one position, or at one that is not a
    function of the row's indices (that varies along the reduction, or is
    read from data), is left out, as are the reductions of a template's
    kernel (its anchor places them)."""
    reductions = [graph.nodes[m] for m in members if graph.nodes[m].kind == "reduction"]
    if any(n.reduce_op not in REDUCTIONS for n in reductions):
        return {}
    found = {}
    for node in reductions:
        if node.shape == rows:
            continue
        positions = {load.index for load in loads if load.buffer == node.name}
        if len(positions) != 1:
            continue
        (index,) = positions
        if at_row(index, len(rows)):
            found[node.name] = dict(zip(ix.out_symbols(len(node.shape)), index))
    return found


def at_row(index: Sequence[sympy.Expr], rank: int) -> bool:
    """Whether position ``index`` is a function of the row's indices alone
    (the first ``rank`` output symbols): not of the reduction's, nor read
    from data (a bound symbol, computed in the loop).  Where a kernel over
    those rows can compute a row statistic read there (:func:`row_statistics`)."""
    row = set(ix.out_symbols(rank))
    return all(sympy.sympify(c).free_symbols <= row for c in index)


def is_row_shape(shape: tuple[int, ...], rows: tuple[int, ...]) -> bool:
    """Whether a value of ``shape`` is a row of ``rows`` with size-1
    dimensions added or left out (a ``keepdim`` row, ``[8, 12, 512, 1]`` for
    rows ``[8, 12, 512]``): the same elements in the same order, so a
    reduction kernel computes and stores it at the row position
    (:func:`row_position`)."""
    return [s for s in shape if s != 1] == [s for s in rows if s != 1]


def row_position(
    rows: tuple[int, ...], shape: tuple[int, ...], ranges: dict[sympy.Symbol, int]
) -> tuple[sympy.Expr, ...]:
    """Where a value of ``shape``, a row-major reshape of ``rows`` (as many
    elements), has the element at the row position ``i0, i1, ...``: a GEMM's
    epilogue stores ``(batch, seq, n)`` values from a ``(batch * seq, n)`` tile."""
    row = ix.out_symbols(len(rows))
    # Trailing dimensions both shapes share keep their symbols (div/mod over
    # them would not simplify back when the value's view reads the rows).
    same = 0
    while same < min(len(rows), len(shape)) and rows[-1 - same] == shape[-1 - same]:
        same += 1
    lead_rows, lead_shape = rows[: len(rows) - same], shape[: len(shape) - same]
    flat = ix.flatten_index(row[: len(lead_rows)], lead_rows)
    index = (*ix.unflatten_index(flat, lead_shape), *row[len(lead_rows) :])
    return tuple(ix.simplify_index(c, ranges) for c in index)


def buffer_loads(expr: InlinedExpr) -> list[BufferLoad]:
    """Every BufferLoad inside ``expr`` (masks included)."""
    out: list[BufferLoad] = []

    def visit(e: InlinedExpr) -> None:
        if isinstance(e, BufferLoad):
            out.append(e)
            if e.mask is not None:
                visit(e.mask)
        elif isinstance(e, Call):
            for a in e.args:
                visit(a)

    visit(expr)
    return out
