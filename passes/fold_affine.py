"""Fold per-channel affine maps into the convolution or matmul before them.

Inference batch norm after a convolution is ``(conv(x, W, c) - mean) * s * g
+ beta``: an affine map ``a[ch] * y + b[ch]`` of the convolution's output,
with coefficients that depend only on the output channel.  When the weights
are constants (``options={"freeze": True}``) such a map is folded into the
call: ``conv(x, W * a[:, None, None, None], c * a + b)``.  The same holds for
``addmm``/``mm`` (a linear layer followed by a per-column scale and shift).

Starting at such a call ``Y``, the pass follows the chain of pointwise
nodes after it while each one

* is the only reader of the node before it (which is not an output),
* reads that node only at its own position, with the same shape,
* has a body affine in that value (add, sub, mul and divide by terms that do
  not read it, negation, casts between float types), every other value it
  reads being constant-valued and indexed by the output channel alone,

and replaces ``Y`` and the chain by one call with new constant weights and
bias: ``Y`` is a non-transposed convolution, ``addmm`` (beta = alpha = 1)
or ``mm`` whose weight is a constant (through views: not a dequantized
weight that constant folding left to be computed per call, which folding
would turn back into a float constant) and whose bias is constant-valued.
The new constants keep the parameter names of the ones they replace.  Each step's
coefficients are built as expressions from its own body, evaluated per
channel and composed in float64, so the new weights are rounded to the
call's dtype once (a half-precision batch norm computes in float32 between
two casts; the chain then ends in a cast of the new call's result).  Does
nothing without constant weights or such chains.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch

from tilec import index as ix
from tilec.interpret import eval_expr
from tilec.ir import (
    Arg,
    Call,
    Const,
    Expr,
    ExternCall,
    Graph,
    Load,
    Node,
    reads_own_position,
    view_base,
    walk,
)
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
        graph, nodes = step
        folded += nodes


def _fold_once(graph: Graph) -> tuple[Graph, int] | None:
    const = constant_valued(graph)
    users = graph.users()
    outputs = set(graph.outputs)
    for y in graph.nodes.values():
        layout = _weight_layout(graph, y, const)
        if layout is None or not y.dtype.is_floating_point:
            continue
        chain: list[tuple[Node, tuple]] = []
        current = y
        while current.name not in outputs and len(users[current.name]) == 1:
            p = graph.nodes[users[current.name][0]]
            coeffs = _step(p, current, const, layout[0])
            if coeffs is None:
                break
            chain.append((p, coeffs))
            current = p
        if any(not _is_cast(p) for p, _ in chain):  # casts alone change nothing
            return _rewrite(graph, y, chain, layout, const), len(chain)
    return None


def _is_cast(node: Node) -> bool:
    body = node.body
    return isinstance(body, Call) and body.op == "cast" and isinstance(body.args[0], Load)


def _step(p: Node, current: Node, const: set[str], channel: int):
    """(a, b) expressions with ``p == a * current + b`` per output channel, or None."""
    if p.kind != "pointwise" or p.shape != current.shape or not p.dtype.is_floating_point:
        return None
    pos = p.inputs.index(current.name)
    coeffs = _affine(p.body, pos, p.shape)
    if coeffs == NOT_AFFINE or not _channel_only(p, pos, coeffs, const, channel):
        return None
    return coeffs


def _weight_layout(
    graph: Graph, y: Node, const: set[str]
) -> tuple[int, int, int, int | None] | None:
    """(output channel dim, weight arg, weight's channel dim, bias arg or None)
    of a library call whose weight is a constant and bias constant-valued."""
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
    weight = y.inputs[call.args[layout[1]].position]
    if graph.nodes[view_base(graph, weight)].kind != "constant":
        return None
    return layout


def _affine(expr: Expr, pos: int, shape: tuple[int, ...]):
    """(a, b) with ``expr == a * y + b`` where y is input ``pos`` read at the
    own position of a node of ``shape``;
    None stands for zero.  NOT_AFFINE when no such form is found."""
    if not any(isinstance(e, Load) and e.src == pos for e in walk(expr)):
        return None, expr
    if isinstance(expr, Load):
        if expr.src != pos or expr.mask is not None or not reads_own_position(expr, shape):
            return NOT_AFFINE
        return Const(1.0, expr.dtype), None
    if not isinstance(expr, Call):
        return NOT_AFFINE
    parts = [_affine(a, pos, shape) for a in expr.args]
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


def _rewrite(
    graph: Graph, y: Node, chain: list[tuple[Node, tuple]], layout, const: set[str]
) -> Graph:
    """One library call for ``y`` and the affine ``chain`` after it, with the
    coefficients composed in float64 and rounded once into the new weights."""
    channel, weight_arg, weight_dim, bias_arg = layout
    size = y.shape[channel]
    call = y.extern
    refs = {k: y.inputs[v.position] for k, v in enumerate(call.args) if isinstance(v, Arg)}
    fixed = evaluate(graph, {refs[k] for k in (weight_arg, bias_arg) if k in refs})
    weight = fixed[refs[weight_arg]]
    scale = torch.ones(size, dtype=torch.float64, device=weight.device)
    shift = torch.zeros(size, dtype=torch.float64, device=weight.device)
    for p, coeffs in chain:
        a, b = _per_channel(graph, p, coeffs, const, channel, weight.device)
        scale, shift = scale * a, shift * a + b
    shape = [1] * weight.dim()
    shape[weight_dim] = size
    new_weight = weight.double() * scale.view(shape)
    bias = fixed[refs[bias_arg]] if bias_arg in refs else None
    new_bias = shift if bias is None else bias.double() * scale + shift

    end = chain[-1][0]
    lib_name = end.name if end.dtype == y.dtype else graph.fresh_name(f"{end.name}_folded")
    nodes: list[Node] = []
    constants: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    new_inputs = list(y.inputs)
    new_args = list(call.args)
    target, kwargs = call.target, call.kwargs
    for arg, value in ((weight_arg, new_weight), (bias_arg, new_bias)):
        value = value.to(y.dtype).contiguous()
        name = graph.fresh_name(f"{lib_name}_{'weight' if arg == weight_arg else 'bias'}")
        constants[name] = value
        parameter = graph.constant_names.get(view_base(graph, refs[arg])) if arg in refs else None
        if parameter is not None:
            names[name] = parameter
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
        name=lib_name,
        inputs=tuple(new_inputs),
        extern=ExternCall(target, tuple(new_args), kwargs, "library"),
        stride=end.stride if end.stride is not None and lib_name == end.name else y.stride,
    )
    nodes.append(folded)
    if lib_name != end.name:  # the chain ends in another float type: cast the result
        own = ix.out_symbols(len(end.shape))
        body = Call("cast", (Load(0, own, y.dtype),), end.dtype)
        nodes.append(
            Node(end.name, "pointwise", end.shape, end.dtype, (lib_name,), body, stride=end.stride)
        )
    out: list[Node] = []
    removed = {y.name} | {p.name for p, _ in chain}
    for node in graph.nodes.values():
        if node.name == end.name:
            out += nodes
        elif node.name not in removed:
            out.append(node)
    result = graph.replace_nodes(out)
    result.constants.update(constants)
    result.constant_names.update(names)
    return result


def _per_channel(
    graph: Graph, p: Node, coeffs, const: set[str], channel: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The coefficient expressions of ``p`` evaluated per channel, as float64
    (None stands for zero)."""
    size = p.shape[channel]
    values = evaluate(graph, {i for i in p.inputs if i in const})
    args = [values.get(i) for i in p.inputs]
    env = {ix.out_symbols(len(p.shape))[channel]: torch.arange(size, device=device)}
    a, b = (
        torch.zeros(size, dtype=torch.float64, device=device)
        if c is None
        else torch.broadcast_to(eval_expr(c, args, env), (size,)).double()
        for c in coeffs
    )
    return a, b
