"""Attention that reads a cache update without waiting for it: decode with a static KV cache.

A decode step with a static cache writes the new key and value into the
cache (``cache.index_copy_(2, pos, k)``: a scatter of one position along the
key axis, stored into the cache input in place, ``passes/in_place.py``) and
then attends over the cache.  As written, attention reads the scatter's
result, so it waits for the scatter's kernel, which also computes the
rotary embedding of q and k: a launch per layer between the q/k/v product
and attention.

This pass (after the SDPA routing, before the split) rewrites the operands
of such an attention so that it computes them itself:

* a key or value read from a one-position scatter is read as
  ``where(n == pos, value, base[n])``: the new entry from the scatter's own
  value expression, every other position from the cache input (its old
  value, which the scatter leaves unchanged there);
* the pointwise producers of q and of those values (the rotary embedding,
  its cos/sin tables, casts) are inlined, down to buffers that other
  kernels compute (the q/k/v product) or inputs.

Attention then needs nothing of the scatter's kernel; the in-place pass
orders it before the scatter (it reads the old cache), and the scatter's
kernel, which nothing in the layer waits for, can share a launch with the
split-KV combine (``passes/combine.py``).  The scatter still writes the
cache.  The inlined producers are computed again in attention (for the new
entry, once per key tile: one row of a head).

Done only where every key/value operand read from a scatter matches (a
scatter of one position along one axis into a graph input, the other
dimensions its own), the producers to inline are pointwise and no larger
than q (a decode step's rows: a prefill's scatter writes many positions
and is left alone), and nothing read depends on the scatter; otherwise the
attention is left as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy
import torch

from tilec import index as ix
from tilec.attention import ATTENTION, BODY, LOGSUMEXP
from tilec.attention import parts as attention_parts
from tilec.inline import Bound, BufferLoad, InlinedExpr, Inliner, buffer_loads
from tilec.ir import AT, CHECK_INDEX, Call, Expr, Graph, Index, Load, Node
from tilec.passes.dce import dce

# Pointwise producers inlined into one attention at most (a rotary
# embedding with its tables is about a dozen).
MAX_INLINED = 48


def read_cache_updates(graph: Graph, enabled: bool = True) -> tuple[Graph, dict[str, int]]:
    """``graph`` with attention reading one-position cache updates from the
    cache input and the update's value (see the module docstring)."""
    if not enabled:
        return graph, {"attention_cache_reads": 0}
    out, found = rewrite_attentions(graph, _rewrite)
    return out, {"attention_cache_reads": found}


Rewrite = Callable[[Graph, Node], "tuple[tuple[str, ...], Call] | None"]


def rewrite_attentions(graph: Graph, rewrite: Rewrite) -> tuple[Graph, int]:
    """``graph`` with each attention's output and log-sum-exp nodes given
    the (inputs, body) ``rewrite`` returns for them (None: left as they
    are), alike for the two (a kernel holds them only with the same inputs
    and body), and what no longer has a reader removed; and how many
    attentions were rewritten."""
    rewritten: dict[tuple, tuple[tuple[str, ...], Call] | None] = {}
    nodes, found = [], 0
    for node in graph.nodes.values():
        if node.kind == "reduction" and node.reduce_op in (ATTENTION, LOGSUMEXP):
            key = (node.inputs, node.body)
            if key not in rewritten:
                rewritten[key] = rewrite(graph, node)
                found += rewritten[key] is not None
            if rewritten[key] is not None:
                inputs, body = rewritten[key]
                node = dataclasses.replace(node, inputs=inputs, body=body)
        nodes.append(node)
    if not found:
        return graph, 0
    out, _ = dce(graph.replace_nodes(nodes))
    return out, found


def _rewrite(graph: Graph, node: Node) -> tuple[tuple[str, ...], Call] | None:
    """(inputs, body) of attention ``node`` reading its cache updates, or
    None where it reads none or the rewrite does not apply."""
    p = attention_parts(node)
    sizes = (*node.shape, *node.reduce_shape)
    if p.blocks is not None or p.chunk is not None or not all(isinstance(s, int) for s in sizes):
        return None
    ranges = ix.symbol_ranges(node.shape, node.reduce_shape)
    plain = Inliner(graph, set(), ranges)
    scatters: dict[str, tuple[Node, tuple]] = {}
    for which, load in (("k", p.k), ("v", p.v)):
        value = plain.value(node.inputs[load.src], load.index)
        if isinstance(value, BufferLoad) and graph.nodes[value.buffer].kind == "scatter":
            scatters[which] = (graph.nodes[value.buffer], value.index)
    if not scatters or plain.bindings:
        return None
    # q's size: the most each inlined producer may have (a decode step's rows).
    limit = ix.numel(node.shape[:3]) * node.reduce_shape[1]
    roots = [node.inputs[p.q.src]] + [i for s, _ in scatters.values() for i in s.inputs[1:]]
    inline = _pointwise_producers(graph, roots, limit)
    if inline is None:
        return None
    inliner = Inliner(graph, inline, ranges)
    operands: dict[str, InlinedExpr] = {"q": inliner.value(node.inputs[p.q.src], p.q.index)}
    for which, (scatter, index) in scatters.items():
        read = _read_through(graph, inliner, scatter, index)
        if read is None:
            return None
        operands[which] = read
    for which, expr in (("k", p.k), ("v", p.v), ("score", p.score), ("mask", p.mask)):
        if which not in operands:  # as it was, over the inputs' buffers
            operands[which] = plain.body(dataclasses.replace(node, body=expr), {})
    if inliner.bindings or plain.bindings:
        return None  # an index read from data
    after = graph.computed_from(s.name for s, _ in scatters.values())
    for load in (load for value in operands.values() for load in buffer_loads(value)):
        if graph.nodes[load.buffer].kind in ("pointwise", "scatter") or load.buffer in after:
            return None  # a producer not inlined, or one that waits for the scatter
    inputs: list[str] = []

    def convert(e: InlinedExpr) -> Expr:
        if isinstance(e, BufferLoad):
            if e.buffer not in inputs:
                inputs.append(e.buffer)
            mask = None if e.mask is None else convert(e.mask)
            return Load(inputs.index(e.buffer), e.index, e.dtype, mask)
        if isinstance(e, Call):
            return Call(e.op, tuple(convert(a) for a in e.args), e.dtype)
        assert not isinstance(e, Bound)  # bindings were refused above
        return e

    q, k, v, score, mask = (convert(operands[w]) for w in ("q", "k", "v", "score", "mask"))
    body = Call(BODY, (q, k, v, score, mask, p.empty), node.body.dtype)
    return tuple(inputs), body


def _read_through(
    graph: Graph, inliner: Inliner, scatter: Node, index: tuple
) -> InlinedExpr | None:
    """Scatter ``scatter``'s value at ``index`` (its shape's) without reading
    it: ``where(index[k] == pos, value, base[index])`` for a scatter that
    stores one position ``pos`` along dimension ``k`` of a graph input and
    every position of its other dimensions as itself; None for another."""
    base = graph.nodes[scatter.inputs[0]]
    body = scatter.body
    if base.kind != "input" or not (isinstance(body, Call) and body.op == AT):
        return None
    value, *position = body.args
    update = ix.out_symbols(len(scatter.update_shape))
    subst: dict[sympy.Symbol, sympy.Expr] = {}
    axis = None
    for d, (c, size, count) in enumerate(zip(position, scatter.shape, scatter.update_shape)):
        own = isinstance(c, Index) and sympy.sympify(c.expr) == update[d]
        if own and count == size:
            subst[update[d]] = index[d]
        elif count == 1 and axis is None:
            axis, subst[update[d]] = d, sympy.Integer(0)
        else:
            return None
    if axis is None:
        return None
    at = inliner.body(dataclasses.replace(scatter, body=_unchecked(position[axis])), subst)
    new = inliner.body(dataclasses.replace(scatter, body=value), subst)
    if new.dtype != scatter.dtype:
        new = Call("cast", (new,), scatter.dtype)
    here = Call("eq", (Index(index[axis], torch.int64), at), torch.bool)
    return Call("where", (here, new, inliner.value(base.name, index)), scatter.dtype)


def _unchecked(e: Expr) -> Expr:
    """``e`` without its index checks: the position only selects the new
    entry here (the scatter's kernel checks it and raises)."""
    if isinstance(e, Call):
        if e.op == CHECK_INDEX:
            return _unchecked(e.args[0])
        return Call(e.op, tuple(_unchecked(a) for a in e.args), e.dtype)
    return e


def _pointwise_producers(graph: Graph, roots: list[str], limit: int) -> set[str] | None:
    """The pointwise nodes the buffers ``roots`` are computed from, through
    views and pointwise nodes; None if one is larger than ``limit``
    elements or there are more than :data:`MAX_INLINED`."""
    found: set[str] = set()
    todo = list(roots)
    while todo:
        node = graph.nodes[todo.pop()]
        while node.kind == "view":
            node = graph.nodes[node.inputs[0]]
        if node.kind != "pointwise" or node.name in found:
            continue
        if len(found) == MAX_INLINED or ix.numel(node.shape) > limit:
            return None
        found.add(node.name)
        todo += node.inputs
    return found
