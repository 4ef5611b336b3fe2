"""Static memory planning: execution order, liveness, one arena.

Runs after fusion.  It fixes the order of the program's steps (kernels and
library/fallback calls; a topological order that keeps the graph's order
where it can) and gives every intermediate buffer a kernel stores an offset
in one arena, allocated once per Program and reused by every call.

A buffer lives from the step that writes it to the last step that reads it
(through views).  Offsets are chosen best-fit: buffers are placed largest
first (ties by name, so the plan is deterministic), each in the smallest gap
left by the already placed buffers whose lifetimes overlap its own.

In place: a pointwise kernel that stores one buffer may write it over a
buffer it reads that dies with it, when every read of that buffer is at the
very memory offset the kernel writes (same element size; each element is
loaded before the value computed from it is stored, by the same program).
Such chains share one offset; they are placed as one buffer whose lifetime
is the union of theirs.

Buffers that may outlive the call stay out of the arena: graph outputs, and
anything an output may alias (views of it, and results of fallback calls
that read it, which may be views), and what a collective reads (it may read
it until its wait), and in a graph compiled for symbolic
sizes every buffer whose size is symbolic: those are allocated per call.
Does nothing (an empty arena) when no kernel stores an intermediate.
"""

from __future__ import annotations

import math

import networkx as nx
import sympy

from tilec import index as ix
from tilec.inline import kernel_loads
from tilec.ir import (
    OUTPUT,
    Graph,
    MemoryPlan,
    Node,
    base_inputs,
    buffers_of,
    is_collective,
    readers,
)

ALIGN = 256  # bytes; what the CUDA caching allocator aligns to


def memory_plan(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Order the steps and place intermediates in one arena."""
    schedule = _schedule(graph)
    step_of = {u: k for k, u in enumerate(schedule)}
    unit_of = {n: g.name for g in graph.groups for n in g.nodes}
    escaping = _escaping(graph)
    # A buffer lives from the first kernel that writes it (a scatter's init).
    first_write: dict[str, int] = {}
    for g in graph.groups:
        for n in g.stored:
            first_write[n] = min(first_write.get(n, step_of[g.name]), step_of[g.name])
    stored = list(first_write)
    lifetimes: dict[str, tuple[int, int]] = {}
    read_by = readers(graph)
    for name in stored:
        start = first_write[name]
        steps = [step_of[unit_of.get(r, r)] for r in read_by[name] if r != OUTPUT]
        lifetimes[name] = (start, max([start, *steps]))
    # A buffer of symbolic size has no fixed place in an arena of fixed size.
    static = [
        n for n in stored if ix.is_static((*graph.nodes[n].shape, *graph.nodes[n].buffer_stride))
    ]
    sizes = {n: _aligned(_nbytes(graph.nodes[n])) for n in static}
    candidates = {n for n in static if n not in escaping}
    in_place = _in_place(graph, candidates, lifetimes, step_of)
    # Each in-place chain is placed as one buffer under its first member's name.
    root = {n: n for n in candidates}
    for out, src in in_place.items():  # in schedule order: src's root is final
        root[out] = root[src]
    chains: dict[str, list[str]] = {}
    for n in sorted(candidates):
        chains.setdefault(root[n], []).append(n)
    chain_size = {r: max(sizes[m] for m in ms) for r, ms in chains.items()}
    chain_life = {
        r: (min(lifetimes[m][0] for m in ms), max(lifetimes[m][1] for m in ms))
        for r, ms in chains.items()
    }
    placed: dict[str, int] = {}
    for r in sorted(chains, key=lambda r: (-chain_size[r], r)):
        placed[r] = _best_fit(r, placed, chain_size, chain_life)
    offsets = {n: placed[root[n]] for n in candidates}
    arena = max((placed[r] + chain_size[r] for r in placed), default=0)
    out = graph.replace_nodes(list(graph.nodes.values()))
    out.schedule = schedule
    out.memory = MemoryPlan(
        offsets={n: offsets[n] for n in sorted(offsets)},
        sizes={n: sizes[n] for n in sorted(offsets)},
        lifetimes={n: lifetimes[n] for n in sorted(offsets)},
        arena_bytes=arena,
        in_place=dict(sorted(in_place.items())),
    )
    counts = {
        **figures(out.memory),
        "in_place": len(in_place),
        "unplanned_buffers": len(stored) - len(offsets),
    }
    return out, counts


def figures(plan: MemoryPlan) -> dict[str, int]:
    """What a plan achieved: its arena against the sum of the intermediates
    and the naive peak (allocate at first write, free after last read)."""
    return {
        "planned_buffers": len(plan.offsets),
        "arena_bytes": plan.arena_bytes,
        "intermediate_bytes": sum(plan.sizes.values()),
        "naive_peak_bytes": _naive_peak(plan.lifetimes, plan.sizes),
    }


def _in_place(
    graph: Graph,
    candidates: set[str],
    lifetimes: dict[str, tuple[int, int]],
    step_of: dict[str, int],
) -> dict[str, str]:
    """Planned buffers a kernel writes over one of its planned inputs: out -> in."""
    pairs: dict[str, str] = {}
    for group in sorted(graph.groups, key=lambda g: step_of[g.name]):
        if group.parts or group.reduce_shape or len(group.stored) != 1:
            continue
        if group.stored[0] not in candidates:
            continue
        if group.init or any(graph.nodes[n].kind == "scatter" for n in group.nodes):
            continue  # writes where its values say, not at its own positions
        (out,) = group.stored
        node = graph.nodes[out]
        step = step_of[group.name]
        loads = kernel_loads(graph, group.nodes, group.stored, group.shape)
        taken = set(pairs.values())
        for src in sorted({load.buffer for load in loads}):
            src_node = graph.nodes[src]
            if (
                src in candidates
                and src not in taken
                and lifetimes[src][1] == step
                and src_node.dtype.itemsize == node.dtype.itemsize
                and _nbytes(src_node) >= _nbytes(node)
                and reads_only_where_written(graph, loads, src, node)
            ):
                pairs[out] = src
                break
    return pairs


def reads_only_where_written(graph: Graph, loads: list, src: str, out: Node) -> bool:
    """Whether every load of buffer ``src`` among a pointwise kernel's
    ``loads`` is unmasked and at the memory offset where the kernel stores
    ``out`` (at its own positions): each element is then read by the
    program that overwrites it, before it does."""
    written = ix.flatten_strided(ix.own_position(out.shape), out.buffer_stride)
    stride = graph.nodes[src].buffer_stride
    return all(
        load.mask is None and sympy.expand(ix.flatten_strided(load.index, stride) - written) == 0
        for load in loads
        if load.buffer == src
    )


def _schedule(graph: Graph) -> list[str]:
    """Kernels (group names) and extern nodes in a topological order that
    follows the graph's own order where dependencies allow."""
    units, position = steps(graph)
    return list(nx.lexicographical_topological_sort(units, key=lambda u: position[u]))


def steps(graph: Graph) -> tuple[nx.DiGraph, dict[str, int]]:
    """The program's steps (kernels by group name, extern nodes by name) and
    what must run before what: an edge per buffer one writes and the other
    reads, and a kernel storing into an input after every other read of
    it; and
    each step's first position in the graph's own order."""
    unit_of = {n: g.name for g in graph.groups for n in g.nodes}
    units = nx.DiGraph()
    position: dict[str, int] = {}
    for k, node in enumerate(graph.nodes.values()):
        # Compute nodes outside every group are recomputed by their readers.
        if node.kind != "extern" and node.name not in unit_of:
            continue
        u = unit_of.get(node.name, node.name)
        units.add_node(u)
        position[u] = min(position.get(u, k), k)
        for base in base_inputs(graph, node):
            if base in unit_of or graph.nodes[base].kind == "extern":
                src = unit_of.get(base, base)
                if src != u:
                    units.add_edge(src, u)
    # A scatter's init kernel runs after its base is computed, before its own kernel.
    for group in graph.groups:
        if group.init:
            (scatter,) = group.stored
            units.add_node(group.name)
            position.setdefault(group.name, position[unit_of[scatter]])
            units.add_edge(group.name, unit_of[scatter])
            for base in buffers_of(graph, graph.nodes[scatter].inputs[0]):
                src = unit_of.get(base, base)
                if src != group.name and (base in unit_of or graph.nodes[base].kind == "extern"):
                    units.add_edge(src, group.name)
    # A kernel that stores into an input comes after every other read of it.
    read_by = readers(graph) if graph.in_place else {}
    for scatter, base in graph.in_place.items():
        for src in steps_reading_before(scatter, base, read_by, units, unit_of):
            units.add_edge(src, unit_of[scatter])
    return units, position


def step_order(graph: Graph) -> tuple[nx.DiGraph, list[str]]:
    """The program's steps (:func:`steps`) and the order passes walk them
    in: topological, ties broken by their first position in the graph."""
    units, position = steps(graph)
    return units, list(nx.lexicographical_topological_sort(units, key=lambda u: position[u]))


def steps_reading_before(
    name: str,
    base: str,
    read_by: dict[str, dict[str, bool]],
    units: nx.DiGraph,
    unit_of: dict[str, str],
) -> set[str]:
    """The steps (of :func:`steps`) that read input ``base``'s old value, so
    run before ``name``'s kernel stores its new value into it."""
    found = {unit_of.get(r, r) for r in read_by[base] if r not in (OUTPUT, name)}
    return {u for u in found if u in units} - {unit_of[name]}


def _escaping(graph: Graph) -> set[str]:
    """Nodes whose memory must outlive the arena's reuse: outputs, the bases
    of output views, and the inputs of fallback calls that lead to an
    output; and the operands of collectives, which may read them after
    their own step, until their ``wait_tensor``."""
    todo = [o for o in graph.outputs if o]
    todo += [i for node in graph.nodes.values() if is_collective(node) for i in node.inputs]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = graph.nodes[name]
        if node.kind == "view" or (node.kind == "extern" and node.extern.role != "library"):
            todo += list(node.inputs)
    return seen


def _nbytes(node: Node) -> int:
    if 0 in node.shape:
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(node.shape, node.buffer_stride))
    return extent * node.dtype.itemsize


def _aligned(nbytes: int) -> int:
    return math.ceil(nbytes / ALIGN) * ALIGN


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _best_fit(
    name: str,
    offsets: dict[str, int],
    sizes: dict[str, int],
    lifetimes: dict[str, tuple[int, int]],
) -> int:
    """The offset of the smallest gap among live-overlapping buffers that fits."""
    busy = sorted(
        (offsets[o], offsets[o] + sizes[o])
        for o in offsets
        if _overlap(lifetimes[o], lifetimes[name])
    )
    best, best_gap, cursor = None, None, 0
    for lo, hi in busy:
        gap = lo - cursor
        if gap >= sizes[name] and (best_gap is None or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, hi)
    return cursor if best is None else best


def _naive_peak(lifetimes: dict[str, tuple[int, int]], sizes: dict[str, int]) -> int:
    """Peak bytes when each buffer is allocated at its first write and freed
    after its last read."""
    if not lifetimes:
        return 0
    last = max(end for _, end in lifetimes.values())
    return max(
        sum(sizes[n] for n, (s, e) in lifetimes.items() if s <= step <= e)
        for step in range(last + 1)
    )
