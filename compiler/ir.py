"""tilec's tensor IR: plain, frozen data and its one printer.

A :class:`Graph` is an ordered list of SSA :class:`Node` s.  A node computes one
tensor.  How it computes it depends on its ``kind``:

* ``input`` / ``constant``: a tensor handed in or captured at compile time.
* ``pointwise``: ``out[i0, i1, ...] = body`` where ``body`` is a scalar
  expression tree over the index symbols.
* ``reduction``: ``out[i...] = reduce_op over r... of body(i..., r...)``.
* ``view``: index remapping of one input (reshape, permute, expand, slice,
  select).  A view never copies; readers fold it into their load indices.
* ``extern``: a call of a torch op on real tensors (matmul and convolution
  library calls, and ATen fallbacks for ops tilec does not lower).
* ``scatter``: an indexed store: the node's value is its base (``inputs[0]``)
  with values stored at computed positions, ``out[position(i...)] = value(i...)``
  (or combined with what is there, ``reduce_op``) for ``i`` over
  ``update_shape`` (see :func:`scatter_parts`).

Scalar bodies are built from :class:`Load`, :class:`Const`, :class:`Index` and
:class:`Call`; every expression knows its dtype.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import sympy
import torch
import torch.fx

from tilec import index as ix
from tilec.decisions import Decision

Kind = Literal["input", "constant", "pointwise", "reduction", "view", "extern", "scatter"]


@dataclass(frozen=True)
class Load:
    """Value of input ``src`` (a position in ``Node.inputs``) at ``index``.

    Each index component is a sympy expression over the index symbols, or, for
    indirect (gathered) access, a scalar expression such as another Load.

    ``mask``, when set, says where the load is meaningful; elsewhere the index
    may be out of bounds and the value is unspecified (callers wrap the load in
    a ``where`` on the same condition).
    """

    src: int
    index: tuple[sympy.Expr | Expr, ...]
    dtype: torch.dtype
    mask: Expr | None = None


@dataclass(frozen=True, eq=False)
class Const:
    # A str only as the last argument of ``check_index`` (see CHECK_INDEX).
    value: bool | int | float | str
    dtype: torch.dtype

    # Equality decides what CSE merges and what the emitter reuses: -0.0 and
    # 0.0 are equal as Python floats but not as constants (``1 / c`` tells
    # them apart), and a nan constant is the same constant as another nan.
    def _key(self) -> tuple:
        v = self.value
        if isinstance(v, float):
            return (self.dtype, "nan" if v != v else v, math.copysign(1.0, v))
        return (self.dtype, v)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Const) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class Index:
    """An integer index expression (sympy, over ``i*``/``r*`` symbols)."""

    expr: sympy.Expr
    dtype: torch.dtype = torch.int64


@dataclass(frozen=True)
class Call:
    """A scalar op from :mod:`tilec.scalar_ops` applied to ``args``."""

    op: str
    args: tuple[Expr, ...]
    dtype: torch.dtype


Expr = Load | Const | Index | Call

# The op of a scatter node's body: ``at(value, c0, c1, ...)`` stores ``value``
# at position ``(c0, c1, ...)`` of the node (index expressions or gathered values).
AT = "at"


# ``check_index(value, size, where)`` is ``value``, an index read from data (a
# gather's, a scatter's), which must lie in ``[0, size)``: elsewhere the program
# raises an error naming ``where`` (a str Const, ``dimension 0 with size 10 in
# aten.embedding``), and kernels access no memory at it.
CHECK_INDEX = "check_index"


def check_index(value: Expr, size: ix.Size, dim: int, op: str) -> Call:
    """``value`` as an index into dimension ``dim`` (of ``size``) of ``op``'s
    operand, checked (see ``CHECK_INDEX``)."""
    where = Const(f"dimension {dim} with size {size} in {op}", torch.int64)
    return Call(CHECK_INDEX, (value, Const(size, torch.int64), where), torch.int64)


# How every index error starts (the runtime recognizes a kernel's by it).
INDEX_ERROR = "tilec: "


def index_error(where: str, value: int | None = None) -> str:
    """The message of an index outside its dimension (``where``: check_index's)."""
    index = "an index" if value is None else f"index {value}"
    return f"{INDEX_ERROR}{index} is out of bounds for {where}"


def scatter_parts(node: Node) -> tuple[Expr, tuple[Expr, ...]]:
    """(value, destination position) of a scatter node, over the index symbols
    of its ``update_shape``.  Lowering makes every gathered component a
    ``check_index``: a position outside the node's shape is an error."""
    assert node.kind == "scatter" and isinstance(node.body, Call) and node.body.op == AT
    value, *position = node.body.args
    return value, tuple(position)


def walk(expr: Expr) -> Iterator[Expr]:
    """Every sub-expression, pre-order (load indices and masks included)."""
    yield expr
    if isinstance(expr, Load):
        for e in expr.index:
            if not isinstance(e, sympy.Expr):
                yield from walk(e)
        if expr.mask is not None:
            yield from walk(expr.mask)
    elif isinstance(expr, Call):
        for a in expr.args:
            yield from walk(a)


def map_loads(expr: Expr, fn) -> Expr:
    """Rebuild ``expr`` with every Load replaced by ``fn(load)`` (bottom-up)."""
    if isinstance(expr, Load):
        new = dataclasses.replace(
            expr,
            index=tuple(e if isinstance(e, sympy.Expr) else map_loads(e, fn) for e in expr.index),
            mask=None if expr.mask is None else map_loads(expr.mask, fn),
        )
        return fn(new)
    if isinstance(expr, Call):
        return dataclasses.replace(expr, args=tuple(map_loads(a, fn) for a in expr.args))
    return expr


@dataclass(frozen=True)
class View:
    """A view op: ``permute(dims)``, ``reshape(shape)``, ``expand(shape)``,
    ``slice(dim, start, step)`` or ``select(dim, index)``."""

    op: Literal["permute", "reshape", "expand", "slice", "select"]
    args: tuple[Any, ...]

    def source_index(
        self, out_index: tuple[sympy.Expr, ...], in_shape: tuple[int, ...]
    ) -> tuple[sympy.Expr, ...]:
        """Index into the viewed tensor that output position ``out_index`` reads."""
        if self.op == "permute":
            src = [sympy.Integer(0)] * len(out_index)
            for k, d in enumerate(self.args[0]):
                src[d] = out_index[k]
            return tuple(src)
        if self.op == "reshape":
            (out_shape,) = self.args
            return ix.unflatten_index(ix.flatten_index(out_index, out_shape), in_shape)
        if self.op == "expand":
            lead = len(out_index) - len(in_shape)
            return tuple(
                sympy.Integer(0) if size == 1 else out_index[k + lead]
                for k, size in enumerate(in_shape)
            )
        if self.op == "slice":
            dim, start, step = self.args
            src = list(out_index)
            src[dim] = start + step * out_index[dim]
            return tuple(src)
        if self.op == "select":
            dim, idx = self.args
            return (*out_index[:dim], sympy.sympify(idx), *out_index[dim:])
        raise AssertionError(self.op)

    def apply(self, t: torch.Tensor, out_shape: tuple[int, ...]) -> torch.Tensor:
        """The same view, done by torch on a real tensor."""
        return apply_view(t, self.op, self.args, out_shape)


def apply_view(t: torch.Tensor, op: str, args: tuple, out_shape: tuple[int, ...]) -> torch.Tensor:
    """View ``op`` with ``args`` (a :class:`View`'s), done by torch on ``t``."""
    if op == "permute":
        return t.permute(args[0])
    if op == "reshape":
        return t.reshape(out_shape)
    if op == "expand":
        return t.expand(out_shape)
    if op == "slice":
        dim, start, step = args
        narrowed = t.narrow(dim, start, (out_shape[dim] - 1) * step + 1 if out_shape[dim] else 0)
        return (
            narrowed if step == 1 else narrowed[(slice(None),) * dim + (slice(None, None, step),)]
        )
    if op == "select":
        dim, idx = args
        return t.select(dim, idx)
    raise AssertionError(op)


@dataclass(frozen=True)
class ExternCall:
    """``target(*args, **kwargs)`` where ``Arg(k)`` stands for ``Node.inputs[k]``.

    ``role`` is ``library`` for calls tilec chose (matmul, convolution),
    ``fallback`` for ATen ops it does not lower, and ``unpack`` for taking one
    tensor out of a fallback that returns several (``operator.getitem``).
    ``device``: set on a fallback that touches a tensor on another device than
    the graph's (a CPU step counter beside CUDA tensors): that device.
    """

    target: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    role: Literal["library", "fallback", "unpack"]
    device: str | None = None


@dataclass(frozen=True)
class Arg:
    position: int


@dataclass(frozen=True)
class Node:
    name: str
    kind: Kind
    shape: tuple[int, ...]
    dtype: torch.dtype
    inputs: tuple[str, ...] = ()
    body: Expr | None = None
    reduce_op: str | None = None
    reduce_shape: tuple[int, ...] = ()
    view: View | None = None
    extern: ExternCall | None = None
    # Strides of the buffer this node is stored in when it is materialized.
    stride: tuple[int, ...] | None = None
    # A scatter's iteration space: its body is over the index symbols of this
    # shape (the values' shape), not of ``shape`` (the base's).
    update_shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> ix.Size:
        """Bytes of the node's elements (not of a strided buffer's extent)."""
        return ix.numel(self.shape) * self.dtype.itemsize

    @property
    def buffer_stride(self) -> tuple[int, ...]:
        return self.stride if self.stride is not None else ix.contiguous_strides(self.shape)


@dataclass(frozen=True)
class Group:
    """A set of pointwise/reduction nodes that become one kernel.

    The iteration space is ``shape`` (pointwise) or rows of ``shape`` by
    ``reduce_shape`` (reduction).  ``stored`` nodes are written to memory;
    the others are inlined into their readers.  ``reason`` says why the
    group was formed.
    """

    name: str
    nodes: tuple[str, ...]
    stored: tuple[str, ...]
    shape: tuple[int, ...]
    reduce_shape: tuple[int, ...]
    reason: str
    # The first of a scatter node's two kernels: it writes the base of the
    # scatter node it stores into that node's buffer (a copy, or computed by
    # ``nodes`` when only the scatter reads it); the scatter's own group then
    # stores its values.
    init: bool = False
    # Independent groups run side by side in one kernel (``passes/combine.py``):
    # ``nodes`` and ``stored`` are theirs together, ``shape`` is ().
    parts: tuple[Group, ...] = ()
    # A chain (``passes/chain.py``): ``parts`` run as consecutive stages of
    # one kernel, each waiting for the ones before it; how many parts each
    # stage has (a stage may be a combination).  Empty: not a chain.
    stages: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemoryPlan:
    """Where the memory planning pass put each intermediate buffer: byte
    ``offsets`` into one arena of ``arena_bytes``, the (aligned) ``sizes``,
    ``lifetimes`` as (first, last) step of the schedule, and the ``in_place``
    pairs that share an offset although their lifetimes touch."""

    offsets: dict[str, int]
    sizes: dict[str, int]
    lifetimes: dict[str, tuple[int, int]]
    arena_bytes: int
    # Buffers a kernel writes over one of its inputs (same offset): out -> in.
    in_place: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass
class Graph:
    """Nodes in topological order; ``outputs`` name the returned nodes."""

    name: str
    nodes: dict[str, Node]
    inputs: list[str]
    outputs: list[str]
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # Graph outputs that are not tensors (None, Python numbers), by position;
    # ``outputs`` holds a placeholder name "" at those positions.
    literal_outputs: dict[int, Any] = dataclasses.field(default_factory=dict)
    # A graph with symbolic sizes: the size symbols' values in the call it was
    # compiled for, used where a decision needs a number (fusion benefit,
    # block sizes); the code stays correct for every value.
    hints: dict[sympy.Symbol, int] = dataclasses.field(default_factory=dict)
    # Set by the fusion pass: the kernels.
    groups: list[Group] | None = None
    # What the passes chose and why (fusion, matmuls, layout, quantization).
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    # Set by memory planning: the order of kernels and extern calls, and the arena.
    schedule: list[str] | None = None
    memory: MemoryPlan | None = None
    # Constant node -> the name of the parameter it holds (its module path,
    # ``fc.weight``), for constants that freezing made from parameters or
    # that passes computed from one such constant alone.
    constant_names: dict[str, str] = dataclasses.field(default_factory=dict)
    # Inputs the graph writes (AOTAutograd's input mutations, kept in the
    # graph): output position -> input position.  Those outputs are the
    # inputs' new values, the last of ``outputs``; a call writes each into
    # its input and does not return it.
    mutations: dict[int, int] = dataclasses.field(default_factory=dict)
    # Set by ``passes/in_place.py``: a scatter or pointwise node -> the input
    # it stores into (its new value), every other read of which comes first.
    in_place: dict[str, str] = dataclasses.field(default_factory=dict)
    # Cache of ``recomputed()``: nodes must not change after its first call.
    _recomputed: frozenset[str] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def recomputed(self) -> frozenset[str]:
        """Pointwise nodes that are never stored: each reader computes them
        from their inputs (see :func:`recomputed_nodes`)."""
        if self._recomputed is None:
            self._recomputed = recomputed_nodes(self)
        return self._recomputed

    def fresh_name(self, hint: str, taken: set[str] | None = None) -> str:
        """``hint``, or ``hint_1``, ``hint_2``, ...: the first that names no
        node or constant of the graph (for a node a pass adds), nor one in
        ``taken`` (the names a pass has given so far), which it joins."""
        name, k = hint, 0
        while name in self.nodes or name in self.constants or name in (taken or ()):
            k += 1
            name = f"{hint}_{k}"
        if taken is not None:
            taken.add(name)
        return name

    def users(self) -> dict[str, list[str]]:
        users: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in self.nodes.values():
            for i in dict.fromkeys(node.inputs):
                users[i].append(node.name)
        return users

    def computed_from(
        self, names: Iterable[str], users: dict[str, list[str]] | None = None
    ) -> set[str]:
        """The nodes computed (directly or not) from any of nodes ``names``
        (``users``: :meth:`users`, where a caller asks many times)."""
        users = self.users() if users is None else users
        found: set[str] = set()
        todo = [u for n in names for u in users[n]]
        while todo:
            current = todo.pop()
            if current not in found:
                found.add(current)
                todo += users[current]
        return found

    def replace_nodes(self, nodes: list[Node], outputs: list[str] | None = None) -> Graph:
        """The same graph with other nodes (and outputs).

        What fusion and memory planning decided (groups, schedule, arena) is
        carried over, so a pass after them only changes what it means to; it
        refers to nodes by name, so a node it names must not disappear."""
        names = {n.name for n in nodes}
        out = Graph(
            self.name,
            {n.name: n for n in nodes},
            list(self.inputs),
            list(self.outputs if outputs is None else outputs),
            # A constant no node refers to any more is dropped with its node.
            {k: v for k, v in self.constants.items() if k in names},
            dict(self.literal_outputs),
            dict(self.hints),
            groups=self.groups,
            decisions=list(self.decisions),
            schedule=self.schedule,
            memory=self.memory,
            constant_names={k: v for k, v in self.constant_names.items() if k in names},
            mutations=dict(self.mutations),
            in_place=dict(self.in_place),
        )
        for group in self.groups or ():
            gone = [n for n in group.nodes if n not in names]
            if gone:
                raise ValueError(
                    f"replace_nodes: kernel {group.name} contains %{gone[0]}, which the new "
                    "nodes no longer have; passes that remove nodes run before fusion"
                )
        return out


# The reader ``readers`` reports for a graph output.
OUTPUT = "@output"


def readers(graph: Graph) -> dict[str, dict[str, bool]]:
    """Who reads each node's values, looking through views and recomputed nodes.

    For every node: the nodes that read its memory (and ``OUTPUT`` for a
    graph output), each mapped to whether it reads through a view (True if
    any of its reads does).  A view never copies, so what reads a view of a
    buffer reads the buffer; a recomputed node (``Graph.recomputed``) is never
    stored, so what reads it reads the buffers it is computed from."""
    return _readers(graph, graph.recomputed())


def _readers(graph: Graph, transparent: frozenset[str]) -> dict[str, dict[str, bool]]:
    direct: dict[str, list[str]] = {n: [] for n in graph.nodes}
    for node in graph.nodes.values():
        for i in dict.fromkeys(node.inputs):
            direct[i].append(node.name)
    for out in dict.fromkeys(graph.outputs):
        if out:
            direct[out].append(OUTPUT)
    found: dict[str, dict[str, bool]] = {}
    for name in reversed(graph.nodes):  # readers come after what they read
        mine: dict[str, bool] = {}
        for r in direct[name]:
            if r != OUTPUT and (graph.nodes[r].kind == "view" or r in transparent):
                for rr, via_view in found[r].items():
                    mine[rr] = mine.get(rr, False) or via_view or graph.nodes[r].kind == "view"
            else:
                mine.setdefault(r, False)
        found[name] = mine
    return {name: found[name] for name in graph.nodes}


def base_inputs(graph: Graph, node: Node) -> list[str]:
    """The buffers ``node`` reads: its inputs, looking through chains of
    views and through recomputed nodes to what they are computed from."""
    return [b for name in node.inputs for b in buffers_of(graph, name)]


def buffers_of(graph: Graph, name: str) -> list[str]:
    """The buffers that reading node ``name`` reads: its own, or, for a view or
    a recomputed node, those it is a view of or is computed from."""
    name = view_base(graph, name)
    if name in graph.recomputed():
        return base_inputs(graph, graph.nodes[name])
    return [name]


def is_free(node: Node) -> bool:
    """A pointwise node that reads no tensor (a constant, an iota)."""
    return node.kind == "pointwise" and not node.inputs


def recomputed_nodes(graph: Graph) -> frozenset[str]:
    """Pointwise nodes every reader recomputes instead of loading them.

    Two kinds: nodes that read no tensor (:func:`is_free`), and casts or
    copies of one tensor at the node's own position to an element at least as
    wide: a reader that loads the (narrower or equal) source and converts it
    moves fewer bytes than a kernel that writes the copy and a reader that
    loads it back (a bf16 model's float32 upcasts before a group norm).
    Only nodes that kernels alone read qualify: a graph output or a library
    call needs the values in memory."""
    candidates = frozenset(n for n, node in graph.nodes.items() if _recomputable(node))
    direct = _readers(graph, frozenset())
    return frozenset(
        n
        for n in candidates
        if all(r != OUTPUT and graph.nodes[r].kind in KERNEL_KINDS for r in direct[n])
    )


def _recomputable(node: Node) -> bool:
    if is_free(node):
        return True
    if node.kind != "pointwise" or len(node.inputs) != 1:
        return False
    body = node.body
    if isinstance(body, Call) and body.op == "cast":
        (body,) = body.args
    return (
        isinstance(body, Load)
        and body.mask is None
        and all(isinstance(c, sympy.Expr) for c in body.index)
        and ix.same_position(body.index, node.shape)
        and body.dtype.itemsize <= node.dtype.itemsize
    )


# Kinds of node that kernels compute.
KERNEL_KINDS = ("pointwise", "reduction", "scatter")


def is_random(node: Node) -> bool:
    """An extern call of a random op: never merged, never folded."""
    if node.kind != "extern":
        return False
    return torch.Tag.nondeterministic_seeded in getattr(node.extern.target, "tags", ())


# Library calls that are matrix products: linear layers and batched products.
MATMULS = (
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
)


def is_matmul(node: Node) -> bool:
    """A library call of a matrix product (``MATMULS``)."""
    return node.kind == "extern" and node.extern.role == "library" and node.extern.target in MATMULS


def _space(group: Group) -> str:
    """A kernel's iteration space as the dump prints it: ``[rows] x [reduced]``."""
    space = f"[{', '.join(map(str, group.shape))}]"
    if group.reduce_shape:
        space += f" x [{', '.join(map(str, group.reduce_shape))}]"
    return space


def is_collective(node: Node) -> bool:
    """A call of one of torch.distributed's functional collectives
    (``_c10d_functional``: all_reduce, all_gather_into_tensor, ...,
    wait_tensor), a library call that may read its operands until the
    matching ``wait_tensor`` and takes them dense."""
    return node.kind == "extern" and is_collective_op(node.extern.target)


def is_collective_op(target: object) -> bool:
    return getattr(target, "namespace", None) == "_c10d_functional"


# Ops that only raise when a condition fails (``torch._check`` on sizes,
# ``torch._assert_async`` on a tensor, size-range constraints): they return
# nothing, so nothing reads them.
CHECKS = frozenset(
    {
        torch.ops.aten._assert_async.default,
        torch.ops.aten._assert_async.msg,
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten.sym_constrain_range.default,
        torch.ops.aten.sym_constrain_range_for_size.default,
    }
)


def is_check(node: Node) -> bool:
    """An extern call of a runtime check (``CHECKS``): kept for its effect."""
    return node.kind == "extern" and node.extern.target in CHECKS


def is_tuple(node: Node) -> bool:
    """An extern call that returns several tensors (read through ``unpack`` nodes)."""
    return (
        node.kind == "extern"
        and node.extern.role != "unpack"
        and node.stride is None
        and node.shape == ()
    )


def reads_own_position(load: Load, shape: tuple[int, ...]) -> bool:
    """Whether ``load``, in a node of ``shape``, reads the element at the
    node's own position (``i_k``, or 0 in a size-1 dimension)."""
    return ix.same_position(load.index, shape)


def view_base(graph: Graph, name: str) -> str:
    """The first non-view node under a chain of views."""
    node = graph.nodes[name]
    while node.kind == "view":
        node = graph.nodes[node.inputs[0]]
    return node.name


def prologue_reads(graph: Graph, name: str) -> set[str]:
    """The buffers a template reads for its operand ``name``, where fusion
    computes the operand in its prologue: under views, and under pointwise
    nodes of constants only (a weight's dequantization: its packed bytes
    and scales) or of one input (a copy or cast: ``repeat_kv``'s keys
    expanded over the heads that share them are read once)."""
    node = graph.nodes[view_base(graph, name)]
    sources = [graph.nodes[view_base(graph, i)] for i in node.inputs]
    if node.kind == "pointwise" and sources and all(s.kind == "constant" for s in sources):
        return {s.name for s in sources}
    if node.kind == "pointwise" and len(sources) == 1:
        return prologue_reads(graph, sources[0].name)
    return {node.name}


# ---------------------------------------------------------------- printing

_DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def format_type(node: Node) -> str:
    return f"{dtype_name(node.dtype)}[{', '.join(str(s) for s in node.shape)}]"


def format_expr(expr: Expr | sympy.Expr, names: tuple[str, ...]) -> str:
    if isinstance(expr, sympy.Expr):
        return str(expr)
    if isinstance(expr, Load):
        idx = ", ".join(format_expr(e, names) for e in expr.index)
        mask = "" if expr.mask is None else f" if {format_expr(expr.mask, names)}"
        return f"%{names[expr.src]}[{idx}{mask}]"
    if isinstance(expr, Const):
        return repr(expr.value)
    if isinstance(expr, Index):
        return str(expr.expr)
    if expr.op == "cast":
        return f"{dtype_name(expr.dtype)}({format_expr(expr.args[0], names)})"
    return f"{expr.op}({', '.join(format_expr(a, names) for a in expr.args)})"


def format_extern(call: ExternCall, names: tuple[str, ...]) -> str:
    def arg(a: Any) -> str:
        if isinstance(a, Arg):
            return f"%{names[a.position]}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        if isinstance(a, torch.fx.GraphModule):
            # A higher-order op's subgraph: its ops, not its Python repr.
            ops = (str(n.target) for n in a.graph.nodes if n.op == "call_function")
            return f"subgraph({', '.join(ops)})"
        return repr(a)

    if call.role == "unpack":
        return f"unpack {arg(call.args[0])}[{call.args[1]}]"
    parts = [arg(a) for a in call.args] + [f"{k}={arg(v)}" for k, v in call.kwargs]
    return f"{call.role} {call.target}({', '.join(parts)})"


def format_node(node: Node) -> str:
    head = f"%{node.name} = {node.kind:<9} {format_type(node)}"
    if node.stride is not None and node.stride != ix.contiguous_strides(node.shape):
        head += f" strides({', '.join(map(str, node.stride))})"
    if node.kind == "pointwise":
        return f"{head}  {format_expr(node.body, node.inputs)}"
    if node.kind == "reduction":
        ranges = ", ".join(f"r{k} < {s}" for k, s in enumerate(node.reduce_shape))
        return f"{head}  {node.reduce_op}({format_expr(node.body, node.inputs)}) over {ranges}"
    if node.kind == "view":
        return f"{head}  {node.view.op}{node.view.args} of %{node.inputs[0]}"
    if node.kind == "extern":
        return f"{head}  {format_extern(node.extern, node.inputs)}"
    if node.kind == "scatter":
        value, position = scatter_parts(node)
        where = ", ".join(format_expr(c, node.inputs) for c in position)
        combine = {None: "=", "sum": "+=", "max": "max=", "min": "min="}
        space = ", ".join(f"i{k} < {s}" for k, s in enumerate(node.update_shape))
        return (
            f"{head}  %{node.inputs[0]} with [{where}] {combine[node.reduce_op]} "
            f"{format_expr(value, node.inputs)} over {space}"
        )
    return head


def format_graph(graph: Graph) -> str:
    params = ", ".join(f"%{n}: {format_type(graph.nodes[n])}" for n in graph.inputs)
    lines = [f"graph {graph.name}({params})"]
    for node in graph.nodes.values():
        if node.kind != "input":
            parameter = graph.constant_names.get(node.name)
            lines.append(f"  {format_node(node)}" + (f"  ({parameter})" if parameter else ""))
    rets = [
        repr(graph.literal_outputs[k]) if k in graph.literal_outputs else f"%{o}"
        for k, o in enumerate(graph.outputs)
    ]
    lines.append("  return " + ", ".join(rets))
    for g in graph.groups or ():
        # A combined kernel: each part's space, " + " between them.
        space = " + ".join(_space(p) for p in g.parts) if g.parts else _space(g)
        nodes = ", ".join(
            ["init", *(f"%{n}" for n in g.nodes)] if g.init else [f"%{n}" for n in g.nodes]
        )
        stored = ", ".join(f"%{n}" for n in g.stored)
        lines.append(f"kernel {g.name} over {space}: {nodes}  stores {stored}  ({g.reason})")
    if graph.decisions:
        lines.append("decisions:")
        lines += [f"  {d.stage}: {d.text()}" for d in graph.decisions]
    if graph.schedule is not None:
        lines.append("schedule: " + ", ".join(graph.schedule))
    if graph.memory is not None:
        plan = graph.memory
        lines.append(f"arena: {plan.arena_bytes} bytes")
        for name, offset in sorted(plan.offsets.items(), key=lambda kv: (kv[1], kv[0])):
            first, last = plan.lifetimes[name]
            over = f", in place of %{plan.in_place[name]}" if name in plan.in_place else ""
            lines.append(
                f"  %{name}: offset {offset}, {plan.sizes[name]} bytes, steps {first}..{last}{over}"
            )
    return "\n".join(lines) + "\n"
