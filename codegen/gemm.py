"""The GEMM template: a group whose anchor is a dot reduction (``passes/matmul.py``).

One program computes a ``BLOCK_M x BLOCK_N`` tile of the product (of one
batch element): it walks K in steps of ``BLOCK_K``, computing a tile of each
operand (the prologue: whatever the group computes the operand from,
inlined as any kernel inlines its producers, so a dequantized weight is
computed from its int8 values in registers and never stored), multiplies
them with ``tl.dot`` into a float32 accumulator, and then computes and
stores the group's other nodes from the accumulator (the epilogue: bias,
activation, residual, casts; each at its own position in the tile).

Programs run in grouped order: ``GROUP_M`` row tiles advance together along
the columns, so the operand tiles they share stay in L2.  Edges of sizes that
are not multiples of the tiles are masked; an operand tile is zeroed past K
(a prologue may compute something else than 0 from a masked load).  Operands
in float32 multiply in TF32 where the target's ``tf32`` says so (torch's
setting, read once when the target is built); 16-bit operands go to
``tl.dot`` as they are.

Tile configurations (:func:`gemm_config`): under the interpreter, large
tiles (it pays per program); on a GPU, for 16-bit operands 128 x 128 tiles
with 8 warps (narrower where the epilogue holds many values an element:
``gemm.fit_epilogue``), and a small-M configuration (16 rows, longer K steps) for
decode-shaped products with at most 16 rows, where a 128-row tile would be
mostly masked; fp32 operands (no tensor cores without TF32) at most 64 x 64
by 16, with 8 warps at 64 x 64 (4 spill).  Under
max-autotune (``codegen/autotune.py``) the kernel's launch is instead the
fastest of :func:`gemm_candidates`, measured on the device: the source is
the same for every candidate, only :func:`gemm_launch` differs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.codegen.emit import Axis, Emitter, Scope, Value
from tilec.codegen.launch import LaunchConfig, program_id, programs
from tilec.codegen.triton_ops import COMBINE, full_text, neutral
from tilec.gemm import (
    GEMM,
    MIN_DOT_K,
    GemmConfig,
    gpu_gemm_config,
    masks_k,
    next_pow2,
    operand,
    template_config,
)
from tilec.inline import BufferLoad, InlinedExpr, row_position
from tilec.ir import Call, Expr, Graph, Group, Node
from tilec.target import Target

if TYPE_CHECKING:
    from tilec.codegen.kernel import KernelSource

# Row tiles that advance together along the columns (L2 reuse of the
# right operand's tiles).
GROUP_M = 8
# Tiles max-autotune measures, for 16-bit operands: (BLOCK_M, BLOCK_N,
# BLOCK_K, num_warps, num_stages); fp32 operands take half the BLOCK_K (the
# same bytes per stage).  From decode-shaped 16-row tiles to 128 x 256, in
# the spirit of Inductor's mm configurations; :func:`gemm_candidates` keeps
# those that fit the problem and the device.
TUNING_TILES = (
    (16, 32, 128, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 128, 64, 4, 4),
    (16, 128, 128, 4, 3),
    (16, 256, 64, 8, 3),
    (32, 64, 64, 4, 4),
    (32, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (128, 128, 32, 8, 4),
    (128, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
)


def gemm_candidates(
    m: int, n: int, k: int, dtype: torch.dtype, shared_memory: int, sm_count: int = 0
) -> list[GemmConfig]:
    """The configurations max-autotune measures for an ``m x k @ k x n``
    product of ``dtype`` operands on a device with ``shared_memory`` bytes
    per block and ``sm_count`` SMs: the heuristic's tiles first
    (:func:`gpu_gemm_config`; the launch's own, which ``gemm_config`` may
    give fewer stages, ``fewest_waves``, comes before it in
    :meth:`Gemm.candidates`), then each of :data:`TUNING_TILES` that

    * fits the product's rows and columns (:func:`_fits`: no 128-row tiles
      for M <= 16, no 16-row tiles for M > 64),
    * keeps ``tl.dot``'s minimum of 16 on every side,
    * launches the same source: where the heuristic's ``BLOCK_K`` divides K
      (no K masks in the source), only a ``BLOCK_K`` that divides K too,
    * fits its software-pipeline stages in shared memory."""
    first = gpu_gemm_config(m, n, k, dtype, sm_count)
    wide = 1 if dtype.itemsize <= 2 else 2
    found = [first]
    for block_m, block_n, block_k, warps, stages in TUNING_TILES:
        block_k = max(16, min(block_k // wide, next_pow2(k)))
        config = GemmConfig(block_m, block_n, block_k, warps, stages)
        if not (_fits(block_m, m, 128) and _fits(block_n, n, 256)):
            continue
        if masks_k(k, block_k) and not masks_k(k, first.block_k):
            continue
        stage_bytes = (config.block_m + config.block_n) * config.block_k * dtype.itemsize
        if stages * stage_bytes > shared_memory or config in found:
            continue
        found.append(config)
    return found


def gemm_launch(dot: Node, config: GemmConfig) -> LaunchConfig:
    """The launch of a GEMM kernel anchored on ``dot`` with ``config``'s tiles:
    one program per output tile of each batch element."""
    *batch, m, n = dot.shape
    constexprs = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "GROUP_M": GROUP_M,
    }
    tiles = programs(m, config.block_m) * programs(n, config.block_n)
    grid = (ix.size(ix.numel(tuple(batch)) * tiles),)
    return LaunchConfig(constexprs, grid, config.num_warps, config.num_stages)


def _map_loads(value: InlinedExpr, fn: Callable[[BufferLoad], BufferLoad]) -> InlinedExpr:
    """``value`` with ``fn`` applied to each of its loads (not their masks)."""
    if isinstance(value, BufferLoad):
        return fn(value)
    if isinstance(value, Call):
        return Call(value.op, tuple(_map_loads(a, fn) for a in value.args), value.dtype)
    return value


def _fits(block: int, size: int, largest: int) -> bool:
    """Whether a tile side of ``block`` suits a dimension of ``size`` (tile
    sides up to ``largest``): at most the next power of two of the size (a
    larger tile only computes masked lanes), and at least a quarter of the
    largest useful side (smaller tiles only add programs and reloads)."""
    useful = max(16, min(next_pow2(size), largest))
    return useful // 4 <= block <= useful


class Gemm:
    """The GEMM template's writer (``codegen/templates.py``'s protocol):
    writes the kernel of a group anchored on ``dot``, lists the tile
    configurations max-autotune measures, launches one, prices the kernel."""

    # What max-autotune measures and caches: one tile configuration.
    Config = GemmConfig

    def __init__(self, graph: Graph, group: Group, target: Target, dot: Node):
        self.graph, self.group, self.target, self.dot = graph, group, target, dot
        *self.batch, m, n = dot.shape
        (k,) = dot.reduce_shape
        self.left, self.right = (operand(a) for a in dot.body.args)
        # Sub-byte operands (:func:`packing`): K walked as d interleaved
        # slices, ``k = d * j + p``, over the packed index ``j``.
        self.template = template_config(graph, group, dot, target)
        masked = masks_k(k, self.config.block_k)
        self.m = Axis("m", "irow", (m,), (0,), "mmask", "mzero")
        self.n = Axis("n", "icol", (n,), (0,), "nmask", "nzero")
        self.ka = Axis("ka", "rka", (k,), (0,), "kamask" if masked else "", "kazero")
        self.kb = Axis("kb", "rkb", (k,), (0,), "kbmask" if masked else "", "kbzero")
        order = tuple(range(len(self.batch)))
        self.b = Axis("b", "ibat", tuple(self.batch), order, "", "0")
        axes = (self.m, self.n, self.ka, self.kb) + ((self.b,) if self.batch else ())
        if self.pack > 1:
            self.ja = Axis("ja", "rja", (k // self.pack,), (0,), "", "jazero")
            self.jb = Axis("jb", "rjb", (k // self.pack,), (0,), "", "jbzero")
            axes += (self.ja, self.jb)
        # The K step's first position (packed: ``koff // pack``), for what a
        # whole step reads at one place (:meth:`per_step`), and the step's
        # width along each walked K symbol.
        self.ks = ix.index_symbol("rks", 0)
        walked = (self.ja, self.jb) if self.pack > 1 else (self.ka, self.kb)
        self.widths = {s: self.config.block_k // self.pack for a in walked for s in a.symbols}
        self.step_written = False  # ``rks0`` assigned in the K loop's body
        self.step_asserts: set[int] = set()
        self.e = Emitter(graph, group, axes, {self.ks: k // self.pack})

    @staticmethod
    def candidates(
        graph: Graph, dot: Node, target: Target, launch: LaunchConfig
    ) -> list[GemmConfig]:
        """The configurations to measure for the kernel launched as ``launch``:
        its own first (it wins ties), then :func:`gemm_candidates`'s."""
        problem = GEMM.problem(graph, dot)
        found = [
            GemmConfig.of(launch),
            *gemm_candidates(*problem, target.shared_memory_per_block, target.sm_count),
        ]
        return list(dict.fromkeys(found))

    @staticmethod
    def launch(dot: Node, config: GemmConfig) -> LaunchConfig:
        return gemm_launch(dot, config)

    @staticmethod
    def predict(kernel: KernelSource, target: Target) -> cost.Prediction:
        """One launch of the kernel: its FLOPs at the template's rate for its
        narrowest floating-point input, over its grid's tiles (wave
        quantization), or its bytes if more."""
        inputs = [a.dtype for a in kernel.args if not a.is_output and a.dtype.is_floating_point]
        dtype = min(inputs, key=lambda d: d.itemsize, default=torch.float32)
        tiles = math.prod(int(g) for g in kernel.launch.grid)
        nbytes = kernel.bytes_read + kernel.bytes_written
        return cost.gemm(
            target,
            kernel.flops,
            nbytes,
            dtype,
            template=True,
            tiles=tiles,
            k_loop=kernel.program_loop,
        )

    def write(self) -> tuple[Emitter, LaunchConfig, ix.Size, ix.Size]:
        e = self.e
        size = e.size_text
        e.line(f"pid = {program_id(self.graph, ix.numel(self.dot.shape))}")
        # Tile counts from the block sizes, which are launch parameters.
        e.line(f"tiles_m = ({size(self.m.numel)} + BLOCK_M - 1) // BLOCK_M")
        e.line(f"tiles_n = ({size(self.n.numel)} + BLOCK_N - 1) // BLOCK_N")
        if self.batch:
            e.line("b = pid // (tiles_m * tiles_n)")
            e.line("tile = pid % (tiles_m * tiles_n)")
            e.index_variables(self.b)
        else:
            e.line("tile = pid")
        # Grouped order: GROUP_M row tiles walk the columns together.
        e.line("width = GROUP_M * tiles_n")
        e.line("first = (tile // width) * GROUP_M")
        e.line("rows = tl.minimum(tiles_m - first, GROUP_M)")
        e.line("pid_m = first + (tile % width) % rows")
        e.line("pid_n = (tile % width) // rows")
        e.line("m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
        e.line("n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
        e.line(f"mmask = m < {size(self.m.numel)}")
        e.line(f"nmask = n < {size(self.n.numel)}")
        e.line("mzero = tl.full([BLOCK_M, 1], 0, tl.int32)")
        e.line("nzero = tl.full([1, BLOCK_N], 0, tl.int32)")
        e.line("kazero = tl.full([1, BLOCK_K], 0, tl.int32)")
        e.line("kbzero = tl.full([BLOCK_K, 1], 0, tl.int32)")
        if self.pack > 1:
            slice_k = f"BLOCK_K // {self.pack}"
            # Every configuration this source launches with keeps tl.dot's minimum.
            e.line(f"tl.static_assert({slice_k} >= {MIN_DOT_K})")
            e.line(f"jazero = tl.full([1, {slice_k}], 0, tl.int32)")
            e.line(f"jbzero = tl.full([{slice_k}, 1], 0, tl.int32)")
        e.index_variables(self.m)
        e.index_variables(self.n)
        top = Scope()
        self.accumulate(top)
        self.epilogue(Scope(top))
        launch = gemm_launch(self.dot, self.config)
        return e, launch, ix.numel(self.dot.shape), self.ka.numel

    @property
    def config(self) -> GemmConfig:
        return self.template.config

    @property
    def pack(self) -> int:
        """K positions a byte of the operands packs (:func:`packing`)."""
        return self.template.pack

    def program_loop(self) -> cost.KLoop | None:
        """The K loop as the cost model counts it (``GemmConfig.k_loop``:
        its steps, stages, rows, and the programs an SM holds, which a
        packed weight's registers bound); None where K is symbolic."""
        return self.template.loop

    def work(self) -> tuple[dict[str, ix.Size], ix.Size]:
        """For the metrics: how often each operand's tile (its prologue) is
        computed, once per tile of the other side, and the product's FLOPs
        (a multiply and an add per point) and its prologue reductions'."""
        cfg = self.config
        per_n, per_m = programs(self.n.numel, cfg.block_n), programs(self.m.numel, cfg.block_m)
        recomputed = {"ka": per_n, "kb": per_m, "ja": per_n, "jb": per_m}
        flops = 2 * ix.numel(self.dot.shape) * self.ka.numel
        # A row reduction of the prologue: one op per row and K, per column tile.
        reductions = sum(1 for n in self.group.nodes if self.graph.nodes[n].kind == "reduction") - 1
        batch = ix.numel(tuple(self.batch))
        flops += reductions * batch * self.m.numel * self.ka.numel * recomputed["ka"]
        return recomputed, flops

    def accumulate(self, top: Scope) -> None:
        """The K loop: operand tiles (with their prologue) into ``acc``.
        With sub-byte operands (``pack`` d > 1) each K step is d products,
        one per slice ``k = d * j + p`` of it: an operand's packed bytes are
        then loaded once per step at ``j`` (contiguous, so in wide loads),
        and which part of a byte position ``k`` takes is the constant ``p``."""
        e, dot = self.e, self.dot
        k = e.size_text(self.ka.numel)
        batch = dict(zip(ix.out_symbols(len(self.batch)), self.b.symbols))
        i_m, i_n = ix.out_symbols(len(dot.shape))[-2:]
        (r,) = ix.reduce_symbols(1)
        a_subst = {**batch, i_m: self.m.symbols[0], r: self.ka.symbols[0]}
        b_subst = {**batch, r: self.kb.symbols[0], i_n: self.n.symbols[0]}
        self.row_reductions(a_subst, top)
        e.line("acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)")
        e.line(f"for koff in range(0, {k}, BLOCK_K):")
        e.indent += 1
        if self.pack == 1:
            self.k_step()
            slices = [(self.ka, self.kb, self.ka.symbols[0], self.kb.symbols[0], "BLOCK_K")]
        else:
            self.packed_step()
            d, (ja,), (jb,) = self.pack, self.ja.symbols, self.jb.symbols
            width = f"BLOCK_K // {d}"
            slices = [(self.ja, self.jb, d * ja + p, d * jb + p, width) for p in range(d)]
        loop = Scope(top)
        # Each operand in a scope of its own: a scalar is loaded along the
        # operand's own rows, so the two may not share it.  The slices of an
        # operand share one: its packed bytes are loaded once.
        a_scope, b_scope = Scope(loop), Scope(loop)
        precision = ""
        if self.left.dtype == torch.float32:
            tf32 = self.target.tf32
            precision = f", input_precision={'tf32' if tf32 else 'ieee'!r}"
        # Packed two a byte: the left operand (the activations) is computed
        # over the step's contiguous K positions, loaded in wide
        # (asynchronous) copies, and split into its two slices in registers.
        sliced = self.deinterleave(a_subst, a_scope) if self.pack == 2 else ()
        for p, (ka, kb, at_a, at_b, width) in enumerate(slices):
            if sliced:
                a = sliced[p]
            else:
                a = self.tile(self.left, {**a_subst, r: at_a}, a_scope, self.m)
            b = self.tile(self.right, {**b_subst, r: at_b}, b_scope, kb)
            a = self.full(a, self.m, ka, f"[BLOCK_M, {width}]")
            b = self.full(b, kb, self.n, f"[{width}, BLOCK_N]")
            e.line(f"acc = tl.dot({a}, {b}, acc{precision})")
        e.indent -= 1
        e.define(dot.name, "acc", frozenset("mn"), torch.float32)

    def deinterleave(
        self, a_subst: dict[sympy.Symbol, sympy.Expr], scope: Scope
    ) -> tuple[str, str]:
        """The left operand at the step's positions ``k = koff + i``, split
        into the two slices of a weight packing 2 positions a byte (int4):
        ``k = 2 j`` and ``2 j + 1``, along axis ``ja``.  Loaded contiguously,
        its loads are wide enough for Triton's pipeliner to copy them
        asynchronously; loaded per slice (stride 2), they were 2-byte loads
        each step waited for."""
        e = self.e
        (r,) = ix.reduce_symbols(1)
        value = self.tile(self.left, {**a_subst, r: self.ka.symbols[0]}, scope, self.m)
        axes = e.axes_of(value)
        if self.ka.name not in axes:  # constant along K: both slices are the value
            return value, value
        rows = "BLOCK_M" if self.m.name in axes else "1"
        even, odd = e.tmp("even"), e.tmp("odd")
        e.line(f"{even}, {odd} = tl.split(tl.reshape({value}, [{rows}, BLOCK_K // 2, 2]))")
        sliced = Value(None, (axes - {self.ka.name}) | {self.ja.name}, self.left.dtype)
        e.values[even] = e.values[odd] = sliced
        return even, odd

    def packed_step(self) -> None:
        """The packed K indices of the step at ``koff`` (``pack`` divides
        ``BLOCK_K``, and ``BLOCK_K`` divides K: no masks), and for 2 a byte
        the unpacked ones the left operand is computed at (:meth:`deinterleave`)."""
        e, d = self.e, self.pack
        if d == 2:
            e.line("ka = koff + tl.arange(0, BLOCK_K)[None, :]")
            e.index_variables(self.ka)
        e.line(f"ja = koff // {d} + tl.arange(0, BLOCK_K // {d})[None, :]")
        e.line(f"jb = koff // {d} + tl.arange(0, BLOCK_K // {d})[:, None]")
        e.index_variables(self.ja)
        e.index_variables(self.jb)

    def k_step(self) -> None:
        """The K loop's indices (and masks) for the step at ``koff``."""
        e, k = self.e, self.e.size_text(self.ka.numel)
        e.line("ka = koff + tl.arange(0, BLOCK_K)[None, :]")
        e.line("kb = koff + tl.arange(0, BLOCK_K)[:, None]")
        if self.ka.mask:
            e.line(f"kamask = ka < {k}")
            e.line(f"kbmask = kb < {k}")
        e.index_variables(self.ka)
        e.index_variables(self.kb)

    def row_reductions(self, a_subst: dict[sympy.Symbol, sympy.Expr], top: Scope) -> None:
        """The left operand's row reductions (``GemmAnchor.row_reductions``:
        a norm's statistic), each in a loop over K of its own before the
        product's, for this tile's rows, at the position the operand reads
        it: the operand's loads of it then read the result."""
        e, graph = self.e, self.graph
        reductions = [
            graph.nodes[n]
            for n in self.group.nodes
            if graph.nodes[n].kind == "reduction" and n != self.dot.name
        ]
        if not reductions:
            return
        holder = dataclasses.replace(self.dot, body=self.left)
        loads = e.inliner.loads(e.inliner.body(holder, a_subst))
        (r,) = ix.reduce_symbols(1)
        k = e.size_text(self.ka.numel)
        mask = " & ".join(e.masks(frozenset({"m", "ka"})))
        for red in reductions:
            (index,) = {load.index for load in loads if load.buffer == red.name}
            subst = {**dict(zip(ix.out_symbols(len(red.shape)), index)), r: self.ka.symbols[0]}
            dtype, combine = red.body.dtype, COMBINE[red.reduce_op]
            start = neutral(red.reduce_op, dtype)
            acc = e.tmp("racc")
            e.line(f"{acc} = {full_text(start, dtype, '[BLOCK_M, BLOCK_K]')}")
            e.line(f"for koff in range(0, {k}, BLOCK_K):")
            e.indent += 1
            self.k_step()
            value = e.emit(e.inliner.body(red, subst), Scope(top))
            if mask:
                value = f"tl.where({mask}, {value}, {full_text(start, dtype)})"
            e.line(f"{acc} = {combine}({acc}, {value})")
            e.indent -= 1
            out = e.tmp("row")
            e.line(f"{out} = tl.reduce({acc}, 1, {combine})[:, None]")
            e.define(red.name, out, frozenset("m"), red.body.dtype)

    def tile(
        self, expr: Expr, subst: dict[sympy.Symbol, sympy.Expr], scope: Scope, rows: Axis
    ) -> str:
        """One operand's tile this K step: its expression inlined over the
        tile's index symbols (the prologue), in the operand's dtype."""
        holder = dataclasses.replace(self.dot, body=expr)
        self.e.scalar_axis = rows.name
        value = self.e.emit(self.per_step(self.e.inliner.body(holder, subst)), scope)
        self.e.scalar_axis = None
        known = self.e.values.get(value)
        if known is None or known.dtype != expr.dtype:
            value = self.e.convert(value, expr.dtype)
        return value

    def per_step(self, value: InlinedExpr) -> InlinedExpr:
        """``value`` with each load that reads its K position ``k`` only as
        ``k // c``, where ``c`` is a multiple of the step's width, read at the
        step's first position instead: one value per step (an int4 weight's
        group scale, for a group of at least a step), loaded once per column
        rather than for every position of the tile.  The source asserts the
        width divides ``c`` for every configuration it is launched with; a
        width that does not keeps the per-position load."""
        widths, start = self.widths, self.ks

        def at_start(load: BufferLoad) -> BufferLoad:
            index = tuple(sympy.sympify(c) for c in load.index)
            walked = set().union(*(c.free_symbols for c in index)) & set(widths)
            if len(walked) != 1:
                return load
            (k,) = walked
            divisors: set[int] = set()
            moved = {}
            for f in set().union(*(c.atoms(sympy.floor) for c in index)):
                num, den = sympy.fraction(sympy.together(f.args[0]))
                if num == k and den.is_Integer and int(den) % widths[k] == 0:
                    moved[f] = sympy.floor(start / den)
                    divisors.add(int(den))
            index = tuple(c.xreplace(moved) for c in index)
            if not moved or any(k in c.free_symbols for c in index):
                return load
            self.start_step(divisors)
            return dataclasses.replace(load, index=index)

        return _map_loads(value, at_start)

    def start_step(self, divisors: set[int]) -> None:
        """The step's first position in the K loop's body (once), and the
        assertions that the step's width divides ``divisors``."""
        e = self.e
        if not self.step_written:
            e.line(f"{self.ks} = koff" + (f" // {self.pack}" if self.pack > 1 else ""))
            self.step_written = True
        width = "BLOCK_K" if self.pack == 1 else f"(BLOCK_K // {self.pack})"
        for c in sorted(divisors - self.step_asserts):
            e.line(f"tl.static_assert({c} % {width} == 0)")
        self.step_asserts |= divisors

    def full(self, value: str, rows: Axis, cols: Axis, shape: str) -> str:
        """``value`` as a full operand tile, zero past K when K is ragged."""
        e = self.e
        if e.axes_of(value) != {rows.name, cols.name}:
            out = e.tmp("op")
            e.line(f"{out} = tl.broadcast_to({value}, {shape})")
            value = out
        k_mask = (cols if rows is self.m else rows).mask
        known = e.values.get(value)
        loaded = known is not None and isinstance(known.expr, BufferLoad)
        if k_mask and not loaded:  # a load past K already gives 0
            out = e.tmp("op")
            zero = full_text("0", self.left.dtype)
            e.line(f"{out} = tl.where({k_mask}, {value}, {zero})")
            value = out
        return value

    def epilogue(self, scope: Scope) -> None:
        """Every stored node at its own position in the output tile."""
        e = self.e
        rows = (*self.b.symbols, self.m.symbols[0], self.n.symbols[0])
        to_tile = dict(zip(ix.out_symbols(len(rows)), rows))
        for name in self.group.stored:
            shape = self.graph.nodes[name].shape
            index = rows
            if shape != self.dot.shape:  # a reshape of the product (same elements)
                position = row_position(self.dot.shape, shape, ix.symbol_ranges(self.dot.shape))
                index = tuple(sympy.sympify(c).xreplace(to_tile) for c in position)
                index = tuple(ix.simplify_index(c, e.ranges) for c in index)
            value = e.computed[name] if name == self.dot.name else None
            if value is None:
                value = e.emit(e.inliner.value(name, index), scope)
            e.store(name, index, value, scope, frozenset("mn"))
