"""Combine small independent kernels into one launch (horizontal fusion).

A kernel of a few thousand elements costs its launch, not its bytes: a
decode step's rotary embedding of q, its key and value cache writes and a
cache counter's increment are four launches of some hundred bytes each,
and they do not depend on one another.  This pass groups such kernels into
one: ``Group.parts`` holds them, and codegen (``codegen/kernel.py``) writes
one kernel whose programs run each part's programs in turn, as its own
kernel would (``pid`` in ``[END_{k-1}, END_k)`` runs part ``k``).

A group is a candidate when its iteration space has at most
:data:`SMALL` elements and static sizes, it is not a template's (GEMM,
attention: their own tiling, warps and pipelining) and not a scatter's init
kernel.  Walking the steps in program order, a candidate joins one of the
last :data:`WINDOW` combinations when no path of dependencies runs between
it and that combination either way (``memory_plan.steps``: buffers, and a
scatter into an input after every other read of it), so the combination
can run as one step; at most :data:`MAX_PARTS` parts each.  Runs after the
in-place pass, before memory planning, which then treats a combination as
one step: its parts' buffers are live together.  The rule needs no times,
so kernels are the same on every target.
"""

from __future__ import annotations

import math

import networkx as nx

from tilec.anchors import anchor_of
from tilec.ir import Graph, Group
from tilec.passes.memory_plan import steps

# Elements of a kernel's iteration space below which its launch is what it
# costs: 64K elements of 4 bytes read and written move 0.5 MB, 0.17 us at
# an H100's 3 TB/s, against 0.66 us per replayed launch.
SMALL = 1 << 16
MAX_PARTS = 8
WINDOW = 4


def combine(graph: Graph, enabled: bool = True) -> tuple[Graph, dict[str, int]]:
    """``graph`` with small independent kernels combined (module docstring)."""
    if not enabled or len(graph.groups) < 2:
        return graph, {"combined_kernels": 0}
    units, position = steps(graph)
    order = list(nx.lexicographical_topological_sort(units, key=lambda u: position[u]))
    by_name = {g.name: g for g in graph.groups}
    members: dict[str, list[Group]] = {}
    open_: list[str] = []
    for unit in order:
        group = by_name.get(unit)
        if group is None or not _small(graph, group):
            continue
        for first in reversed(open_[-WINDOW:]):
            if len(members[first]) < MAX_PARTS and _independent(units, first, unit):
                nx.contracted_nodes(units, first, unit, self_loops=False, copy=False)
                members[first].append(group)
                break
        else:
            members[unit] = [group]
            open_.append(unit)
    combined = {first: parts for first, parts in members.items() if len(parts) > 1}
    if not combined:
        return graph, {"combined_kernels": 0}
    absorbed = {p.name for parts in combined.values() for p in parts[1:]}
    groups = []
    for group in graph.groups:
        if group.name in combined:
            groups.append(_combination(combined[group.name]))
        elif group.name not in absorbed:
            groups.append(group)
    out = graph.replace_nodes(list(graph.nodes.values()))
    out.groups = groups
    return out, {"combined_kernels": len(absorbed) + len(combined)}


def _small(graph: Graph, group: Group) -> bool:
    sizes = (*group.shape, *group.reduce_shape)
    if group.init or group.parts or not all(isinstance(s, int) for s in sizes):
        return False
    if any(anchor_of(graph.nodes[n]) is not None for n in group.nodes):
        return False
    return math.prod(sizes) <= SMALL


def _independent(units: nx.DiGraph, a: str, b: str) -> bool:
    return not nx.has_path(units, a, b) and not nx.has_path(units, b, a)


def _combination(parts: list[Group]) -> Group:
    return Group(
        parts[0].name,
        tuple(dict.fromkeys(n for p in parts for n in p.nodes)),
        tuple(dict.fromkeys(n for p in parts for n in p.stored)),
        (),
        (),
        f"combined: {len(parts)} independent small kernels ({', '.join(p.name for p in parts)})",
        parts=tuple(parts),
    )
