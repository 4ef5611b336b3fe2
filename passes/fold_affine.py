"""Fold per-channel affine maps into the convolution or matmul before them.

Inference batch norm after a convolution is ``(conv(x, W, c) - mean) * s * g
+ beta``: an affine map ``a[ch] * y + b[ch]`` of the convolution's output,
with coefficients that depend only on the output channel.  When the weights
are constants (``options={"freeze": True}``) such a map is folded into the
call: ``conv(x, W * a[:, None, None, None], c * a + b)``.  The same holds for
``addmm``/``mm`` (a linear layer followed by a per-column scale and shift).

A pointwise node ``P`` is folded into the library call ``Y`` it reads when

* ``Y`` is a non-transposed convolution, ``addmm`` (beta = alpha = 1) or
  ``mm``, whose weight (and bias) are constant-valued, and ``P`` is its only
  reader (not an output);
* ``P`` reads ``Y`` only at its own position, with the same shape and dtype;
* ``P``'s body is affine in that value (add, sub, mul and divide by terms
  that do not read ``Y``, negation, float casts), and every other value it
  reads is constant-valued and indexed by the channel alone.

The coefficients are built as expressions from ``P``'s own body and
evaluated once per channel.  The new call takes ``P``'s name, so chains
(``sub``, ``mul``, ``mul``, ``add`` of a decomposed batch norm) fold one step
at a time.  Does nothing without constant weights or such maps.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch

from tilec import index as ix
from tilec.interpret import eval_expr
from tilec.ir import Arg, Call, Const, Expr, ExternCall, Graph, Load, Node, walk
from tilec.passes.constant_fold import constant_valued, evaluate

aten = torch.ops.aten
NOT_AFFINE = "not affine"


def fold_affine(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Fold per-channel affine pointwise nodes into the library call they read."""
    folded = 0
    while True:
        step = _fold_once(graph)
        if step is None:
            return graph, {"folded_into_library": folded}
        graph = step
        folded += 1


def _fold_once(graph: Graph) -> Graph | None:
    const = constant_valued(graph)
    users = graph.users()
    outputs = set(graph.outputs)
    for p in graph.nodes.values():
        if p.kind != "pointwise":
            continue
        for pos, y_name in enumerate(p.inputs):
            y = graph.nodes[y_name]
            layout = _weight_layout(y, const)
            if layout is None or users[y_name] != [p.name] or y_name in outputs:
                continue
            if p.shape != y.shape or p.dtype != y.dtype or not y.dtype.is_floating_point:
                continue
            channel = layout[0]
            row = tuple(
                (sym, sympy.Integer(0)) if size == 1 else (sym,)
                for sym, size in zip(ix.out_symbols(len(p.shape)), p.shape)
            )
            coeffs = _affine(p.body, pos, row)
            if coeffs == NOT_AFFINE or not _channel_only(p, pos, coeffs, const, channel):
                continue
            return _rewrite(graph, p, y, layout, coeffs)
    return None


def _weight_layout(y: Node, const: set[str]) -> tuple[int, int, int, int | None] | None:
    """(output channel dim, weight arg, weight's channel dim, bias arg or None)
    of a library call whose weight and bias are constant-valued."""
    if y.kind != "extern" or y.extern.role != "library":
        return None
    call, kwargs = y.extern, dict(y.extern.kwargs)
    if call.target is aten.convolution.default and not call.args[6]:
        layout = (1, 1, 0, 2)
    elif call.target is aten.addmm.default and kwargs.get("beta", 1) == kwargs.get("alpha", 1) == 1:
        layout = (1, 2, 1, 0)
    elif call.target is aten.mm.default:
        layout = (1, 1, 1, None)
    else:
        return None
    for arg in (layout[1], layout[3]):
        value = None if arg is None else call.args[arg]
        if isinstance(value, Arg) and y.inputs[value.position] not in const:
            return None
    return layout


def _affine(expr: Expr, pos: int, row: tuple[tuple[sympy.Expr, ...], ...]):
    """(a, b) with ``expr == a * y + b`` where y is input ``pos`` at ``row``;
    None stands for zero.  NOT_AFFINE when no such form is found."""
    if not any(isinstance(e, Load) and e.src == pos for e in walk(expr)):
        return None, expr
    if isinstance(expr, Load):
        if expr.src != pos or expr.mask is not None or not _at_own_position(expr, row):
            return NOT_AFFINE
        return Const(1.0, expr.dtype), None
    if not isinstance(expr, Call):
        return NOT_AFFINE
    parts = [_affine(a, pos, row) for a in expr.args]
    if NOT_AFFINE in parts:
        return NOT_AFFINE
    dtype, op = expr.dtype, expr.op
    if op in ("add", "sub"):
        (a1, b1), (a2, b2) = parts
        return _combine(op, a1, a2, dtype), _combine(op, b1, b2, dtype)
    if op == "neg":
        ((a, b),) = parts
        return _combine("sub", None, a, dtype), _combine("sub", None, b, dtype)
    if op == "cast" and dtype.is_floating_point:
        ((a, b),) = parts
        return _cast(a, dtype), _cast(b, dtype)
    if op in ("mul", "truediv"):
        (a1, b1), (a2, b2) = parts
        if a2 is None:  # y-term times (or over) a y-free factor
            return _scale(op, a1, expr.args[1], dtype), _scale(op, b1, expr.args[1], dtype)
        if op == "mul" and a1 is None:
            return _scale(op, a2, expr.args[0], dtype), _scale(op, b2, expr.args[0], dtype)
    return NOT_AFFINE


def _at_own_position(load: Load, row: tuple[tuple[sympy.Expr, ...], ...]) -> bool:
    """The load reads the element at the output's own position (``row[k]``
    lists the forms dimension k's index may take: ``i_k``, or 0 for size 1)."""
    return len(load.index) == len(row) and all(c in ok for c, ok in zip(load.index, row))


def _combine(op: str, x: Expr | None, y: Expr | None, dtype: torch.dtype) -> Expr | None:
    if y is None:
        return x
    if x is None:
        return y if op == "add" else Call("neg", (y,), dtype)
    return Call(op, (x, y), dtype)


def _scale(op: str, x: Expr | None, factor: Expr, dtype: torch.dtype) -> Expr | None:
    return None if x is None else Call(op, (x, factor), dtype)


def _cast(x: Expr | None, dtype: torch.dtype) -> Expr | None:
    return None if x is None or x.dtype == dtype else Call("cast", (x,), dtype)


def _channel_only(p: Node, pos: int, coeffs, const: set[str], channel: int) -> bool:
    """Every load in the coefficients reads a constant, indexed by the channel alone."""
    allowed = {ix.out_symbols(len(p.shape))[channel]}
    for part in coeffs:
        for e in () if part is None else walk(part):
            if isinstance(e, Load):
                if e.src == pos or p.inputs[e.src] not in const:
                    return False
                for component in e.index:
                    if (
                        not isinstance(component, sympy.Expr)
                        or not component.free_symbols <= allowed
                    ):
                        return False
            elif not isinstance(e, Load | Const | Call):
                return False  # an Index term varies along other dimensions too
    return True


def _rewrite(graph: Graph, p: Node, y: Node, layout, coeffs) -> Graph:
    channel, weight_arg, weight_dim, bias_arg = layout
    size = p.shape[channel]
    call = y.extern
    refs = {k: y.inputs[v.position] for k, v in enumerate(call.args) if isinstance(v, Arg)}
    fixed = evaluate(graph, {refs[k] for k in (weight_arg, bias_arg) if k in refs})
    weight = fixed[refs[weight_arg]]

    values = evaluate(graph, {i for i in p.inputs if i != y.name})
    args = [values.get(i) for i in p.inputs]
    env = {ix.out_symbols(len(p.shape))[channel]: torch.arange(size, device=weight.device)}
    a, b = (
        None if c is None else torch.broadcast_to(eval_expr(c, args, env), (size,)).double()
        for c in coeffs
    )
    shape = [1] * weight.dim()
    shape[weight_dim] = size
    new_weight = weight if a is None else weight.double() * a.view(shape)
    bias = fixed[refs[bias_arg]] if bias_arg in refs else None
    new_bias = bias if bias is None or a is None else bias.double() * a
    if b is not None:
        new_bias = b if new_bias is None else new_bias + b

    nodes: list[Node] = []
    constants: dict[str, torch.Tensor] = {}
    new_inputs = list(y.inputs)
    new_args = list(call.args)
    target, kwargs = call.target, call.kwargs
    for arg, value in ((weight_arg, new_weight), (bias_arg, new_bias)):
        if value is None:
            continue
        value = value.to(y.dtype).contiguous()
        name = _fresh(graph, f"{p.name}_{'weight' if arg == weight_arg else 'bias'}")
        constants[name] = value
        nodes.append(Node(name, "constant", tuple(value.shape), value.dtype, stride=value.stride()))
        if arg is None:  # mm gains a bias: it becomes addmm
            target, kwargs = aten.addmm.default, (("beta", 1), ("alpha", 1))
            new_args = [Arg(len(new_inputs)), *new_args]
            new_inputs.append(name)
        elif arg in refs:
            new_inputs[call.args[arg].position] = name
        else:  # a convolution without bias gains one
            new_args[arg] = Arg(len(new_inputs))
            new_inputs.append(name)
    folded = dataclasses.replace(
        y,
        name=p.name,
        inputs=tuple(new_inputs),
        extern=ExternCall(target, tuple(new_args), kwargs, "library"),
        stride=p.stride if p.stride is not None else y.stride,
    )
    out: list[Node] = []
    for node in graph.nodes.values():
        if node.name == p.name:
            out += [*nodes, folded]
        elif node.name != y.name:
            out.append(node)
    result = graph.replace_nodes(out)
    result.constants.update(constants)
    return result


def _fresh(graph: Graph, hint: str) -> str:
    name, k = hint, 0
    while name in graph.nodes or name in graph.constants:
        k += 1
        name = f"{hint}_{k}"
    return name
