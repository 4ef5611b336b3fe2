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
once.  Sums of floats accumulate their partials in float32.

Which reductions: ``sum``, ``prod``, ``max``, ``min``, ``any`` and ``all``
(a variance is two sums after decomposition; ``argmax``/``argmin`` need
the partial's position too and are not split yet), with static sizes, a
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

OPS = ("sum", "prod", "max", "min", "any", "all")
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
            splits = _best_splits(graph, node, target)
            if splits > 1:
                replaced[node.name] = _split(graph, node, splits)
    if not replaced:
        return graph, {"split_reductions": 0}
    nodes = [n for node in graph.nodes.values() for n in replaced.get(node.name, [node])]
    return graph.replace_nodes(nodes), {"split_reductions": len(replaced)}


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
    best, best_s = cost.kernel(target, read + out, programs=rows).seconds, 1
    splits = 2
    while rows * splits <= 2 * target.sm_count and k0 // splits * inner >= MIN_CHUNK:
        if k0 % splits == 0:
            partials = rows * splits * 4
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
    floats = node.dtype.is_floating_point and node.reduce_op in ("sum", "prod")
    partial = Node(
        graph.fresh_name(f"{node.name}_partial"),
        "reduction",
        (*node.shape, splits),
        torch.float32 if floats else node.dtype,
        node.inputs,
        shifted(node.body, shift),
        reduce_op=node.reduce_op,
        reduce_shape=(chunk, *rest),
    )
    total = Node(
        node.name,
        "reduction",
        node.shape,
        node.dtype,
        (partial.name,),
        Load(0, (*ix.out_symbols(rank), r0), partial.dtype),
        reduce_op=node.reduce_op,
        reduce_shape=(splits,),
        stride=node.stride,
    )
    return [partial, total]


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
