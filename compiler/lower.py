"""ATen FX graph -> tilec IR.

The driver walks the FX graph in order and looks each op up in one table,
``tilec.lower_ops.RULES``.  A rule gets a :class:`Lowering` context and the
op's arguments bound to its schema (defaults filled in); tensors arrive as IR
:class:`Node` s.  A rule that does not apply raises :class:`Unsupported`, and
any op without a rule, or whose rule refused it, becomes an explicit ATen
fallback node that runs the original op: a model never fails to compile for
lack of a lowering.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from tilec import index as ix
from tilec import rng, symbolic_scalars
from tilec.freeze import NAME_META
from tilec.ir import (
    CHECKS,
    Arg,
    Call,
    Const,
    Expr,
    ExternCall,
    Graph,
    Load,
    Node,
    View,
    is_collective_op,
)

SUPPORTED_DTYPES = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
}


# Shape, strides and dtype of an extern call's result.
ExternMeta = tuple[ix.Shape, ix.Shape, torch.dtype]


class Unsupported(Exception):
    """A lowering rule does not handle these arguments; fall back to ATen."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision values are computed in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def cast(expr: Expr, dtype: torch.dtype) -> Expr:
    if expr.dtype == dtype:
        return expr
    if isinstance(expr, Const):
        return Const(_python_value(expr.value, dtype), dtype)
    return Call("cast", (expr,), dtype)


def _python_value(value: Any, dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        # Rounded to the dtype: a half tensor compares with fp16(0.1), not 0.1.
        return torch.tensor(float(value), dtype=dtype).item()
    # Like torch, an integer scalar wraps around into the dtype's range
    # (uint8 tensor * 300 multiplies by 44; uint8 > -1 compares with 255).
    info = torch.iinfo(dtype)
    span = info.max - info.min + 1
    return (int(value) - info.min) % span + info.min


def broadcast_index(in_shape: Sequence[int], out_index: Sequence[sympy.Expr]) -> tuple:
    """Index into ``in_shape`` for an output position under numpy broadcasting."""
    lead = len(out_index) - len(in_shape)
    return tuple(
        sympy.Integer(0) if size == 1 else out_index[k + lead] for k, size in enumerate(in_shape)
    )


class Lowering:
    """State of one FX -> IR lowering: the nodes emitted so far."""

    def __init__(
        self,
        name: str,
        symbol_values: dict[sympy.Symbol, int] | None,
        device: torch.device,
    ):
        self.name = name
        # Where the graph's kernels run (:func:`graph_device`).
        self.device = device
        self.nodes: dict[str, Node] = {}
        # None: sizes stay symbolic (the generic variant of a dynamic graph).
        self.symbol_values = symbol_values
        self.fallbacks: dict[str, int] = {}
        self.current: torch.fx.Node | None = None
        # The value (IR node, tuple, size) of each FX node lowered so far.
        self.values: dict[torch.fx.Node, Any] = {}
        # This call's random seed (``tilec.rng``), drawn once per call by a
        # library call made on first use; how many random ops use it.
        self.seed: Node | None = None
        self.random_ops = 0

    def random_stream(self) -> tuple[Node, int]:
        """The call's seed (a 0-d int64 node: a library call drawing it,
        made on first use) and the number of the next random op, which
        generates from seed + number."""
        if self.seed is None:
            meta = ((), (), torch.int64)
            self.seed = self.extern(rng.draw_seed, (str(self.device),), {}, meta, "library")
        self.random_ops += 1
        return self.seed, self.random_ops - 1

    # -------------------------------------------------------- node builders
    def fresh(self, hint: str) -> str:
        base, k = hint, 0
        while hint in self.nodes:
            k += 1
            hint = f"{base}_{k}"
        return hint

    def add(self, node: Node) -> Node:
        self.nodes[node.name] = node
        return node

    def hint(self) -> str:
        return self.current.name if self.current is not None else "t"

    def pointwise(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        inputs: Sequence[Node],
        body: Expr,
        stride: tuple[int, ...] | None = None,
    ) -> Node:
        node = Node(
            self.fresh(self.hint()),
            "pointwise",
            tuple(ix.size(s) for s in shape),
            dtype,
            inputs=tuple(n.name for n in inputs),
            body=cast(body, dtype),
            stride=stride,
        )
        return self.add(node)

    def reduction(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        inputs: Sequence[Node],
        body: Expr,
        op: str,
        reduce_shape: Sequence[int],
    ) -> Node:
        node = Node(
            self.fresh(self.hint()),
            "reduction",
            tuple(ix.size(s) for s in shape),
            dtype,
            inputs=tuple(n.name for n in inputs),
            body=body,
            reduce_op=op,
            reduce_shape=tuple(ix.size(s) for s in reduce_shape),
        )
        return self.add(node)

    def view(self, x: Node, view: View, shape: Sequence[int]) -> Node:
        shape = tuple(ix.size(s) for s in shape)
        if view.op in ("reshape", "expand") and shape == x.shape:
            return x
        if view.op == "permute" and list(view.args[0]) == list(range(len(shape))):
            return x
        node = Node(self.fresh(self.hint()), "view", shape, x.dtype, (x.name,), view=view)
        return self.add(node)

    def extern(
        self,
        target: Any,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        meta: ExternMeta | None,
        role: str = "library",
        device: str | None = None,
    ) -> Node:
        """A call of ``target`` on real tensors; Node arguments become inputs."""
        inputs: list[str] = []

        def ref(a: Any) -> Any:
            if isinstance(a, Node):
                if a.name not in inputs:
                    inputs.append(a.name)
                return Arg(inputs.index(a.name))
            if isinstance(a, (list, tuple)):
                return tuple(ref(x) for x in a)
            return a

        call = ExternCall(
            target, ref(tuple(args)), tuple((k, ref(v)) for k, v in kwargs.items()), role, device
        )
        if meta is None:  # a tuple of results, taken apart by "unpack" nodes
            shape, dtype, stride = (), torch.uint8, None
        else:
            shape, stride, dtype = meta
        node = Node(
            self.fresh(self.hint()),
            "extern",
            shape,
            dtype,
            tuple(inputs),
            extern=call,
            stride=stride,
        )
        return self.add(node)

    # ------------------------------------------------------- expression help
    @property
    def symbolic(self) -> bool:
        return self.symbol_values is None

    def concrete(self, value: Any) -> Any:
        """Replace symbolic sizes by this specialization's integers (or, when
        lowering with symbolic sizes, by sympy expressions)."""
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            if self.symbolic:
                # A size expression; a float or bool computed from sizes is
                # computed by kernels from the size arguments (``scalar``).
                expr = sympy.sympify(ix.size(value.node.expr))
            else:
                expr = value.node.expr.subs(self.symbol_values)
            if expr.free_symbols:
                if self.symbolic:
                    return expr
                raise NotImplementedError(f"size {value} has no value in this specialization")
            kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)]
            return kind(expr)
        if isinstance(value, (list, tuple)):
            return type(value)(self.concrete(v) for v in value)
        return value

    def sizes(self, values: Any) -> ix.Shape:
        """A fake tensor's shape or strides as this lowering's sizes."""
        return tuple(ix.size(s) for s in self.concrete(tuple(values)))

    def meta(self) -> Any:
        return self.current.meta.get("val")

    def out_stride(self) -> tuple[int, ...] | None:
        val = self.meta()
        if not isinstance(val, torch.Tensor):
            return None
        stride = self.sizes(val.stride())
        shape = self.sizes(val.shape)
        return stride if ix.dense_order(shape, stride) is not None else None


def bind_schema(target: Any, args: tuple, kwargs: dict) -> list[Any]:
    """Arguments of an ATen call in schema order, defaults filled in."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return list(args)
    bound = []
    for k, a in enumerate(schema.arguments):
        if k < len(args) and not a.kwarg_only:
            bound.append(args[k])
        elif a.name in kwargs:
            bound.append(kwargs[a.name])
        elif a.has_default_value():
            bound.append(a.default_value)
        else:
            bound.append(None)
    return bound


def lower_graph(
    gm: torch.fx.GraphModule,
    name: str,
    rules: dict[Any, Callable],
    symbol_values: dict[sympy.Symbol, int] | None = None,
) -> tuple[Graph, dict[str, int]]:
    """Lower an ATen-level FX graph; returns the IR graph and fallback counts.

    ``symbol_values``: the sizes to specialize symbolic sizes to; None keeps
    them symbolic (sympy expressions in shapes, strides and indices)."""
    ctx = Lowering(name, symbol_values, graph_device(gm))
    env = ctx.values
    inputs: list[str] = []
    constants: dict[str, torch.Tensor] = {}
    constant_names: dict[str, str] = {}
    outputs: list[str] = []
    literal_outputs: dict[int, Any] = {}
    mutations: dict[str, str] = {}  # input -> the node of its new value

    def value_of(a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    for fx_node in gm.graph.nodes:
        ctx.current = fx_node
        val = fx_node.meta.get("val")
        if fx_node.op == "placeholder":
            if isinstance(val, torch.Tensor):
                node = _input_node(ctx, fx_node.name, val, "input")
                inputs.append(node.name)
                env[fx_node] = node
            else:
                # A symbolic size handed in as an argument: a compile-time integer here.
                inputs.append(ctx.add(Node(ctx.fresh(fx_node.name), "input", (), torch.int64)).name)
                env[fx_node] = ctx.concrete(val)
        elif fx_node.op == "get_attr":
            tensor = getattr(gm, fx_node.target)
            if not isinstance(tensor, torch.Tensor):
                # A subgraph of a higher-order op (cond's branches, a
                # score_mod): an argument of the op's ATen fallback.
                env[fx_node] = tensor
                continue
            node = _input_node(ctx, fx_node.name, tensor, "constant")
            constants[node.name] = tensor
            if NAME_META in fx_node.meta:
                constant_names[node.name] = fx_node.meta[NAME_META]
            env[fx_node] = node
        elif _writes_an_input(fx_node, env):
            env[fx_node] = _input_mutation(ctx, fx_node, value_of, mutations)
        elif fx_node.op == "call_function":
            env[fx_node] = _lower_call(ctx, rules, fx_node, value_of)
        elif fx_node.op == "output":
            # A tuple, or one value (a higher-order op's subgraph).
            results = fx_node.args[0]
            results = results if isinstance(results, (tuple, list)) else (results,)
            for k, out in enumerate(value_of(results)):
                if isinstance(out, Node):
                    _keep_eager_layout(ctx, results[k])
                    outputs.append(out.name)
                else:
                    outputs.append("")
                    literal_outputs[k] = out
        else:
            raise NotImplementedError(f"FX node {fx_node.op} {fx_node.target} in an ATen graph")
    written = {}
    for dst, value in mutations.items():
        written[len(outputs)] = inputs.index(dst)
        outputs.append(value)
    graph = Graph(name, dict(ctx.nodes), inputs, outputs, constants, literal_outputs)
    graph.constant_names = constant_names
    graph.mutations = written
    return graph, ctx.fallbacks


def _writes_an_input(fx_node: torch.fx.Node, env: dict) -> bool:
    """Whether ``fx_node`` is ``copy_`` of a tensor into a graph input: an
    input mutation AOTAutograd kept in its functional graph.  (A ``copy_``
    into anything else, which only graphs traced without functionalization
    have, is an ordinary op.)"""
    if fx_node.target is not torch.ops.aten.copy_.default:
        return False
    dst, src = (env.get(a) if isinstance(a, torch.fx.Node) else a for a in fx_node.args[:2])
    return isinstance(dst, Node) and dst.kind == "input" and isinstance(src, Node)


def _input_mutation(
    ctx: Lowering, fx_node: torch.fx.Node, value_of: Callable, mutations: dict[str, str]
) -> Node:
    """``dst.copy_(src)``: AOTAutograd's input mutation, kept in the graph
    (``keep_inference_input_mutations``): input ``dst``'s new value is
    ``src`` in ``dst``'s shape and dtype, which the call writes into it
    after every step (``Graph.mutations``).  Returns ``dst``: what reads the
    op's result reads the input."""
    dst, src = value_of(fx_node.args[:2])
    value = src
    if (src.shape, src.dtype) != (dst.shape, dst.dtype):
        body = cast(load(0, src, out_index(dst.shape)), dst.dtype)
        value = ctx.pointwise(dst.shape, dst.dtype, [src], body)
    mutations[dst.name] = value.name
    return dst


def graph_device(gm: torch.fx.GraphModule) -> torch.device:
    """The device a graph's kernels run on: the accelerator its tensors are
    on, else the CPU.  A tensor on another device (a CPU step counter beside
    CUDA tensors, as eager allows for 0-dim tensors) is only touched by ATen
    fallbacks (:func:`_off_device`).  Reads AOTAutograd's ``val`` and
    Dynamo's ``example_value``."""
    devices = {
        t.device
        for node in gm.graph.nodes
        for t in _flat(node.meta.get("val", node.meta.get("example_value")))
        if isinstance(t, torch.Tensor)
    }
    accelerators = sorted((d for d in devices if d.type != "cpu"), key=str)
    return accelerators[0] if accelerators else torch.device("cpu")


def _off_device(ctx: Lowering, fx_node: torch.fx.Node) -> str | None:
    """The device of a tensor ``fx_node`` reads or makes that is not the
    graph's, or None: a kernel cannot read it (Triton gets a pointer to the
    graph's device), so the op runs in ATen, which moves it as eager does."""
    tensors = _flat(fx_node.meta.get("val"))
    for arg in fx_node.all_input_nodes:
        tensors += _flat(arg.meta.get("val"))
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device != ctx.device:
            return str(t.device)
    return None


def storage_base(fx_node: torch.fx.Node) -> torch.fx.Node:
    """The FX node whose result owns the storage ``fx_node``'s value lives in:
    in a functional graph only views share their input's storage."""
    storage = StorageWeakRef(fx_node.meta["val"].untyped_storage())
    while fx_node.op == "call_function" and fx_node.args:
        src = fx_node.args[0]
        val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or StorageWeakRef(val.untyped_storage()) != storage:
            break
        fx_node = src
    return fx_node


def _keep_eager_layout(ctx: Lowering, fx_out: torch.fx.Node) -> None:
    """Give the buffer a graph output lives in eager's strides.

    Lowering gives computed nodes eager's strides only where they are dense
    (and some rules none); an output, or the buffer an output is a view
    of, must be laid out as eager lays it out, gaps included, since users
    see its strides."""
    node = ctx.values[fx_out]
    if node.kind == "view":
        fx_out = storage_base(fx_out)
        base = ctx.values[fx_out]
        if not isinstance(base, Node) or _view_chain_base(ctx, node) != base.name:
            return
        node = base
    val = fx_out.meta["val"]
    stride = ctx.sizes(val.stride())
    # A kernel writes each element once: only layouts where no two share memory.
    if node.kind not in ("pointwise", "reduction", "scatter") or not ix.non_overlapping(
        node.shape, stride
    ):
        return
    if node.stride != stride:
        ctx.nodes[node.name] = dataclasses.replace(ctx.nodes[node.name], stride=stride)


def _view_chain_base(ctx: Lowering, node: Node) -> str:
    while node.kind == "view":
        node = ctx.nodes[node.inputs[0]]
    return node.name


def _input_node(ctx: Lowering, name: str, val: torch.Tensor, kind: str) -> Node:
    shape = ctx.sizes(val.shape)
    stride = ctx.sizes(val.stride())
    return ctx.add(Node(ctx.fresh(name), kind, shape, val.dtype, stride=stride))


def _lower_call(ctx: Lowering, rules: dict, fx_node: torch.fx.Node, value_of) -> Any:
    target = fx_node.target
    args, kwargs = value_of(fx_node.args), value_of(fx_node.kwargs)
    val = fx_node.meta.get("val")
    if target is operator.getitem:
        return args[0][args[1]]
    if target in CHECKS:
        return _check(ctx, target, located_check_args(fx_node, args), kwargs)
    if not isinstance(val, torch.Tensor | tuple | list):
        # Size arithmetic (sym_size, operator.mul, ...): known at compile time.
        return ctx.concrete(val)
    device = _off_device(ctx, fx_node)
    if device is not None:
        return _fallback(ctx, target, args, kwargs, val, device)
    if is_collective_op(target) and _dtypes_supported(val, args):
        # torch.distributed's functional collectives (tensor and sequence
        # parallelism): library calls, as matmuls are.
        return call_extern(ctx, target, args, kwargs, val, "library")
    rule = rules.get(target) or rules.get(getattr(target, "overloadpacket", None))
    if rule is not None and _dtypes_supported(val, args):
        try:
            return rule(ctx, *ctx.concrete(bind_schema(target, args, kwargs)))
        except Unsupported:
            pass
        except TypeError:
            # With symbolic sizes, a rule that must decide something about a
            # size sympy cannot decide (``s0 < 8``, ``range(s0)``) falls back.
            if not ctx.symbolic:
                raise
    return _fallback(ctx, target, args, kwargs, val)


def _dtypes_supported(val: Any, args: Sequence[Any]) -> bool:
    vals = val if isinstance(val, (tuple, list)) else [val]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    tensors += [a for a in _flat(args) if isinstance(a, Node)]
    return all(t.dtype in SUPPORTED_DTYPES for t in tensors)


def _flat(args: Any) -> list[Any]:
    if isinstance(args, (list, tuple)):
        return [x for a in args for x in _flat(a)]
    return [args]


def _check(ctx: Lowering, target: Any, args: Any, kwargs: dict) -> None:
    """A runtime check (``torch._check``, ``torch._assert_async``).  One that
    reads only sizes this program is specialized to holds or fails on every
    call the program takes: decided now, and one that fails is kept so that
    each call raises, as eager does.  One on data or on symbolic sizes runs
    in ATen, in the graph's order."""
    args, kwargs = ctx.concrete(args), ctx.concrete(kwargs)
    if not any(isinstance(a, Node | sympy.Basic) for a in _flat([*args, *kwargs.values()])):
        try:
            target(*args, **kwargs)
            return None
        except RuntimeError:
            pass
    _fallback(ctx, target, args, kwargs, None)
    return None


def located_check_args(fx_node: torch.fx.Node, args: tuple) -> tuple:
    """A runtime check's arguments, its message (``_assert_scalar``,
    ``_assert_async.msg``) followed by the user's line that made the check:
    torch's message has the condition as simplified by then ("expression
    True" once a check pinned a size to a number)."""
    trace = (fx_node.meta.get("stack_trace") or "").rstrip()
    if len(args) < 2 or not isinstance(args[1], str) or not trace:
        return args
    lines = trace.splitlines()
    frames = [k for k, line in enumerate(lines) if line.lstrip().startswith("File ")]
    if not frames:
        return args
    return (args[0], "\n".join([args[1], *lines[frames[-1] :]]), *args[2:])


def _fallback(
    ctx: Lowering, target: Any, args: Any, kwargs: dict, val: Any, device: str | None = None
) -> Any:
    """Run the original op on real tensors: an ATen op, a custom op, or a
    higher-order op (``cond``, ``flex_attention``) called with its subgraphs.
    ``device``: the other device it touches (:func:`_off_device`), named in
    the count."""
    name = _fallback_name(target, args) + (f" (on {device})" if device else "")
    ctx.fallbacks[name] = ctx.fallbacks.get(name, 0) + 1
    return call_extern(ctx, target, args, kwargs, val, "fallback", device)


def _fallback_name(target: Any, args: Any) -> str:
    """The op a fallback stands for, as the user knows it."""
    if target is torch.ops.higher_order.with_effects:
        # An op with side effects, threaded through a token: name the op itself.
        return str(args[1])
    if target in (
        torch.ops.higher_order.auto_functionalized,
        torch.ops.higher_order.auto_functionalized_v2,
    ):
        # A custom op that mutates its inputs, in functional form: name the op.
        return str(args[0])
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return str(target) if isinstance(target, torch._ops.OpOverload) else target.__name__


def fallback_with(ctx: Lowering, args: Sequence[Any]) -> Any:
    """The current op as an ATen fallback (counted) on ``args`` instead of
    its own arguments: for a rule that knows an equivalent call tilec can
    run exactly (``as_strided`` of the buffer that owns the storage)."""
    return _fallback(ctx, ctx.current.target, tuple(args), {}, ctx.meta())


def call_extern(
    ctx: Lowering,
    target: Any,
    args: Any,
    kwargs: dict,
    val: Any,
    role: str,
    device: str | None = None,
) -> Any:
    """``target`` on real tensors; a tuple result is taken apart by ``unpack`` nodes."""
    args, kwargs = ctx.concrete(args), ctx.concrete(kwargs)
    if isinstance(val, torch.Tensor):
        return ctx.extern(target, args, kwargs, _concrete_meta(ctx, val), role, device)
    results = ctx.extern(target, args, kwargs, None, role, device)
    if val is None:  # called for its effect (a runtime check)
        return results
    return _unpack(ctx, results, val)


def _unpack(ctx: Lowering, results: Node, val: tuple | list) -> tuple:
    """The parts of the tuple ``results`` (example value ``val``): an unpack
    node for each tensor, nested tuples taken apart in turn (a backward op's
    tuple of buffer gradients); the rest, such as sizes, as constants."""

    def part(k: int, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ctx.extern(operator.getitem, (results, k), {}, _concrete_meta(ctx, v), "unpack")
        if isinstance(v, (tuple, list)):
            inner = ctx.extern(operator.getitem, (results, k), {}, None, "unpack")
            return _unpack(ctx, inner, v)
        return ctx.concrete(v)

    return tuple(part(k, v) for k, v in enumerate(val))


def _concrete_meta(ctx: Lowering, val: torch.Tensor) -> ExternMeta:
    shape = ctx.sizes(val.shape)
    stride = ctx.sizes(val.stride())
    return shape, stride, val.dtype


def load(position: int, node: Node, out_index: Sequence[sympy.Expr]) -> Load:
    """Broadcasting load of ``node`` (input ``position``) at an output index."""
    return Load(position, broadcast_index(node.shape, out_index), node.dtype)


def scalar(value: Any, dtype: torch.dtype) -> Expr:
    """A Python number as a constant of ``dtype``; a symbolic size, or a float
    or bool computed from sizes (generic variant), as the expression computing
    it from the size arguments, cast."""
    if isinstance(value, sympy.Basic):
        return cast(symbolic_scalars.scalar_expr(value), dtype)
    return Const(_python_value(value, dtype), dtype)


def out_index(shape: Sequence[int]) -> tuple[sympy.Symbol, ...]:
    return ix.out_symbols(len(shape))
