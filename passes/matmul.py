"""Matmul: a library call or a Triton GEMM template, for each matmul.

Lowering makes every ``mm``/``bmm``/``addmm``/``baddbmm`` a library call.
This pass decides, per call, whether it stays one (cuBLAS on a GPU, torch's
CPU matmul under the interpreter) or becomes a *dot reduction* that codegen
writes as a Triton GEMM kernel (``codegen/gemm.py``), into which fusion can
then pull pointwise consumers (the epilogue: bias, activation, residual,
casts) and cheap pointwise producers of an operand (the prologue: casts,
dequantization).

A dot reduction (the anchor of the GEMM template, ``compiler/gemm.py``) is
an ordinary reduction node, ``reduce_op=DOT``: its
body is ``mul(A, B)`` where ``A`` indexes the left operand at ``(batch...,
i_m, r0)`` and ``B`` the right one at ``(batch..., r0, i_n)``, both in
float32 (half-precision operands are cast up, exactly: products of 16-bit
floats are exact in float32); its value is the float32 sum over ``r0``.  The
call's node keeps its name and becomes a pointwise node after it:
``cast(alpha * dot + beta * bias, dtype)``, rounded once as cuBLAS does.
So every pass after this one, and the reference interpreter, treat the
template like any other reduction.

Which side (option ``matmul``): ``"library"`` and ``"triton"`` force one
(for tests and bisecting; ``"triton"`` still keeps what the template cannot
run: integer or float64 operands, and bf16 on a target without a bf16 dot,
the Triton interpreter).  ``"auto"`` (the default) takes the template where
what fuses into it (a prologue computing an operand from narrower data, an
epilogue whose values are stored anyway) saves more than the template loses
to the library's faster tiles, as the cost model predicts on the target
(``passes/matmul_gain.py``, ``compiler/cost.py``); the decision records both
predicted times.  Under the interpreter (no figures) only prologues take it.
Checked after fusion: a template whose kernel fusion left with nothing but
the product (an epilogue it refused), or whose kernel as fused is predicted
slower than the library call plus kernels for its prologue and epilogue
(``matmul_gain.fused_gain``), goes back to the library.

With the option ``gemv_reduction``, a one-row product (a batch-1 decode
step's GEMV, :func:`is_gemv`) that takes the template, or would but for
the target's missing bf16 dot, is a ``sum`` reduction of the same body
instead: the generic reduction kernel, with no 16-row tensor-core tile;
an int4 weight's sum walks its packed bytes (:func:`_packed`).  One the
cost model leaves in the library (:data:`PRICED_LIBRARY`: nothing to fuse,
say) is priced as a reduction too, on a target with figures, and becomes
one where that is predicted faster.

With ``race`` (max-autotune on a GPU, wired in by the pipeline from
``codegen/autotune.py``), a matmul that ``auto`` would leave in the library
for want of anything to fuse is measured instead: the bare template (its
fastest tiles) against the library call on the same shapes, strides and
dtypes; the faster wins.  Matmuls where fusion pays stay templates.

Each decision is recorded in ``Graph.decisions`` (stage ``matmul``) with
its reason and the predicted (or, when raced, measured) times.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Protocol

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.anchors import anchor_of
from tilec.decisions import Decision, Reason
from tilec.gemm import DOT, packing, row_statistic_problem
from tilec.inline import Inliner, at_row
from tilec.ir import (
    Arg,
    Call,
    Const,
    Expr,
    Graph,
    Group,
    Load,
    Node,
    is_matmul,
    readers,
)
from tilec.passes.fuse import fuse
from tilec.passes.matmul_gain import fused_gain, fusion_gain, reduction_seconds
from tilec.passes.split_reduction import shifted
from tilec.target import Target

aten = torch.ops.aten

# Operand dtypes the template computes (its accumulator is float32).
TEMPLATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Measured(Protocol):
    """What racing a matmul found; its text says what was measured."""

    @property
    def template_wins(self) -> bool: ...


# Why ``auto`` leaves a matmul the template could compute in the library:
# the cost model's choice (not an option, a measurement or what the
# template cannot compute).  With the option ``gemv_reduction`` such a
# product of one row is priced as a sum reduction as well.
PRICED_LIBRARY = frozenset(
    {"nothing_to_fuse", "library_faster", "absorbed_nothing", "library_faster_fused"}
)

# Times a matmul as its bare template (a graph of one kernel, the call's
# inputs as its inputs) and as the library call (the node), on the device.
Race = Callable[[Graph, Node], Measured]


def choose_matmul(
    graph: Graph,
    mode: str = "auto",
    *,
    target: Target,
    race: Race | None = None,
    replayed: bool = False,
    gemv_reduction: bool = False,
) -> tuple[Graph, dict]:
    """Rewrite the matmuls chosen for the template as dot reductions, for
    kernels that run on ``target``.  ``replayed``: the program is to run in
    CUDA graphs, where a library call over symbolic sizes would keep a
    generic program out of them (``Plan.sizes_refusal``): with ``auto``,
    such a matmul takes the template wherever it can, unpriced.
    ``gemv_reduction`` (the option): those of one row become sum
    reductions instead (:func:`is_gemv`), and so do those
    the template would take but for the target's missing bf16 dot (the
    interpreter's: a reduction needs none)."""
    read_by = readers(graph)
    stored = functools.cache(lambda: _stored_with_library_calls(graph, target))
    choices = {
        node.name: _choice(graph, node, mode, target, race, read_by, stored, replayed)
        for node in graph.nodes.values()
        if is_matmul(node)
    }
    out = _rewrite(graph, choices)
    # Checked after fusion: a template chosen for what would fuse into it
    # goes back to the library where its kernel, as fused, holds nothing
    # else (an epilogue it refused) or is predicted slower than the library
    # call and kernels for the rest.
    back, kept = _after_fusion(out, choices, target)
    for name, (code, detail, times) in back.items():
        why = choices[name][1]
        choices[name] = (False, Reason(code, f"{why.detail}, but {detail}"), times)
    for name, times in kept.items():  # the times as fused, as codegen prices them
        choices[name] = (True, choices[name][1], times)
    # With the option, a one-row product the cost model leaves in the library
    # (PRICED_LIBRARY) is priced as a reduction too, on a target with
    # figures, and takes it where that is predicted faster.
    priceable = cost.has_figures(target)
    reductions = {
        name
        for name, (template, why, _) in choices.items()
        if gemv_reduction
        and (template or why.code == "no_bf16_dot" or (priceable and why.code in PRICED_LIBRARY))
        and is_gemv(graph.nodes[name])
    }
    out, priced = _with_reductions(graph, out, choices, reductions, bool(back), target)
    rejected = {
        name: priced.get(name, ())
        for name in reductions
        if _library_faster(choices[name], dict(priced.get(name, ())).get("reduction"))
    }
    if rejected:
        reductions -= set(rejected)
        out, priced = _with_reductions(graph, out, choices, reductions, True, target)
    log = []
    for name, (template, why, t) in choices.items():
        outcome = "template" if template else "library"
        if name in reductions:
            outcome = "reduction"
            detail = f"{why.detail}; option gemv_reduction: one row, a sum reduction"
            why = Reason("gemv_reduction", detail)
            t = t + priced.get(name, ())
        elif name in rejected:
            t = t + rejected[name]
        log.append(Decision.of("matmul", f"%{name}", outcome, why, predicted_s=t))
    out = out.replace_nodes(list(out.nodes.values()))
    out.decisions = graph.decisions + log
    templates = sum(t for name, (t, _, _) in choices.items() if name not in reductions)
    return out, {
        "matmul_template": templates,
        "matmul_reduction": len(reductions),
        "matmul_library": len(choices) - templates - len(reductions),
    }


def _with_reductions(
    graph: Graph,
    out: Graph,
    choices: dict[str, tuple[bool, Reason, tuple]],
    reductions: set[str],
    rewrite: bool,
    target: Target,
) -> tuple[Graph, dict[str, tuple[tuple[str, float]]]]:
    """``graph`` rewritten for ``choices`` with ``reductions`` as sum
    reductions (``out`` where nothing changes: no ``rewrite`` asked, no
    reduction), and each reduction's predicted time."""
    if rewrite or reductions:
        out = _rewrite(graph, choices, reductions)
    if reductions:
        out = _packed(out, reductions)
    return out, _reduction_times(graph, out, reductions, target)


def _library_faster(choice: tuple[bool, Reason, tuple], reduction_s: float | None) -> bool:
    """Whether a product the library keeps (``choice``) stays there: its sum
    reduction unpriced (``reduction_s`` None) or predicted no faster."""
    template, why, times = choice
    if template or why.code not in PRICED_LIBRARY:
        return False
    return reduction_s is None or reduction_s >= dict(times).get("library", math.inf)


def is_gemv(node: Node) -> bool:
    """Whether matmul ``node``'s product has one row, statically: a batch-1
    decode step's GEMV, which the option ``gemv_reduction`` writes as a sum
    reduction (the generic reduction kernel: each program sums whole rows of
    the weight against the input row, multiplying in float32 as the template
    does, with no tensor-core tile of 16 rows).  Not more rows: the
    reduction's rows are output elements, so each would read its weight row
    again (through L2 at best), which the kernel's bytes do not count."""
    rows = node.shape[-2]
    return ix.is_static([rows]) and int(rows) == 1


def _packed(graph: Graph, reductions: set[str]) -> Graph:
    """``graph`` with the sum reduction of each matmul of ``reductions`` (the
    node its finishing node reads) walked over packed positions where an
    operand packs ``d`` K positions into one element (``gemm.packing``: an
    int4 weight, two to a byte): the same sum over ``K / d`` steps of ``d``
    products each, ``k = d * j + p``, so that each element is loaded once
    and its halves are taken by constant shifts (summed over ``k`` instead,
    each byte was loaded by ``d`` lanes, one byte at a time)."""
    nodes = dict(graph.nodes)
    pointwise = {n for n, node in graph.nodes.items() if node.kind in ("pointwise", "view")}
    for name in reductions:
        red = graph.nodes[graph.nodes[name].inputs[0]]
        (k,) = red.reduce_shape
        d = packing(graph, _operand_nodes(graph, red), red)
        if d == 1 or not isinstance(k, int) or k % d:
            continue
        for walked in (red.name, *_row_statistics(graph, red, pointwise)):
            nodes[walked] = _walked(graph.nodes[walked], d)
    return graph.replace_nodes(list(nodes.values()))


# How two parts of a sum, max or min reduction combine.
_PAIRWISE = {"sum": "add", "max": "maximum", "min": "minimum"}


def _walked(red: Node, d: int) -> Node:
    """Reduction ``red`` over ``K / d`` steps of ``d`` of its ``K`` positions
    each, ``k = d * j + p``: the same sum (max, min), reassociated."""
    (r,) = ix.reduce_symbols(1)
    (k,) = red.reduce_shape
    parts = [shifted(red.body, {r: d * r + p}) for p in range(d)]
    pair = _PAIRWISE[red.reduce_op]
    body = functools.reduce(lambda a, b: Call(pair, (a, b), red.body.dtype), parts)
    return dataclasses.replace(red, body=body, reduce_shape=(k // d,))


def _row_statistics(graph: Graph, red: Node, pointwise: set[str]) -> list[str]:
    """The row statistics GEMV ``red`` (a sum reduction over K) reads
    through its operands (inlining the ``pointwise`` nodes, the graph's
    pointwise nodes and views): sum, max or min reductions over K of
    pointwise producers, each read at one position, a function of the
    row's indices (an RMS norm's mean square).  :func:`_packed` walks them
    as it walks ``red``, so that a reduction kernel can compute them from
    the loads the product makes (``inline.row_statistics``)."""
    (k,) = red.reduce_shape
    inliner = Inliner(graph, pointwise, ix.symbol_ranges(red.shape, red.reduce_shape))
    positions: dict[str, set] = {}
    for load in inliner.loads(inliner.body(red, {})):
        positions.setdefault(load.buffer, set()).add(load.index)
    found = []
    for name, indices in positions.items():
        node = graph.nodes[name]
        if node.kind != "reduction" or node.reduce_op not in _PAIRWISE or len(indices) != 1:
            continue
        (index,) = indices
        if (
            at_row(index, len(red.shape))
            and row_statistic_problem(graph, node, pointwise | {name}, k) is None
        ):
            found.append(name)
    return found


def _operand_nodes(graph: Graph, red: Node) -> set[str]:
    """``red`` and the nodes fusion inlines into its kernel to compute its
    operands: the views each operand is read through and the pointwise
    node under them (a dequantized weight)."""
    found = {red.name}
    for name in red.inputs:
        while graph.nodes[name].kind == "view":
            found.add(name)
            name = graph.nodes[name].inputs[0]
        if graph.nodes[name].kind == "pointwise":
            found.add(name)
    return found


def _rewrite(
    graph: Graph,
    choices: dict[str, tuple[bool, Reason, tuple]],
    reductions: frozenset[str] | set[str] = frozenset(),
) -> Graph:
    """``graph`` with the matmuls ``choices`` takes the template for as dot
    reductions, or (``reductions``) as sum reductions."""
    if not reductions and not any(template for template, _, _ in choices.values()):
        return graph
    nodes: list[Node] = []
    for node in graph.nodes.values():
        if not choices.get(node.name, (False,))[0] and node.name not in reductions:
            nodes.append(node)
            continue
        reduce_op = "sum" if node.name in reductions else DOT
        nodes += as_dot(graph, node, reduce_op=reduce_op)
    return graph.replace_nodes(nodes)


def _reduction_times(
    graph: Graph, out: Graph, reductions: set[str], target: Target
) -> dict[str, tuple[tuple[str, float]]]:
    """The predicted seconds of each matmul of ``reductions`` (calls of
    ``graph``) as the kernel fusion makes of its sum reduction in ``out``
    (the node its finishing node reads), on a target with figures:
    ``(("reduction", seconds),)``."""
    if not reductions or not cost.has_figures(target):
        return {}
    fused, _ = fuse(out, target=target)
    sums = {out.nodes[name].inputs[0]: name for name in reductions}
    found = {}
    for group in fused.groups:
        for red in sums.keys() & set(group.nodes):
            name = sums[red]
            node = graph.nodes[name]
            _, left, _, _, _ = matmul_operands(node)
            points = ix.numel(node.shape) * graph.nodes[left].shape[-1]
            flops = 2 * int(ix.hint(points, graph.hints))
            found[name] = (("reduction", reduction_seconds(fused, group, flops, target)),)
    return found


def _after_fusion(
    graph: Graph, choices: dict[str, tuple[bool, Reason, tuple]], target: Target
) -> tuple[dict[str, tuple[str, str, tuple]], dict[str, tuple]]:
    """The matmuls taken as templates for a prologue or an epilogue that go
    back to the library once ``graph`` is fused: (reason code, why, times);
    and those that stay templates, priced as fused: their times."""
    chosen = {
        name
        for name, (template, why, _) in choices.items()
        if template and why.code in ("prologue", "epilogue")
    }
    if not chosen:
        return {}, {}
    fused, _ = fuse(graph, target=target)
    back, kept = {}, {}
    for group in fused.groups:
        names = [n for n in group.nodes if n in chosen]
        if len(names) != 1:
            continue
        (name,) = names
        others = [graph.nodes[n] for n in group.nodes if n != name]
        if all(anchor_of(n) is not None for n in others):
            detail = "fusion put nothing else into its kernel"
            back[name] = ("absorbed_nothing", detail, choices[name][2])
        elif cost.has_figures(target):
            faster, times = fused_gain(graph, group, name, target)
            if not faster:
                detail = "as fused, its kernel is predicted slower than the library path"
                back[name] = ("library_faster_fused", detail, times)
            else:
                kept[name] = times
    return back, kept


def _choice(
    graph: Graph,
    node: Node,
    mode: str,
    target: Target,
    race: Race | None,
    read_by: dict,
    stored: Callable[[], frozenset[str]],
    replayed: bool,
) -> tuple[bool, Reason, tuple[tuple[str, float], ...]]:
    """(whether the matmul becomes a template, why, the predicted seconds of
    each side where ``auto`` weighed them)."""
    if mode == "library":
        return False, Reason("option_library", 'option matmul="library"'), ()
    refusal = _cannot_template(graph, node, target)
    if refusal is not None:
        return False, refusal, ()
    if mode == "triton":
        return True, Reason("option_triton", 'option matmul="triton"'), ()
    if replayed and not all(ix.is_static(graph.nodes[i].shape) for i in (node.name, *node.inputs)):
        detail = "symbolic sizes under CUDA graphs: a library call would keep the program out"
        return True, Reason("replayed_symbolic", detail), ()
    _, left, right, _, _ = matmul_operands(node)
    template, why, times = fusion_gain(graph, node, (left, right), read_by, target, stored)
    if not template and race is not None:
        return (*_raced(graph, node, race, why), ())
    return template, why, times


def matmul_operands(node: Node) -> tuple[str | None, str, str, float, float]:
    """(bias, left, right, beta, alpha) of a matmul call, by node name."""
    call, kwargs = node.extern, dict(node.extern.kwargs)

    def name(a: Arg) -> str:
        return node.inputs[a.position]

    if call.target in (aten.mm.default, aten.bmm.default):
        return None, name(call.args[0]), name(call.args[1]), 0, 1
    bias, left, right = call.args[:3]
    return name(bias), name(left), name(right), kwargs.get("beta", 1), kwargs.get("alpha", 1)


def _cannot_template(graph: Graph, node: Node, target: Target) -> Reason | None:
    """Why the template cannot compute this call on ``target``, or None."""
    if node.dtype not in TEMPLATE_DTYPES:
        return Reason("dtype", f"{node.dtype} operands")
    if not target.bf16_dot and node.dtype == torch.bfloat16:
        return Reason("no_bf16_dot", f"the {target.name} has no bf16 dot")
    _, left, right, _, _ = matmul_operands(node)
    if {graph.nodes[left].dtype, graph.nodes[right].dtype} != {node.dtype}:
        return Reason("operand_dtypes", "operands of another dtype than the result")
    _, _, _, beta, alpha = matmul_operands(node)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (beta, alpha)):
        return Reason("symbolic_scalars", "alpha or beta computed from sizes")
    return None


def _stored_with_library_calls(graph: Graph, target: Target) -> frozenset[str]:
    """The nodes fusion stores when every matmul is a library call."""
    fused, _ = fuse(graph, target=target)
    return frozenset(name for group in fused.groups for name in group.stored)


def _raced(graph: Graph, node: Node, race: Race, heuristic: Reason) -> tuple[bool, Reason]:
    """(whether the template is taken, why), after racing a matmul the
    heuristic leaves in the library."""
    sizes = [*node.shape, *(s for n in node.inputs for s in graph.nodes[n].shape)]
    if not all(isinstance(s, int) for s in sizes):
        detail = f"{heuristic.detail}; autotune: symbolic sizes (generic variant), not measured"
        return False, Reason("not_raced_symbolic", detail)
    measured = race(_bare(graph, node), node)
    if measured.template_wins:
        return True, Reason("raced_template_faster", f"{measured}; {heuristic.detail}")
    return False, Reason("raced_library_faster", f"{heuristic.detail}; {measured}")


def _bare(graph: Graph, node: Node) -> Graph:
    """The matmul call alone as a template kernel with nothing fused: the
    buffers its operands are (views of) as inputs, laid out as in ``graph``,
    the views, then the dot reduction and the node that finishes it."""
    nodes: dict[str, Node] = {}

    def add(name: str) -> None:
        operand = graph.nodes[name]
        if name in nodes:
            return
        if operand.kind == "view":
            add(operand.inputs[0])
            nodes[name] = operand
        else:
            stride = operand.buffer_stride
            nodes[name] = Node(name, "input", operand.shape, operand.dtype, stride=stride)

    for name in node.inputs:
        add(name)
    inputs = [name for name, n in nodes.items() if n.kind == "input"]
    bare = Graph(f"{graph.name}_{node.name}", dict(nodes), inputs, [node.name])
    dot, finish = as_dot(bare, node)
    nodes.update({dot.name: dot, finish.name: finish})
    group = Group(
        "k0",
        (dot.name, finish.name),
        (finish.name,),
        node.shape,
        dot.reduce_shape,
        "the bare template",
    )
    return Graph(bare.name, nodes, inputs, [node.name], groups=[group])


def as_dot(
    graph: Graph,
    node: Node,
    operands: tuple[str, str] | None = None,
    scales: tuple[tuple[str, int], ...] = (),
    reduce_op: str = DOT,
) -> list[Node]:
    """The dot reduction of matmul call ``node`` and the node, of the call's
    name, that finishes it: ``cast(alpha * dot * scales + beta * bias)``.
    ``reduce_op="sum"``: the same products summed by a plain reduction
    (the option ``gemv_reduction``), not the GEMM template's anchor.

    ``operands`` (left, right) replace the call's own, e.g. fp8 values of
    them (``passes/fp8.py``); ``scales`` are float32 nodes the product is
    multiplied by, each indexed by one output dimension (-2: rows, -1:
    columns), e.g. the per-row and per-column scales of fp8 operands."""
    bias, left, right, beta, alpha = matmul_operands(node)
    if operands is not None:
        left, right = operands
    *batch, _, _ = node.shape
    k_size = graph.nodes[left].shape[-1]
    i = ix.out_symbols(len(node.shape))
    (r,) = ix.reduce_symbols(1)
    inputs = tuple(dict.fromkeys((left, right)))

    def operand(name: str, index: tuple[sympy.Expr, ...]) -> Expr:
        load = Load(inputs.index(name), index, graph.nodes[name].dtype)
        return load if load.dtype == torch.float32 else Call("cast", (load,), torch.float32)

    batch_index = i[: len(batch)]
    body = Call(
        "mul",
        (operand(left, (*batch_index, i[-2], r)), operand(right, (*batch_index, r, i[-1]))),
        torch.float32,
    )
    dot = Node(
        graph.fresh_name(f"{node.name}_dot"),
        "reduction",
        node.shape,
        torch.float32,
        inputs=inputs,
        body=body,
        reduce_op=reduce_op,
        reduce_shape=(k_size,),
    )
    finish_inputs = [dot.name]

    def read(name: str, index: tuple[sympy.Expr, ...]) -> Expr:
        finish_inputs.append(name)
        load = Load(len(finish_inputs) - 1, index, graph.nodes[name].dtype)
        return load if load.dtype == torch.float32 else Call("cast", (load,), torch.float32)

    value: Expr = Load(0, i, torch.float32)
    if alpha != 1:
        value = Call("mul", (value, Const(float(alpha), torch.float32)), torch.float32)
    for scale, dim in scales:
        value = Call("mul", (value, read(scale, (i[dim],))), torch.float32)
    if bias is not None and beta != 0:
        b = read(bias, _broadcast_index(graph.nodes[bias].shape, i))
        if beta != 1:
            b = Call("mul", (b, Const(float(beta), torch.float32)), torch.float32)
        value = Call("add", (value, b), torch.float32)
    if node.dtype != torch.float32:
        value = Call("cast", (value,), node.dtype)
    finish = Node(
        node.name,
        "pointwise",
        node.shape,
        node.dtype,
        inputs=tuple(finish_inputs),
        body=value,
        stride=node.stride,
    )
    return [dot, finish]


def _broadcast_index(shape: tuple, index: tuple[sympy.Symbol, ...]) -> tuple[sympy.Expr, ...]:
    """Where a bias of ``shape``, broadcast to the output, is read (right-aligned)."""
    lead = len(index) - len(shape)
    return tuple(sympy.Integer(0) if s == 1 else index[lead + k] for k, s in enumerate(shape))
