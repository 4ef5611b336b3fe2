"""A compiled graph as an immutable plan: tensor slots with roles, and steps.

The plan is everything a call of a compiled graph needs that can be decided
when it is built: which tensor each step reads and writes, and what *role*
each tensor has (:class:`Role`: a call argument, a constant, a planned
intermediate in the arena, a buffer allocated per call, a library call's
result, a view), the order of kernel launches and library calls, each
launch's grid and options.  Executors (:mod:`tilec.runtime.executors`) run it.

From the steps the plan writes the *call function*: Python source, one line
per step, that takes the call's arguments and returns its outputs (see
:meth:`Plan.source`; it is dumped as ``program.py``).  Kernels, library
targets and prepared tensors are names in the function's namespace, so a
call does nothing but the steps: no per-step dispatch, no argument lists
built from slot tables, no sympy.  Views of tensors that live as long as the
executor (constants, the arena) are made once, when the executor prepares
them, not per call.

A graph compiled for symbolic sizes (the generic variant of a dynamic graph)
gets a call function with one more argument, ``sizes`` (the size symbols'
values by name): grids, size arguments of kernels, shapes of per-call
buffers and arguments of library calls and views are integer arithmetic on
them, printed into the source.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree

from tilec import index as ix
from tilec.codegen.kernel import KernelSource
from tilec.codegen.launch import INT32_LIMIT
from tilec.ir import Arg, Graph, Node, apply_view


class Role(enum.Enum):
    """What a tensor slot of a plan holds, and so who provides it and when."""

    INPUT = "input"  # an argument of the call
    STATIC_INPUT = "static input"  # an argument that keeps its storage between calls (parameters)
    CONSTANT = "constant"  # a compile-time constant (frozen weights, folded values)
    ARENA = "arena"  # a planned intermediate: a view of the executor's arena
    BUFFER = "buffer"  # written by a kernel and alive after the call: allocated per call
    LIBRARY = "library result"  # returned by a library call or an ATen fallback
    VIEW = "view"  # a view of another slot


# Roles whose tensors an executor makes once and keeps (and so their views).
PREPARED_ROLES = frozenset({Role.CONSTANT, Role.ARENA})


@dataclasses.dataclass(frozen=True)
class Slot:
    var: str  # the variable holding it in the call function
    node: Node
    role: Role


@dataclasses.dataclass(frozen=True)
class LaunchStep:
    kernel: KernelSource
    fn: Any  # the @triton.jit function
    var: str  # its name in the call function's namespace
    args: tuple[str, ...]  # slot variables, in the kernel's parameter order
    grid: tuple[ix.Size, ...]

    @property
    def symbolic(self) -> bool:
        return any(not isinstance(g, int) for g in self.grid)

    @property
    def options(self) -> dict[str, Any]:
        return self.kernel.launch.options


@dataclasses.dataclass(frozen=True)
class LibraryStep:
    """A library call or ATen fallback: ``out = node.extern.target(...)``."""

    node: Node
    var: str  # the target's name in the namespace
    args: tuple[str, ...]  # slot variables of node.inputs
    out: str


@dataclasses.dataclass(frozen=True)
class ViewStep:
    """``out`` is a view of ``src``: the node's view op, or (``strided``) the
    (shape, stride, offset from src's) that a chain of views from ``src``
    comes to, made in one ``as_strided``."""

    node: Node
    src: str
    out: str
    strided: tuple[tuple[int, ...], tuple[int, ...], int] | None = None

    def apply(self, src: torch.Tensor) -> torch.Tensor:
        if self.strided is None:
            return apply_view(src, self.node.view.op, self.node.view.args, self.node.shape)
        shape, stride, offset = self.strided
        return src.as_strided(shape, stride, src.storage_offset() + offset)


Step = LaunchStep | LibraryStep | ViewStep


@dataclasses.dataclass(frozen=True)
class ViewChain:
    """The views (``steps``, in order) that make a view of slot ``root``."""

    root: str
    node: Node  # the root's
    steps: tuple[ViewStep, ...]

    def at(self, root: torch.Tensor, sizes: dict[str, int]) -> torch.Tensor:
        """The view of ``root`` (the root slot's tensor, made for larger
        sizes and laid out at ``sizes``' strides, as a bucket graph's
        buffers are) as it is at ``sizes``."""
        shape = at_sizes(self.node.shape, sizes)
        stride = at_sizes(self.node.buffer_stride, sizes)
        out = root.as_strided(shape, stride, root.storage_offset())
        for step in self.steps:
            out = _view_at(step, out, sizes)
            if out is None:
                raise RuntimeError(f"tilec: view %{step.node.name} is a copy at sizes {sizes}")
        return out


def _view_at(step: ViewStep, src: torch.Tensor, sizes: dict[str, int]) -> torch.Tensor | None:
    """``step``'s view of ``src`` at ``sizes``; None where torch makes it a copy."""
    if step.strided is not None:
        out = step.apply(src)
    else:
        view = step.node.view
        args, shape = at_sizes(view.args, sizes), at_sizes(step.node.shape, sizes)
        out = apply_view(src, view.op, args, shape)
    return out if torch._C._is_alias_of(out, src) else None


def keep_strides(result: Any, shape: tuple[int, ...], stride: tuple[int, ...]) -> Any:
    """A library call's result with the strides codegen baked in (the ones
    fake tensors predicted), copied into such a buffer if torch chose others."""
    if isinstance(result, torch.Tensor) and result.numel() > 1 and result.stride() != stride:
        fixed = torch.empty_strided(shape, stride, dtype=result.dtype, device=result.device)
        result = fixed.copy_(result)
    return result


class Plan:
    """The slots and steps of one compiled graph (immutable once built)."""

    def __init__(
        self,
        graph: Graph,
        kernels: dict[str, tuple[KernelSource, Any]],
        static_inputs: frozenset[int] = frozenset(),
    ):
        self.graph = graph
        self.slots: dict[str, Slot] = {}  # by node name, in order of creation
        self.steps: list[Step] = []
        # Values a call function refers to by name: kernels, library targets,
        # constant arguments of library calls.
        self.names: dict[str, Any] = {}
        self.symbols = _symbols_used(graph, kernels)
        for k, name in enumerate(graph.inputs):
            self._add(name, Role.STATIC_INPUT if k in static_inputs else Role.INPUT)
        for name in graph.constants:
            self._add(name, Role.CONSTANT)
        for u in graph.schedule:
            if u in kernels:
                self._add_launch(*kernels[u])
            else:
                node = graph.nodes[u]
                args = tuple(self._materialize(i) for i in node.inputs)
                var = self._name(f"f_{node.extern.role}", node.extern.target)
                self.steps.append(LibraryStep(node, var, args, self._add(u, Role.LIBRARY)))
        self.outputs: list[str | None] = [
            None if k in graph.literal_outputs else self._materialize(name)
            for k, name in enumerate(graph.outputs)
        ]
        self.size_limits = _size_limits(graph, kernels)
        # Library call arguments and returned values that have no literal
        # are named now, so that every namespace made from ``names`` holds
        # them, whether or not ``source()`` ran before (it names them too).
        for step in self.library_calls():
            self._library_lines(step)
        for k in graph.literal_outputs:
            self._literal(k)

    # ------------------------------------------------------------- building

    def _add(self, name: str, role: Role) -> str:
        var = "b_" + re.sub(r"\W", "_", name)
        while any(s.var == var for s in self.slots.values()):
            var += "_"
        self.slots[name] = Slot(var, self.graph.nodes[name], role)
        return var

    def _name(self, prefix: str, value: Any) -> str:
        name = f"{prefix}{len(self.names)}"
        self.names[name] = value
        return name

    def _materialize(self, name: str) -> str:
        """The variable holding node ``name`` as a real tensor (views made by torch)."""
        if name in self.slots:
            return self.slots[name].var
        node = self.graph.nodes[name]
        if node.kind != "view":
            raise KeyError(f"node %{name} is used before it is computed")
        chain = [node]
        while chain[-1].kind == "view" and chain[-1].inputs[0] not in self.slots:
            chain.append(self.graph.nodes[chain[-1].inputs[0]])
        base = chain.pop() if chain[-1].kind != "view" else None
        if base is not None:  # a chain of views of a node not yet made
            self._materialize(base.name)
        src = self.slots[chain[-1].inputs[0]]
        strided = self._strided(src, chain[::-1])
        if strided is None:  # one step per view of the chain
            src_var = self._materialize(node.inputs[0])
            out = self._add(name, Role.VIEW)
            self.steps.append(ViewStep(node, src_var, out))
            return out
        out = self._add(name, Role.VIEW)
        self.steps.append(ViewStep(node, src.var, out, strided))
        return out

    def _strided(self, src: Slot, chain: list[Node]) -> tuple | None:
        """The layout a chain of views makes of ``src`` (shape, stride and
        offset from src's), when it is known now: sizes and src's strides
        are static, and every view in the chain is a view, not a copy."""
        known = src.role != Role.LIBRARY or src.node.stride is not None
        if self.symbols or not known or src.role == Role.VIEW:
            return None
        base = torch.empty_strided(
            src.node.shape, src.node.buffer_stride, dtype=src.node.dtype, device="meta"
        )
        t = base
        for node in chain:
            t = apply_view(t, node.view.op, node.view.args, node.shape)
        if not torch._C._is_alias_of(t, base):
            return None
        return tuple(t.shape), tuple(t.stride()), t.storage_offset()

    def _add_launch(self, kernel: KernelSource, fn: Any) -> None:
        group = kernel.group
        for name in (n for part in (group.parts or (group,)) for n in part.stored):
            if name in self.graph.in_place and name not in self.slots:
                # A value stored into the input it is the new value of (its
                # kernel may pass it as that input's argument): that tensor.
                written = self.slots[self.graph.in_place[name]]
                self.slots[name] = Slot(written.var, self.graph.nodes[name], written.role)
        for arg in kernel.args:
            if arg.is_output and arg.buffer not in self.slots:
                planned = arg.buffer in self.graph.memory.offsets
                self._add(arg.buffer, Role.ARENA if planned else Role.BUFFER)
        # (After the outputs' slots: a kernel may read back what it stored,
        # a split attention combining its chunks, ``codegen/attention.py``.)
        args = [self.slots[arg.buffer].var for arg in kernel.args]
        grid = tuple(kernel.launch.grid)
        if any(not isinstance(g, int) for g in grid) or all(grid):  # else nothing to compute
            var = self._name("k", fn)
            self.steps.append(LaunchStep(kernel, fn, var, tuple(args), grid))

    # ------------------------------------------------------------ questions

    def role_of(self, var: str) -> Role:
        return self._by_var()[var].role

    def _by_var(self) -> dict[str, Slot]:
        return {s.var: s for s in self.slots.values()}

    def inputs(self) -> list[Slot]:
        return [self.slots[name] for name in self.graph.inputs]

    def launches(self) -> list[LaunchStep]:
        return [s for s in self.steps if isinstance(s, LaunchStep)]

    def library_calls(self) -> list[LibraryStep]:
        return [s for s in self.steps if isinstance(s, LibraryStep)]

    def fallbacks(self) -> list[LibraryStep]:
        """The ATen fallbacks among the library calls."""
        return [s for s in self.library_calls() if s.node.extern.role == "fallback"]

    def step_counts(self) -> dict[str, int]:
        kinds = {LaunchStep: "launches", LibraryStep: "library", ViewStep: "views"}
        counts = dict.fromkeys(kinds.values(), 0)
        for step in self.steps:
            counts[kinds[type(step)]] += 1
        return counts

    def guards(self) -> list[str]:
        """What the code assumes of the size symbols (symbolic graphs)."""
        symbols = sorted({s.name for c in self.size_limits for s in ix.size_symbols(c)})
        return [f"{s} >= 2" for s in symbols] + [f"{c} <= {INT32_LIMIT}" for c in self.size_limits]

    def prepared(self, static_buffers: bool) -> list[Step | Slot]:
        """What an executor makes once, in order: arena slots, (with
        ``static_buffers``) the per-call buffers, and the views of those and
        of constants whose sizes are known."""
        roles = PREPARED_ROLES | ({Role.BUFFER} if static_buffers else set())
        made: set[str] = {s.var for s in self.slots.values() if s.role in roles}
        out: list[Step | Slot] = [
            s for s in self.slots.values() if s.role in roles - {Role.CONSTANT}
        ]
        for step in self.steps:
            if isinstance(step, ViewStep) and step.src in made and not _symbolic(step.node.shape):
                if not _symbolic(step.node.view.args):
                    made.add(step.out)
                    out.append(step)
        return out

    def refreshed(self) -> list[ViewStep]:
        """Views of static inputs (a linear layer's transposed weight), in
        order: made again only when a static input's storage moved."""
        made = {s.var for s in self.slots.values() if s.role == Role.STATIC_INPUT}
        out = []
        for step in self.steps:
            if isinstance(step, ViewStep) and step.src in made and step.strided is not None:
                made.add(step.out)
                out.append(step)
        return out

    def refreshed_roots(self) -> list[str]:
        """The static inputs whose views :meth:`refreshed` makes."""
        views = self.refreshed()
        outs = {v.out for v in views}
        return sorted({v.src for v in views} - outs, key=self._order)

    def _order(self, var: str) -> int:
        return [s.var for s in self.slots.values()].index(var)

    # ---------------------------------------------- one graph for many sizes

    def size_positions(self, kernel: KernelSource) -> tuple[int, ...]:
        """Where each of ``kernel``'s size arguments is among :attr:`symbols`."""
        return tuple(self.symbols.index(s) for s in kernel.sizes)

    def layouts(self, sizes: dict[str, int]) -> dict[str, tuple[tuple, tuple, int]]:
        """Every tensor variable's (shape, stride, storage offset) at
        ``sizes``: buffers as their nodes say, views as torch makes them of
        those (on the meta device).  A view that torch makes as a copy is
        left out."""
        tensors: dict[str, torch.Tensor] = {}
        for slot in self.slots.values():
            if slot.role != Role.VIEW and slot.var not in tensors:
                shape = at_sizes(slot.node.shape, sizes)
                stride = at_sizes(slot.node.buffer_stride, sizes)
                tensors[slot.var] = torch.empty_strided(
                    shape, stride, dtype=slot.node.dtype, device="meta"
                )
        for step in self.steps:
            if isinstance(step, ViewStep) and step.src in tensors:
                out = _view_at(step, tensors[step.src], sizes)
                if out is not None:
                    tensors[step.out] = out
        return {
            var: (tuple(t.shape), tuple(t.stride()), t.storage_offset())
            for var, t in tensors.items()
        }

    def view_chain(self, var: str) -> ViewChain:
        """How view ``var`` is made of the slot it (through a chain of
        views) is a view of; for a slot that is not a view, of itself."""
        made_by = {s.out: s for s in self.steps if isinstance(s, ViewStep)}
        steps = []
        while self.role_of(var) == Role.VIEW:
            steps.append(made_by[var])
            var = made_by[var].src
        return ViewChain(var, self._by_var()[var].node, tuple(reversed(steps)))

    def view_root(self, var: str) -> str:
        return self.view_chain(var).root

    def sizes_refusal(self) -> str | None:
        """Why one captured graph cannot serve every size of a size bucket;
        None when it can.  Such a graph is captured at the bucket's largest
        sizes and replayed at smaller ones, its kernels reading the true
        sizes from memory: whatever else the capture bakes in must not
        depend on the sizes.  So every view starts at an offset that does
        not, library calls see tensors of fixed layout and take no size
        arguments, and an output of symbolic shape is a buffer a kernel
        wrote or a view of one (returned at its true shape), not a library
        call's result or a view of an input."""
        if not self.symbols:
            return None
        # Layouts at three size sets: the sizes the graph was compiled for,
        # twice those, and those plus a different amount per symbol (so that
        # symbols of equal values are told apart).  A layout that differs
        # between them depends on the sizes.
        hints = {s: ix.hint(s, self.graph.hints) for s in self.symbols}
        probes = [
            {s.name: f(h, k) for k, (s, h) in enumerate(hints.items())}
            for f in (lambda h, k: h, lambda h, k: 2 * h, lambda h, k: h + 1 + k)
        ]
        try:
            layouts = [self.layouts(sizes) for sizes in probes]
        except (RuntimeError, ValueError, IndexError) as err:
            return f"its views could not be laid out at sample sizes ({err})"

        def varies(var: str, part: slice) -> bool:
            return len({layout.get(var, ())[part] for layout in layouts}) > 1

        for step in self.steps:
            if isinstance(step, ViewStep):
                if any(step.out not in layout for layout in layouts):
                    return f"view %{step.node.name} is a copy at some sizes"
                if varies(step.out, slice(2, 3)):
                    return f"view %{step.node.name} starts at an offset that depends on the sizes"
            elif isinstance(step, LibraryStep):
                call = step.node.extern
                if _symbolic((call.args, call.kwargs)):
                    return f"library call {call.target} takes size arguments"
                if any(varies(var, slice(0, 2)) for var in (*step.args, step.out)):
                    return f"library call {call.target} on a tensor of symbolic layout"
        for k, var in enumerate(self.outputs):
            if var is None or k in self.graph.mutations:
                continue
            role = self.role_of(var)
            if role == Role.VIEW and self.role_of(self.view_root(var)) == Role.BUFFER:
                continue  # made at the call's sizes of its buffer's (GraphExecutor._copy_out)
            if role not in (Role.BUFFER, Role.INPUT) and varies(var, slice(0, 2)):
                return f"output {k} of symbolic shape is a {role.value}, not a buffer"
        return None

    # ------------------------------------------------------------ the source

    def source(
        self, static_buffers: bool = False, timed: bool = False, device_sizes: bool = False
    ) -> str:
        """The call function ``run(<inputs>[, sizes])``.  ``static_buffers``:
        per-call buffers are prepared once (by an executor that replays a
        captured graph) instead of allocated by each call.  ``timed``: every
        launch is bracketed by ``start()`` / ``stop(name, token)``.
        ``device_sizes``: kernels take their size arguments from the tensor
        ``size_values`` (the symbols' values in :attr:`symbols` order), each
        kernel the variant :func:`~tilec.codegen.kernel.sizes_in_memory`
        writes."""
        made = {s.var for s in self.prepared(static_buffers) if isinstance(s, Slot)}
        made |= {s.out for s in self.prepared(static_buffers) if isinstance(s, ViewStep)}
        made |= {s.var for s in self.slots.values() if s.role == Role.CONSTANT}
        made |= {v.out for v in self.refreshed()}
        params = [s.var for s in self.inputs()] + (["sizes"] if self.symbols else [])
        lines = [f"def run({', '.join(params)}):"]
        lines += [f"    {_size_var(s)} = sizes[{s.name!r}]" for s in self.symbols]
        roots = self.refreshed_roots()
        if roots:  # views of parameters: made again only if one moved
            pointers = _tuple_code(roots, lambda var: f"{var}.data_ptr()")
            lines += [
                f"    if {pointers} != static_pointers:",
                f"        refresh_static_views({', '.join(roots)})",
            ]
        if not static_buffers:
            for slot in self.slots.values():
                if slot.role == Role.BUFFER:
                    lines.append(f"    {slot.var} = {_allocation(slot.node)}")
        for step in self.steps:
            if isinstance(step, ViewStep):
                if step.out not in made:
                    lines.append(f"    {step.out} = {_view_call(step)}")
            elif isinstance(step, LibraryStep):
                lines += self._library_lines(step)
            else:
                lines += _launch_lines(step, timed, device_sizes)
        # Inputs the graph writes: their new values, after every step.
        for k, position in self.graph.mutations.items():
            written = self.slots[self.graph.inputs[position]].var
            if written != self.outputs[k]:
                lines.append(f"    write_input({written}, {self.outputs[k]})")
        outputs = (
            self.slots[self.graph.outputs[k]].var if var is not None else self._literal(k)
            for k, var in enumerate(self.outputs)
            if k not in self.graph.mutations
        )
        lines.append(f"    return [{', '.join(outputs)}]")
        return "\n".join(lines) + "\n"

    def _literal(self, k: int) -> str:
        return self._code(self.graph.literal_outputs[k], ())

    def _library_lines(self, step: LibraryStep) -> list[str]:
        call = step.node.extern
        args = [self._code(a, step.args) for a in call.args]
        args += [f"{key}={self._code(v, step.args)}" for key, v in call.kwargs]
        lines = [f"    {step.out} = {step.var}({', '.join(args)})"]
        node = step.node
        if node.stride is not None:
            shape, stride = _tuple_code(node.shape), _tuple_code(node.stride)
            lines += [
                f"    if {step.out}.stride() != {stride}:",
                f"        {step.out} = keep_strides({step.out}, {shape}, {stride})",
            ]
        return lines

    def _code(self, value: Any, args: tuple[str, ...]) -> str:
        """Python source for a library call's argument (``Arg(k)``: the
        variable of the call's k-th input); values that have no literal
        become names in the namespace."""
        if isinstance(value, Arg):
            return args[value.position]
        if isinstance(value, tuple):
            return _tuple_code(value, lambda v: self._code(v, args))
        if isinstance(value, list):
            return f"[{', '.join(self._code(v, args) for v in value)}]"
        if isinstance(value, sympy.Basic):
            return _size_code(value)
        if value is None or isinstance(value, (bool, int, str)):
            return repr(value)
        if isinstance(value, float) and math.isfinite(value):
            return repr(value)
        if isinstance(value, torch.dtype):
            return str(value)
        existing = next((n for n, v in self.names.items() if v is value), None)
        return existing or self._name("x", value)


def write_input(dst: torch.Tensor, value: torch.Tensor) -> None:
    """An input the graph writes gets its new value (the call's last steps)."""
    dst.copy_(value)


def _symbolic(value: Any) -> bool:
    if isinstance(value, sympy.Basic):
        return not value.is_number
    if isinstance(value, (list, tuple)):
        return any(_symbolic(v) for v in value)
    return False


def _symbols_used(graph: Graph, kernels: dict[str, tuple[KernelSource, Any]]) -> list[sympy.Symbol]:
    """The size symbols a call function reads: those in shapes, strides,
    view arguments (a slice that starts at a size), library-call arguments
    and outputs that are sizes (``x.shape[0]`` returned), and those the
    kernels take as size arguments."""
    values: list[Any] = [kernel.sizes for kernel, _ in kernels.values()]
    values += list(graph.literal_outputs.values())
    for n in graph.nodes.values():
        values += [n.shape, n.stride, n.reduce_shape, n.update_shape]
        values += [n.view.args] if n.view is not None else []
        values += [n.extern.args, n.extern.kwargs] if n.extern is not None else []
    leaves = pytree.tree_leaves(values)
    exprs = [v for v in leaves if isinstance(v, sympy.Basic)]
    return sorted({s for e in exprs for s in ix.size_symbols(e)}, key=str)


def _size_var(symbol: sympy.Symbol) -> str:
    return f"size_{symbol.name}"


def _size_code(value: ix.Size) -> str:
    """Python source for a size, or a float or bool computed from sizes."""
    expr = sympy.sympify(value)
    if expr.is_Integer:
        return repr(int(expr))
    return ix.print_index(expr, _size_var)


def _tuple_code(values: Any, code: Any = _size_code) -> str:
    parts = [code(v) for v in values]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _allocation(node: Node) -> str:
    shape, stride = _tuple_code(node.shape), _tuple_code(node.buffer_stride)
    return f"empty_strided({shape}, {stride}, dtype={node.dtype}, device=device)"


def _view_call(step: ViewStep) -> str:
    if step.strided is not None:
        shape, stride, offset = step.strided
        start = (
            f"{step.src}.storage_offset() + {offset}" if offset else f"{step.src}.storage_offset()"
        )
        return f"{step.src}.as_strided({_tuple_code(shape)}, {_tuple_code(stride)}, {start})"
    view = step.node.view
    args = _tuple_code(
        view.args, lambda a: _tuple_code(a) if isinstance(a, tuple) else _size_code(a)
    )
    return f"view({step.src}, {view.op!r}, {args}, {_tuple_code(step.node.shape)})"


def _launch_lines(step: LaunchStep, timed: bool, device_sizes: bool) -> list[str]:
    sizes = [_size_var(s) for s in step.kernel.sizes]
    if device_sizes and sizes:
        sizes = ["size_values"]
    args = ", ".join([*step.args, *sizes])
    if step.symbolic:
        # A symbolic count may be 0 in a call: nothing to launch then.
        lines = [f"    grid = {_tuple_code(step.grid)}", "    if all(grid):"]
        call = f"        {step.var}[grid]({args}, **options_{step.var})"
    else:
        lines, call = [], f"    {step.var}({args})"
    if not timed:
        return lines + [call]
    indent = call[: len(call) - len(call.lstrip())]
    return lines + [
        f"{indent}token = start()",
        call,
        f"{indent}stop({step.kernel.name!r}, token)",
    ]


def _size_limits(graph: Graph, kernels: dict[str, tuple[KernelSource, Any]]) -> list[sympy.Expr]:
    """Element counts of a symbolic graph that must stay below 2**31 (codegen
    chose 32-bit indexing for them): every tensor and every kernel's
    iteration space, less those another one always reaches (s0 follows from
    64*s0)."""
    counts = {ix.numel(n.shape) for n in graph.nodes.values() if n.kind != "view"}
    counts |= {ix.size(k.xnumel * k.rnumel) for k, _ in kernels.values()}
    limits: list[sympy.Expr] = []
    for c in sorted((c for c in counts if not isinstance(c, int)), key=str):
        if not any(ix.always_positive(k - c + 1) for k in limits):
            limits = [k for k in limits if not ix.always_positive(c - k + 1)] + [c]
    return limits


_size_function = functools.lru_cache(maxsize=None)(ix.size_function)


def at_sizes(value: Any, sizes: dict[str, int]) -> Any:
    """``value`` (a size, or tuples and lists of them) at the symbols' values ``sizes``."""
    if isinstance(value, sympy.Basic):
        return _size_function(value)(sizes)
    if isinstance(value, tuple):
        return tuple(at_sizes(v, sizes) for v in value)
    if isinstance(value, list):
        return [at_sizes(v, sizes) for v in value]
    return value
