"""Dead-code elimination."""

from __future__ import annotations

from tilec.ir import Graph, is_check


def dce(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Drop nodes no output depends on.  Inputs stay (they are the signature).

    Fallback nodes are dropped like any other: after AOTAutograd's
    functionalization an ATen op has no side effect the graph relies on,
    except runtime checks (``ir.is_check``), which are kept with what they
    read.  Does nothing when every node feeds an output.
    """
    live = {o for o in graph.outputs if o} | {n.name for n in graph.nodes.values() if is_check(n)}
    for node in reversed(list(graph.nodes.values())):
        if node.name in live:
            live.update(node.inputs)
    kept = [n for n in graph.nodes.values() if n.name in live or n.kind == "input"]
    return graph.replace_nodes(kept), {"removed": len(graph.nodes) - len(kept)}
