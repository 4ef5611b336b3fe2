"""Layout selection: strides for the buffers kernels store inside the graph.

Lowering gives every node the strides eager would give it.  Graph outputs
keep them (users can observe strides), and so does every buffer that an
ATen fallback, a view taken by torch or a matmul reads.  The other stored
intermediates, read only by kernels (and, for channels-last, by
convolutions), are free, and this pass picks their layout:

* **reductions read rows contiguously**: a buffer whose every reading
  kernel is a reduction that reads it as its rows x reduction tile, in the
  same order, is laid out with the reduced dimensions innermost (a softmax
  over dim 0 of a computed value reads unit-stride rows);
* **channels-last** for convolution networks when it pays (on a GPU, where
  cuDNN's NHWC kernels are the fast ones; or when forced with
  ``options={"layout": "channels_last"}``): 4-D convolution results and the
  4-D buffers kernels store between convolutions are NHWC, and constant
  convolution weights are converted once, so each convolution reads and
  writes NHWC without a copy.

Pointwise kernels walk their iteration space in the memory order of what
they store (codegen), so a chosen layout is written contiguously.  Matmul
transposes need no copy in the first place: views reach library calls as
strided tensors.  Does nothing with ``options={"layout": "eager"}``, or when
no free buffer has a better layout than eager's.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch

from tilec import index as ix
from tilec.decisions import Decision, Reason
from tilec.inline import Inliner, kernel_loads
from tilec.ir import OUTPUT, Graph, Group, Node, readers, view_base

aten = torch.ops.aten


def layout(graph: Graph, mode: str = "auto", gpu: bool = False) -> tuple[Graph, dict[str, int]]:
    """Choose strides for free intermediates (after fusion: stored buffers are known)."""
    strides: dict[str, tuple[int, ...]] = {}
    constants = dict(graph.constants)
    if mode == "eager":
        return graph, {"reduction_layouts": 0, "channels_last": 0}
    read_by = readers(graph)
    stored = [n for g in graph.groups for n in g.stored]
    outputs = set(graph.outputs)
    convs = [n for n in graph.nodes.values() if _is_conv2d(n)]
    channels_last = bool(convs) and (mode == "channels_last" or gpu)
    decisions: list[Decision] = []
    if convs:
        decisions.append(_convolution_layout(graph, len(convs), mode, channels_last))
    if channels_last:
        strides.update(_channels_last_choice(graph, convs, read_by, constants))
        why = Reason("channels_last", "NHWC between convolutions")
        decisions += [
            Decision.of("layout", f"%{n}", f"strides {list(s)}", why) for n, s in strides.items()
        ]
    reduction_layouts = 0
    for name in stored:
        if name in outputs or name in strides:
            continue
        order = _reduction_order(graph, name, read_by[name])
        if order is not None:
            wanted = _strides_in_order(graph.nodes[name].shape, order)
            if wanted != graph.nodes[name].buffer_stride:
                strides[name] = wanted
                reduction_layouts += 1
                why = Reason("reduction_rows", "its reducing readers read rows contiguously")
                decisions.append(Decision.of("layout", f"%{name}", f"strides {list(wanted)}", why))
    nodes = [
        dataclasses.replace(n, stride=strides[n.name]) if n.name in strides else n
        for n in graph.nodes.values()
    ]
    out = graph.replace_nodes(nodes)
    out.constants.update({k: v for k, v in constants.items() if k in out.nodes})
    out.decisions += decisions
    counts = {
        "reduction_layouts": reduction_layouts,
        "channels_last": sum(1 for n in strides if graph.nodes[n].kind != "constant")
        if channels_last
        else 0,
    }
    return out, counts


def _convolution_layout(graph: Graph, convs: int, mode: str, channels_last: bool) -> Decision:
    """The decision for a graph's 2-D convolutions: NHWC or eager's layout."""
    subject = f"{convs} convolutions"
    if mode == "channels_last":
        return Decision.of("layout", subject, "channels-last", Reason("option", "option layout"))
    if channels_last:
        why = Reason("gpu_nhwc", "cuDNN's NHWC kernels are the fast ones on a GPU")
        return Decision.of("layout", subject, "channels-last", why)
    why = Reason(
        "interpreter", "under the interpreter torch's CPU convolutions keep eager's layout"
    )
    return Decision.of("layout", subject, "eager layout", why)


def _channels_last_choice(
    graph: Graph,
    convs: list[Node],
    read_by: dict[str, dict[str, bool]],
    constants: dict[str, torch.Tensor],
) -> dict[str, tuple[int, ...]]:
    """NHWC strides for convolution results, their constant weights (converted
    in ``constants``) and the 4-D buffers kernels store from them or for them."""
    outputs = set(graph.outputs)

    def free(name: str) -> bool:
        # Read only by kernels (through views too) and directly by convolutions.
        return name not in outputs and all(
            r != OUTPUT
            and (
                graph.nodes[r].kind in ("pointwise", "reduction")
                or (_is_conv2d(graph.nodes[r]) and not via_view)
            )
            for r, via_view in read_by[name].items()
        )

    strides: dict[str, tuple[int, ...]] = {}
    for conv in convs:
        weight = graph.nodes[_operand(conv, 1)]
        if weight.kind == "constant" and free(weight.name):
            tensor = constants[weight.name].contiguous(memory_format=torch.channels_last)
            constants[weight.name] = tensor
            strides[weight.name] = tuple(tensor.stride())
    # A convolution returns NHWC when its input or weight is NHWC; a kernel
    # stores what it computes from NHWC values in their memory order, and
    # NHWC what a convolution reads.
    # What each stored 4-D value reads at a permutation of its position: the
    # same whatever strides are chosen, so found once, not on every pass.
    permuted = {
        name: _permuted_reads(graph, group, graph.nodes[name])
        for group in graph.groups
        for name in group.stored
        if len(graph.nodes[name].shape) == 4
    }
    changed = True
    while changed:
        changed = False
        for conv in convs:
            nhwc_in = any(view_base(graph, _operand(conv, k)) in strides for k in (0, 1))
            if conv.name not in strides and nhwc_in and free(conv.name):
                strides[conv.name] = _channels_last(conv.shape)
                changed = True
        for group in graph.groups:
            for name in group.stored:
                node = graph.nodes[name]
                if name in strides or len(node.shape) != 4 or not free(name):
                    continue
                feeds_conv = any(r != OUTPUT and _is_conv2d(graph.nodes[r]) for r in read_by[name])
                wanted = _channels_last(node.shape) if feeds_conv else None
                wanted = wanted or _order_of_nhwc_read(node, permuted[name], strides)
                if wanted is not None and wanted != node.buffer_stride:
                    strides[name] = wanted
                    changed = True
    return strides


def _permuted_reads(graph: Graph, group: Group, node: Node) -> list[tuple[str, tuple[int, ...]]]:
    """The 4-D buffers ``node`` (computed in ``group``) is computed from,
    each read at a permutation of ``node``'s own position, in load order:
    (buffer, the dimension of ``node`` read at each of the buffer's)."""
    own = ix.out_symbols(len(node.shape))
    ranges = ix.symbol_ranges(node.shape)
    members = {n for n in group.nodes if graph.nodes[n].kind == "pointwise"}
    inliner = Inliner(graph, members, ranges)
    found = []
    for load in inliner.loads(inliner.body(node, {})):
        if len(load.index) != 4 or set(load.index) != set(own):
            continue
        if any(ranges[s] != graph.nodes[load.buffer].shape[d] for d, s in enumerate(load.index)):
            continue
        found.append((load.buffer, tuple(own.index(s) for s in load.index)))
    return found


def _order_of_nhwc_read(
    node: Node, reads: list[tuple[str, tuple[int, ...]]], strides: dict[str, tuple[int, ...]]
) -> tuple[int, ...] | None:
    """Strides that store ``node`` in the memory order of the first of its
    permuted ``reads`` (:func:`_permuted_reads`) with chosen ``strides``
    (None: none has): the same position of an NHWC value gives NHWC, and
    a value read through ``permute(0, 2, 3, 1)`` (ConvNeXt's LayerNorm
    over channels, on an NHWC view of a convolution's result) is stored
    with its last dimension innermost, as read, not taken for NCHW and
    stored with its height innermost, which its readers (a GEMM along the
    channels) would read one element at a time."""
    for buffer, dims in reads:
        source = strides.get(buffer)
        if source is not None:
            by_stride = sorted(range(4), key=lambda d: -source[d])
            return _strides_in_order(node.shape, tuple(dims[d] for d in by_stride))
    return None


def _is_conv2d(node: Node) -> bool:
    return (
        node.kind == "extern"
        and node.extern.target is aten.convolution.default
        and len(node.shape) == 4
    )


def _operand(conv: Node, k: int) -> str:
    """The node passed as argument ``k`` of a convolution (0: input, 1: weight)."""
    return conv.inputs[conv.extern.args[k].position]


def _channels_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    return _strides_in_order(shape, (0, 2, 3, 1))


def _strides_in_order(shape: ix.Shape, order: tuple[int, ...]) -> ix.Shape:
    """Dense strides with dimension ``order[-1]`` innermost."""
    strides: list[ix.Size] = [0] * len(shape)
    for d, stride in zip(order, ix.contiguous_strides([shape[d] for d in order])):
        strides[d] = stride
    return tuple(strides)


def _reduction_order(graph: Graph, name: str, read_by: dict[str, bool]) -> tuple[int, ...] | None:
    """The dimension order (reduced dimensions last) in which every reading
    kernel, a reduction, reads ``name`` as its tile; None if they disagree."""
    group_of = {n: g for g in graph.groups for n in g.nodes}
    orders = set()
    for reader in read_by:
        group = group_of.get(reader)
        if group is None or not group.reduce_shape:
            return None
        order = _tile_order(graph, group, name)
        if order is None:
            return None
        orders.add(order)
    return orders.pop() if len(orders) == 1 else None


def _tile_order(graph: Graph, group: Group, name: str) -> tuple[int, ...] | None:
    """Dimensions of ``name`` ordered by the tile symbol each is read at
    (rows before reduced, in order), when every read is such a permutation."""
    ranges = ix.symbol_ranges(group.shape, group.reduce_shape)
    loads = kernel_loads(graph, group.nodes, (), group.shape, group.reduce_shape)
    loads = [load for load in loads if load.buffer == name]
    shape = graph.nodes[name].shape
    indices = {load.index for load in loads}
    if len(indices) != 1:
        return None
    (index,) = indices
    rank = {
        s: k
        for k, s in enumerate(
            (*ix.out_symbols(len(group.shape)), *ix.reduce_symbols(len(group.reduce_shape)))
        )
    }
    keys = []
    for d, c in enumerate(index):
        if shape[d] == 1:
            keys.append((-1, d))  # any place will do
        elif isinstance(c, sympy.Symbol) and c in rank and ranges[c] == shape[d]:
            keys.append((rank[c], d))
        else:
            return None
    return tuple(d for _, d in sorted(keys))
