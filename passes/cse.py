"""Common-subexpression elimination."""

from __future__ import annotations

import dataclasses

from tilec.ir import Graph, Node, is_random


def cse(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Merge nodes that compute the same thing from the same inputs.

    Two nodes are the same when everything but their name and layout is
    equal (the IR is plain data, so that is dataclass equality), and their
    layouts agree: equal, or one of them free (``stride`` None, which the
    layout pass chooses).  A free node merged into one whose layout is
    fixed (a graph output keeps eager's) reads that layout; a fixed node
    merged into a free one fixes it.  ``x.sum(-1)`` returned beside
    ``x.std(-1)``, whose mean sums the same row, is one reduction.
    Fallback calls are merged too: functional ATen ops are deterministic
    except random ones, which are kept.  Does nothing when no two nodes
    agree.
    """
    rename: dict[str, str] = {}
    seen: dict[Node, int] = {}  # a node less its name and layout -> where it is in kept
    kept: list[Node] = []
    for node in graph.nodes.values():
        node = dataclasses.replace(node, inputs=tuple(rename.get(i, i) for i in node.inputs))
        if node.kind in ("input", "constant") or is_random(node):
            kept.append(node)
            continue
        key = dataclasses.replace(node, name="", stride=None)
        first = kept[seen[key]] if key in seen else None
        if first is not None and (
            first.stride is None or node.stride is None or first.stride == node.stride
        ):
            if first.stride is None:
                kept[seen[key]] = dataclasses.replace(first, stride=node.stride)
            rename[node.name] = first.name
            continue
        seen.setdefault(key, len(kept))
        kept.append(node)
    outputs = [rename.get(o, o) for o in graph.outputs]
    return graph.replace_nodes(kept, outputs), {"merged": len(rename)}
