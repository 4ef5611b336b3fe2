"""One fused group -> the source of one Triton kernel.

Pointwise groups get a 1-D tiling over the flat output index ``x``, which
walks the dimensions in the memory order of the (first) stored value, so a
channels-last or transposed output is written, and inputs laid out alike are
read, contiguously.
Reduction groups get a 2-D tiling: ``XBLOCK`` rows by ``RBLOCK`` reduction
elements.  When a whole row fits in one block the kernel is *persistent*: it
loads each value once and keeps it in registers for every reduction and for
the pointwise outputs after them (a softmax or a layer norm reads its input
once).  Otherwise each reduction level loops over the row in chunks and a
final loop writes the full-size outputs.

Sizes are baked in as literals (shapes are static per compiled graph); only
the block sizes are ``tl.constexpr`` launch parameters.  In a graph compiled
for symbolic sizes, the size symbols (``s0``, ...) the kernel needs are
integer arguments after the tensors, block sizes are chosen for the sizes the
graph was compiled with (``Graph.hints``), and reductions over a symbolic
extent always loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import sympy
import torch

from tilec import index as ix
from tilec.codegen.triton_ops import (
    ARITHMETIC,
    PRELUDE,
    TL_DTYPES,
    call_text,
    cast_text,
    literal,
)
from tilec.inline import Bound, BufferLoad, InlinedExpr, Inliner, buffer_loads, tile_indices
from tilec.ir import Call, Const, Graph, Group, Index

INT32_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class KernelArg:
    buffer: str
    dtype: torch.dtype
    is_output: bool


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """Generated source plus what the runtime needs to launch it."""

    # ``name`` tells kernels apart in dumps and reports (``tilec_k3``: the
    # group's); ``function``, the @triton.jit function in ``source``, is named
    # by content, so identical kernels share one source.
    name: str
    function: str
    group: Group
    source: str
    args: tuple[KernelArg, ...]
    # Parameter names: one per arg, then one per size symbol.
    params: tuple[str, ...]
    # Size symbols passed after the tensors, in this order (symbolic graphs).
    sizes: tuple[sympy.Symbol, ...]
    xnumel: ix.Size
    rnumel: ix.Size
    xblock: int
    rblock: int
    num_warps: int
    persistent: bool
    # Traffic and work, for roofline reports: bytes of distinct elements the
    # loads touch (per buffer read) and the stores write, and arithmetic ops
    # over the iteration space.
    reads: dict[str, int]
    bytes_written: int
    flops: int

    @property
    def bytes_read(self) -> int:
        return sum(self.reads.values())


# Rows up to this many elements are reduced in registers in one pass.
MAX_PERSISTENT = 4096


@dataclasses.dataclass(frozen=True)
class Target:
    """Where kernels will run: the Triton interpreter or a GPU.

    The target only changes launch parameters (block sizes, warps), never the
    kernel source, so the sources the CPU test suite runs are exactly the ones
    a GPU compiles (and the PTX test tier checks)."""

    interpret: bool

    def blocks(self, xnumel: int, rnumel: int | None, itemsize: int = 4) -> tuple[int, int, int]:
        """(XBLOCK, RBLOCK, num_warps) for a kernel storing ``itemsize``-byte
        elements.  The interpreter pays per program, so it gets large blocks;
        a GPU gets blocks sized for occupancy and vector accesses."""
        if rnumel is None:
            cap = 16384 if self.interpret else 1024
            xblock = min(_pow2(xnumel), cap)
            return xblock, 1, _warps(xblock, itemsize)
        if rnumel <= MAX_PERSISTENT:
            rblock = _pow2(rnumel)
        else:
            rblock = 4096 if self.interpret else 1024
        budget = 16384 if self.interpret else 4096
        xblock = max(1, min(_pow2(xnumel), budget // rblock))
        return xblock, rblock, _warps(xblock * rblock, itemsize)


# Bytes a thread should move per access: one 128-bit load or store.
VECTOR_BYTES = 16


def _warps(tile: int, itemsize: int) -> int:
    """Warps for a tile of ``tile`` elements of ``itemsize`` bytes: 1 to 8,
    keeping enough elements per thread for 128-bit accesses (4 in fp32, 8 in
    16-bit types, at most 8: more costs registers).  4 warps on a 256-element
    tile would give each thread 2, and only 64-bit accesses."""
    per_thread = max(1, min(8, VECTOR_BYTES // itemsize))
    return max(1, min(8, tile // (32 * per_thread)))


def _memory_order(stride: ix.Shape, shape: ix.Shape, hints: dict) -> tuple[int, ...]:
    """Dimensions from the largest stride to the smallest (size-1 dimensions
    and ties keep their logical order); symbolic strides are compared at the
    hinted sizes (any order is correct, this one is fast there)."""

    def key(d: int) -> tuple[int, int]:
        return (-ix.hint(stride[d], hints) if shape[d] != 1 else 0, d)

    return tuple(sorted(range(len(shape)), key=key))


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


NEUTRAL = {"sum": 0, "prod": 1, "any": False, "all": True}


def write_kernel(graph: Graph, group: Group, target: Target) -> KernelSource:
    return _Writer(graph, group, target).write()


class _Scope:
    """Emitted values visible at one place in the kernel (memoized by expression)."""

    def __init__(self, parent: _Scope | None, dims: frozenset[str], mask: str):
        self.parent = parent
        self.dims = dims  # which tile axes values here may vary along: "x", "r"
        self.mask = mask
        self.memo: dict = {}

    def lookup(self, key):
        scope = self
        while scope is not None:
            if key in scope.memo:
                return scope.memo[key]
            scope = scope.parent
        return None


class _Writer:
    def __init__(self, graph: Graph, group: Group, target: Target):
        self.graph, self.group, self.target = graph, group, target
        self.is_reduction = bool(group.reduce_shape) or any(
            graph.nodes[n].kind == "reduction" for n in group.nodes
        )
        self.rows = group.shape
        self.rshape = group.reduce_shape if self.is_reduction else ()
        # Order in which the flat index x walks the row dimensions, outermost
        # first: row-major, or for pointwise kernels the memory order of what
        # they store, so that stores (and loads laid out alike) coalesce.
        self.x_order = tuple(range(len(self.rows)))
        if not self.is_reduction and group.stored:
            self.x_order = _memory_order(
                graph.nodes[group.stored[0]].buffer_stride, self.rows, graph.hints
            )
        self.xnumel = ix.numel(self.rows)
        self.rnumel = ix.numel(self.rshape) if self.is_reduction else 1
        # Size symbols passed as arguments, by first use: symbol -> parameter name.
        self.sizes: dict[sympy.Symbol, str] = {}
        xhint, rhint = self.hint(self.xnumel), self.hint(self.rnumel)
        ranges = ix.symbol_ranges(self.rows, self.rshape)
        self.inliner = Inliner(graph, set(group.nodes), ranges)
        self.ranges = ranges
        self.lines: list[str] = []
        self.indent = 1
        self.counter = 0
        # Pointer arguments by first use: (buffer, is_output) -> (parameter, arg).
        self.args: dict[tuple[str, bool], tuple[str, KernelArg]] = {}
        self.deps: dict[str, frozenset[str]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.reduction_values: dict[str, str] = {}
        sizes = [
            self.hint(ix.numel(graph.nodes[n].shape))
            for n in graph.nodes
            if graph.nodes[n].kind != "view"
        ]
        # A graph of symbolic sizes is only run where this still holds (a guard).
        self.wide = max([xhint * rhint, *sizes]) > INT32_LIMIT
        # The narrowest element the kernel stores sets how many make 128 bits.
        itemsize = min((graph.nodes[n].dtype.itemsize for n in group.stored), default=4)
        xb, rb, warps = target.blocks(xhint, rhint if self.is_reduction else None, itemsize)
        self.xblock, self.rblock, self.num_warps = xb, rb, warps
        self.persistent = (
            self.is_reduction and isinstance(self.rnumel, int) and self.rnumel <= MAX_PERSISTENT
        )
        self.read_points: dict[str, int] = {}
        self.flops = 0

    def hint(self, size: ix.Size) -> int:
        return ix.hint(size, self.graph.hints)

    def size_text(self, size: ix.Size) -> str:
        """A size as kernel text: a literal, or arithmetic on size arguments."""
        return ix.print_index(sympy.sympify(size), self.size_name, ix.TRITON_MINMAX)

    def size_name(self, sym: sympy.Symbol) -> str:
        """The parameter that passes size symbol ``sym``: ``size0, size1, ...``
        by first use, so the source does not depend on Dynamo's symbol names."""
        return self.sizes.setdefault(sym, f"size{len(self.sizes)}")

    # ----------------------------------------------------------------- text
    def line(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def tmp(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def assign(self, scope: _Scope, key, text: str, deps: frozenset[str], dtype) -> str:
        name = self.tmp()
        self.line(f"{name} = {text}")
        scope.memo[key] = name
        self.deps[name], self.dtypes[name] = deps, dtype
        return name

    def pointer(self, buffer: str, is_output: bool) -> str:
        """The parameter of ``buffer``'s pointer: ``in0, in1, ...`` and ``out0,
        ...`` by first use, so the source does not depend on the graph's names."""
        key = (buffer, is_output)
        if key not in self.args:
            kind = "out" if is_output else "in"
            count = sum(1 for _, out in self.args if out == is_output)
            node = self.graph.nodes[buffer]
            self.args[key] = (f"{kind}{count}", KernelArg(buffer, node.dtype, is_output))
        return self.args[key][0]

    # ---------------------------------------------------------- expressions
    def symbol_name(self, sym: sympy.Symbol, scope: _Scope) -> str:
        name = str(sym)
        if name.startswith("v"):
            return self.emit(self.inliner.bindings[sym], scope)
        if name[0] not in "ir":
            return self.size_name(sym)
        return name

    def symbol_deps(self, expr: sympy.Expr, scope: _Scope) -> frozenset[str]:
        deps: set[str] = set()
        for sym in expr.free_symbols:
            name = str(sym)
            if name.startswith("i"):
                deps.add("x")
            elif name.startswith("r"):
                deps.add("r")
            elif name.startswith("v"):
                deps |= self.deps.get(self.emit(self.inliner.bindings[sym], scope), frozenset())
        return frozenset(deps)

    def index_text(self, expr: sympy.Expr, scope: _Scope) -> str:
        flat = self._as_flat(expr)
        if flat is not None:
            return flat
        return ix.print_index(expr, lambda s: self.symbol_name(s, scope), ix.TRITON_MINMAX)

    def _as_flat(self, expr: sympy.Expr) -> str | None:
        """Print ``c + a*x + b*r`` when the index is affine in the flat indices:
        contiguous accesses then read as ``x``, which Triton vectorizes."""
        isyms = ix.out_symbols(len(self.rows))
        rsyms = ix.reduce_symbols(len(self.rshape))
        (expr,) = ix.pin_unit_dims((expr,), self.rows, self.rshape)
        if any(str(s).startswith("v") for s in expr.free_symbols):
            return None
        zero = {s: 0 for s in (*isyms, *rsyms)}
        c = sympy.sympify(expr.xreplace(zero))
        # Size-1 dimensions add nothing to the flat indices.
        x_dims = [d for d in self.x_order if self.rows[d] != 1]
        r_dims = [d for d in range(len(self.rshape)) if self.rshape[d] != 1]
        xsyms, rsyms = [isyms[d] for d in x_dims], [rsyms[d] for d in r_dims]
        a = sympy.sympify(expr.coeff(xsyms[-1]) if xsyms else 0)
        b = sympy.sympify(expr.coeff(rsyms[-1]) if rsyms else 0)
        if not (c.is_Integer and a.is_Integer and b.is_Integer):
            return None
        flat_x = ix.flatten_index(xsyms, [self.rows[d] for d in x_dims]) if xsyms else 0
        flat_r = ix.flatten_index(rsyms, [self.rshape[d] for d in r_dims]) if rsyms else 0
        if sympy.expand(expr - c - a * flat_x - b * flat_r) != 0:
            return None
        parts = [] if c == 0 else [str(int(c))]
        if a != 0 and xsyms:
            parts.append("x" if a == 1 else f"{int(a)} * x")
        if b != 0 and rsyms:
            parts.append("r" if b == 1 else f"{int(b)} * r")
        return "(" + " + ".join(parts or ["0"]) + ")"

    def emit(self, e: InlinedExpr, scope: _Scope) -> str:
        if isinstance(e, Const) and isinstance(e.value, sympy.Basic):
            # A symbolic size used as a value (an offset compared with an index).
            if e.dtype != torch.int64:
                raise NotImplementedError(f"symbolic size {e.value} as a {e.dtype} constant")
            return self.emit(Index(e.value), scope)
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
            return self.assign(scope, e, text, self.symbol_deps(expr, scope), torch.int64)
        if isinstance(e, BufferLoad):
            return self.emit_load(e, scope)
        assert isinstance(e, Call)
        args = [self.emit(a, scope) for a in e.args]
        deps = frozenset().union(*(self.deps.get(a, frozenset()) for a in args))
        text = call_text(e.op, args, [a.dtype for a in e.args], e.dtype)
        if e.op in ARITHMETIC:
            self.flops += self.points(deps)
        return self.assign(scope, e, text, deps, e.dtype)

    def points(self, deps: frozenset[str]) -> int:
        """Iteration points a value with these dependencies is computed at."""
        x = self.hint(self.xnumel) if "x" in deps else 1
        return x * (self.hint(self.rnumel) if "r" in deps else 1)

    def touched(self, index: tuple[sympy.Expr, ...]) -> int:
        """Distinct positions an index reaches: the product of the ranges of
        the loop indices it depends on (through gathered values too)."""
        seen: set[sympy.Symbol] = set()
        todo = [s for c in index for s in sympy.sympify(c).free_symbols]
        while todo:
            sym = todo.pop()
            if sym in seen:
                continue
            seen.add(sym)
            if sym in self.inliner.bindings:
                todo += _free_symbols(self.inliner.bindings[sym])
        return math.prod(self.hint(self.ranges[s]) for s in seen if s in self.ranges)

    def emit_load(self, load: BufferLoad, scope: _Scope) -> str:
        if load.buffer in self.reduction_values:
            return self.reduction_values[load.buffer]
        node = self.graph.nodes[load.buffer]
        offset = ix.simplify_index(ix.flatten_strided(load.index, node.buffer_stride), self.ranges)
        offset_text = self.index_text(offset, scope)
        deps = offset_deps = self.symbol_deps(offset, scope)
        mask_parts = []
        if load.mask is not None:
            m = self.emit(load.mask, scope)
            mask_parts.append(m)
            deps |= self.deps.get(m, frozenset())
        ptr = f"{self.pointer(load.buffer, False)} + {offset_text}"
        if not deps:
            # A scalar is loaded as a block of rows, never as a 0-d value: the
            # interpreter gives a 0-d float comparison a float result, and a later
            # `&` / `|` on it fails.
            deps = frozenset("x")
        if not self.is_reduction and not offset_deps:
            # A block mask (the scalar case above, or a mask that varies with x)
            # needs a block pointer.
            ptr += " + 0 * x"
        ptr += self.broadcast_zero(deps - offset_deps)
        mask = " & ".join([*self.axis_masks(deps), *mask_parts])
        text = f"tl.load({ptr}, mask={mask}, other=0)"
        points = self.read_points.get(load.buffer, 0) + self.touched(load.index)
        self.read_points[load.buffer] = points
        return self.assign(scope, load, text, deps, node.dtype)

    def axis_masks(self, deps: frozenset[str]) -> list[str]:
        return [m for axis, m in (("x", "xmask"), ("r", "rmask")) if axis in deps]

    def broadcast_zero(self, missing: frozenset[str]) -> str:
        """Zeros that extend a pointer of a reduction kernel along the axes in
        ``missing`` (those its offset does not vary along)."""
        if not self.is_reduction:
            return ""
        return "".join(f" + {axis}zero" for axis in sorted(missing))

    # -------------------------------------------------------------- kernels
    def write(self) -> KernelSource:
        if self.is_reduction:
            self.write_reduction()
        else:
            self.write_pointwise()
        # Inputs, then outputs (a stable sort keeps each in first-use order),
        # then sizes: in0, in1, ..., out0, ..., size0, ...
        order = sorted(self.args.values(), key=lambda a: a[1].is_output)
        params = [name for name, _ in order] + list(self.sizes.values())
        signature = ", ".join([*params, "XBLOCK: tl.constexpr", "RBLOCK: tl.constexpr"])
        body = "\n".join(self.lines)
        # Named by content: identical kernels (the same op in every layer) have
        # one source, one cache file and one compiled function.
        function = "tilec_" + hashlib.sha256(f"{signature}\n{body}".encode()).hexdigest()[:12]
        header = ["@triton.jit", f"def {function}({signature}):"]
        needs_libdevice = "libdevice." in "\n".join(self.lines)
        imports = ["import triton", "import triton.language as tl"]
        if needs_libdevice:
            imports.append("from triton.language.extra import libdevice")
        source = (
            "\n".join(imports) + "\n" + PRELUDE + "\n\n" + "\n".join(header + self.lines) + "\n"
        )
        return KernelSource(
            f"tilec_{self.group.name}",
            function,
            self.group,
            source,
            tuple(arg for _, arg in order),
            tuple(params),
            tuple(self.sizes),
            self.xnumel,
            self.rnumel,
            self.xblock,
            self.rblock,
            self.num_warps,
            self.persistent,
            reads={
                b: min(points, self.hint(ix.numel(self.graph.nodes[b].shape)))
                * self.graph.nodes[b].dtype.itemsize
                for b, points in self.read_points.items()
            },
            bytes_written=sum(self.hint(self.graph.nodes[n].nbytes) for n in self.group.stored),
            flops=self.flops,
        )

    def index_vars(self, syms, shape, flat: str, order: tuple[int, ...] | None = None) -> None:
        """Index symbols from the flat index, walking dimensions in ``order``."""
        order = tuple(range(len(shape))) if order is None else order
        syms, shape = [syms[d] for d in order], [shape[d] for d in order]
        strides = ix.contiguous_strides(shape)
        for k, (sym, size, stride) in enumerate(zip(syms, shape, strides)):
            if size == 1:
                self.line(f"{sym} = 0")
                continue
            part = flat if stride == 1 else f"({flat} // {self.size_text(stride)})"
            self.line(f"{sym} = {part}" if k == 0 else f"{sym} = {part} % {self.size_text(size)}")

    def pid_offset(self) -> str:
        pid = "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"
        return f"{pid} * XBLOCK"

    def write_pointwise(self) -> None:
        self.line(f"x = {self.pid_offset()} + tl.arange(0, XBLOCK)")
        self.line(f"xmask = x < {self.size_text(self.xnumel)}")
        self.index_vars(ix.out_symbols(len(self.rows)), self.rows, "x", self.x_order)
        scope = _Scope(None, frozenset("x"), "xmask")
        for name in self.group.stored:
            node = self.graph.nodes[name]
            value = self.emit(self.inliner.value(name, ix.out_symbols(len(node.shape))), scope)
            self.store(name, ix.out_symbols(len(node.shape)), value, scope, frozenset("x"))

    def store(self, name: str, index, value: str, scope: _Scope, deps: frozenset[str]) -> None:
        node = self.graph.nodes[name]
        offset = ix.simplify_index(ix.flatten_strided(index, node.buffer_stride), self.ranges)
        offset_text = self.index_text(offset, scope)
        missing = deps - self.symbol_deps(offset, scope)
        ptr = f"{self.pointer(name, True)} + {offset_text}"
        if missing:
            ptr += self.broadcast_zero(missing) if self.is_reduction else " + 0 * x"
        if self.dtypes.get(value) != node.dtype or value not in self.deps:
            value = self.cast_value(value, node.dtype)
        mask = " & ".join(self.axis_masks(deps))
        self.line(f"tl.store({ptr}, {value}, mask={mask})")

    def cast_value(self, value: str, dtype: torch.dtype) -> str:
        if value in self.deps:
            return cast_text(value, self.dtypes[value], dtype)
        return f"tl.full([], {value}, {TL_DTYPES[dtype]})"

    # ----------------------------------------------------------- reductions
    def write_reduction(self) -> None:
        self.line(f"x = {self.pid_offset()} + tl.arange(0, XBLOCK)[:, None]")
        self.line(f"xmask = x < {self.size_text(self.xnumel)}")
        self.line("xzero = tl.full([XBLOCK, 1], 0, tl.int32)")
        self.line("rzero = tl.full([1, RBLOCK], 0, tl.int32)")
        self.index_vars(ix.out_symbols(len(self.rows)), self.rows, "x")
        rows = _Scope(None, frozenset("x"), "xmask")
        reductions = [n for n in self.group.nodes if self.graph.nodes[n].kind == "reduction"]
        full_stores = [
            n
            for n in self.group.stored
            if self.graph.nodes[n].kind == "pointwise" and self.graph.nodes[n].shape != self.rows
        ]
        if self.persistent:
            self.line("rbase = tl.arange(0, RBLOCK)[None, :]")
            self.line("r = rbase")
            self.line(f"rmask = r < {self.size_text(self.rnumel)}")
            self.index_vars(ix.reduce_symbols(len(self.rshape)), self.rshape, "r")
            tile = _Scope(rows, frozenset("xr"), "xmask & rmask")
            for name in reductions:
                self.reduce_persistent(name, tile)
            self.store_rows(tile)
            for name in full_stores:
                self.store_full(name, tile)
            return
        for level in self.levels(reductions):
            self.reduce_loop(level, rows)
        self.store_rows(rows)
        if full_stores:
            tile = self.open_loop(rows)
            for name in full_stores:
                self.store_full(name, tile)
            self.indent -= 1

    def levels(self, reductions: list[str]) -> list[list[str]]:
        """Reductions grouped so that each level reads only earlier levels."""
        level: dict[str, int] = {}
        for name in reductions:
            body = self.inliner.body(self.graph.nodes[name], {})
            reads = {b.buffer for b in _loads_with_bindings(body, self.inliner)}
            level[name] = 1 + max((level[r] for r in reads if r in level), default=-1)
        return [[n for n in reductions if level[n] == k] for k in range(max(level.values()) + 1)]

    def open_loop(self, rows: _Scope) -> _Scope:
        self.line(f"for roff in range(0, {self.size_text(self.rnumel)}, RBLOCK):")
        self.indent += 1
        self.line("r = roff + tl.arange(0, RBLOCK)[None, :]")
        self.line(f"rmask = r < {self.size_text(self.rnumel)}")
        self.index_vars(ix.reduce_symbols(len(self.rshape)), self.rshape, "r")
        return _Scope(rows, frozenset("xr"), "xmask & rmask")

    def body_value(self, name: str, scope: _Scope) -> tuple[str, torch.dtype]:
        node = self.graph.nodes[name]
        return self.emit(self.inliner.body(node, {}), scope), node.body.dtype

    def neutral(self, op: str, dtype: torch.dtype) -> str:
        if op in NEUTRAL:
            return literal(NEUTRAL[op], dtype)
        if dtype.is_floating_point:
            sign = "-" if op in ("max", "argmax") else ""
            return f"{sign}float('inf')"
        if dtype == torch.bool:
            return "False" if op in ("max", "argmax") else "True"
        info = torch.iinfo(dtype)
        return str(info.min if op in ("max", "argmax") else info.max)

    def masked(self, value: str, op: str, dtype: torch.dtype) -> str:
        full = f"tl.full([XBLOCK, RBLOCK], {self.neutral(op, dtype)}, {TL_DTYPES[dtype]})"
        return f"tl.where(xmask & rmask, {value}, {full})"

    def finish(self, name: str, op: str, values: str, index: str | None) -> None:
        node = self.graph.nodes[name]
        self.flops += self.hint(self.xnumel) * self.hint(self.rnumel)
        out = self.tmp("red")
        if op == "sum":
            self.line(f"{out} = tl.reduce({values}, 1, _add)[:, None]")
        elif op == "prod":
            self.line(f"{out} = tl.reduce({values}, 1, _mul)[:, None]")
        elif op == "max":
            self.line(f"{out} = tl.reduce({values}, 1, _maximum)[:, None]")
        elif op == "min":
            self.line(f"{out} = tl.reduce({values}, 1, _minimum)[:, None]")
        elif op == "any":
            self.line(f"{out} = (tl.reduce({values}.to(tl.int32), 1, _add) > 0)[:, None]")
        elif op == "all":
            self.line(f"{out} = (tl.reduce(({values} == 0).to(tl.int32), 1, _add) == 0)[:, None]")
        else:
            combine = "_argmax_combine" if op == "argmax" else "_argmin_combine"
            self.line(f"_, {out} = tl.reduce(({values}, {index}), 1, {combine})")
            self.line(f"{out} = {out}[:, None]")
        self.reduction_values[name] = out
        self.deps[out], self.dtypes[out] = frozenset("x"), _result_dtype(op, node)

    def reduce_persistent(self, name: str, tile: _Scope) -> None:
        node = self.graph.nodes[name]
        value, dtype = self.body_value(name, tile)
        if node.reduce_op in ("any", "all"):
            value = f"({value} != 0)"
        masked = self.tmp("m")
        self.line(f"{masked} = {self.masked(value, node.reduce_op, dtype)}")
        index = "(r + rzero + xzero)" if node.reduce_op in ("argmax", "argmin") else None
        self.finish(name, node.reduce_op, masked, index)

    def reduce_loop(self, names: list[str], rows: _Scope) -> None:
        accs = {}
        for name in names:
            node = self.graph.nodes[name]
            dtype = node.body.dtype if node.reduce_op not in ("any", "all") else torch.bool
            acc = self.tmp("acc")
            self.line(
                f"{acc} = tl.full([XBLOCK, RBLOCK], {self.neutral(node.reduce_op, dtype)}, {TL_DTYPES[dtype]})"
            )
            idx = None
            if node.reduce_op in ("argmax", "argmin"):
                idx = self.tmp("acci")
                self.line(f"{idx} = tl.full([XBLOCK, RBLOCK], {2**31 - 1}, tl.int32)")
            accs[name] = (acc, idx, dtype)
        tile = self.open_loop(rows)
        for name in names:
            node = self.graph.nodes[name]
            op = node.reduce_op
            acc, idx, dtype = accs[name]
            value, _ = self.body_value(name, tile)
            if op in ("any", "all"):
                value = f"({value} != 0)"
            v = self.tmp("m")
            self.line(f"{v} = {self.masked(value, op, dtype)}")
            update = {
                "sum": f"{acc} + {v}",
                "prod": f"{acc} * {v}",
                "max": f"_maximum({acc}, {v})",
                "min": f"_minimum({acc}, {v})",
                "any": f"{acc} | {v}",
                "all": f"{acc} & {v}",
            }
            if op in update:
                self.line(f"{acc} = {update[op]}")
            else:
                combine = "_argmax_combine" if op == "argmax" else "_argmin_combine"
                self.line(f"{acc}, {idx} = {combine}({acc}, {idx}, {v}, r + rzero + xzero)")
        self.indent -= 1
        for name in names:
            acc, idx, _ = accs[name]
            self.finish(name, self.graph.nodes[name].reduce_op, acc, idx)

    def store_rows(self, scope: _Scope) -> None:
        row_index = ix.out_symbols(len(self.rows))
        for name in self.group.stored:
            node = self.graph.nodes[name]
            if node.kind == "reduction":
                self.store(name, row_index, self.reduction_values[name], scope, frozenset("x"))
            elif node.shape == self.rows:
                value = self.emit(self.inliner.value(name, row_index), scope)
                self.store(name, row_index, value, scope, frozenset("x"))

    def store_full(self, name: str, tile: _Scope) -> None:
        # The tile itself, or the order in which the group's reductions read this shape.
        index = tile_indices(self.graph, set(self.group.nodes), self.rows, self.rshape)[
            self.graph.nodes[name].shape
        ]
        value = self.emit(self.inliner.value(name, index), tile)
        self.store(name, index, value, tile, frozenset("xr"))


def _free_symbols(expr: InlinedExpr) -> list[sympy.Symbol]:
    """Index symbols an inlined expression depends on (loads, masks, indices)."""
    if isinstance(expr, Index):
        return list(sympy.sympify(expr.expr).free_symbols)
    if isinstance(expr, Bound):
        return [expr.symbol]
    if isinstance(expr, BufferLoad):
        out = [s for c in expr.index for s in sympy.sympify(c).free_symbols]
        return out + (_free_symbols(expr.mask) if expr.mask is not None else [])
    if isinstance(expr, Call):
        return [s for a in expr.args for s in _free_symbols(a)]
    return []


def _result_dtype(op: str, node) -> torch.dtype:
    if op in ("argmax", "argmin"):
        return torch.int32
    if op in ("any", "all"):
        return torch.bool
    return node.body.dtype


def _loads_with_bindings(expr: InlinedExpr, inliner: Inliner) -> list[BufferLoad]:
    out = buffer_loads(expr)
    for bound in list(inliner.bindings.values()):
        out += buffer_loads(bound)
    return out
