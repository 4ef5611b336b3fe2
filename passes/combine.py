"""Combine independent kernels into one launch (horizontal fusion).

A kernel of a few thousand elements costs its launch, not its bytes: a
decode step's rotary embedding of q, its key and value cache writes and a
cache counter's increment are four launches of some hundred bytes each,
and they do not depend on one another.  An optimizer step is the same
shape at any size: one update kernel per parameter (or per class of
parameter shapes, which fusion already merges), each independent of the
others, and a step counter per parameter.  This pass groups such kernels
into one: ``Group.parts`` holds them, and codegen (``codegen/kernel.py``)
writes one kernel whose programs run each part's programs in turn, as its
own kernel would (``pid`` in ``[END_{k-1}, END_k)`` runs part ``k``).

A group is a candidate when its sizes are static, it is not a template's
(GEMM, attention: their own tiling, warps and pipelining) nor a scatter's
init kernel, and either its iteration space has at most :data:`SMALL`
elements, or everything it stores leaves the program (graph outputs, and
inputs written in place: ``passes/in_place.py``) or has at most
:data:`SMALL` elements (a gradient's norm).  The second kind is what makes
combining free of memory: a combination's parts' buffers are live
together, and such a kernel's buffers are small or live to the end of the
call anyway.  Walking the steps in program order, a candidate joins one of the
last :data:`WINDOW` combinations when no path of dependencies runs between
it and that combination either way (``memory_plan.steps``: buffers, and a
kernel storing into an input after every other read of it), so the
combination can run as one step, while its arguments stay within
:data:`MAX_ARGS`; the earliest such combination, so that a chain of
independent pairs (each parameter's step count, then its update that
reads the count) becomes two combinations, not one per pair.  Runs after
the in-place pass, before memory planning, which then treats a
combination as one step.  The rule needs no times, so
kernels are the same on every target.
"""

from __future__ import annotations

import math

import networkx as nx

from tilec.anchors import anchor_of
from tilec.ir import Graph, Group, base_inputs
from tilec.passes.memory_plan import step_order

# Elements of a kernel's iteration space below which its launch is what it
# costs: 64K elements of 4 bytes read and written move 0.5 MB, 0.17 us at
# an H100's 3 TB/s, against 0.66 us per replayed launch.
SMALL = 1 << 16
# Arguments (pointers) of one combined kernel: 8 KB of them.  CUDA's kernel
# parameter space is 32 KB on sm_70 and later since CUDA 12.1 (4 KB
# before); ptxas compiles an sm_90 kernel of 2000 pointers.  A part's own
# arguments count whole: a kernel that has more on its own (fusion does not
# bound them) stays alone.
MAX_ARGS = 1024
WINDOW = 4


def combine(graph: Graph, enabled: bool = True) -> tuple[Graph, dict[str, int]]:
    """``graph`` with small independent kernels combined (module docstring)."""
    if not enabled or len(graph.groups) < 2:
        return graph, {"combined_kernels": 0}
    units, order = step_order(graph)
    by_name = {g.name: g for g in graph.groups}
    leaving = {o for o in graph.outputs if o} | set(graph.in_place)
    members: dict[str, list[Group]] = {}
    args: dict[str, int] = {}
    open_: list[str] = []
    for unit in order:
        group = by_name.get(unit)
        if group is None or not _candidate(graph, group, leaving):
            continue
        own = arguments(graph, group)
        for first in open_[-WINDOW:]:
            if args[first] + own <= MAX_ARGS and _independent(units, first, unit):
                nx.contracted_nodes(units, first, unit, self_loops=False, copy=False)
                members[first].append(group)
                args[first] += own
                break
        else:
            members[unit] = [group]
            args[unit] = own
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


def combinable(graph: Graph, group: Group) -> bool:
    """Whether ``group``'s kernel can share a launch with others: static
    sizes, not a template's (GEMM, attention: their own tiling, warps and
    pipelining), not a scatter's init kernel, not a combination itself."""
    sizes = (*group.shape, *group.reduce_shape)
    if group.init or group.parts or not all(isinstance(s, int) for s in sizes):
        return False
    return not any(anchor_of(graph.nodes[n]) is not None for n in group.nodes)


def _candidate(graph: Graph, group: Group, leaving: set[str]) -> bool:
    if not combinable(graph, group):
        return False
    # Small kernels; and kernels whose every stored buffer leaves the
    # program or is small (a parameter's gradient norm): combined, they
    # keep no large buffer alive longer than alone.
    small = math.prod((*group.shape, *group.reduce_shape)) <= SMALL
    return small or all(n in leaving or _elements(graph, n) <= SMALL for n in group.stored)


def _elements(graph: Graph, name: str) -> int:
    return math.prod(graph.nodes[name].shape)


def arguments(graph: Graph, group: Group) -> int:
    """The kernel's arguments: each buffer it reads (through views and
    recomputed nodes) or stores (``codegen/emit.py``: an input's new value
    stored into the input it reads takes the input's); its sizes are
    static, so literals."""
    read = {b for n in group.nodes for b in base_inputs(graph, graph.nodes[n])}
    read -= set(group.nodes)
    # A new value stored into an input the kernel reads shares its argument.
    stored = {n for n in group.stored if graph.in_place.get(n) not in read}
    return len(read | stored)


def _independent(units: nx.DiGraph, a: str, b: str) -> bool:
    return not nx.has_path(units, a, b) and not nx.has_path(units, b, a)


def _combination(parts: list[Group]) -> Group:
    return Group(
        parts[0].name,
        tuple(dict.fromkeys(n for p in parts for n in p.nodes)),
        tuple(dict.fromkeys(n for p in parts for n in p.stored)),
        (),
        (),
        f"combined: {len(parts)} independent kernels ({', '.join(p.name for p in parts)})",
        parts=tuple(parts),
    )
