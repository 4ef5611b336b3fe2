"""Split reductions with too few rows to fill the GPU.

A reduction kernel runs its rows on its programs: a loss (one row), a
gradient's norm, LayerNorm's weight gradient summed over batch x sequence
(a few hundred rows of some thousands of elements) runs on a handful of an
H100's 132 SMs, streaming its input at a few percent of the bandwidth
(``compiler/cost.fill``).  This pass splits such a reduction over its first
reduced dimension ``K0`` into ``S`` chunks: the node ``(rows...)`` over
``(K0, ...)`` becomes a partial reduction ``(rows..., S)`` over
``(K0 / S, ...)`` (chunk ``s`` reads ``k0 = s * K0/S + r0``), and the same
reduction over the ``S`` partials under the node's name, which fusion puts
in one small kernel with what reads it.  Each input element is still read
once.  Sums of floats accumulate their partials in float32.  An
``argmax`` (``argmin``) chunk keeps its position ``p`` and its maximum
(minimum) as two partials, which fusion computes in one kernel; the second
kernel takes the argmax ``s`` of the chunks' maxima (the first on a tie,
so the first position overall, as torch's; a NaN counts as the maximum in
both) and gives ``s * chunk + p[s]``, ``chunk`` elements per chunk.

Which reductions: ``sum``, ``prod``, ``max``, ``min``, ``any``, ``all``,
``argmax`` and ``argmin`` (a variance is two sums after decomposition), with
static sizes, a
body of loads, constants, index expressions and scalar ops, and ``K0``
divisible by ``S`` into chunks of at least :data:`MIN_CHUNK` elements.  ``S`` is
the power of two, up to filling twice the target's SMs with rows x S
programs, that the cost model predicts fastest, counting the second
kernel; nothing is split where it predicts no gain, nor on a target
without figures (the interpreter): CPU programs keep their kernels.  The
pass's count is ``split_reductions``.
"""

from __future__ import annotations

import math

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.ir import Call, Const, Expr, Graph, Index, Load, Node
from tilec.target import Target

OPS = ("sum", "prod", "max", "min", "any", "all", "argmax", "argmin")
# An arg-reduction's partial maxima (minima): the value op of each.
VALUE_OPS = {"argmax": "max", "argmin": "min"}
# Fewest elements per chunk: below this the partials' traffic and the
# second kernel outweigh what more programs win.
MIN_CHUNK = 1024


def split_reductions(graph: Graph, target: Target) -> tuple[Graph, dict[str, int]]:
    """``graph`` with few-row reductions split (module docstring)."""
    if not cost.has_figures(target):
        return graph, {"split_reductions": 0}
    replaced: dict[str, list[Node]] = {}
    for node in graph.nodes.values():
        if _candidate(node):
            nodes = _split_node(graph, node, target)
            if nodes:
                replaced[node.name] = nodes
    if not replaced:
        return graph, {"split_reductions": 0}
    nodes = [n for node in graph.nodes.values() for n in replaced.get(node.name, [node])]
    return graph.replace_nodes(nodes), {"split_reductions": len(replaced)}


def _split_node(graph: Graph, node: Node, target: Target) -> list[Node] | None:
    """``node``'s replacement, split where the cost model predicts a gain
    (None: kept whole).  Where the first reduced dimension is too short to
    fill the target's SMs even in chunks of one (a loss over
    ``(batch, sequence, vocabulary)`` logits, reduced over 8 x 1024 x
    50257, splits at most 8 ways over ``batch``), the partials keep it whole
    as their rows and the next reduced dimension is split: ``(K0, K1, ...)``
    becomes ``K0 x S`` partials over ``(K1 / S, ...)``."""
    rows, (k0, *rest) = math.prod(node.shape), node.reduce_shape
    if rest and node.reduce_op not in VALUE_OPS and rows * k0 < 2 * target.sm_count:
        partial = _keep_first(graph, node)
        inner = _split_node(graph, partial, target) if _candidate(partial) else None
        if inner:
            # One reduction of the innermost partials over all their extra
            # dimensions (K0 x S), in place of the partials' own reduction.
            *first, last = inner
            (innermost,) = (n for n in first if n.name == last.inputs[0])
            return [*first, _total(node, innermost)]
    splits = _best_splits(graph, node, target)
    return _split(graph, node, splits) if splits > 1 else None


def _keep_first(graph: Graph, node: Node) -> Node:
    """Partials ``(rows..., K0)`` over the reduced dimensions after the first."""
    rank = len(node.shape)
    k0, *rest = node.reduce_shape
    symbols = ix.reduce_symbols(len(node.reduce_shape))
    # r0 becomes the partials' last dimension; r1, r2, ... become r0, r1, ...
    rename = {symbols[0]: ix.out_symbols(rank + 1)[rank]}
    rename.update(zip(symbols[1:], symbols))
    return _partial(graph, node, k0, shifted(node.body, rename), tuple(rest))


def _partial(graph: Graph, node: Node, count: int, body: Expr, reduce_shape: tuple) -> Node:
    """``node``'s reduction of ``body`` over ``reduce_shape`` for each of
    ``count`` parts: float sums and products accumulate in float32."""
    floats = node.dtype.is_floating_point and node.reduce_op in ("sum", "prod")
    return Node(
        graph.fresh_name(f"{node.name}_partial"),
        "reduction",
        (*node.shape, count),
        torch.float32 if floats else node.dtype,
        node.inputs,
        body,
        reduce_op=node.reduce_op,
        reduce_shape=reduce_shape,
    )


def _total(node: Node, partial: Node) -> Node:
    """The reduction of ``partial`` over its dimensions after ``node``'s
    (the chunks) under ``node``'s name."""
    rank = len(node.shape)
    extra = partial.shape[rank:]
    return Node(
        node.name,
        "reduction",
        node.shape,
        node.dtype,
        (partial.name,),
        Load(0, (*ix.out_symbols(rank), *ix.reduce_symbols(len(extra))), partial.dtype),
        reduce_op=node.reduce_op,
        reduce_shape=tuple(extra),
        stride=node.stride,
    )


def _candidate(node: Node) -> bool:
    if node.kind != "reduction" or node.reduce_op not in OPS or not node.reduce_shape:
        return False
    if not all(isinstance(s, int) for s in (*node.shape, *node.reduce_shape)):
        return False
    return _movable(node.body)


def _movable(e: Expr | None) -> bool:
    """Whether the body is made of what :func:`shifted` rewrites."""
    if isinstance(e, Load):
        return all(isinstance(c, sympy.Basic) or _movable(c) for c in e.index) and (
            e.mask is None or _movable(e.mask)
        )
    if isinstance(e, Call):
        return all(_movable(a) for a in e.args)
    return isinstance(e, (Const, Index))


def _best_splits(graph: Graph, node: Node, target: Target) -> int:
    """The number of chunks the cost model predicts fastest (1: no split)."""
    rows = math.prod(node.shape)
    k0 = node.reduce_shape[0]
    inner = math.prod(node.reduce_shape[1:])  # elements per step of k0
    read = sum(int(graph.nodes[i].nbytes) for i in node.inputs)
    out = rows * node.dtype.itemsize
    # Bytes of one partial: float32 for float sums; a position and a value
    # for an arg-reduction.
    partial_size = 4
    if node.reduce_op in VALUE_OPS:
        partial_size = node.dtype.itemsize + node.body.dtype.itemsize
    best, best_s = cost.kernel(target, read + out, programs=rows).seconds, 1
    splits = 2
    while rows * splits <= 2 * target.sm_count and k0 // splits * inner >= MIN_CHUNK:
        if k0 % splits == 0:
            partials = rows * splits * partial_size
            seconds = (
                cost.kernel(target, read + partials, programs=rows * splits).seconds
                + cost.kernel(target, partials + out, programs=math.ceil(rows / 1024)).seconds
            )
            if seconds < best:
                best, best_s = seconds, splits
        splits *= 2
    return best_s


def _split(graph: Graph, node: Node, splits: int) -> list[Node]:
    """The partial reduction over ``splits`` chunks of the first reduced
    dimension, and the reduction of the partials under ``node``'s name."""
    rank = len(node.shape)
    k0, *rest = node.reduce_shape
    chunk = k0 // splits
    (r0,) = ix.reduce_symbols(1)
    chunk_of = ix.out_symbols(rank + 1)[rank]  # the partials' last dimension
    shift = {r0: chunk_of * chunk + r0}
    partial = _partial(graph, node, splits, shifted(node.body, shift), (chunk, *rest))
    if node.reduce_op in VALUE_OPS:
        return _split_arg(graph, node, partial, chunk * math.prod(rest))
    return [partial, _total(node, partial)]


def _split_arg(graph: Graph, node: Node, position: Node, chunk: int) -> list[Node]:
    """An arg-reduction split: ``position`` (each chunk's own position), the
    chunks' maxima (minima), the chunk holding the answer, and the position
    overall under ``node``'s name (module docstring); ``chunk`` elements
    per chunk."""
    rank = len(node.shape)
    out = ix.out_symbols(rank)
    (r0,) = ix.reduce_symbols(1)
    value = Node(
        graph.fresh_name(f"{node.name}_partial_value"),
        "reduction",
        position.shape,
        node.body.dtype,
        position.inputs,
        position.body,
        reduce_op=VALUE_OPS[node.reduce_op],
        reduce_shape=position.reduce_shape,
    )
    best = Node(
        graph.fresh_name(f"{node.name}_chunk"),
        "reduction",
        node.shape,
        torch.int64,
        (value.name,),
        Load(0, (*out, r0), value.dtype),
        reduce_op=node.reduce_op,
        reduce_shape=(position.shape[-1],),
    )
    s = Load(0, out, torch.int64)
    start = Call("mul", (s, Const(chunk, torch.int64)), torch.int64)
    within = Load(1, (*out, s), torch.int64)
    total = Node(
        node.name,
        "pointwise",
        node.shape,
        node.dtype,
        (best.name, position.name),
        Call("add", (start, within), torch.int64),
        stride=node.stride,
    )
    return [position, value, best, total]


def shifted(e: Expr, shift: dict) -> Expr:
    """Body ``e`` with its index symbols replaced by ``shift`` (symbol ->
    expression), in loads, their masks and index expressions."""
    if isinstance(e, Load):
        index = tuple(
            sympy.sympify(c).xreplace(shift) if isinstance(c, sympy.Basic) else shifted(c, shift)
            for c in e.index
        )
        mask = None if e.mask is None else shifted(e.mask, shift)
        return Load(e.src, index, e.dtype, mask)
    if isinstance(e, Call):
        return Call(e.op, tuple(shifted(a, shift) for a in e.args), e.dtype)
    if isinstance(e, Index):
        return Index(sympy.sympify(e.expr).xreplace(shift), e.dtype)
    return e
