"""Scalar simplification: identities and constant arithmetic in node bodies.

Rewrite rules are data:

* ``IDENTITIES``: (op, position of the constant, its value, dtypes) for which
  ``op(x, c)`` is exactly ``x``;
* ``CANCELLING``: unary ops that undo the one they are applied to (double
  negation; a cast back from a type that holds every value, ``f16 -> f32 ->
  f16``), also when the inner op is another node read at the same position;
* casts to the value's own dtype, and ops whose arguments are all constants
  (computed once with torch's semantics for the op's dtype); a checked
  index (``check_index``) of a constant inside its dimension is that
  constant (one outside stays, to raise at run time as eager does);
  one-element constant tensors are read as literals.

A node whose body becomes a plain read of another node at the same position
is an alias: its readers read that node instead (unless it is an output, or
it changes the layout and something other than a kernel or a library call
reads it).  Only exact rewrites are
listed: ``x + 0.0`` is not ``x`` for ``x = -0.0``, so for floats the additive
identities are ``x + -0.0`` and ``x - 0.0``, matched with the zero's sign.
Does nothing when no body matches.
"""

from __future__ import annotations

import dataclasses
import math

import sympy
import torch

from tilec import index as ix
from tilec.ir import (
    CHECK_INDEX,
    KERNEL_KINDS,
    Call,
    Const,
    Expr,
    Graph,
    Load,
    Node,
    is_collective,
    map_loads,
    reads_own_position,
    walk,
)
from tilec.scalar_ops import run_on_constants

# (op, position of the constant argument, its value, dtypes: "any" / "int" / "float").
# A zero's sign matters: x + -0.0 and x - 0.0 are x, x + 0.0 and x - -0.0 are
# not for x = -0.0.
IDENTITIES = [
    ("add", 0, 0, "int"),
    ("add", 1, 0, "int"),
    ("add", 0, -0.0, "float"),
    ("add", 1, -0.0, "float"),
    ("sub", 1, 0, "any"),
    ("mul", 0, 1, "any"),
    ("mul", 1, 1, "any"),
    ("truediv", 1, 1, "float"),
    ("floordiv", 1, 1, "int"),
    ("truncdiv", 1, 1, "int"),
]

# (outer op, inner op): outer(inner(x)) == x, given the dtype condition below.
CANCELLING = [("neg", "neg"), ("cast", "cast")]


def simplify(graph: Graph) -> tuple[Graph, dict[str, int]]:
    """Apply the rules to every pointwise and reduction body; forward aliases."""
    rewriter = _Rewriter(graph)
    readers = graph.users()
    nodes: list[Node] = []
    alias: dict[str, str] = {}
    for node in graph.nodes.values():
        node = dataclasses.replace(node, inputs=tuple(alias.get(i, i) for i in node.inputs))
        if node.body is not None:
            node = rewriter.node(node)
            rewriter.done[node.name] = node
            source = _alias_of(node, graph, rewriter.done)
            if source is not None and _may_alias(graph, node, graph.nodes[source], readers):
                alias[node.name] = source
                rewriter.count += 1
        nodes.append(node)
    kept = [n for n in nodes if n.name not in alias]
    return graph.replace_nodes(kept), {"rewrites": rewriter.count, "aliases": len(alias)}


class _Rewriter:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.done: dict[str, Node] = {}  # nodes already simplified
        self.count = 0

    def node(self, node: Node) -> Node:
        self.inputs = list(node.inputs)
        self.shape = node.shape
        body = self.expr(node.body)
        # Inputs no load reads any more (a producer looked through) are dropped;
        # a scatter's base is read whole by its kernels, not by its body.
        used = sorted({e.src for e in walk(body) if isinstance(e, Load)} | _whole(node))
        position = {old: new for new, old in enumerate(used)}
        body = map_loads(body, lambda load: dataclasses.replace(load, src=position[load.src]))
        return dataclasses.replace(node, body=body, inputs=tuple(self.inputs[k] for k in used))

    def expr(self, e: Expr) -> Expr:
        if isinstance(e, Load):
            scalar = self.graph.constants.get(self.inputs[e.src])
            if scalar is not None and scalar.numel() == 1:
                self.count += 1
                return Const(scalar.reshape(()).item(), scalar.dtype)
            index = tuple(c if isinstance(c, sympy.Expr) else self.expr(c) for c in e.index)
            mask = None if e.mask is None else self.expr(e.mask)
            return dataclasses.replace(e, index=index, mask=mask)
        if not isinstance(e, Call):
            return e
        e = dataclasses.replace(e, args=tuple(self.expr(a) for a in e.args))
        while isinstance(e, Call):
            new = _rewrite_once(e) or self._cancel_across_nodes(e)
            if new is None:
                break
            self.count += 1
            e = new
        return e

    def _cancel_across_nodes(self, e: Call) -> Expr | None:
        """``outer(%a[own position])`` where node a is ``inner(x)``: x, read directly."""
        if len(e.args) != 1 or not isinstance(e.args[0], Load):
            return None
        producer = self.done.get(self.inputs[e.args[0].src])
        if (
            producer is None
            or producer.kind != "pointwise"
            or producer.shape != self.shape
            or not reads_own_position(e.args[0], self.shape)
            or not isinstance(producer.body, Call)
        ):
            return None
        inner = producer.body
        x = inner.args[0] if len(inner.args) == 1 else None
        if not isinstance(x, Load) or x.mask is not None or not _direct(x):
            return None
        if _cancel(e, inner) is None:
            return None
        name = producer.inputs[x.src]
        if name not in self.inputs:
            self.inputs.append(name)
        return dataclasses.replace(x, src=self.inputs.index(name))


def _whole(node: Node) -> set[int]:
    """Inputs ``node`` reads other than through its body's loads."""
    return {0} if node.kind == "scatter" else set()


def _rewrite_once(e: Call) -> Expr | None:
    args = e.args
    for op, pos, value, kinds in IDENTITIES:
        if e.op != op or not _dtype_kind_ok(e.dtype, kinds):
            continue
        c, other = args[pos], args[1 - pos]
        if isinstance(c, Const) and _same_number(c.value, value) and other.dtype == e.dtype:
            return other
    if e.op == "cast" and args[0].dtype == e.dtype:
        return args[0]
    if len(args) == 1 and isinstance(args[0], Call):
        return _cancel(e, args[0])
    if e.op == CHECK_INDEX:
        index, size, _ = args
        if not (isinstance(index, Const) and isinstance(size, Const)) or index.value < 0:
            return None
        # A symbolic size: folded only where the index is provably below it.
        inside = ix.always_positive(sympy.sympify(size.value) - index.value)
        return index if inside else None
    if args and all(isinstance(a, Const) for a in args):
        values, dtypes = [a.value for a in args], [a.dtype for a in args]
        return Const(run_on_constants(e.op, values, dtypes, e.dtype), e.dtype)
    return None


def _same_number(a: bool | int | float, b: int | float) -> bool:
    """``a == b`` with the sign of a zero compared too (-0.0 is not 0)."""
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _cancel(outer: Call, inner: Call) -> Expr | None:
    """``outer(inner(x))`` as ``x`` where the two cancel."""
    if (outer.op, inner.op) not in CANCELLING or len(inner.args) != 1:
        return None
    (x,) = inner.args
    if x.dtype != outer.dtype:
        return None
    if outer.op == "cast" and not _widens(x.dtype, inner.dtype):
        return None
    return x


def _alias_of(node: Node, graph: Graph, done: dict[str, Node]) -> str | None:
    """The node ``node`` reads unchanged at its own position, if that is all it
    does (``done``: the nodes simplified so far)."""
    body = node.body
    if node.kind != "pointwise" or not isinstance(body, Load) or body.mask is not None:
        return None
    source = node.inputs[body.src]
    src = done.get(source) or graph.nodes[source]
    if (src.shape, src.dtype) != (node.shape, node.dtype) or not reads_own_position(
        body, node.shape
    ):
        return None
    return source


def _may_alias(graph: Graph, node: Node, source: Node, readers: dict[str, list[str]]) -> bool:
    """Whether ``node``'s readers may read ``source`` instead.  Outputs stay
    copies; a copy that changes the layout stays unless only kernels and
    library calls read it directly: kernels read by logical index, and a
    library call (matmul, convolution, attention; not a collective, which
    takes them dense) takes operands of any strides, so T5's copies of
    permuted keys and values for attention go.  A fallback such as ``view.dtype`` may depend on the layout, and a view of
    the copy may need the copy's contiguity (a reshape)."""
    if node.name in graph.outputs:
        return False
    same_layout = source.kind != "view" and source.buffer_stride == node.buffer_stride
    return same_layout or all(
        graph.nodes[r].kind in KERNEL_KINDS
        or (
            graph.nodes[r].kind == "extern"
            and graph.nodes[r].extern.role == "library"
            and not is_collective(graph.nodes[r])
        )
        for r in readers[node.name]
    )


def _direct(load: Load) -> bool:
    return all(isinstance(c, sympy.Expr) for c in load.index)


def _dtype_kind_ok(dtype: torch.dtype, kinds: str) -> bool:
    if kinds == "float":
        return dtype.is_floating_point
    if kinds == "int":
        return not dtype.is_floating_point and dtype != torch.bool
    return True


def _widens(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Every value of ``narrow`` survives a round trip through ``wide``."""
    if narrow.is_floating_point and wide.is_floating_point:
        return torch.finfo(wide).bits > torch.finfo(narrow).bits and (
            narrow != torch.bfloat16 or wide in (torch.float32, torch.float64)
        )
    if narrow.is_floating_point or wide.is_floating_point or torch.bool in (narrow, wide):
        return False
    n, w = torch.iinfo(narrow), torch.iinfo(wide)
    return w.min <= n.min and n.max <= w.max
