"""Inputs the graph writes, written where they are: a scatter into its
input, and a pointwise kernel's new value of an input it reads (an
optimizer's parameters and state).

A graph that mutates an input (a static KV cache updated by ``index_copy_``
or ``index_put_``; ``Graph.mutations``) computes the input's new value as a
scatter node whose base is the input, and the call copies that value into
the input after its last step.  Done plainly that is two copies of the
whole input per call: the scatter's init kernel copies the base into the
scatter's buffer, and the call copies the buffer back.  For a KV cache that
is as large as the weights.

This pass (after fusion and layout, before memory planning) makes such a
scatter store into the input's own storage: its init kernel is dropped (the
input already holds the base), the plan gives the scatter the input's
tensor (``runtime/plan.py``), and nothing is copied.  Every other read of
the input's old value must then come first: the memory plan orders each
reader before the scatter's kernel (``Graph.in_place``).  A scatter stays a
copy (a decision in the dump says why) when that cannot be: a reader needs
the scatter's result too, or shares its kernel; the scatter is also
returned (the caller would get the input itself); its layout or dtype is
not the input's; another scatter has the same input as its base.

The same holds for an input's new value that a pointwise kernel computes
(``param.add_(...)``, an optimizer's ``exp_avg.lerp_(grad, ...)``): the
kernel stores it into the input, and the call copies nothing.  Within its
own kernel the old value may be read only where it is overwritten: every
load of the input there is at the very element the kernel stores (one
program loads it before storing the value computed from it), as for the
memory plan's in-place intermediates.  A kernel that reads it elsewhere (a
transpose, a broadcast, a reduction over it) stays a copy, as do template
and combined kernels.
"""

from __future__ import annotations

import networkx as nx

from tilec.anchors import anchor_of
from tilec.decisions import Decision, Reason
from tilec.inline import kernel_loads
from tilec.ir import OUTPUT, Graph, Group, readers
from tilec.passes.memory_plan import reads_only_where_written, steps, steps_reading_before


def write_in_place(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Scatters and pointwise kernels that compute an input's new value,
    made to store into that input."""
    if not graph.mutations or graph.groups is None:
        return graph, {"inputs_written": 0}
    read_by = readers(graph)
    # The kernels' order so far; each input written in place adds its own
    # (every other reader before the writing kernel) as it is chosen.
    units, _ = steps(graph)
    unit_of = {n: g.name for g in graph.groups for n in g.nodes}
    by_name = {g.name: g for g in graph.groups}
    loads: dict[str, list] = {}  # by kernel: what it reads where
    returned = {o for k, o in enumerate(graph.outputs) if k not in graph.mutations}
    chosen: dict[str, str] = {}
    log: list[Decision] = []
    for k, position in graph.mutations.items():
        name, base = graph.outputs[k], graph.inputs[position]
        node = graph.nodes[name]
        scatter = node.kind == "scatter" and node.inputs[0] == base
        if not scatter and (node.kind != "pointwise" or name not in unit_of):
            continue
        why = _refusal(graph, name, base, read_by, units, unit_of, returned)
        if why is None and not scatter:
            why = _pointwise_refusal(graph, by_name[unit_of[name]], name, base, loads)
        if why is None:
            chosen[name] = base
            units.add_edges_from(
                (u, unit_of[name])
                for u in steps_reading_before(name, base, read_by, units, unit_of)
            )
            why = Reason("input_written", f"stores into input %{base}: no init copy, no copy back")
        log.append(
            Decision.of("memory", f"%{name}", "in place" if name in chosen else "copied", why)
        )
    out = graph.replace_nodes(list(graph.nodes.values()))
    out.groups = [g for g in graph.groups if not (g.init and g.stored[0] in chosen)]
    out.in_place = chosen
    out.decisions = graph.decisions + log
    return out, {"inputs_written": len(chosen)}


def _refusal(
    graph: Graph,
    name: str,
    base: str,
    read_by: dict[str, dict[str, bool]],
    units: nx.DiGraph,
    unit_of: dict[str, str],
    returned: set[str],
) -> Reason | None:
    """Why ``name`` (a scatter, or a pointwise node) cannot store into input
    ``base``; None when it can (for a pointwise node, as far as readers in
    other kernels go: see :func:`_pointwise_refusal`)."""
    node, source = graph.nodes[name], graph.nodes[base]
    if name in returned:
        return Reason("returned", "the new value is returned too: the caller would get the input")
    if (node.dtype, node.buffer_stride) != (source.dtype, source.buffer_stride):
        return Reason("layout", "its layout or dtype is not the input's")
    # What needs the writing kernel must come after it: a kernel that
    # reads the old value cannot (it may read the new one through another
    # node fused beside it, or through an input written in place before).
    after = nx.descendants(units, unit_of[name])
    for reader in read_by[base]:
        if reader in (OUTPUT, name):
            continue
        if graph.nodes[reader].kind == "scatter" and graph.nodes[reader].inputs[0] == base:
            return Reason("two_scatters", f"scatter %{reader} has the same base")
        if unit_of.get(reader, reader) in after:
            return Reason(
                "read_after", f"%{reader} reads the old value in a step that needs the new one"
            )
        same = unit_of.get(reader) is not None and unit_of.get(reader) == unit_of.get(name)
        if same and node.kind == "scatter":
            return Reason("same_kernel", f"%{reader} reads the old value in the scatter's kernel")
    return None


def _pointwise_refusal(
    graph: Graph, group: Group, name: str, base: str, loads: dict[str, list]
) -> Reason | None:
    """Why pointwise ``name``'s kernel cannot store it into input ``base``
    that it may also read; None when every read of ``base`` in the kernel
    is at the element it stores."""
    node = graph.nodes[name]
    if group.init or group.parts or group.reduce_shape or node.shape != group.shape:
        return Reason("kernel", "its kernel does not store it at the kernel's own positions")
    if any(anchor_of(graph.nodes[n]) is not None for n in group.nodes):
        return Reason("kernel", "its kernel is a template's")
    if group.name not in loads:  # what the kernel reads where, once per kernel
        loads[group.name] = kernel_loads(graph, group.nodes, group.stored, group.shape)
    if not reads_only_where_written(graph, loads[group.name], base, node):
        return Reason(
            "same_kernel", "its kernel reads the old value at elements other than those it stores"
        )
    return None
