"""Inlined expressions -> Triton statements, over a tile of named axes.

The :class:`Emitter` prints the values a kernel computes (loads, arithmetic,
index math) and its stores, one statement per distinct expression and
scope.  It knows nothing of how the group is tiled: a template
(``codegen/templates.py``) describes the tile's axes (:class:`Axis`), opens
the scopes and loops, and asks for values and stores; the emitter works out,
for each value, which axes it varies along (so that masks and pointer
broadcasts are only as wide as needed) and prints offsets that are affine in
the axes' flat indices as such (``64 * x + r``), which Triton vectorizes.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch

from tilec import index as ix
from tilec import symbolic_scalars
from tilec.codegen.triton_ops import call_text, cast_text, full_text, literal
from tilec.inline import Bound, BufferLoad, InlinedExpr, Inliner
from tilec.ir import CHECK_INDEX, Call, Const, Graph, Group, Index, index_error
from tilec.scalar_ops import run_on_constants

# The Triton atomic of each way a scatter combines a value with what is there.
ATOMICS = {"sum": "atomic_add", "max": "atomic_max", "min": "atomic_min"}


@dataclasses.dataclass(frozen=True)
class KernelArg:
    """A pointer parameter of the kernel: the buffer it passes."""

    buffer: str
    dtype: torch.dtype
    is_output: bool


@dataclasses.dataclass(frozen=True)
class Axis:
    """One axis of a kernel's tile: a flat index over some of the iteration
    space's dimensions."""

    # The flat index variable in the kernel text (``x``); also what the
    # emitter calls the axis when it records which axes a value varies along.
    name: str
    # Index symbols of its dimensions are ``prefix + k`` (``i0``, ``i1``, ...).
    prefix: str
    shape: ix.Shape
    # Dimensions from the outermost to the innermost in the flat index.
    order: tuple[int, ...]
    # Kernel text of the axis's bounds mask and of a zero that varies along
    # the axis only (added to a pointer to broadcast it along the axis).
    mask: str
    zero: str

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        return tuple(ix.index_symbol(self.prefix, k) for k in range(len(self.shape)))

    @property
    def numel(self) -> ix.Size:
        return ix.numel(self.shape)


@dataclasses.dataclass(frozen=True)
class Value:
    """A named value of the kernel body: the expression it computes (None for
    a reduction's result) and the axes it varies along."""

    expr: InlinedExpr | None
    axes: frozenset[str]
    dtype: torch.dtype


class Scope:
    """Values visible at one place in the kernel (memoized by expression): a
    loop body sees its own and those computed before the loop."""

    def __init__(self, parent: Scope | None = None):
        self.parent = parent
        self.memo: dict[InlinedExpr, str] = {}

    def lookup(self, key: InlinedExpr) -> str | None:
        scope = self
        while scope is not None:
            if key in scope.memo:
                return scope.memo[key]
            scope = scope.parent
        return None


class Emitter:
    """The statements of one kernel body, over the tile ``axes``.

    Besides the text it keeps what the kernel's signature needs (pointer
    arguments and size symbols, by first use) and every value it named
    (``values``, in order), which the metrics read."""

    def __init__(
        self,
        graph: Graph,
        group: Group,
        axes: tuple[Axis, ...],
        loop_symbols: dict[sympy.Symbol, ix.Size] | None = None,
    ):
        self.graph, self.axes = graph, axes
        self.ranges = {sym: ix.size(n) for axis in axes for sym, n in zip(axis.symbols, axis.shape)}
        # Index symbols a loop's iterations vary, not a tile axis (a GEMM's K
        # step's first position), with their ranges: a value of them is one
        # per iteration, along no axis, and they are named in the text as they are.
        self.loop_symbols = dict(loop_symbols or {})
        self.ranges |= {sym: ix.size(n) for sym, n in self.loop_symbols.items()}
        self.inliner = Inliner(graph, set(group.nodes), self.ranges)
        self.lines: list[str] = []
        self.indent = 1
        self.counter = 0
        # Pointer arguments by first use: (buffer, is_output) -> (parameter, arg).
        self.args: dict[tuple[str, bool], tuple[str, KernelArg]] = {}
        # Size symbols passed as arguments, by first use: symbol -> parameter name.
        self.sizes: dict[sympy.Symbol, str] = {}
        self.values: dict[str, Value] = {}
        # Traffic a template writes by hand rather than through the table of
        # values (the split attention's combine, ``codegen/attention.py``):
        # bytes read per buffer, and bytes written, which the metrics add.
        self.extra_reads: dict[str, int] = {}
        self.extra_written = 0
        # Buffers of the group whose values are already in registers (its reductions).
        self.computed: dict[str, str] = {}
        # Sizes computed with float arithmetic (``ceil((end - start) / step)``):
        # term -> the symbol standing for it, and that symbol -> its value's
        # name; computed at the top of the kernel (from ``preamble`` on).
        self.size_values: dict[sympy.Expr, sympy.Symbol] = {}
        self.size_value_names: dict[sympy.Symbol, str] = {}
        self.preamble = 0
        # The axis scalars are loaded along (None: the first).
        self.scalar_axis: str | None = None
        # Checked indices (``check_index``): value name -> name of "in bounds",
        # which masks every load at that index.
        self.in_bounds: dict[str, str] = {}
        # Calls on constants alone, by expression: their values (None: not constant).
        self.folded: dict[InlinedExpr, Const | None] = {}

    # ----------------------------------------------------------------- text
    def line(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def tmp(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def size_text(self, size: ix.Size) -> str:
        """A size as kernel text: a literal, or arithmetic on size arguments."""
        expr = self.bind_size_values(sympy.sympify(size))
        return ix.print_index(expr, self.size_name, ix.TRITON)

    def size_name(self, sym: sympy.Symbol) -> str:
        """The parameter that passes size symbol ``sym``: ``size0, size1, ...``
        by first use, so the source does not depend on Dynamo's symbol names
        (or the value a symbol of ``bind_size_values`` stands for)."""
        if sym in self.size_value_names:
            return self.size_value_names[sym]
        return self.sizes.setdefault(sym, f"size{len(self.sizes)}")

    def bind_size_values(self, expr: sympy.Expr) -> sympy.Expr:
        """``expr`` with each integer computed with float arithmetic (an
        ``arange`` length, an upsampled size) replaced by a symbol for a value
        the kernel computes once, at its top, from the size arguments."""
        terms = _outermost(expr, tuple(symbolic_scalars.TO_INT_OPS))
        return expr.xreplace({term: self._size_value(term) for term in terms}) if terms else expr

    def _size_value(self, term: sympy.Expr) -> sympy.Symbol:
        if term not in self.size_values:
            lines, indent = self.lines, self.indent
            self.lines, self.indent = [], 1
            name = self.emit(symbolic_scalars.scalar_expr(term), Scope())
            lines[self.preamble : self.preamble] = self.lines
            self.preamble += len(self.lines)
            self.lines, self.indent = lines, indent
            sym = sympy.Symbol(f"c{len(self.size_values)}", integer=True)
            self.size_values[term], self.size_value_names[sym] = sym, name
        return self.size_values[term]

    def pointer(self, buffer: str, is_output: bool) -> str:
        """The parameter of ``buffer``'s pointer: ``in0, in1, ...`` and ``out0,
        ...`` by first use, so the source does not depend on the graph's names.
        A value stored into an input the kernel has loaded takes that input's."""
        key = (buffer, is_output)
        written = self.graph.in_place.get(buffer) if is_output else None
        if written is not None and (written, False) in self.args:
            # An input's new value stored where the kernel read the old one
            # (``passes/in_place.py``): one pointer, one argument.
            return self.args[(written, False)][0]
        if key not in self.args:
            kind = "out" if is_output else "in"
            count = sum(1 for _, out in self.args if out == is_output)
            node = self.graph.nodes[buffer]
            self.args[key] = (f"{kind}{count}", KernelArg(buffer, node.dtype, is_output))
        return self.args[key][0]

    def index_variables(self, axis: Axis) -> None:
        """Index symbols of ``axis`` from its flat index, by div/mod in its order."""
        syms = [axis.symbols[d] for d in axis.order]
        shape = [axis.shape[d] for d in axis.order]
        strides = ix.contiguous_strides(shape)
        for k, (sym, size, stride) in enumerate(zip(syms, shape, strides)):
            if size == 1:
                self.line(f"{sym} = 0")
                continue
            flat = axis.name
            part = flat if stride == 1 else f"({flat} // {self.size_text(stride)})"
            self.line(f"{sym} = {part}" if k == 0 else f"{sym} = {part} % {self.size_text(size)}")

    def define(self, buffer: str, name: str, axes: frozenset[str], dtype: torch.dtype) -> None:
        """The group's node ``buffer`` is in registers as ``name``, a value the
        template computed itself (a reduction's result): loads of it read that."""
        self.computed[buffer] = name
        self.values[name] = Value(None, axes, dtype)

    # ---------------------------------------------------------- expressions
    def emit(self, e: InlinedExpr, scope: Scope) -> str:
        """The kernel text of ``e``'s value in ``scope``: a literal, or the
        name of a statement computing it (emitted now unless visible already)."""
        if isinstance(e, Const) and isinstance(e.value, sympy.Basic):
            # A symbolic size used as a value (an offset compared with an index),
            # or a float computed from sizes: computed from the size arguments.
            value = symbolic_scalars.scalar_expr(e.value)
            return self.emit(
                value if value.dtype == e.dtype else Call("cast", (value,), e.dtype), scope
            )
        if isinstance(e, Const):
            return literal(e.value, e.dtype)
        found = scope.lookup(e)
        if found is not None:
            return found
        if isinstance(e, Bound):
            return str(e.symbol)
        if isinstance(e, Index):
            expr = sympy.sympify(e.expr)
            text = self.index_text(expr, scope)
            if expr.is_Integer:
                text = f"tl.full([], {int(expr)}, tl.int64)"
            return self._assign(scope, e, text, self.symbol_axes(expr, scope), torch.int64)
        if isinstance(e, BufferLoad):
            return self._load(e, scope)
        assert isinstance(e, Call)
        if e.op == CHECK_INDEX:
            return self._check_index(e, scope)
        folded = self.fold(e)
        if folded is not None:
            return literal(folded.value, folded.dtype)
        args = [self.emit(a, scope) for a in e.args]
        axes = frozenset().union(*(self.axes_of(a) for a in args))
        text = call_text(e.op, args, [a.dtype for a in e.args], e.dtype)
        return self._assign(scope, e, text, axes, e.dtype)

    def fold(self, e: InlinedExpr) -> Const | None:
        """``e``'s value if it is computed from constants alone (inlining put
        a fill under an op on a literal): computed now with torch's semantics,
        never printed as kernel text that Python or Triton would fold with
        Python's (``0.0 / 0.0`` raises, ``0.0 * -1.0`` loses its sign)."""
        if isinstance(e, Const):
            return None if isinstance(e.value, sympy.Basic) else e
        if not isinstance(e, Call) or not e.args or e.op == CHECK_INDEX:
            # A checked index stays in the kernel, where its check runs.
            return None
        if e not in self.folded:
            args = [self.fold(a) for a in e.args]
            value = None
            if all(a is not None for a in args):
                values, dtypes = [a.value for a in args], [a.dtype for a in args]
                value = Const(run_on_constants(e.op, values, dtypes, e.dtype), e.dtype)
            self.folded[e] = value
        return self.folded[e]

    def tiled(self, axes: frozenset[str]) -> bool:
        """Whether a value along ``axes`` is a block: some axis varies within a
        program (a template's program-wide axes, whose zero is ``0``, do not)."""
        zeros = {axis.name: axis.zero for axis in self.axes}
        return any(zeros[name] != "0" for name in axes)

    def axes_of(self, text: str) -> frozenset[str]:
        """Axes the value named ``text`` varies along (none for a literal)."""
        value = self.values.get(text)
        return value.axes if value is not None else frozenset()

    def _assign(
        self, scope: Scope, key: InlinedExpr, text: str, axes: frozenset[str], dtype: torch.dtype
    ) -> str:
        name = self.tmp()
        self.line(f"{name} = {text}")
        scope.memo[key] = name
        self.values[name] = Value(key, axes, dtype)
        return name

    def _check_index(self, check: Call, scope: Scope) -> str:
        """An index read from data, asserted to be inside its dimension where it
        is used (the lanes of its axes, and of the load it indexes, which the
        inliner passes as a fourth argument).  Triton keeps the assert with
        ``launch.CHECKED``; whether it is kept or not, loads at the index are
        masked to where it is inside (``in_bounds``) and scatters store only
        there (``_inside``), so no memory outside is touched."""
        value, size, where, *used = check.args
        index = self.emit(value, scope)
        # One comparison: a negative index is a huge uint64.  The text's type
        # follows its operands (int32 index math), whatever the IR's int64.
        unsigned = f"{index}.to(tl.int64).to(tl.uint64, bitcast=True)"
        axes = self.axes_of(index)
        if not self.tiled(axes):
            # As a block along one axis, as scalar loads are: the interpreter's
            # `&` of a block with a 0-d bool gives int32 data, and the next
            # `&` of a mask fails.
            block = frozenset([self.scalar_axis or self.axes[0].name])
            unsigned = f"({index}{self.broadcast(block)}).to(tl.int64).to(tl.uint64, bitcast=True)"
            axes = axes | block
        inside = f"{unsigned} < {self.emit(size, scope)}"
        ok = self._assign(scope, (CHECK_INDEX, check), inside, axes, torch.bool)
        active = [*self.masks(self.axes_of(ok)), *(self.emit(m, scope) for m in used)]
        condition = f"{ok} | ~({' & '.join(active)})" if active else ok
        self.line(f"tl.device_assert({condition}, {index_error(where.value)!r})")
        scope.memo[check] = index
        self.in_bounds[index] = ok
        return index

    def _load(self, load: BufferLoad, scope: Scope) -> str:
        if load.buffer in self.computed:
            return self.computed[load.buffer]
        node = self.graph.nodes[load.buffer]
        offset = ix.simplify_index(ix.flatten_strided(load.index, node.buffer_stride), self.ranges)
        offset_text = self.index_text(offset, scope)
        axes = offset_axes = self.symbol_axes(offset, scope)
        # Gathered components checked by ``check_index``: read only where inside.
        mask_parts = [
            self.in_bounds[text]
            for text in (self.emit(self.inliner.bindings[s], scope) for s in ix.gathered(offset))
            if text in self.in_bounds
        ]
        if load.mask is not None:
            m = self.emit(load.mask, scope)
            mask_parts.append(m)
            axes |= self.axes_of(m)
        ptr = f"{self.pointer(load.buffer, False)} + {offset_text}"
        if not self.tiled(axes):
            # A scalar is loaded as a block along one axis (the first, unless
            # the template says which), never as a 0-d value: the interpreter
            # gives a 0-d float comparison a float result, and a later `&` /
            # `|` on it fails.
            axes = axes | {self.scalar_axis or self.axes[0].name}
        ptr += self.broadcast(axes - offset_axes)
        mask = " & ".join([*self.masks(axes), *mask_parts])
        # Triton converts ``other`` to the element type: an int 0 does not
        # convert to fp8, a float 0.0 does.
        other = "0.0" if node.dtype.itemsize == 1 and node.dtype.is_floating_point else "0"
        text = f"tl.load({ptr}, mask={mask}, other={other})" if mask else f"tl.load({ptr})"
        return self._assign(scope, load, text, axes, node.dtype)

    def store(
        self,
        name: str,
        index: tuple[sympy.Expr, ...],
        value: str,
        scope: Scope,
        axes: frozenset,
        combine: str | None = None,
    ) -> None:
        """Store ``value`` into node ``name`` at ``index`` (in its shape), over
        ``axes``; ``combine`` (a scatter's "sum", "max", "min") updates what is
        there atomically instead.  Index components computed from loaded values
        (a scatter's positions) are stored only where they are inside ``name``."""
        node = self.graph.nodes[name]
        offset = ix.simplify_index(ix.flatten_strided(index, node.buffer_stride), self.ranges)
        offset_text = self.index_text(offset, scope)
        ptr = f"{self.pointer(name, True)} + {offset_text}"
        ptr += self.broadcast(axes - self.symbol_axes(offset, scope))
        known = self.values.get(value)
        if known is None or known.dtype != node.dtype:
            value = self.convert(value, node.dtype)
        mask = " & ".join([*self.masks(axes), *self._inside(index, node.shape, scope)])
        masked = f", mask={mask}" if mask else ""
        if combine is None:
            self.line(f"tl.store({ptr}, {value}{masked})")
        else:
            atomic = ATOMICS[combine]
            self.line(f"tl.{atomic}({ptr}, {value}{masked}, sem='relaxed')")

    def _inside(self, index: tuple[sympy.Expr, ...], shape: ix.Shape, scope: Scope) -> list[str]:
        """Bounds checks of the components of ``index`` that may leave the
        shape: gathered ones (``v`` symbols; that of ``check_index`` where a
        component is a checked index), and index arithmetic not proven inside
        (an ``as_strided_scatter``'s storage positions)."""
        checks = []
        for c, size in zip(index, shape):
            c = sympy.sympify(c)
            gathered = bool(ix.gathered(c))
            computed = not (c.is_Symbol or c.is_Integer) and not ix.in_bounds(
                (ix.simplify_index(c, self.ranges),), (size,), self.ranges
            )
            if gathered or computed:
                text = self.index_text(c, scope)
                checks.append(
                    self.in_bounds.get(text, f"({text} >= 0) & ({text} < {self.size_text(size)})")
                )
        return checks

    def convert(self, value: str, dtype: torch.dtype) -> str:
        """The text of the named value (or literal) ``value`` in ``dtype``."""
        if value in self.values:
            return cast_text(value, self.values[value].dtype, dtype)
        return full_text(value, dtype)

    def masks(self, axes: frozenset[str]) -> list[str]:
        """Bounds masks of ``axes`` (an axis whose tiles always fit has none)."""
        return [axis.mask for axis in self.axes if axis.name in axes and axis.mask]

    def broadcast(self, missing: frozenset[str]) -> str:
        """Zeros that extend a pointer along the axes in ``missing`` (those its
        offset does not vary along but its value or mask does), in name order."""
        zeros = {axis.name: axis.zero for axis in self.axes}
        return "".join(f" + {zeros[name]}" for name in sorted(missing))

    # ---------------------------------------------------------------- index
    def symbol_axes(self, expr: sympy.Expr, scope: Scope) -> frozenset[str]:
        """Axes an index expression varies along (through gathered values too)."""
        axes: set[str] = set()
        for sym in expr.free_symbols:
            if isinstance(sym, ix.ValueSymbol):
                axes |= self.axes_of(self.emit(self.inliner.bindings[sym], scope))
            axes |= {axis.name for axis in self.axes if sym in axis.symbols}
        return frozenset(axes)

    def index_text(self, expr: sympy.Expr, scope: Scope) -> str:
        flat = self._as_flat(expr)
        if flat is not None:
            return flat
        expr = self.bind_size_values(expr)
        return ix.print_index(expr, lambda s: self._symbol_text(s, scope), ix.TRITON, self.ranges)

    def _symbol_text(self, sym: sympy.Symbol, scope: Scope) -> str:
        if isinstance(sym, ix.ValueSymbol):
            return self.emit(self.inliner.bindings[sym], scope)
        if sym in self.loop_symbols or any(sym in axis.symbols for axis in self.axes):
            return str(sym)
        return self.size_name(sym)

    def _as_flat(self, expr: sympy.Expr) -> str | None:
        """Print ``c + a*x + b*r`` when the index is affine in the axes' flat
        indices: contiguous accesses then read as ``x``, which Triton vectorizes."""
        # (sympify again: a symbol replaced by a Python 0 is a bare int.)
        expr = sympy.sympify(sympy.sympify(expr).xreplace(ix.unit_symbols(self.ranges)))
        if ix.gathered(expr):
            return None
        zero = {s: 0 for axis in self.axes for s in axis.symbols}
        c = sympy.sympify(expr.xreplace(zero))
        terms = []  # (axis, coefficient, flat index in symbols), size-1 dimensions left out
        for axis in self.axes:
            dims = [d for d in axis.order if axis.shape[d] != 1]
            syms = [axis.symbols[d] for d in dims]
            coeff = sympy.sympify(expr.coeff(syms[-1]) if syms else 0)
            flat = ix.flatten_index(syms, [axis.shape[d] for d in dims]) if syms else 0
            terms.append((axis, coeff, flat))
        if not (c.is_Integer and all(coeff.is_Integer for _, coeff, _ in terms)):
            return None
        if sympy.expand(expr - c - sum(coeff * flat for _, coeff, flat in terms)) != 0:
            return None
        parts = [] if c == 0 else [str(int(c))]
        for axis, coeff, flat in terms:
            if coeff != 0 and flat != 0:
                parts.append(axis.name if coeff == 1 else f"{int(coeff)} * {axis.name}")
        return "(" + " + ".join(parts or ["0"]) + ")"


def _outermost(expr: sympy.Basic, types: tuple[type, ...]) -> list[sympy.Basic]:
    """The subexpressions of ``expr`` of ``types`` that no other one contains."""
    if isinstance(expr, types):
        return [expr]
    return [t for arg in expr.args for t in _outermost(arg, types)]
