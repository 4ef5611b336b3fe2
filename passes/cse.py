"""Common-subexpression elimination."""

from __future__ import annotations

import dataclasses

from tilec.ir import Graph, Node, is_random


def cse(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Merge nodes that compute the same thing from the same inputs.

    Two nodes are the same when everything but their name is equal (the IR is
    plain data, so that is dataclass equality).  Fallback calls are merged too:
    functional ATen ops are deterministic except random ones, which are kept.
    Does nothing when no two nodes agree.
    """
    rename: dict[str, str] = {}
    seen: dict[Node, str] = {}
    kept: list[Node] = []
    for node in graph.nodes.values():
        node = dataclasses.replace(node, inputs=tuple(rename.get(i, i) for i in node.inputs))
        if node.kind in ("input", "constant") or is_random(node):
            kept.append(node)
            continue
        key = dataclasses.replace(node, name="")
        if key in seen:
            rename[node.name] = seen[key]
            continue
        seen[key] = node.name
        kept.append(node)
    outputs = [rename.get(o, o) for o in graph.outputs]
    return graph.replace_nodes(kept, outputs), {"merged": len(rename)}
