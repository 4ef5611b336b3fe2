"""Tiling templates: how one fused group's iteration space becomes a kernel body.

Pointwise groups get a 1-D tiling over the flat output index ``x``, which
walks the dimensions in the memory order of the (first) stored value, so a
channels-last or transposed output is written, and inputs laid out alike are
read, contiguously.
Reduction groups get a 2-D tiling: ``XBLOCK`` rows by ``RBLOCK`` reduction
elements.  When a whole row fits in one block the kernel is *persistent*: it
loads each value once and keeps it in registers for every reduction and for
the pointwise outputs after them (a softmax or a layer norm reads its input
once).  Otherwise each reduction level loops over the row in chunks and a
final loop writes the full-size outputs.

A template describes its tile's axes, opens the loops and scopes, and drives
the :class:`~tilec.codegen.emit.Emitter` for the values and stores; it also
chooses the launch (:class:`~tilec.codegen.launch.LaunchConfig`).  Sizes are
baked in as literals (shapes are static per compiled graph); only the block
sizes are ``tl.constexpr`` launch parameters.  In a graph compiled for
symbolic sizes, block sizes are chosen for the sizes the graph was compiled
with (``Graph.hints``), and reductions over a symbolic extent always loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.anchors import anchors_in
from tilec.codegen.attention import Attention
from tilec.codegen.attention_grad import AttentionGrad
from tilec.codegen.emit import Axis, Emitter, Scope
from tilec.codegen.gemm import Gemm
from tilec.codegen.launch import (
    MAX_PERSISTENT,
    NUM_STAGES,
    LaunchConfig,
    blocks,
    program_id,
    programs,
)
from tilec.codegen.triton_ops import COMBINE, full_text, literal, neutral
from tilec.inline import (
    BufferLoad,
    is_row_shape,
    row_loads,
    row_position,
    row_statistics,
    tile_indices,
)
from tilec.ir import Graph, Group, Node
from tilec.target import Target


class TemplateWriter(Protocol):
    """The codegen side of a template kind (``compiler/anchors.py``), one
    class per kind in :data:`WRITERS`: it writes the kernel of a group
    around the group's anchor, lists the tile configurations max-autotune
    measures (``codegen/autotune.py``; ``Config`` is their type, kept in its
    cache), launches one, and prices a kernel it wrote on a target."""

    Config: type

    def __init__(self, graph: Graph, group: Group, target: Target, anchor: Node) -> None: ...

    def write(self) -> tuple[Emitter, LaunchConfig, ix.Size, ix.Size]:
        """The body, its launch, and the rows and reduction extents."""
        ...

    def work(self) -> tuple[dict[str, ix.Size], ix.Size]:
        """For the metrics: recomputation per axis, and the anchor's FLOPs."""
        ...

    def program_loop(self) -> cost.KLoop | None:
        """One program's longest loop, where ``predict`` cannot read it from
        the kernel (attention's key blocks: their count and the shared
        memory they take); else None."""
        ...

    @staticmethod
    def candidates(graph: Graph, anchor: Node, target: Target, launch: LaunchConfig) -> list: ...

    @staticmethod
    def launch(anchor: Node, config: Any) -> LaunchConfig: ...

    @staticmethod
    def predict(kernel: Any, target: Target) -> cost.Prediction: ...


# The writer of each template kind, by the kind's name (also the kernel's
# ``template``).
WRITERS: dict[str, type[TemplateWriter]] = {
    "gemm": Gemm,
    "attention": Attention,
    "attention_grad": AttentionGrad,
}


@dataclasses.dataclass(frozen=True)
class TiledKernel:
    """A group's kernel body, as a template wrote it, and its launch."""

    template: str  # "pointwise", "scatter", "persistent", "looped", or an anchor kind
    emitter: Emitter
    launch: LaunchConfig
    xnumel: ix.Size
    rnumel: ix.Size
    # For the metrics (``kernel_metrics``): values along these axes are
    # computed this many times per point; the reductions' FLOPs if not one
    # per point.
    recomputed: dict[str, ix.Size] = dataclasses.field(default_factory=dict)
    reduction_flops: ix.Size | None = None
    # A template's ``program_loop``, for its prediction.
    program_loop: cost.KLoop | None = None


def tile(graph: Graph, group: Group, target: Target) -> TiledKernel:
    """The kernel body of ``group``, from the template that fits it."""
    anchored = anchors_in(graph, group.nodes)
    if anchored:
        # The first anchor leads (an attention's output, before its log-sum-exp).
        anchor, node = anchored[0]
        writer = WRITERS[anchor.kind](graph, group, target, node)
        emitter, launch, xnumel, rnumel = writer.write()
        recomputed, flops = writer.work()
        return TiledKernel(
            anchor.kind, emitter, launch, xnumel, rnumel, recomputed, flops, writer.program_loop()
        )
    is_reduction = bool(group.reduce_shape) or any(
        graph.nodes[n].kind == "reduction" for n in group.nodes
    )
    if is_reduction:
        return _Reduction(graph, group, target).write()
    return _pointwise(graph, group, target)


def _launch(
    graph: Graph, group: Group, target: Target, xnumel: ix.Size, rnumel: ix.Size | None
) -> LaunchConfig:
    """One program per ``XBLOCK`` rows (or elements), blocks for the hinted sizes."""
    # The narrowest element the kernel stores sets how many make 128 bits.
    itemsize = min((graph.nodes[n].dtype.itemsize for n in group.stored), default=4)
    rhint = None if rnumel is None else ix.hint(rnumel, graph.hints)
    xblock, rblock, warps = blocks(target, ix.hint(xnumel, graph.hints), rhint, itemsize)
    constexprs = {"XBLOCK": xblock, "RBLOCK": rblock}
    return LaunchConfig(constexprs, (programs(xnumel, xblock),), warps, NUM_STAGES)


def _reduced_order(
    graph: Graph, rows: ix.Shape, rshape: ix.Shape, loads: list[BufferLoad]
) -> tuple[int, ...]:
    """The reduced dimensions from the outermost to the innermost in the flat
    ``r``: in the memory order of the largest buffer the kernel reads along
    all of them at a constant stride each (their logical order where none
    does).  A sum's order is any; coalescing is not: GroupNorm over an NHWC
    map reduces (channels of a group, pixels), and walked in that order
    each lane of a warp read a 2-byte element 512 channels from the
    next."""
    logical = tuple(range(len(rshape)))
    if len(rshape) < 2:
        return logical
    symbols = ix.reduce_symbols(len(rshape))
    ranges = ix.symbol_ranges(rows, rshape)
    best: tuple[int, tuple[int, ...]] | None = None
    for load in loads:
        node = graph.nodes[load.buffer]
        stride = node.buffer_stride
        if len(load.index) != len(stride):
            continue
        flat = sum(sympy.sympify(c) * s for c, s in zip(load.index, stride))
        flat = ix.simplify_index(sympy.expand(flat), ranges)
        coefficients = [flat.coeff(r) for r in symbols]
        linear = sympy.expand(flat - sum(c * r for c, r in zip(coefficients, symbols)))
        if linear.has(*symbols) or not all(c.is_Integer and c > 0 for c in coefficients):
            continue
        nbytes = int(ix.hint(node.nbytes, graph.hints))
        if best is None or nbytes > best[0]:
            best = (nbytes, _memory_order(tuple(coefficients), rshape, graph.hints))
    return logical if best is None else best[1]


def _memory_order(stride: ix.Shape, shape: ix.Shape, hints: dict) -> tuple[int, ...]:
    """Dimensions from the largest stride to the smallest (size-1 dimensions
    and ties keep their logical order); symbolic strides are compared at the
    hinted sizes (any order is correct, this one is fast there)."""

    def key(d: int) -> tuple[int, int]:
        return (-ix.hint(stride[d], hints) if shape[d] != 1 else 0, d)

    return tuple(sorted(range(len(shape)), key=key))


def _pointwise(graph: Graph, group: Group, target: Target) -> TiledKernel:
    """1-D over the flat index ``x`` of the group's shape.  A scatter's group
    runs over its updates and stores each value (or combines it atomically)
    at the position it computes; other nodes are stored at their own
    positions, and a scatter's init kernel stores its base."""
    rows = group.shape
    scatters = {n for n in group.nodes if graph.nodes[n].kind == "scatter"}
    # x walks the dimensions in the memory order of what the kernel stores, so
    # that stores (and loads laid out alike) coalesce; a scatter's, in its values' order.
    order = tuple(range(len(rows)))
    if group.stored and not scatters:
        order = _memory_order(graph.nodes[group.stored[0]].buffer_stride, rows, graph.hints)
    x = Axis("x", "i", rows, order, mask="xmask", zero="0 * x")
    e = Emitter(graph, group, (x,))
    e.line(f"x = {program_id(graph, x.numel)} * XBLOCK + tl.arange(0, XBLOCK)")
    e.line(f"xmask = x < {e.size_text(x.numel)}")
    e.index_variables(x)
    scope = Scope()
    for name in group.stored:
        node = graph.nodes[name]
        if name in scatters:
            value, position = e.inliner.scatter(node)
            e.store(name, position, e.emit(value, scope), scope, frozenset("x"), node.reduce_op)
            continue
        index = ix.out_symbols(len(node.shape))
        source = node.inputs[0] if group.init else name
        e.store(name, index, e.emit(e.inliner.value(source, index), scope), scope, frozenset("x"))
    launch = _launch(graph, group, target, x.numel, None)
    return TiledKernel("scatter" if scatters else "pointwise", e, launch, x.numel, 1)


class _Reduction:
    """The reduction template: a persistent row, or loops over it."""

    def __init__(self, graph: Graph, group: Group, target: Target):
        self.graph, self.group, self.target = graph, group, target
        self.rows, self.rshape = group.shape, group.reduce_shape
        loads = row_loads(graph, group.nodes, group.stored, self.rows, self.rshape)
        self.x = Axis("x", "i", self.rows, tuple(range(len(self.rows))), "xmask", "xzero")
        order = _reduced_order(graph, self.rows, self.rshape, loads)
        self.r = Axis("r", "r", self.rshape, order, "rmask", "rzero")
        self.e = Emitter(graph, group, (self.x, self.r))
        rnumel = self.r.numel
        self.persistent = isinstance(rnumel, int) and rnumel <= MAX_PERSISTENT
        # Where each full-size shape lives in the tile (inline.tile_indices).
        self.tiles = tile_indices(graph, set(group.nodes), self.rows, self.rshape)
        # Row statistics, each computed where the kernel reads it (inline.row_statistics).
        self.statistics = row_statistics(graph, group.nodes, self.rows, loads)

    def write(self) -> TiledKernel:
        e, graph = self.e, self.graph
        pid = program_id(graph, self.x.numel * self.r.numel)
        e.line(f"x = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
        e.line(f"xmask = x < {e.size_text(self.x.numel)}")
        e.line("xzero = tl.full([XBLOCK, 1], 0, tl.int32)")
        e.line("rzero = tl.full([1, RBLOCK], 0, tl.int32)")
        e.index_variables(self.x)
        row_scope = Scope()
        # Row statistics first: the reductions over the kernel's rows read them.
        reductions = [*self.statistics] + [
            n
            for n in self.group.nodes
            if graph.nodes[n].kind == "reduction" and n not in self.statistics
        ]
        full_stores = [
            n
            for n in self.group.stored
            if graph.nodes[n].kind == "pointwise" and not self.stored_per_row(graph.nodes[n])
        ]
        if self.persistent:
            e.line("rbase = tl.arange(0, RBLOCK)[None, :]")
            e.line("r = rbase")
            e.line(f"rmask = r < {e.size_text(self.r.numel)}")
            e.index_variables(self.r)
            tile = Scope(row_scope)
            for name in reductions:
                self.reduce_persistent(name, tile)
            self.store_rows(tile)
            for name in full_stores:
                self.store_full(name, tile)
        else:
            for level in self.levels(reductions):
                self.reduce_loop(level, row_scope)
            self.store_rows(row_scope)
            if full_stores:
                tile = self.open_loop(row_scope)
                for name in full_stores:
                    self.store_full(name, tile)
                e.indent -= 1
        launch = _launch(graph, self.group, self.target, self.x.numel, self.r.numel)
        template = "persistent" if self.persistent else "looped"
        return TiledKernel(template, e, launch, self.x.numel, self.r.numel)

    def levels(self, reductions: list[str]) -> list[list[str]]:
        """Reductions grouped so that each level reads only earlier levels."""
        level: dict[str, int] = {}
        inliner = self.e.inliner
        for name in reductions:
            body = inliner.body(self.graph.nodes[name], self.statistics.get(name, {}))
            reads = {b.buffer for b in inliner.loads(body)}
            level[name] = 1 + max((level[r] for r in reads if r in level), default=-1)
        return [[n for n in reductions if level[n] == k] for k in range(max(level.values()) + 1)]

    def open_loop(self, rows: Scope) -> Scope:
        e, rnumel = self.e, self.e.size_text(self.r.numel)
        e.line(f"for roff in range(0, {rnumel}, RBLOCK):")
        e.indent += 1
        e.line("r = roff + tl.arange(0, RBLOCK)[None, :]")
        e.line(f"rmask = r < {rnumel}")
        e.index_variables(self.r)
        return Scope(rows)

    def body_value(self, name: str, scope: Scope) -> tuple[str, torch.dtype]:
        node = self.graph.nodes[name]
        body = self.e.inliner.body(node, self.statistics.get(name, {}))
        return self.e.emit(body, scope), node.body.dtype

    def masked(self, value: str, op: str, dtype: torch.dtype) -> str:
        full = full_text(neutral(op, dtype), dtype, "[XBLOCK, RBLOCK]")
        return f"tl.where(xmask & rmask, {value}, {full})"

    def finish(self, name: str, op: str, values: str, index: str | None) -> None:
        e = self.e
        out = e.tmp("red")
        if op in COMBINE:
            e.line(f"{out} = tl.reduce({values}, 1, {COMBINE[op]})[:, None]")
        elif op == "any":
            e.line(f"{out} = (tl.reduce({values}.to(tl.int32), 1, _add) > 0)[:, None]")
        elif op == "all":
            e.line(f"{out} = (tl.reduce(({values} == 0).to(tl.int32), 1, _add) == 0)[:, None]")
        else:
            combine = "_argmax_combine" if op == "argmax" else "_argmin_combine"
            e.line(f"_, {out} = tl.reduce(({values}, {index}), 1, {combine})")
            e.line(f"{out} = {out}[:, None]")
        e.define(name, out, frozenset("x"), _result_dtype(op, self.graph.nodes[name]))

    def reduce_persistent(self, name: str, tile: Scope) -> None:
        node = self.graph.nodes[name]
        masked = self.e.tmp("m")
        if self.r.numel == 0:
            # A row of no elements reduces to the identity, and its body is not
            # evaluated: an index into an empty buffer collapses to a constant
            # (``ix.unflatten_index``), so a load of it would not be masked by
            # the (all-false) ``rmask`` and would read past the buffer.
            dtype = torch.bool if node.reduce_op in ("any", "all") else node.body.dtype
            start = neutral(node.reduce_op, dtype)
            self.e.line(f"{masked} = {full_text(start, dtype, '[XBLOCK, RBLOCK]')}")
        else:
            value, dtype = self.body_value(name, tile)
            if node.reduce_op in ("any", "all"):
                value = f"({value} != 0)"
            self.e.line(f"{masked} = {self.masked(value, node.reduce_op, dtype)}")
        index = "(r + rzero + xzero)" if node.reduce_op in ("argmax", "argmin") else None
        self.finish(name, node.reduce_op, masked, index)

    def reduce_loop(self, names: list[str], rows: Scope) -> None:
        e = self.e
        accs = {}
        for name in names:
            node = self.graph.nodes[name]
            dtype = node.body.dtype if node.reduce_op not in ("any", "all") else torch.bool
            acc = e.tmp("acc")
            start = neutral(node.reduce_op, dtype)
            e.line(f"{acc} = {full_text(start, dtype, '[XBLOCK, RBLOCK]')}")
            idx = None
            if node.reduce_op in ("argmax", "argmin"):
                idx = e.tmp("acci")
                e.line(f"{idx} = tl.full([XBLOCK, RBLOCK], {2**31 - 1}, tl.int32)")
            accs[name] = (acc, idx, dtype)
        tile = self.open_loop(rows)
        for name in names:
            op = self.graph.nodes[name].reduce_op
            acc, idx, dtype = accs[name]
            value, _ = self.body_value(name, tile)
            if op in ("any", "all"):
                value = f"({value} != 0)"
            v = e.tmp("m")
            e.line(f"{v} = {self.masked(value, op, dtype)}")
            update = {
                "sum": f"{acc} + {v}",
                "prod": f"{acc} * {v}",
                "max": f"_maximum({acc}, {v})",
                "min": f"_minimum({acc}, {v})",
                "any": f"{acc} | {v}",
                "all": f"{acc} & {v}",
            }
            if op in update:
                e.line(f"{acc} = {update[op]}")
            else:
                combine = "_argmax_combine" if op == "argmax" else "_argmin_combine"
                e.line(f"{acc}, {idx} = {combine}({acc}, {idx}, {v}, r + rzero + xzero)")
        e.indent -= 1
        for name in names:
            acc, idx, _ = accs[name]
            self.finish(name, self.graph.nodes[name].reduce_op, acc, idx)

    def stored_per_row(self, node: Node) -> bool:
        """Whether pointwise ``node`` is stored once per row (its shape is
        the rows', or a ``keepdim`` form of them) rather than over the tile."""
        if node.shape == self.rows:
            return True
        return node.shape not in self.tiles and is_row_shape(node.shape, self.rows)

    def store_rows(self, scope: Scope) -> None:
        e, row_index = self.e, ix.out_symbols(len(self.rows))
        ranges = ix.symbol_ranges(self.rows, self.rshape)
        for name in self.group.stored:
            node = self.graph.nodes[name]
            if node.kind == "reduction":
                e.store(name, row_index, e.computed[name], scope, frozenset("x"))
            elif self.stored_per_row(node):
                index = (
                    row_index
                    if node.shape == self.rows
                    else row_position(self.rows, node.shape, ranges)
                )
                value = e.emit(e.inliner.value(name, index), scope)
                e.store(name, index, value, scope, frozenset("x"))

    def store_full(self, name: str, tile: Scope) -> None:
        # The tile itself, or the order in which the group's reductions read this shape.
        index = self.tiles[self.graph.nodes[name].shape]
        if self.r.numel == 0:
            # No elements, so no values computed (see ``reduce_persistent``): a
            # store with every lane masked off keeps the buffer this kernel's output.
            value = literal(0, self.graph.nodes[name].dtype)
        else:
            value = self.e.emit(self.e.inliner.value(name, index), tile)
        self.e.store(name, index, value, tile, frozenset("xr"))


def _result_dtype(op: str, node) -> torch.dtype:
    if op in ("argmax", "argmin"):
        return torch.int32
    if op in ("any", "all"):
        return torch.bool
    return node.body.dtype
