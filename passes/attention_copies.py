"""Attention reading keys and values through copies: GQA's repeated heads indexed.

Models written for attention without grouped-query support give each query
head its own copy of the key/value head it shares.  transformers'
``repeat_kv`` is

    k[:, :, None].expand(b, kv_heads, G, n, e).reshape(b, kv_heads * G, n, e)

and the reshape of the expanded view is a copy: a pointwise node of G
times the cache's size whose value at head ``h`` is the cache's at head
``h // G``.  An attention reading the copy reads a different buffer
position for each query head, so its kernel cannot tell that ``G`` heads
share their keys and values.

This pass (after ``attention_cache``, before the split) rewrites an
attention's K and V operands that are loads of such a copy (a pointwise
node whose value is a load of another buffer, of the same dtype, through
views; copies of copies too) into loads of the buffer copied:
``k[i0, i1 // G, r0, r1]``, the form grouped-query attention has when it
is indexed (``enable_gqa``).  Its kernel then loads a key/value head once
for the ``G`` query heads of one program (``attention.head_group``), and a
copy that nothing else reads is removed.  The output and the log-sum-exp
node of one attention are rewritten alike (a kernel holds the two only
with the same inputs and body).  The values read are the same, so the IR
interpreter computes the same graph.
"""

from __future__ import annotations

import dataclasses

import sympy

from tilec import index as ix
from tilec.attention import BODY, head_group, parts
from tilec.inline import BufferLoad, Inliner
from tilec.ir import Call, Graph, Load, Node, map_loads, walk
from tilec.passes.attention_cache import rewrite_attentions


def read_through_copies(graph: Graph, enabled: bool = True) -> tuple[Graph, dict[str, int]]:
    """``graph`` with attention reading its keys and values from the
    buffers they are copies of (see the module docstring)."""
    if not enabled:
        return graph, {"attention_copies_read_through": 0}
    out, found = rewrite_attentions(graph, _rewrite)
    return out, {"attention_copies_read_through": found}


def _rewrite(graph: Graph, node: Node) -> tuple[tuple[str, ...], Call] | None:
    """(inputs, body) of attention ``node`` with its K and V loads of copies
    reading the buffers copied; None where that shows no more query heads
    sharing their keys and values (:func:`~tilec.attention.head_group`)."""
    p = parts(node)
    ranges = ix.symbol_ranges(node.shape, node.reduce_shape)
    names = list(node.inputs)  # the inputs, then the buffers copied
    operands = {}
    for which, load in (("k", p.k), ("v", p.v)):
        operands[which] = load
        if not isinstance(load, Load) or load.mask is not None:
            continue  # an expression (a cache update read, attention_cache)
        copies = _copies(graph, names[load.src])
        if not copies:
            continue
        inliner = Inliner(graph, copies, ranges)
        value = inliner.value(names[load.src], load.index)
        if not isinstance(value, BufferLoad) or value.mask is not None or inliner.bindings:
            continue
        if value.buffer not in names:
            names.append(value.buffer)
        operands[which] = Load(names.index(value.buffer), value.index, load.dtype)
    value = operands["v"]
    if isinstance(value, Load) and ix.out_symbols(4)[3] not in value.index:
        return None  # V's columns not one dimension of what it copies
    body = Call(BODY, (p.q, operands["k"], operands["v"], *node.body.args[3:]), node.body.dtype)
    # The inputs still read, in their order: the copies no more.
    read = sorted({x.src for x in walk(body) if isinstance(x, Load)})
    renumber = {old: new for new, old in enumerate(read)}
    body = map_loads(body, lambda x: dataclasses.replace(x, src=renumber[x.src]))
    inputs = tuple(names[k] for k in read)
    # Only where it shows heads sharing their keys and values: elsewhere
    # the copy is a layout (a transpose made contiguous), left as it is.
    shared = dataclasses.replace(node, inputs=inputs, body=body)
    return (inputs, body) if head_group(shared) > head_group(node) else None


def _copies(graph: Graph, name: str) -> set[str]:
    """The copies buffer ``name`` is read through: the pointwise nodes under
    its views whose body is one unmasked load of their own dtype, and the
    copies that one reads through in turn."""
    found: set[str] = set()
    while True:
        node = graph.nodes[name]
        while node.kind == "view":
            node = graph.nodes[node.inputs[0]]
        body = node.body
        copy = (
            node.kind == "pointwise"
            and isinstance(body, Load)
            and body.mask is None
            and body.dtype == node.dtype
            and all(isinstance(c, sympy.Expr) for c in body.index)
        )
        if not copy:
            return found
        found.add(node.name)
        name = node.inputs[body.src]
