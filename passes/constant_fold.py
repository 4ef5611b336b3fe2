"""Constant folding: compute what depends on constants alone, once.

A node is *constant-valued* when every tensor it reads is: graph constants
(frozen parameters, captured tensors), nodes that read no tensor (``full``,
``arange``) and anything computed only from those.  The pass evaluates, with
the reference interpreter, every constant-valued node that a run-time node
or an output reads, and turns it into a constant of the graph: weight casts,
normalization statistics, rotary tables, masks built from buffers.

Some constant-valued nodes stay as they are, because folding them
would cost memory and save nothing:

* nodes that read no tensor (iotas, fills), or are computed from such nodes
  alone (a causal mask from two iotas): kernels recompute them for free;
* views: a view never copies, its readers fold it into their index math;
* nodes larger than the constants they are computed from (an expanded
  weight), unless they are small (``SMALL_BYTES``: rotary tables, masks):
  their readers compute them inside their own kernels;
* nodes larger than the constants they are computed from that only matrix
  products read (through views), whatever their size: a dequantized weight
  (``(w_q.to(dtype) * scale).t()`` with ``w_q`` an int8 parameter) or a
  widening cast of a weight.  Folding would store the wide weight and give
  up the narrow one; left in the graph, it is computed per call, as a
  prologue of the matmul where a GEMM template reads it (today a kernel
  writes it before the library call).

Random ops are never folded.  Does nothing when no node is constant-valued
and read at run time.
"""

from __future__ import annotations

import torch

from tilec import index as ix
from tilec.interpret import run_node
from tilec.ir import Graph, Node, is_free, is_matmul, is_random, is_tuple, view_base

# Below this size a folded constant may be larger than what it is computed from.
SMALL_BYTES = 4 << 20


def constant_fold(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Replace constant-valued nodes read at run time by computed constants."""
    const = constant_valued(graph)
    readers = graph.users()
    # Read by a run-time node or an output, directly or through views.
    read_at_run_time = set(graph.outputs)
    for node in reversed(graph.nodes.values()):
        for r in readers[node.name]:
            if r not in const or (graph.nodes[r].kind == "view" and r in read_at_run_time):
                read_at_run_time.add(node.name)
    folded = {
        name
        for name in const
        if name in read_at_run_time and _worth_folding(graph, graph.nodes[name], readers)
    }
    values = evaluate(graph, folded)
    nodes = []
    constants = dict(graph.constants)
    names = dict(graph.constant_names)
    for node in graph.nodes.values():
        if node.name in folded:
            tensor = _with_strides(values[node.name], node)
            constants[node.name] = tensor
            # Computed from one parameter alone (a cast or transposed weight): its name.
            parameters = {graph.constant_names.get(c) for c in _constant_sources(graph, node)}
            if len(parameters) == 1 and None not in parameters:
                names[node.name] = parameters.pop()
            node = Node(
                node.name, "constant", node.shape, node.dtype, stride=tuple(tensor.stride())
            )
        nodes.append(node)
    out = graph.replace_nodes(nodes)
    out.constants = constants
    out.constant_names = {k: v for k, v in names.items() if k in out.nodes}
    return out, {"folded": len(folded)}


def constant_valued(graph: Graph) -> set[str]:
    """Nodes whose value is known at compile time (random ops excluded)."""
    const: set[str] = set()
    for node in graph.nodes.values():
        if node.kind == "constant":
            const.add(node.name)
        elif node.kind == "input" or is_random(node):
            continue
        elif node.kind == "extern" and not node.inputs:
            continue  # a factory call (empty, ...): keep it where it runs
        elif all(i in const for i in node.inputs):
            const.add(node.name)
    return const


def evaluate(graph: Graph, names: set[str]) -> dict[str, torch.Tensor]:
    """Values of the constant-valued nodes ``names`` (and what they read)."""
    needed: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo += graph.nodes[name].inputs
    env: dict[str, torch.Tensor] = {}
    device = next((t.device for t in graph.constants.values()), torch.device("cpu"))
    for node in graph.nodes.values():
        if node.name not in needed:
            continue
        if node.kind == "constant":
            env[node.name] = graph.constants[node.name]
        else:
            env[node.name] = run_node(node, [env[i] for i in node.inputs], device)
    return env


def constant_bytes(graph: Graph) -> int:
    """Bytes of the constant tensors the graph's nodes hold (shared storage once)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for name, t in graph.constants.items()
        if name in graph.nodes
    }
    return sum(storages.values())


def _worth_folding(graph: Graph, node: Node, readers: dict[str, list[str]]) -> bool:
    if node.kind in ("constant", "view") or is_free(node) or not ix.is_static(node.shape):
        return False  # a value of symbolic size is computed per call
    if is_tuple(node):
        return False  # the tuple itself; its unpacked parts are folded
    sources = _constant_sources(graph, node)
    if not sources:
        return False  # computed from iotas and fills alone: index math kernels inline
    source_bytes = sum(graph.nodes[c].nbytes for c in sources)
    if node.nbytes > source_bytes and _only_matmuls_read(graph, node.name, readers):
        return False  # a dequantized weight: the matmul computes it per call
    return node.nbytes <= max(source_bytes, SMALL_BYTES)


def _only_matmuls_read(graph: Graph, name: str, readers: dict[str, list[str]]) -> bool:
    """Whether matrix products alone read ``name`` (through views), and no output."""
    if name in graph.outputs:
        return False
    return all(
        _only_matmuls_read(graph, r, readers)
        if graph.nodes[r].kind == "view"
        else is_matmul(graph.nodes[r])
        for r in readers[name]
    )


def _constant_sources(graph: Graph, node: Node) -> set[str]:
    """The graph constants ``node`` is computed from."""
    out: set[str] = set()
    seen: set[str] = set()
    todo = list(node.inputs)
    while todo:
        name = view_base(graph, todo.pop())
        if name in seen:
            continue  # shared: a chain of in-place updates reads each value twice
        seen.add(name)
        if graph.nodes[name].kind == "constant":
            out.add(name)
        else:
            todo += graph.nodes[name].inputs
    return out


def _with_strides(tensor: torch.Tensor, node: Node) -> torch.Tensor:
    """The folded value laid out as ``node`` promises its readers."""
    tensor = tensor.to(node.dtype)
    if node.stride is None or tuple(tensor.stride()) == node.stride:
        return tensor.contiguous() if node.stride is None else tensor
    out = torch.empty_strided(node.shape, node.stride, dtype=node.dtype, device=tensor.device)
    return out.copy_(tensor)
