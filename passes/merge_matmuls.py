"""Merge sibling linear layers into one matmul.

Matmuls ``x @ W_i.t()`` that read the same input ``x`` (the same views of
one node) and ``[N_i, K]`` weights of one kind (LLaMA's q, k and v
projections; an MLP's gate and up projections) become one matmul
``x @ W.t()`` over the weights concatenated along their output channels,
``W = cat(W_i)``; each former product is a slice of the merged one's
columns, under its old name.  A weight is a constant (a frozen parameter)
or the quantization pass's dequantization of constants: then its constants
are concatenated (int8 values and scales per output channel, int4 packed
values and scales per group of input features: each row stays its own), and
one dequantization of the same expression reads them.  Runs after
quantization, so each layer is quantized, and reported, alone.

A decode step streams every weight once either way; merged, it does so in
one launch instead of several, and a product of few rows over
``N_q + N_k + N_v`` columns has enough column tiles to fill the SMs where
``N_k``'s 256 alone do not (``compiler/cost.fill``).

A weight stays alone when anything other than its matmul reads it (or its
constants), or when its product is a graph output.  Merged constants are
named by their parameters joined with ``+`` (``Graph.constant_names``).
The pass's count is ``merged_matmuls`` (matmuls removed); its dump shows
the merged nodes.
"""

from __future__ import annotations

import dataclasses

import torch

from tilec import index as ix
from tilec.ir import Arg, Graph, Node, View

aten = torch.ops.aten


def merge_matmuls(graph: Graph, enabled: bool = True) -> tuple[Graph, dict[str, int]]:
    """``graph`` with sibling matmuls over constant weights merged (module docstring)."""
    siblings: dict[tuple, list[tuple[Node, Node]]] = {}
    if enabled:
        users = graph.users()
        for node in graph.nodes.values():
            weight = _weight(graph, node, users)
            if weight is not None:
                key = (_viewed(graph, node.inputs[0]), weight.shape[1], *_kind(graph, weight))
                siblings.setdefault(key, []).append((node, weight))
    groups = [g for g in siblings.values() if len(g) > 1]
    if not groups:
        return graph, {"merged_matmuls": 0}
    taken: set[str] = set()
    replaced: dict[str, list[Node]] = {}
    constants = dict(graph.constants)
    names = dict(graph.constant_names)

    def concatenated(parts: list[Node]) -> Node:
        """A constant: ``parts`` (constants) concatenated along dimension 0."""
        value = torch.cat([graph.constants[p.name] for p in parts]).contiguous()
        name = graph.fresh_name(f"{parts[0].name}_merged", taken)
        constants[name] = value
        names[name] = "+".join(graph.constant_names.get(p.name, p.name) for p in parts)
        return Node(name, "constant", tuple(value.shape), value.dtype, stride=value.stride())

    for group in groups:
        (first, weight), *_ = group
        weights = [w for _, w in group]
        columns, k = sum(w.shape[0] for w in weights), weight.shape[1]
        if weight.kind == "constant":
            merged = concatenated(weights)
            new = [merged]
        else:  # a dequantization of constants: its constants concatenated, one by one
            parts = [
                concatenated([graph.nodes[w.inputs[i]] for w in weights])
                for i in range(len(weight.inputs))
            ]
            merged = dataclasses.replace(
                weight,
                name=graph.fresh_name(f"{weight.name}_merged", taken),
                shape=(columns, k),
                inputs=tuple(p.name for p in parts),
                stride=ix.contiguous_strides((columns, k)),
            )
            new = [*parts, merged]
        transposed = graph.fresh_name(f"{merged.name}_t", taken)
        product = graph.fresh_name(f"{first.name}_merged", taken)
        rows = first.shape[0]
        new += [
            Node(
                transposed,
                "view",
                (k, columns),
                merged.dtype,
                (merged.name,),
                view=View("permute", ((1, 0),)),
            ),
            dataclasses.replace(
                first,
                name=product,
                shape=(rows, columns),
                inputs=(first.inputs[0], transposed),
                stride=ix.contiguous_strides((rows, columns)),
            ),
        ]
        start = 0
        for i, (mm, w) in enumerate(group):
            view = View("slice", (1, start, 1))
            sliced = Node(mm.name, "view", mm.shape, mm.dtype, (product,), view=view)
            replaced[mm.name] = (new if i == 0 else []) + [sliced]
            start += w.shape[0]
    nodes = [n for node in graph.nodes.values() for n in replaced.get(node.name, [node])]
    out = graph.replace_nodes(nodes)
    out.constants = {k: v for k, v in constants.items() if k in out.nodes}
    out.constant_names = {k: v for k, v in names.items() if k in out.nodes}
    removed = sum(len(g) - 1 for g in groups)
    return out, {"merged_matmuls": removed}


def _viewed(graph: Graph, name: str) -> tuple:
    """What node ``name`` is: its base and the views on the way (two views
    of the same base by the same ops are the same tensor)."""
    node = graph.nodes[name]
    chain: list[tuple] = []
    while node.kind == "view":
        chain.append((node.view, node.shape))
        node = graph.nodes[node.inputs[0]]
    return node.name, tuple(chain)


def _weight(graph: Graph, node: Node, users: dict[str, list[str]]) -> Node | None:
    """The constant ``[N, K]`` weight that matmul ``node`` reads as ``W.t()``
    (``x @ W.t()``, 2-D), where only that matmul reads it, or None."""
    if node.kind != "extern" or node.extern.target is not aten.mm.default:
        return None
    if node.extern.args != (Arg(0), Arg(1)) or node.extern.kwargs or node.name in graph.outputs:
        return None
    operand = graph.nodes[node.inputs[1]]
    if (
        operand.kind != "view"
        or operand.view.op != "permute"
        or tuple(operand.view.args[0]) != (1, 0)
    ):
        return None
    weight = graph.nodes[operand.inputs[0]]
    if (
        len(weight.shape) != 2
        or users[weight.name] != [operand.name]
        or users[operand.name] != [node.name]
    ):
        return None
    if weight.kind == "constant":
        return weight
    if weight.kind != "pointwise" or not weight.inputs:
        return None
    # A dequantization: of constants with a row per output channel, read by it alone.
    sources = [graph.nodes[i] for i in weight.inputs]
    if any(s.kind != "constant" or not s.shape or s.shape[0] != weight.shape[0] for s in sources):
        return None
    if any(users[s.name] != [weight.name] for s in sources):
        return None
    return weight


def _kind(graph: Graph, weight: Node) -> tuple:
    """What must agree for weights to be merged: dtype, and for a
    dequantization its expression and its constants' dtypes and trailing sizes."""
    if weight.kind == "constant":
        return (weight.dtype,)
    sources = tuple((graph.nodes[i].dtype, graph.nodes[i].shape[1:]) for i in weight.inputs)
    return weight.dtype, weight.body, sources
