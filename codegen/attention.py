"""The attention template: a group of one attention's nodes (``compiler/attention.py``).

One program computes ``BLOCK_M`` query rows of one (batch, head): it loads
their q tile once, then walks the key/value positions in steps of
``BLOCK_N``: ``qk = q @ k^T`` with ``tl.dot`` (float32 accumulation), the
score expression and the mask over the ``BLOCK_M x BLOCK_N`` tile (loads
of a bias or a position table inlined, as any kernel inlines them), and
the online softmax: a running maximum and sum per row in float32,
exponentials in base 2 (``exp2`` of the scaled difference), the output accumulator rescaled when the maximum grows, and
``p @ v`` added with ``tl.dot`` (``p`` in V's dtype, as FlashAttention
does).  The scores never leave registers.  After the loop the output is
the accumulator over the sum (0 for a row with every position masked) and
the log-sum-exp ``max + log2(sum)``, back in natural units (``-inf`` for such
a row).

The head dimensions are whole in one tile (padded to a power of two, at
least ``tl.dot``'s 16, masked); positions past the sequence ends are
masked.  Key/value tiles that the mask's linear constraints rule out for
all of a program's rows (causal, a sliding window: ``attention.key_range``)
are not visited; the mask decides per element in the others.

Where query heads share their keys and values (GQA; ``attention.head_group``)
and their rows fit one tile (decode), a program computes ``G`` of them:
its tile's rows are (head within the group, query row), its K and V tiles
are loaded once at the group's first head, and q, the score, the mask and
the stores take each row's own head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.attention import (
    ATTENTION,
    LOGSUMEXP,
    QK,
    SPLIT_ACC,
    SPLIT_MAX,
    SPLIT_SUM,
    SPLITS,
    AttentionConfig,
    Blocks,
    attention_config,
    block_tiles,
    counter_name,
    head_group,
    is_combining_output,
    key_constraints,
    key_loop,
    parts,
    value_columns,
    visited_keys,
)
from tilec.codegen.emit import Axis, Emitter, Scope, Value
from tilec.codegen.launch import LaunchConfig, program_id, programs
from tilec.codegen.triton_ops import TL_DTYPES, literal
from tilec.gemm import next_pow2
from tilec.inline import Bound, BufferLoad, InlinedExpr, buffer_loads
from tilec.ir import Call, Expr, Graph, Group, Index, Node
from tilec.target import Target

if TYPE_CHECKING:
    from tilec.codegen.kernel import KernelSource

# The most key chunks whose combine (``combine_last``) is unrolled.
MAX_UNROLLED_CHUNKS = 64


class Attention:
    """The attention template's writer (``codegen/templates.py``'s protocol)."""

    Config = AttentionConfig

    def __init__(self, graph: Graph, group: Group, target: Target, anchor: Node):
        self.graph, self.group, self.target = graph, group, target
        members = [graph.nodes[n] for n in group.nodes]
        self.out = next((n for n in members if n.reduce_op == ATTENTION), None)
        self.lse = next((n for n in members if n.reduce_op == LOGSUMEXP), None)
        # Split-KV partial results (``attention.split_nodes``), by reduce_op.
        self.split = {n.reduce_op: n for n in members if n.reduce_op in SPLITS}
        self.node = anchor
        self.parts = parts(anchor)
        self.splits = anchor.shape[4] if self.split else 1
        # The nodes combining the split that this kernel computes itself, by
        # its last program per row tile (``passes/attention_split.py``,
        # ``combine_in_kernel``): "out" and "lse".
        self.tail = {
            "out" if f"{n.name}_num" in n.inputs else "lse": n
            for n in members
            if is_combining_output(n)
        }
        self.constraints = key_constraints(self.parts.mask)
        batch, heads, m = anchor.shape[:3]
        ev = value_columns(graph, anchor)
        n, e = anchor.reduce_shape
        self.sizes = (batch, heads, m, ev, n, e)
        # Query heads a program computes, as its tile's rows (GQA decode).
        self.packed = head_group(anchor)
        self.blocks = Blocks.of(self.parts.blocks) if self.parts.blocks is not None else None
        rows = self.packed * m
        config = attention_config(target, *(ix.hint(s, graph.hints) for s in (rows, n, e)),
                                  self.parts.q.dtype)  # fmt: skip
        self.config = block_tiles(config, self.blocks)
        self.block_e, self.block_ev = max(16, next_pow2(e)), max(16, next_pow2(ev))

        def axis(name: str, size: ix.Size, block: int | None = None) -> Axis:
            masked = block is None or size != block
            zero = f"{name}zero" if name != "bh" else "0"
            # Index symbols ``a<axis>0``: ``in0`` would be a pointer's name.
            return Axis(name, f"a{name}", (size,), (0,), f"{name}mask" if masked else "", zero)

        # Packed, a program's (batch, key/value head) and its rows' (query
        # head within the group, query row).
        kv_heads = heads // self.packed
        self.bh = Axis("bh", "abh", (batch, kv_heads), (0, 1), "", "0")
        if self.packed > 1:
            self.m = Axis("m", "am", (self.packed, m), (0, 1), "mmask", "mzero")
        else:
            self.m = axis("m", m)
        self.n = axis("n", n)
        self.nv = axis("nv", n)
        self.eq = axis("eq", e, self.block_e)
        self.ek = axis("ek", e, self.block_e)
        self.ev = axis("ev", ev, self.block_ev)
        self.sp = Axis("sp", "asp", (self.splits,), (0,), "", "0")
        axes = (self.bh, self.m, self.n, self.nv, self.eq, self.ek, self.ev)
        self.e = Emitter(graph, group, axes + ((self.sp,) if self.split else ()))

    @staticmethod
    def candidates(graph: Graph, anchor: Node, target: Target, launch: LaunchConfig) -> list:
        """Nothing is measured yet: the launch it was written with."""
        return [AttentionConfig.of(launch)]

    @staticmethod
    def launch(anchor: Node, config: AttentionConfig) -> LaunchConfig:
        batch, heads, m = anchor.shape[:3]
        splits = anchor.shape[4] if anchor.reduce_op in SPLITS else 1
        packed = head_group(anchor)
        tiles = batch * heads // packed * programs(packed * m, config.block_m)
        grid = (ix.size(tiles * splits),)
        constexprs = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n}
        return LaunchConfig(constexprs, grid, config.num_warps, config.num_stages)

    @staticmethod
    def predict(kernel: KernelSource, target: Target) -> cost.Prediction:
        """One launch: its FLOPs (of the tiles it visits) at the measured
        attention template rate for its narrowest floating-point input, over
        its grid, or its bytes if more."""
        inputs = [a.dtype for a in kernel.args if not a.is_output and a.dtype.is_floating_point]
        dtype = min(inputs, key=lambda d: d.itemsize, default=torch.float32)
        tiles = math.prod(int(g) for g in kernel.launch.grid)
        nbytes = kernel.bytes_read + kernel.bytes_written
        return cost.attention_template(
            target, kernel.flops, nbytes, dtype, tiles, kernel.program_loop
        )

    def program_loop(self) -> cost.KLoop | None:
        """The longest program's loop over key blocks (``attention.key_loop``)."""
        _, _, m, ev, n, e = (ix.hint(s, self.graph.hints) for s in self.sizes)
        chunk = int(self.parts.chunk.value) if self.split else 0
        itemsize = self.parts.q.dtype.itemsize
        return key_loop(self.constraints, (m, n, e, ev), itemsize, self.config, self.target, chunk,
                        self.packed)  # fmt: skip

    def work(self) -> tuple[dict[str, ix.Size], ix.Size]:
        """Two products per (row, visited key) point."""
        batch, heads, _, ev, _, e = self.sizes
        # Loads are counted by distinct position, and the score's ops once per
        # (row, key): nothing is counted again per tile.
        return {}, 2 * batch * heads * self.visited_keys() * (e + ev)

    def write(self) -> tuple[Emitter, LaunchConfig, ix.Size, ix.Size]:
        e, (batch, heads, m, _, n, emb) = self.e, self.sizes
        size = e.size_text
        e.line(f"pid = {program_id(self.graph, batch * heads * m * self.splits)}")
        if self.split:  # the key chunk of this program, then its row tile
            e.line(f"sp = pid % {size(self.splits)}")
            e.index_variables(self.sp)
            e.line(f"tile = pid // {size(self.splits)}")
        else:
            e.line("tile = pid")
        e.line(f"tiles_m = ({size(self.m.numel)} + BLOCK_M - 1) // BLOCK_M")
        e.line("bh = tile // tiles_m")
        e.index_variables(self.bh)
        e.line("m = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
        e.line(f"eq = tl.arange(0, {self.block_e})[None, :]")
        e.line(f"ek = tl.arange(0, {self.block_e})[:, None]")
        e.line(f"ev = tl.arange(0, {self.block_ev})[None, :]")
        for axis, shape in ((self.m, "[BLOCK_M, 1]"), (self.eq, f"[1, {self.block_e}]"),
                            (self.ek, f"[{self.block_e}, 1]"), (self.ev, f"[1, {self.block_ev}]"),
                            (self.n, "[1, BLOCK_N]"), (self.nv, "[BLOCK_N, 1]")):  # fmt: skip
            if axis.mask and axis not in (self.n, self.nv):
                e.line(f"{axis.mask} = {axis.name} < {size(axis.numel)}")
            e.line(f"{axis.zero} = tl.full({shape}, 0, tl.int32)")
        for axis in (self.m, self.eq, self.ek, self.ev):
            e.index_variables(axis)
        top = Scope()
        i0, i1, i2, i3 = ix.out_symbols(4)
        r0, r1 = ix.reduce_symbols(2)
        # A row's query head, and the key/value head its program loads for
        # all of its rows (the group's first query head: the same keys).
        ib, ig = self.bh.symbols
        head = {i0: ib, i1: ig * self.packed + (self.m.symbols[0] if self.packed > 1 else 0)}
        kv_head = {i0: ib, i1: ig * self.packed}
        im = self.m.symbols[-1]
        (inn,), (inv,) = self.n.symbols, self.nv.symbols
        (ieq,), (iek,), (iev,) = self.eq.symbols, self.ek.symbols, self.ev.symbols
        q = self.operand(self.parts.q, {**head, i2: im, r1: ieq}, Scope(top), self.m, self.eq)
        e.line(f"acc = tl.full([BLOCK_M, {self.block_ev}], 0, tl.float32)")
        e.line("row_max = tl.full([BLOCK_M, 1], float('-inf'), tl.float32)")
        e.line("row_sum = tl.full([BLOCK_M, 1], 0, tl.float32)")
        # What the loop computes the same in every key tile (a decode step's
        # new cache entry, ``passes/attention_cache.py``; a position read
        # for the mask), computed once before it.
        # A scope each: the loop's operands see them, not one another (a
        # value is shaped along its operand's rows).
        keys, loop = {inn, inv}, Scope(top)
        before_k, before_v, before_scores = Scope(loop), Scope(loop), Scope(loop)
        self.hoist(self.parts.k, {**kv_head, r0: inn, r1: iek}, keys, before_k, self.ek)
        self.hoist(self.parts.v, {**kv_head, r0: inv, i3: iev}, keys, before_v, self.ev)
        at = {**head, i2: im, r0: inn}
        self.hoist(self.parts.score, at, keys, before_scores, self.m)
        self.hoist(self.parts.mask, at, keys, before_scores, self.m)
        self.key_loop_bounds()
        depth = open_key_loops(e, self.graph, self.node, self.blocks, "kv", "m_first", head,
                               ("kv_start", "kv_end"), "noff", "BLOCK_N")  # fmt: skip
        e.line("n = noff + tl.arange(0, BLOCK_N)[None, :]")
        e.line("nv = noff + tl.arange(0, BLOCK_N)[:, None]")
        if self.n.mask:
            e.line(f"nmask = n < {size(n)}")
            e.line(f"nvmask = nv < {size(n)}")
        e.index_variables(self.n)
        e.index_variables(self.nv)
        k = self.operand(self.parts.k, {**kv_head, r0: inn, r1: iek}, Scope(before_k), self.ek,
                         self.n)  # fmt: skip
        e.line(f"qk = tl.dot({q}, {k}{self.precision()})")
        scores = Scope(before_scores)
        scores.memo[QK] = "qk"
        e.values["qk"] = Value(QK, frozenset({"m", "n"}), torch.float32)
        score = self.scalar(self.parts.score, at, scores, torch.float32)
        mask = self.scalar(self.parts.mask, at, scores, torch.bool)
        keep = " & ".join(x for x in (mask if mask != "True" else "", self.n.mask) if x)
        log2e = repr(1 / math.log(2))
        e.line(f"s = tl.where({keep}, {score}, float('-inf'))" if keep else f"s = {score}")
        e.line("new_max = tl.maximum(row_max, tl.reduce(s, 1, _maximum)[:, None])")
        # A row with nothing unmasked yet keeps -inf: subtract 0 instead.  The
        # difference is scaled to base 2, not the score: a score near the
        # float minimum (an additive mask) would overflow to -inf.
        e.line("shift = tl.where(new_max == float('-inf'), 0.0, new_max)")
        e.line(f"p = tl.math.exp2((s - shift) * {log2e})")
        e.line(f"alpha = tl.math.exp2((row_max - shift) * {log2e})")
        e.line("row_sum = row_sum * alpha + tl.reduce(p, 1, _add)[:, None]")
        e.line("row_max = new_max")
        v = self.operand(
            self.parts.v, {**kv_head, r0: inv, i3: iev}, Scope(before_v), self.nv, self.ev
        )
        v_dtype = TL_DTYPES[self.parts.v.dtype]
        e.line(f"acc = acc * alpha + tl.dot(p.to({v_dtype}), {v}{self.precision()})")
        e.indent -= depth
        rows = (head[i0], head[i1], im)
        if self.out is not None and self.out.name in self.group.stored:
            empty = literal(self.parts.empty.value, torch.float32)
            # ``== 0``, not ``> 0``: a nan score makes the sum nan, and the output too.
            e.line(f"o = tl.where(row_sum == 0, {empty}, acc / row_sum)")
            e.define(self.out.name, "o", frozenset({"m", "ev"}), torch.float32)
            e.store(self.out.name, (*rows, iev), "o", top, frozenset({"m", "ev"}))
        if self.lse is not None and self.lse.name in self.group.stored:
            ln2 = math.log(2)
            e.line(
                "lse = tl.where(row_sum == 0, float('-inf'), row_max + tl.math.log2(row_sum) * "
                f"{ln2!r})"
            )
            e.define(self.lse.name, "lse", frozenset({"m"}), torch.float32)
            e.store(self.lse.name, (*rows, sympy.Integer(0)), "lse", top, frozenset({"m"}))
        for op, value in ((SPLIT_ACC, "acc"), (SPLIT_MAX, "row_max"), (SPLIT_SUM, "row_sum")):
            node = self.split.get(op)
            if node is None or node.name not in self.group.stored:
                continue
            axes = frozenset({"m", "ev"} if op == SPLIT_ACC else {"m"})
            column = iev if op == SPLIT_ACC else sympy.Integer(0)
            e.define(node.name, value, axes, torch.float32)
            e.store(node.name, (*rows, column, *self.sp.symbols), value, top, axes)
        launch = self.launch(self.node, self.config)
        if self.tail:
            self.combine_last(rows, iev, top, launch)
        return e, launch, ix.numel(self.node.shape), n * emb

    def combine_last(
        self, rows: tuple, iev: sympy.Symbol, top: Scope, launch: LaunchConfig
    ) -> None:
        """The row tile's last program to finish combines the chunks.

        Every program has stored its partial results; a barrier makes all
        of its threads' stores come first, then one atomic add on the row
        tile's counter (acquire and release, GPU scope) publishes them and
        tells the program how many finished before it.  The last reads
        every chunk's partial results (bypassing L1: other SMs wrote them),
        stores the output and log-sum-exp as the combining nodes compute
        them (``passes/attention_split.py``), and sets the counter back to
        0 for the next launch."""
        e, size = self.e, self.e.size_text
        acc, most, total = (self.split[op] for op in (SPLIT_ACC, SPLIT_MAX, SPLIT_SUM))
        counter = f"{e.pointer(counter_name(acc), False)} + tile"
        chunk = sympy.Symbol("chunk", integer=True, nonnegative=True)
        e.loop_symbols[chunk] = self.splits
        e.ranges[chunk] = ix.size(self.splits)

        def load(node: Node, column: sympy.Expr, axes: frozenset, other: str) -> str:
            offset = ix.simplify_index(
                ix.flatten_strided((*rows, column, chunk), node.buffer_stride), e.ranges
            )
            pointer = f"{e.pointer(node.name, False)} + {e.index_text(offset, top)}"
            pointer += e.broadcast(axes - e.symbol_axes(offset, top))
            mask = " & ".join(e.masks(axes))
            masked = f", mask={mask}, other={other}" if mask else ""
            return f"tl.load({pointer}{masked}, cache_modifier='.cg')"

        zero, rows_axes, tile_axes = sympy.Integer(0), frozenset({"m"}), frozenset({"m", "ev"})
        neg_inf = "float('-inf')"
        e.line("tl.debug_barrier()")
        e.line(f"done = tl.atomic_add({counter}, 1, sem='acq_rel', scope='gpu')")
        e.line(f"if done == {size(self.splits)} - 1:")
        e.indent += 1
        # A constant count of chunks is unrolled, so their loads go out
        # together: in a loop each waits for the one before (a round trip
        # each, on the kernel's tail).
        chunks = (
            f"tl.static_range(0, {self.splits})"
            if isinstance(self.splits, int) and self.splits <= MAX_UNROLLED_CHUNKS
            else f"range(0, {size(self.splits)})"
        )
        e.line("top = tl.full([BLOCK_M, 1], float('-inf'), tl.float32)")
        e.line(f"for chunk in {chunks}:")
        e.line(f"    top = _maximum(top, {load(most, zero, rows_axes, neg_inf)})")
        e.line("den = tl.full([BLOCK_M, 1], 0, tl.float32)")
        e.line(f"num = tl.full([BLOCK_M, {self.block_ev}], 0, tl.float32)")
        e.line(f"for chunk in {chunks}:")
        e.line(f"    part_max = {load(most, zero, rows_axes, neg_inf)}")
        e.line("    w = tl.where(part_max == float('-inf'), 0.0, tl.exp(part_max - top))")
        e.line(f"    den += {load(total, zero, rows_axes, '0.0')} * w")
        e.line(f"    num += {load(acc, iev, tile_axes, '0.0')} * w")
        out, lse = self.tail.get("out"), self.tail.get("lse")
        if out is not None and out.name in self.group.stored:
            empty = literal(self.parts.empty.value, torch.float32)
            e.line(f"o = tl.where(den == 0, {empty}, num / den)")
            e.define(out.name, "o", tile_axes, torch.float32)
            e.store(out.name, (*rows, iev), "o", top, tile_axes)
        if lse is not None and lse.name in self.group.stored:
            e.line("lse = tl.where(den == 0, float('-inf'), top + tl.log(den))")
            e.define(lse.name, "lse", rows_axes, torch.float32)
            e.store(lse.name, (*rows, zero), "lse", top, rows_axes)
        e.line(f"tl.atomic_xchg({counter}, 0, sem='relaxed', scope='gpu')")
        e.indent -= 1
        # Every chunk's partial results are read back (by one program each);
        # the counter is read and written once per program.
        e.extra_reads |= {
            n.name: int(ix.hint(n.nbytes, self.graph.hints)) for n in (acc, most, total)
        }
        launched = math.prod(ix.hint(g, self.graph.hints) for g in launch.grid)
        e.extra_reads[counter_name(acc)] = 4 * launched
        e.extra_written += 4 * launched

    def key_loop_bounds(self) -> None:
        """``kv_start``, ``kv_end``: the key positions this program's rows may
        see (:func:`~tilec.attention.key_range`, the same arithmetic), the
        start rounded down to a tile: tiles wholly outside are skipped."""
        e, (_, _, m, _, n, _) = self.e, self.sizes
        if self.packed > 1:  # one tile: every query row of its heads
            e.line("m_first = 0")
            e.line(f"m_last = {e.size_text(m)} - 1")
        else:
            e.line("m_first = (tile % tiles_m) * BLOCK_M")
            e.line(f"m_last = tl.minimum(m_first + BLOCK_M, {e.size_text(m)}) - 1")
        loop_bounds(
            e, self.constraints, ("m_first", "m_last"), n, ("kv_start", "kv_end"), "BLOCK_N"
        )
        if self.split:  # this program's chunk (a multiple of BLOCK_N)
            chunk = int(self.parts.chunk.value)
            e.line(f"kv_start = tl.maximum(kv_start, sp * {chunk})")
            e.line(f"kv_end = tl.minimum(kv_end, sp * {chunk} + {chunk})")

    def visited_keys(self) -> int:
        """Query rows times the key positions their tiles visit (per head)."""
        _, _, m, _, n, _ = (ix.hint(s, self.graph.hints) for s in self.sizes)
        return visited_keys(self.constraints, m, n, self.config)

    def precision(self) -> str:
        """``tl.dot``'s precision for float32 operands: TF32 where torch allows it."""
        if self.parts.q.dtype != torch.float32:
            return ""
        return f", input_precision={'tf32' if self.target.tf32 else 'ieee'!r}"

    def operand(self, load: Expr, subst: dict, scope: Scope, rows: Axis, cols: Axis) -> str:
        """q, k^T or v as a full ``rows x cols`` tile in its own dtype (zero
        where masked: a masked load gives 0)."""
        e = self.e
        holder = dataclasses.replace(self.node, body=load)
        e.scalar_axis = rows.name
        value = e.emit(e.inliner.body(holder, subst), scope)
        e.scalar_axis = None
        known = e.values.get(value)
        if known is None or known.dtype != load.dtype:
            value = e.convert(value, load.dtype)
        if e.axes_of(value) - {"bh"} != {rows.name, cols.name}:
            full = e.tmp("op")
            shape = ", ".join(self.block(axis) for axis in (rows, cols))
            e.line(f"{full} = tl.broadcast_to({value}, [{shape}])")
            value = full
        return value

    def hoist(self, expr: Expr, subst: dict, varying: set, scope: Scope, rows: Axis) -> None:
        """Emit into ``scope`` (before the key loop) the largest parts of
        ``expr`` at ``subst`` that read memory and depend on none of the
        ``varying`` symbols (the key positions), so that the loop's
        emission finds them there."""
        e = self.e
        value = e.inliner.body(dataclasses.replace(self.node, body=expr), subst)
        e.scalar_axis = rows.name
        for part in _invariant(value, varying, e.inliner.bindings):
            e.emit(part, scope)
        e.scalar_axis = None

    def block(self, axis: Axis) -> str:
        """The tile length along ``axis``, as kernel text."""
        return {"m": "BLOCK_M", "n": "BLOCK_N", "nv": "BLOCK_N", "eq": str(self.block_e),
                "ek": str(self.block_e), "ev": str(self.block_ev)}[axis.name]  # fmt: skip

    def scalar(self, expr: Expr, subst: dict, scope: Scope, dtype: torch.dtype) -> str:
        """The score or mask expression over the ``BLOCK_M x BLOCK_N`` tile."""
        e = self.e
        holder = dataclasses.replace(self.node, body=expr)
        e.scalar_axis = "m"
        value = e.emit(e.inliner.body(holder, subst), scope)
        e.scalar_axis = None
        known = e.values.get(value)
        if known is not None and known.dtype != dtype:
            value = e.convert(value, dtype)
        return value


def _invariant(value: InlinedExpr, varying: set, bindings: dict) -> list[InlinedExpr]:
    """The largest sub-expressions of ``value`` that load from memory and
    depend on none of the symbols ``varying``, also through the index
    values ``bindings`` binds (the scores' ``QK`` varies)."""
    if _varies(value, varying, bindings):
        args = value.args if isinstance(value, Call) else ()
        return [part for a in args for part in _invariant(a, varying, bindings)]
    return [value] if buffer_loads(value) else []


def _varies(value: InlinedExpr, varying: set, bindings: dict) -> bool:
    def symbols_vary(expr: sympy.Expr) -> bool:
        return any(
            s in varying or (s in bindings and _varies(bindings[s], varying, bindings))
            for s in sympy.sympify(expr).free_symbols
        )

    if isinstance(value, Call):
        return value.op == QK.op or any(_varies(a, varying, bindings) for a in value.args)
    if isinstance(value, BufferLoad):
        return any(symbols_vary(c) for c in value.index) or (
            value.mask is not None and _varies(value.mask, varying, bindings)
        )
    if isinstance(value, Index):
        return symbols_vary(value.expr)
    if isinstance(value, Bound):
        return symbols_vary(value.symbol)
    return False


def loop_bounds(
    e: Emitter,
    constraints: list,
    rows: tuple[str, str],
    size: ix.Size,
    bounds: tuple[str, str],
    block: str,
) -> None:
    """Kernel text of :func:`~tilec.attention.key_range`: the positions
    ``[start, end)`` (variables named ``bounds``) in ``[0, size)`` that the
    rows ``rows`` (first, last) may see under ``constraints``, the start
    rounded down to a multiple of ``block``."""
    first, last = rows
    start, end = bounds
    e.line(f"{start} = 0")
    e.line(f"{end} = {e.size_text(size)}")
    for a, b, c in constraints:
        if b < 0:
            e.line(f"top = tl.maximum({a} * {first} + {c}, {a} * {last} + {c})")
            e.line(f"{end} = tl.minimum({end}, tl.where(top < 0, 0, top // {-b} + 1))")
        else:
            e.line(f"low = tl.minimum({-a} * {first} - {c}, {-a} * {last} - {c})")
            e.line(f"{start} = tl.maximum({start}, tl.where(low <= 0, 0, (low + {b - 1}) // {b}))")
    e.line(f"{start} = ({start} // {block}) * {block}")


def open_key_loops(
    e: Emitter,
    graph: Graph,
    node: Node,
    blocks: Blocks | None,
    walked: str,
    first: str,
    head: dict,
    bounds: tuple[str, str],
    var: str,
    tile: str,
) -> int:
    """Open the loop(s) of ``var`` over the walked positions, tiles of
    ``tile`` in ``[bounds)``; returns how many it opened (the caller closes
    them).  Without block lists, one loop over the bounds.  With them, for
    the block holding the program's ``first`` owned position, a loop over
    the blocks its lists name (``walked``: ``"kv"`` for key blocks of a
    query block, ``"q"`` for query blocks of a key block), the partly masked
    ones then the unmasked ones, and in each the tiles of that block within
    the bounds.  ``head`` binds the lists' batch and head symbols."""
    if blocks is None:
        e.line(f"for {var} in range({bounds[0]}, {bounds[1]}, {tile}):")
        e.indent += 1
        return 1
    owned, size = (
        (blocks.q_block, blocks.kv_block) if walked == "kv" else (blocks.kv_block, blocks.q_block)
    )
    (num, indices), (full_num, full_indices) = (
        (blocks.kv, blocks.full_kv) if walked == "kv" else (blocks.q, blocks.full_q)
    )
    i2 = ix.out_symbols(3)[2]
    (r0,) = ix.reduce_symbols(1)
    blk, j, jf = (sympy.Symbol(name, integer=True, nonnegative=True) for name in ("blk", "j", "jf"))
    entry = functools.partial(_list_entry, e, graph, node)
    e.line(f"blk = {first} // {owned}")
    e.line(f"partial = {entry(num, {**head, i2: blk})}")
    e.line(f"listed = partial + {entry(full_num, {**head, i2: blk})}")
    e.line("for j in range(0, listed):")
    e.indent += 1
    e.line("jf = tl.maximum(j - partial, 0)")
    at_j, at_jf = {**head, i2: blk, r0: j}, {**head, i2: blk, r0: jf}
    e.line(f"block = tl.where(j < partial, {entry(indices, at_j)}, {entry(full_indices, at_jf)})")
    e.line(f"lo = tl.maximum(block * {size}, {bounds[0]})")
    e.line(f"hi = tl.minimum(block * {size} + {size}, {bounds[1]})")
    e.line(f"for {var} in range(lo, hi, {tile}):")
    e.indent += 1
    return 2


def _list_entry(e: Emitter, graph: Graph, node: Node, load: Expr, subst: dict) -> str:
    """Kernel text loading one entry of a block list (``load`` at ``subst``:
    program-wide values, so a scalar)."""
    name = node.inputs[load.src]
    index = tuple(sympy.sympify(c).xreplace(subst) for c in load.index)
    offset = ix.flatten_strided(index, graph.nodes[name].buffer_stride)
    known = {str(s) for s in e.ranges} | {"blk", "j", "jf"}
    text = ix.print_index(
        sympy.expand(offset), lambda s: str(s) if str(s) in known else e.size_name(s), ix.TRITON
    )
    return f"tl.load({e.pointer(name, False)} + {text})"
