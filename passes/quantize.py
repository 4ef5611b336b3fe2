"""Quantize the weights of linear layers (``options={"quantize": ...}``).

A *layer* is a 2-D floating constant ``W`` (a frozen parameter) that library
matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``) read as their right
operand, through views that make one of its dimensions the product's output
channel (the operand's last dimension) and the other its reduction dimension
(``x @ W.t()``: ``W`` is ``[N, K]``; GPT-2's ``Conv1D``, ``x @ W``: ``[K, N]``).
The pass replaces ``W`` by the constants of a scheme
(:mod:`tilec.passes.quant_schemes`: int8 per channel, int4 per group) and one
pointwise node of ``W``'s shape and dtype that computes the dequantized
weight from them; the views and matmuls read that node as they read ``W``.
Constant folding has run before, so nothing folds the dequantization back
(and constant folding leaves such nodes alone anyway: they are wider than
their sources and only matmuls read them).

A layer stays in floating point, with the reason recorded, when

* its parameter name matches a ``skip`` pattern (fnmatch, on the name
  freezing gave it: ``model.layers.0.mlp.down_proj.weight``), or
* it is an output head and ``head`` is off: a layer read by a matmul after
  which the graph computes no other matmul (LLaMA's ``lm_head``, GPT-2's
  head tied to the embedding, an MLP's last layer; ``k_proj`` is not one,
  the attention output projection comes after it), or
* something other than those matmuls reads it (GPT-2's embedding reads the
  tied head's weight: the float constant stays either way), or the views
  are not a transpose, or matmuls read it in both orientations, or the
  scheme refuses it (int4: input features not a
  multiple of the group size).

The decisions (``Graph.decisions``, stage ``quantize``: in this pass's dump
and in the summary) give per layer the scheme, constant bytes before and after, and the
error of the layer's output with the dequantized weight against the float
weight: max abs and RMS relative to the float output's RMS, on the layer's
input in a run of the graph on the compile-time example inputs when the
backend has them (static sizes), otherwise on a fixed-seed standard normal
input of the layer's input shape; the decision says which.  Does nothing when no
matmul reads a constant weight.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence

import torch

from tilec import index as ix
from tilec.anchors import anchor_of
from tilec.decisions import Decision, Reason
from tilec.interpret import run_node
from tilec.ir import Call, Graph, Node, dtype_name, is_matmul, view_base
from tilec.passes.constant_fold import constant_bytes, constant_valued, evaluate
from tilec.passes.dce import dce
from tilec.passes.fp8 import fp8_linear
from tilec.passes.quant_schemes import SCHEMES, Quantized

aten = torch.ops.aten
# The argument of each matmul that is its right operand (the weight).
WEIGHT_ARG = {
    aten.mm.default: 1,
    aten.addmm.default: 2,
    aten.bmm.default: 1,
    aten.baddbmm.default: 2,
}
EXAMPLE = "compile-time example input"
RANDOM = "random input (standard normal, seed 0)"


@dataclasses.dataclass
class _Layer:
    constant: str  # the weight's constant node
    name: str  # its parameter name (the node's name when it has none)
    matmuls: list[tuple[str, str]]  # (matmul, the operand that reads the weight)
    skip: Reason | None = None
    channel: int = 0  # the weight's dimension that is the output channel


def quantize(
    graph: Graph,
    scheme: str,
    group_size: int = 128,
    skip: Sequence[str] = (),
    head: bool = False,
    example_inputs: Sequence[object] | None = None,
) -> tuple[Graph, dict[str, int]]:
    """Replace linear-layer weights by quantized constants and a dequantization node."""
    if scheme == "fp8":
        return _fp8(graph, _layers(graph, skip, head), example_inputs)
    if scheme not in SCHEMES:
        raise ValueError(
            f"tilec: no quantization rewrite for scheme {scheme!r} here; "
            f"passes/quant_schemes.SCHEMES has {sorted(SCHEMES)}"
        )
    layers = _layers(graph, skip, head)
    quantized: dict[str, Quantized] = {}
    for layer in layers:
        if layer.skip is None:
            weight = graph.constants[layer.constant]
            result = SCHEMES[scheme](weight if layer.channel == 0 else weight.t(), group_size)
            if isinstance(result, str):
                layer.skip = Reason("scheme_refuses", result)
            else:
                quantized[layer.constant] = result
    out, dequantized = _rewrite(graph, layers, quantized)
    after = {c: sum(t.nbytes for _, t in q.constants) for c, q in quantized.items()}
    return _report(graph, out, layers, scheme, after, dequantized, example_inputs, "output error")


def _report(
    graph: Graph,
    out: Graph,
    layers: list[_Layer],
    scheme: str,
    after: dict[str, int],
    dequantized: dict[str, torch.Tensor],
    example_inputs: Sequence[object] | None,
    error: str,
) -> tuple[Graph, dict[str, int]]:
    """``out`` with the log of every layer (bytes ``after``, the ``error`` of
    its output with the ``dequantized`` weight), and the pass's counts."""
    errors, source = _errors(graph, layers, dequantized, example_inputs)
    log = []
    for layer in layers:
        weight = graph.nodes[layer.constant]
        what = f"{layer.name} {dtype_name(weight.dtype)}{list(weight.shape)}"
        if layer.skip is not None:
            log.append(Decision.of("quantize", what, "skipped", layer.skip))
            continue
        max_abs, rel_rms = errors[layer.constant]
        why = Reason(
            scheme,
            f"{weight.nbytes} -> {after[layer.constant]} bytes, {error} "
            f"max abs {max_abs:.3g}, relative RMS {rel_rms:.3g} on the {source}",
        )
        saved = weight.nbytes - after[layer.constant]
        log.append(Decision.of("quantize", what, "quantized", why, bytes_saved=saved))
    out.decisions = graph.decisions + log
    return out, {
        "quantized": len(after),
        "skipped": len(layers) - len(after),
        "constant_bytes_before": constant_bytes(graph),
        "constant_bytes_after": constant_bytes(out),
    }


def _fp8(
    graph: Graph, layers: list[_Layer], example_inputs: Sequence[object] | None
) -> tuple[Graph, dict[str, int]]:
    """fp8 (:mod:`tilec.passes.fp8`): each matmul of a layer becomes a GEMM of
    e4m3 operands, the activations quantized per row at run time.  The error
    in the log is the weight's part (the weight rounded to e4m3 and scaled
    back); the activations' rounding comes on top, per call."""
    out = graph
    dequantized: dict[str, torch.Tensor] = {}
    after: dict[str, int] = {}
    for layer in layers:
        if layer.skip is None and any(
            graph.nodes[m].extern.target not in (aten.mm.default, aten.addmm.default)
            for m, _ in layer.matmuls
        ):
            layer.skip = Reason(
                "fp8_not_2d", "fp8: only mm and addmm (2-D activations) are rewritten"
            )
        if layer.skip is not None:
            continue
        for matmul, _ in layer.matmuls:
            out = fp8_linear(out, out.nodes[matmul], layer.constant, layer.channel)
        # The e4m3 weight and its scales, as fp8_linear stored them.
        w_q, w_scale = (out.constants[f"{layer.matmuls[0][0]}_{part}"] for part in ("wq", "ws"))
        back = (w_q.float() * w_scale[:, None]).to(graph.nodes[layer.constant].dtype)
        dequantized[layer.constant] = back.t() if layer.channel else back
        after[layer.constant] = w_q.nbytes + w_scale.nbytes
    out, _ = dce(out)  # the float weights, now unread
    error = "output error (weight rounding)"
    return _report(graph, out, layers, "fp8", after, dequantized, example_inputs, error)


def linear_weight_bytes(graph: Graph) -> int:
    """Bytes of the constants that matmuls (library calls, or the dot
    reductions of GEMM templates: their right operand) read as their
    weights: directly, through views, or through the pointwise nodes that
    compute a weight from constants alone (a dequantization).  What a
    model's linear layers cost in memory, measured on the graph."""
    const = constant_valued(graph)
    found: set[str] = set()
    seen: set[str] = set()  # each node walked once (a shared value has many paths)
    for node in graph.nodes.values():
        if is_matmul(node):
            todo = [_weight_operand(node)]
        elif anchor_of(node) is not None:
            todo = list(anchor_of(node).weights(node))
        else:
            continue
        while todo:
            source = graph.nodes[view_base(graph, todo.pop())]
            if source.name in seen:
                continue
            seen.add(source.name)
            if source.kind == "constant":
                found.add(source.name)
            elif source.kind == "pointwise" and source.name in const:
                todo += source.inputs
    return sum(graph.constants[c].nbytes for c in found)


def _layers(graph: Graph, skip: Sequence[str], head: bool) -> list[_Layer]:
    """The constant weights matmuls read, each with the reason to keep it, if any."""
    layers: dict[str, _Layer] = {}
    for node in graph.nodes.values():
        if not is_matmul(node):
            continue
        operand = _weight_operand(node)
        base = graph.nodes[view_base(graph, operand)]
        if base.kind == "constant" and len(base.shape) == 2 and base.dtype.is_floating_point:
            name = graph.constant_names.get(base.name, base.name)
            layers.setdefault(base.name, _Layer(base.name, name, [])).matmuls.append(
                (node.name, operand)
            )
    heads = _last_matmuls(graph)
    users = graph.users()
    for layer in layers.values():
        matmuls = {m for m, _ in layer.matmuls}
        pattern = next((p for p in skip if fnmatch.fnmatchcase(layer.name, p)), None)
        others = sorted(_readers_through_views(graph, layer.constant, users) - matmuls)
        channels = {_channel_dim(graph, operand) for _, operand in layer.matmuls}
        if pattern is not None:
            layer.skip = Reason("skip_pattern", f"matches quantize_skip pattern {pattern!r}")
        elif not head and matmuls & heads:
            layer.skip = Reason(
                "output_head", "output head (no matmul after it); quantize_head=True quantizes it"
            )
        elif others:
            layer.skip = Reason(
                "other_readers", f"also read by %{others[0]} (the float weight stays)"
            )
        elif None in channels:
            layer.skip = Reason("not_transpose", "read through views that are not a transpose")
        elif len(channels) != 1:
            layer.skip = Reason("both_orientations", "read both as W and as W.t() by matmuls")
        else:
            (layer.channel,) = channels
    return list(layers.values())


def _weight_operand(matmul: Node) -> str:
    """The node a matmul reads as its right operand."""
    return matmul.inputs[matmul.extern.args[WEIGHT_ARG[matmul.extern.target]].position]


def _last_matmuls(graph: Graph) -> set[str]:
    """Matmuls after which the graph computes no other matmul (output heads)."""
    users = graph.users()
    before_matmul: set[str] = set()
    for node in reversed(graph.nodes.values()):
        if any(is_matmul(graph.nodes[u]) or u in before_matmul for u in users[node.name]):
            before_matmul.add(node.name)
    return {n for n, node in graph.nodes.items() if is_matmul(node) and n not in before_matmul}


def _readers_through_views(graph: Graph, name: str, users: dict[str, list[str]]) -> set[str]:
    """The nodes that read ``name`` other than as views (and an output as ``@output``)."""
    found = {"@output"} if name in graph.outputs else set()
    for u in users[name]:
        found |= _readers_through_views(graph, u, users) if graph.nodes[u].kind == "view" else {u}
    return found


def _channel_dim(graph: Graph, operand: str) -> int | None:
    """The dimension of the 2-D weight under the views ``operand`` that
    indexes the product's output channel (the operand's last dimension),
    when its other dimension follows the operand's second to last alone."""
    node = graph.nodes[operand]
    rank = len(node.shape)
    index = ix.own_position(node.shape)
    while node.kind == "view":
        source = graph.nodes[node.inputs[0]]
        index = node.view.source_index(index, source.shape)
        node = source
    ranges = ix.symbol_ranges(graph.nodes[operand].shape)
    index = tuple(ix.simplify_index(component, ranges) for component in index)
    column, row = ix.out_symbols(rank)[-1], ix.out_symbols(rank)[-2]
    for channel in (0, 1):
        if index[channel].free_symbols <= {column} and index[1 - channel].free_symbols <= {row}:
            return channel
    return None


def _rewrite(
    graph: Graph, layers: list[_Layer], quantized: dict[str, Quantized]
) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The graph with each quantized weight replaced by its constants and a
    dequantization node (read where the weight was), and the dequantized values."""
    channel = {layer.constant: layer.channel for layer in layers}
    renamed: dict[str, str] = {}
    nodes: list[Node] = []
    constants = {k: v for k, v in graph.constants.items() if k not in quantized}
    names = dict(graph.constant_names)
    dequantized: dict[str, torch.Tensor] = {}
    taken = set(graph.nodes)
    for node in graph.nodes.values():
        if node.name not in quantized:
            inputs = tuple(renamed.get(i, i) for i in node.inputs)
            nodes.append(dataclasses.replace(node, inputs=inputs))
            continue
        parts = []
        for suffix, tensor in quantized[node.name].constants:
            tensor = tensor.contiguous()
            part = graph.fresh_name(f"{node.name}_{suffix}", taken)
            constants[part] = tensor
            names[part] = names.get(node.name, node.name)
            shape = tuple(tensor.shape)
            nodes.append(Node(part, "constant", shape, tensor.dtype, stride=tensor.stride()))
            parts.append(part)
        i, j = ix.out_symbols(2)
        n, k = (i, j) if channel[node.name] == 0 else (j, i)
        body = quantized[node.name].dequantize(n, k)
        if node.dtype != body.dtype:
            body = Call("cast", (body,), node.dtype)
        name = renamed[node.name] = graph.fresh_name(f"{node.name}_dequant", taken)
        dequant = Node(
            name,
            "pointwise",
            node.shape,
            node.dtype,
            tuple(parts),
            body,
            stride=ix.contiguous_strides(node.shape),
        )
        nodes.append(dequant)
        dequantized[node.name] = run_node(
            dequant, [constants[p] for p in parts], graph.constants[node.name].device
        )
    out = graph.replace_nodes(nodes, [renamed.get(o, o) for o in graph.outputs])
    out.constants = {k: v for k, v in constants.items() if k in out.nodes}
    out.constant_names = {k: v for k, v in names.items() if k in out.nodes}
    return out, dequantized


def _errors(
    graph: Graph,
    layers: list[_Layer],
    dequantized: dict[str, torch.Tensor],
    example_inputs: Sequence[object] | None,
) -> tuple[dict[str, tuple[float, float]], str]:
    """(max abs, relative RMS) error of each quantized layer's first matmul
    with the dequantized weight against the float one, and the input used."""
    first = {layer.matmuls[0][0]: layer for layer in layers if layer.constant in dequantized}
    errors: dict[str, tuple[float, float]] = {}

    def measure(node: Node, args: list[torch.Tensor]) -> None:
        layer = first[node.name]
        operand = dict(layer.matmuls)[node.name]
        weight = _through_views(graph, operand, dequantized[layer.constant])
        quantized_args = [weight if name == operand else a for name, a in zip(node.inputs, args)]
        reference = run_node(node, args, weight.device).double()
        error = run_node(node, quantized_args, weight.device).double() - reference
        rms = reference.pow(2).mean().sqrt().item()
        errors[layer.constant] = (
            error.abs().max().item(),
            error.pow(2).mean().sqrt().item() / (rms or 1.0),
        )

    if _runnable(graph, example_inputs):

        def visit(node: Node, args: list[torch.Tensor]) -> None:
            if node.name in first:
                measure(node, args)

        _run(graph, list(example_inputs), visit)
        return errors, EXAMPLE
    generator = torch.Generator().manual_seed(0)
    const = constant_valued(graph)
    for name, layer in first.items():
        node = graph.nodes[name]
        known = evaluate(graph, {i for i in node.inputs if i in const})
        device = dequantized[layer.constant].device
        args = [
            known[i] if i in known else _random(graph, graph.nodes[i], generator, device)
            for i in node.inputs
        ]
        measure(node, args)
    return errors, RANDOM


def _runnable(graph: Graph, inputs: Sequence[object] | None) -> bool:
    """Whether ``graph`` can run on ``inputs`` in the interpreter: static sizes,
    and tensors of the graph's input shapes."""
    return (
        inputs is not None
        and len(inputs) == len(graph.inputs)
        and all(ix.is_static(n.shape) for n in graph.nodes.values())
        and all(
            isinstance(t, torch.Tensor) and tuple(t.shape) == graph.nodes[i].shape
            for i, t in zip(graph.inputs, inputs)
        )
    )


def _run(graph: Graph, inputs: list, visit: Callable[[Node, list[torch.Tensor]], object]) -> None:
    """Run ``graph`` in the reference interpreter, calling ``visit`` with each
    node and its arguments before it runs; values are dropped after their last reader."""
    last = {i: k for k, node in enumerate(graph.nodes.values()) for i in node.inputs}
    env: dict[str, torch.Tensor] = {**dict(zip(graph.inputs, inputs)), **graph.constants}
    device = inputs[0].device if inputs else torch.device("cpu")
    with torch.no_grad():
        for k, node in enumerate(graph.nodes.values()):
            if node.name not in env:
                args = [env[i] for i in node.inputs]
                visit(node, args)
                env[node.name] = run_node(node, args, device)
            for i in set(node.inputs):
                if last[i] == k and i not in graph.constants:
                    del env[i]


def _random(
    graph: Graph, node: Node, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """A standard normal value of ``node``'s shape (a symbolic size: its hint)."""
    shape = [ix.hint(s, graph.hints) for s in node.shape]
    return torch.randn(shape, generator=generator).to(device, node.dtype)


def _through_views(graph: Graph, operand: str, base_value: torch.Tensor) -> torch.Tensor:
    """``base_value`` seen through the chain of views that ``operand`` is."""
    chain = []
    node = graph.nodes[operand]
    while node.kind == "view":
        chain.append(node)
        node = graph.nodes[node.inputs[0]]
    for view in reversed(chain):
        base_value = view.view.apply(base_value, view.shape)
    return base_value
