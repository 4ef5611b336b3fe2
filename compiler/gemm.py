"""The GEMM template's anchor and tiles: everything about it but its kernel writer.

The GEMM is the first template kind (``compiler/anchors.py``).  Its anchor
is a dot reduction, ``reduce_op=DOT`` (built by ``passes/matmul.py``'s
``as_dot``): ``out[b.., m, n] = sum over k of left[b.., m, k] * right[b.., k, n]``,
its body the product of two operand expressions.  This module holds the
anchor kind (:data:`GEMM`: what fuses into a GEMM kernel, reference
semantics, work counts) and the heuristic tile configuration per problem,
shared by codegen (the launch of a GEMM kernel, ``codegen/gemm.py``, which
writes the kernel) and by the cost model (a template's tiles decide its wave
quantization), so the compiler prices the tiles the kernel will run with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.decisions import Reason
from tilec.inline import BufferLoad, InlinedExpr, Inliner, row_position
from tilec.ir import (
    Call,
    Const,
    Expr,
    Graph,
    Group,
    Index,
    Load,
    Node,
    base_inputs,
    buffers_of,
    view_base,
    walk,
)
from tilec.target import Target

if TYPE_CHECKING:
    from tilec.codegen.launch import LaunchConfig

# Software-pipelining stages of a GEMM's K loop (``tl.range``'s ``num_stages``).
STAGES = 3
# Registers a thread of a GEMM template kernel is assumed to take, for how
# many programs an SM holds (``GemmConfig.k_loop``).  Compiled for sm_90
# (triton 3.7.1): TinyLlama's bf16 and int8 decode GEMMs took 44 to 80
# (16 x 16 tiles, 4 warps) and 64 to 127 (16 x 64, 8 warps); 128 x 128 x
# 64 and 64 x 128 x 64 tiles 92 to 126.  fp32's FMA tiles took more (175
# at 64 x 64), so fewer programs an SM than counted; the static decode
# report's sm_90 table names each kernel counted over.
TEMPLATE_REGISTERS = 128
# The same for a tile whose weight packs K positions (int4, ``packing``),
# dequantized in registers, the most TinyLlama's decode GEMMs took on
# sm_90 (triton 3.6 to 3.8): 138 to 144 at 16 x 16 x 256 with one row,
# 168 to 182 with 8 (two programs an SM; 144 would count three); 152 to
# 255 at 16 x 64 x 512; 99 to 186 at 16 x 64 x 256 of 8 warps with 2 to 16
# rows (:func:`packed_alternative`; the most with triton 3.7.1 and
# ``silu(x) * y`` in the prologue: one program an SM, as 128 would be two).
PACKED_NARROW_REGISTERS = 182
PACKED_WIDE_REGISTERS = 255
PACKED_WIDE_SHORT_REGISTERS = 186


def template_registers(config: GemmConfig, pack: int = 1, epilogue: Epilogue | None = None) -> int:
    """Registers a thread of a GEMM template kernel of ``config``'s tiles is
    assumed to take: :data:`TEMPLATE_REGISTERS`, or more where its
    ``epilogue`` (:func:`epilogue_of`) needs them (:func:`epilogue_registers`),
    its weight packing ``pack`` positions to an element."""
    if pack == 1:
        if epilogue is None:
            return TEMPLATE_REGISTERS
        return max(TEMPLATE_REGISTERS, epilogue_registers(config, epilogue))
    if config.block_n < 64:
        return PACKED_NARROW_REGISTERS
    short = config.block_k <= PACKED_NARROW_BLOCK_K
    return PACKED_WIDE_SHORT_REGISTERS if short else PACKED_WIDE_REGISTERS


# What an epilogue adds to a GEMM thread's registers, calibrated on sm_90
# compiles (triton 3.7.1) of the zoo's GEMM templates (bert, gpt2, t5,
# llama, convnext_t; bf16 inference at batch 1 and 32, the training step at
# batch 8: 128 x 128 and 128 x 64 tiles of 8 warps, 64 and 32 elements a
# thread) and of a 4096 x 3072 x 768 product with each unary op of
# torch's in its epilogue.  A tile took its elements plus about 36
# (97 to 114 at 64 elements, one store, cheap ops: exp, log, sqrt, sin,
# sigmoid, silu, ReLU, a bias, a residual); each further tile it stores
# half an element more (128 to 146 storing two, 130 to 177 four); an op
# whose code is long (:data:`LONG_OPS`) one element more per value live
# beside it past two (:func:`epilogue_values`: GELU's erf form, x live
# across erf, 156 to 163 against erf alone's 105; its tanh form 202;
# dropout's Philox at 32 elements 214 to 255); and a libdevice op with a
# slow path (:data:`SLOW_PATH_OPS`) two elements more (erfc and sinh 255
# and spilling at 64 elements, which :data:`EPILOGUE_SCRATCH` now narrows:
# 139 and 90 at 32; a non-integer pow 237, log1p 185; an integer power is
# multiplies, no pow).  Pessimistic for some: recompiled on 2026-12-03,
# ``log1p``, ``cosh`` and ``pow(x, 1.5)`` of ``x @ w.t() + b`` took 101
# to 105 stored in bf16, 103 to 156 stored in fp32; pow since computed in
# float64 (``_pow``; libdevice's log2 and exp2) 238 (``|x @ w.t() + b| **
# 1.7``, counted 228).  Counted against those
# compiles (the zoo's by a calibration script, seven in
# tests/test_gemm_registers.py): above 128 (one 8-warp program an SM, not
# two) wherever the compile was but t5's training-step kernel storing
# ``where(x > 0, x, 0)`` (129); above 128 where the compile was not for
# GELU's erf-form backward (125) and a few single ops (softplus 101,
# tanh-form GELU alone 128).
EPILOGUE_BASE_REGISTERS = 36
STORE_REGISTERS_PER_ELEMENT = 0.5
LONG_OPS = frozenset({"erf", "tanh", "pow", "rand"})
SLOW_PATH_OPS = frozenset({"erfc", "sinh", "cosh", "log1p", "pow"})
SLOW_PATH_REGISTERS_PER_ELEMENT = 2
# The most registers a thread may take (sm_90; more spill).
MAX_REGISTERS = 255


def epilogue_registers(config: GemmConfig, epilogue: Epilogue) -> int:
    """Registers a thread of a GEMM template of ``config``'s tiles takes
    with ``epilogue`` (calibration: :data:`EPILOGUE_BASE_REGISTERS`)."""
    elements = config.elements_per_thread
    per_element = 1 + STORE_REGISTERS_PER_ELEMENT * max(0, epilogue.stores - 1)
    if epilogue.ops & LONG_OPS:
        per_element += max(0, epilogue.values - 2)
    if epilogue.ops & SLOW_PATH_OPS:
        per_element += SLOW_PATH_REGISTERS_PER_ELEMENT
    return min(MAX_REGISTERS, math.ceil(elements * per_element) + EPILOGUE_BASE_REGISTERS)


# Products with at most this many rows (a decode step) get the small-M tiles.
SMALL_M = 16
# ``BLOCK_K`` of a product of few rows.  Each K step's row of activations
# ([1, BLOCK_K]) is spread over the program's threads; Triton's pipeliner
# copies a load asynchronously (cp.async, ``num_stages`` deep) only if each
# thread's part is at least 4 bytes.  At 128 (one bf16 per thread of 4
# warps) every step waited for its 2-byte loads: the H100 and H200 runs
# timed the M = 1 template at about 1.1 us per K step whatever its bytes
# (benchmarks/results/gpu/2026-11-26-*, gemms).  512 gives each of 8 warps'
# threads two (sm_90 PTX: no synchronous load left in the K loop of the
# decode step's GEMVs, bf16, int8 and int4).
SMALL_M_BLOCK_K = 512
# The ``reduce_op`` of a GEMM's anchor, the dot reduction.
DOT = "dot"
# Where no cost model prices it (the interpreter has no figures), what
# computes an operand goes into a GEMM's prologue, computed again for every
# tile that reads it, only if it costs at most this many ops per element in
# all (a cast, a dequantization).
PROLOGUE_OPS = 12


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = STAGES

    @classmethod
    def of(cls, launch: LaunchConfig) -> GemmConfig:
        """The configuration a GEMM kernel's launch uses."""
        c = launch.constexprs
        return cls(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], launch.num_warps, launch.num_stages)

    def k_loop(
        self,
        k: int,
        itemsize: int,
        target: Target,
        pack: int = 1,
        staged: tuple[int, int] | None = None,
        epilogue: Epilogue | None = None,
    ) -> cost.KLoop:
        """The K loop over ``k`` of operands of ``itemsize`` bytes on ``target``,
        for ``cost.gemm``: its steps and stages, the tile's rows, and how many
        programs share an SM (by their pipeline's shared memory, their
        threads and their registers, :func:`template_registers`; ``pack``:
        :func:`packing`).  The shared memory: :func:`staged_steps` times
        ``staged``'s first plus its second where the kernel's loads are
        known (:func:`_staged_bytes`), else times both tiles at
        ``itemsize``; ``epilogue``: the kernel's, where known
        (:func:`epilogue_of`)."""
        ahead, computed = staged or ((self.block_m + self.block_n) * self.block_k * itemsize, 0)
        shared = staged_steps(self, target) * ahead + computed
        steps = math.ceil(k / self.block_k)
        registers = template_registers(self, pack, epilogue)
        resident = cost.resident_programs(target, shared, self.num_warps, registers)
        return cost.KLoop(steps, self.num_stages, self.block_m, resident)

    @property
    def elements_per_thread(self) -> int:
        """Elements of the output tile each of its threads holds."""
        return self.block_m * self.block_n // (32 * self.num_warps)

    def __str__(self) -> str:
        return (
            f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} "
            f"warps={self.num_warps} stages={self.num_stages}"
        )


def gemm_config(
    target: Target,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    batch: int = 1,
    two_tile_left: bool = False,
    epilogue: int = 0,
) -> GemmConfig:
    """Tiles for ``batch`` products ``m x k @ k x n`` of ``dtype`` operands
    (sizes at their hints); ``two_tile_left``: the kernel computes the left
    operand from two tiles or more of its rows (:func:`two_tile_left`);
    ``epilogue``: the values an element of the tile holds at once in the
    kernel's epilogue (:func:`epilogue_values`), which narrow the tile
    (:func:`fit_epilogue`).
    ``tl.dot`` needs every tile side to be at least 16.  Whether K needs
    masks is the same on every target: it is part of the kernel's source,
    which must not depend on the target."""
    if target.interpret:
        return GemmConfig(_fit(m, 64), _fit(n, 64), _block_k(m, k, dtype), 4, 1)
    config = gpu_gemm_config(m, n, k, dtype, target.sm_count)
    if two_tile_left and 1 < m <= SMALL_M and config.block_k > TWO_TILE_LEFT_BLOCK_K:
        # Any K that 512 divides, 256 does: the same source (no K masks).
        block_k = TWO_TILE_LEFT_BLOCK_K
        warps = small_m_warps(config.block_n, block_k)
        config = dataclasses.replace(config, block_k=block_k, num_warps=warps)
    if m <= SMALL_M and dtype.itemsize <= 2 and target.few_row_step_s is not None:
        tiles = cost.output_tiles(m, n, (config.block_m, config.block_n), batch)
        config = fewest_waves(config, tiles, k, dtype.itemsize, target)
    return fit_epilogue(config, epilogue)


# What a thread's share of a GEMM's epilogue may hold: the elements of the
# output tile it holds (``BLOCK_M * BLOCK_N / threads``) times the values
# each holds at once (:func:`epilogue_values`).  A count, not ptxas's
# register allocation: where the compiler computes an element's chain
# before the next element's, far fewer are live.  Calibrated on sm_90
# compiles (triton 3.7.1) of the zoo's batch-8 bf16 training step at 128 x
# 128 tiles of 8 warps (64 elements a thread): dropout in a forward GEMM's
# epilogue (Philox; 7 values) spilled 3.5 to 7.8 KB a thread (bert, gpt2,
# t5), and gpt2's backward through GELU's tanh form (6, each step rounded
# to bf16) 2 KB (1.1 KB with ``_tanh`` taking no log), while GELU's
# backward in its erf form (5) took 125 registers and inference's GELU (3
# or 4) 159 and 202, without a spill.  At 128 x 64 (32 elements) the
# dropout and gpt2's GELU backward took 217 and 179 registers and spilled
# nothing.
EPILOGUE_BUDGET = 320
# Values an element's op holds while it computes, beyond its result:
# Philox's three other counter words (``rand``, ``tilec.rng``; its key is
# the seed's, one per row or program); libdevice's erfc and sinh, whose
# slow paths took 255 registers and spilled at 128 x 128 (296 and 8 bytes
# a thread, ``erfc(x @ w.t() + b)`` of 4096 x 3072 x 768, triton 3.7.1):
# four, which narrows their tile to 128 x 64 (139 and 90, no spill).
EPILOGUE_SCRATCH = {"rand": 3, "erfc": 4, "sinh": 4}


def fit_epilogue(config: GemmConfig, values: int) -> GemmConfig:
    """``config`` with its output tile halved (columns first, down to 64 by
    64) until a thread's share of the epilogue's ``values`` fits
    :data:`EPILOGUE_BUDGET`."""
    while config.elements_per_thread * values > EPILOGUE_BUDGET:
        if config.block_n > 64:
            config = dataclasses.replace(config, block_n=config.block_n // 2)
        elif config.block_m > 64:
            config = dataclasses.replace(config, block_m=config.block_m // 2)
        else:
            break
    return config


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What a GEMM kernel's epilogue holds and does, per element of its
    output tile (:func:`epilogue_of`)."""

    # The most 32-bit values an element holds at once (:func:`epilogue_values`).
    values: int
    # The tiles it stores: its stored nodes that vary along the tile's rows
    # and columns (the product's, or a pointwise node's of its shape).
    stores: int
    # The scalar ops it computes on values that vary along both.
    ops: frozenset[str]


def epilogue_values(
    graph: Graph, members: Collection[str], stored: Collection[str], dot: Node
) -> int:
    """The most 32-bit values an element of ``dot``'s output tile holds at
    once in the epilogue of the kernel computing ``members``
    (:func:`epilogue_of`)."""
    return epilogue_of(graph, members, stored, dot).values


def epilogue_of(
    graph: Graph, members: Collection[str], stored: Collection[str], dot: Node
) -> Epilogue:
    """The epilogue of the kernel computing ``members``, anchored on ``dot``
    (``codegen/gemm.py``).  Its values: the most 32-bit values an element of
    ``dot``'s output tile holds at once, each of its ``stored`` nodes inlined at its
    position in the tile, each distinct expression computed once in that
    order (as the kernel's text computes it) and live from where it is
    computed (the accumulator: from the start) to its last reader or its
    store; a 64-bit value counts two, an op's own working values
    (:data:`EPILOGUE_SCRATCH`) count while it computes.  Only values that
    vary along both the tile's rows and its columns count: a bias or a
    row's statistic is one per row or column."""
    rows = ix.out_symbols(len(dot.shape))
    ranges = ix.symbol_ranges(dot.shape)
    inliner = Inliner(graph, set(members), ranges)
    both = set(rows[-2:])
    order: list[InlinedExpr] = []  # each distinct expression, as computed
    position: dict[InlinedExpr, int] = {}
    tiled: list[bool] = []  # whether order[i] varies along rows and columns
    last: dict[int, int] = {}  # where order[i] is last read (or stored)

    def symbols(e: InlinedExpr) -> set[sympy.Symbol]:
        if isinstance(e, Index):
            return set(sympy.sympify(e.expr).free_symbols)
        if isinstance(e, BufferLoad):
            return set().union(*(sympy.sympify(c).free_symbols for c in e.index))
        return set()

    def visit(e: InlinedExpr) -> int:
        if e in position:
            return position[e]
        args = list(e.args) if isinstance(e, Call) else []
        if isinstance(e, BufferLoad) and e.mask is not None:
            args.append(e.mask)
        kids = [visit(a) for a in args]
        own = both <= symbols(e) or (isinstance(e, BufferLoad) and e.buffer == dot.name)
        i = len(order)
        order.append(e)
        position[e] = i
        tiled.append(own or any(tiled[k] for k in kids))
        for k in kids:
            last[k] = i
        return i

    stores = int(dot.name in stored)
    for name in stored:
        if name == dot.name or graph.nodes[name].kind != "pointwise":
            continue
        shape = graph.nodes[name].shape
        index = rows if shape == dot.shape else row_position(dot.shape, shape, ranges)
        value = visit(inliner.value(name, index))
        last[value] = len(order)  # its store, after it
        stores += tiled[value]
    live = [0] * (len(order) + 1)
    for i, e in enumerate(order):
        if not tiled[i] or isinstance(e, Const):
            continue
        first = 0 if isinstance(e, BufferLoad) and e.buffer == dot.name else i
        words = 2 if e.dtype.itemsize == 8 else 1
        for t in range(first, last.get(i, i) + 1):
            live[t] += words
    for i, e in enumerate(order):
        if isinstance(e, Call):
            live[i] += EPILOGUE_SCRATCH.get(e.op, 0)
    ops = frozenset(e.op for e, t in zip(order, tiled) if t and isinstance(e, Call))
    return Epilogue(max(live), stores, ops)


# ``BLOCK_K`` of a product of 2 to ``SMALL_M`` rows whose kernel computes
# the left operand from two tiles of its rows (the down projection's
# silu(gate) * up, :func:`two_tile_left`).  Compiled for sm_90 (triton
# 3.7.1, TinyLlama's down projection at 8 rows, 16 x 16 tiles, 2 to 6
# stages): int8 weights took 255 registers and spilled 264 to 328 bytes
# with steps of 512, 133 and none with 256; bf16's spilled 29,436 bytes
# with 512, took 115 to 124 and none with 256.  One row did not spill.
TWO_TILE_LEFT_BLOCK_K = 256


def two_tile_left(graph: Graph, members: Collection[str], dot: Node) -> bool:
    """Whether ``dot``'s left operand, as a kernel of ``members`` computes
    it, reads two tiles or more along the product's rows and K (distinct
    loads): ``silu(gate) * up`` does, an RMS norm's ``x * rstd * w`` (one
    tile of x, a row of w) does not, nor a product of one row (no load
    varies along its rows)."""
    (r,) = ix.reduce_symbols(1)
    row = ix.out_symbols(len(dot.shape))[-2]
    inliner, values = _operand_values(graph, members, dot)
    tiles = set()
    for load in inliner.loads(values[0]):
        symbols = _index_symbols(load.index)
        if {r, row} <= symbols:
            tiles.add((load.buffer, load.index))
    return len(tiles) >= 2


# Compute capability from which Triton multiplies a tile of at least
# ``WGMMA_ROWS`` rows with the warpgroup MMA (sm_90's wgmma).
WGMMA_CAPABILITY = (9, 0)
WGMMA_ROWS = 64
# The fewest stages :func:`fewest_waves` gives a few-row product: one step
# copied ahead (one stage has no asynchronous copy: every step would wait
# for its loads, ``Target.round_trip_s``).
MIN_FEW_ROW_STAGES = 2


def staged_steps(config: GemmConfig, target: Target) -> int:
    """How many K steps' loads a kernel of ``config``'s tiles holds in shared
    memory: its stages for a tile the warpgroup MMA multiplies (sm_90, 64
    rows or more), else one fewer (at least one).  Compiled for sm_90
    (triton 3.7.1, 1 to 5 stages): 128 x 128 x 64 and 64 x 128 x 64 bf16
    tiles took their stages times a step's two tiles (32 KB and 24 KB a
    stage); 32 x 128 x 64 and 16 x 16 x 512 tiles one step fewer (20 KB at
    1 and 2 stages, 40 KB at 3; 32 KB at 1 and 2, 64 KB at 3)."""
    wgmma = (
        target.capability is not None
        and target.capability >= WGMMA_CAPABILITY
        and config.block_m >= WGMMA_ROWS
    )
    return config.num_stages if wgmma else max(1, config.num_stages - 1)


def fewest_waves(
    config: GemmConfig,
    tiles: int,
    k: int,
    itemsize: int,
    target: Target,
    staged: tuple[int, int] | None = None,
) -> GemmConfig:
    """``config``, a few-row product's over ``tiles`` output tiles and K
    ``k`` of ``itemsize``-byte operands, with the most stages, down to
    :data:`MIN_FEW_ROW_STAGES`, that run its tiles in the fewest waves.  A
    16-row tile's K step takes ``Target.few_row_step_s`` whatever its
    stages (measured at 8: the steps in flight did not shorten it), while
    the stages' shared memory decides how many programs an SM holds
    (:meth:`GemmConfig.k_loop`), so fewer stages can mean fewer waves of
    the same steps: TinyLlama's q/k/v product at 8 rows, 160 tiles of 16
    columns, takes 2 waves at 8 stages (one program an SM) and one at 3
    (three); its gate/up product's 176 tiles of 64 columns one wave at 2
    (two programs an SM).  Assumed, not measured: programs resident on
    one SM overlap their K steps as programs on different SMs do
    (``benchmarks.gpu_check``'s GEMM variants time it).  ``staged``: the
    kernel's shared memory where its loads are known (``k_loop``)."""

    def waves(stages: int) -> int:
        stepped = dataclasses.replace(config, num_stages=stages)
        loop = stepped.k_loop(k, itemsize, target, staged=staged)
        return math.ceil(tiles / (target.sm_count * loop.resident))

    # ``min`` keeps the first of equals: the most stages.
    stages = min(range(config.num_stages, MIN_FEW_ROW_STAGES - 1, -1), key=waves)
    return dataclasses.replace(config, num_stages=stages)


def gpu_gemm_config(m: int, n: int, k: int, dtype: torch.dtype, sm_count: int = 0) -> GemmConfig:
    """:func:`gemm_config`'s tiles on a GPU of ``sm_count`` SMs (0: unknown)."""
    fit, block_k = _fit, _block_k(m, k, dtype)
    if dtype.itemsize >= 4:
        # fp32 operands multiply without tensor cores (torch's default: no
        # TF32): the FMA dot keeps operand slices in registers, and larger
        # tiles or K steps spill on sm_90 once a prologue adds registers.
        # A 64 x 64 tile takes 8 warps: with 4, each thread holds 32
        # accumulators, and an abs in the prologue took it to 255 registers
        # and a 48-byte spill (triton 3.7 and 3.8); with 8, 175 and none.
        block_m, block_n = 16 if m <= SMALL_M else fit(m, 64), fit(n, 64)
        warps = 8 if block_m * block_n >= 64 * 64 else 4
        return GemmConfig(block_m, block_n, block_k, warps, 4)
    if m <= SMALL_M:
        # A GEMV streams its weight (warps: ``small_m_warps``).  A narrow
        # tile's steps are small, so it keeps more of them in flight
        # (``cost.k_loop_seconds``): 8 stages of 16 columns take 122 KB of
        # shared memory (bf16; sm_90, TinyLlama's o projection), 6 of 32
        # about 165 KB; a 64-column bf16 tile's 4 take 219 KB (its
        # gate/up), near the 227 KB a block may have.
        block_n = _small_m_block_n(n, sm_count)
        warps = small_m_warps(block_n, block_k)
        if block_n >= 64:
            return GemmConfig(16, block_n, block_k, warps, 4)
        return GemmConfig(16, block_n, block_k, warps, 8 if block_n == 16 else 6)
    if m <= 64:
        return GemmConfig(fit(m, 64), fit(n, 128), block_k, 4)
    return GemmConfig(128, fit(n, 128), block_k, 8)


def _small_m_block_n(n: int, sm_count: int) -> int:
    """Columns per tile for a product of few rows (a decode step's GEMV):
    memory-bound, so its tiles are what streams the weight, and the cost
    model (``cost.fill``) prices a grid of fewer tiles than SMs at that share
    of the bandwidth.  The widest of 64 and 32 whose tiles fill the SMs,
    else 16 (``tl.dot``'s minimum)."""
    for block in (64, 32):
        if math.ceil(n / block) >= sm_count:
            return _fit(n, block)
    return 16


def _fit(size: int, cap: int) -> int:
    """A tile side for ``size``: its next power of two, within 16 (``tl.dot``'s
    minimum) and ``cap``."""
    return max(16, min(next_pow2(size), cap))


def small_m_warps(block_n: int, block_k: int) -> int:
    """Warps of a few-row product's tile: 8 on 64 columns, else 4 (on a
    16-column tile 8 warps only repeat the same products, the 16 x 16
    output being one tensor-core tile, and add registers), and no more than
    gives each thread two positions of a K step's row (4 bytes of bf16:
    what Triton copies ahead asynchronously, ``SMALL_M_BLOCK_K``)."""
    return max(1, min(8 if block_n >= 64 else 4, block_k // 64))


def _block_k(m: int, k: int, dtype: torch.dtype) -> int:
    """``BLOCK_K``, the same on every target: 16 for fp32 operands; for
    16-bit ones up to 64, or for few rows the longest step of 512, 256 or
    128 that divides K (:data:`SMALL_M_BLOCK_K`; K masks would also keep an
    int4 weight from being read as whole bytes), else up to 512 with masks."""
    if dtype.itemsize >= 4:
        return _fit(k, 16)
    if m > SMALL_M:
        return _fit(k, 64)
    whole = [b for b in (SMALL_M_BLOCK_K, 256, 128) if b <= k and k % b == 0]
    return whole[0] if whole else _fit(k, SMALL_M_BLOCK_K)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())


# tl.dot's smallest K.
MIN_DOT_K = 16


def masks_k(k: ix.Size, block_k: int) -> bool:
    """Whether a kernel stepping K by ``block_k`` masks K.  The answer is
    part of the kernel's source, so a kernel written without K masks must
    only ever be launched with a ``BLOCK_K`` that divides K."""
    return not (isinstance(k, int) and k % block_k == 0)


def packing(graph: Graph, members: Collection[str], dot: Node) -> int:
    """How many K positions an operand of ``dot`` packs into one element:
    ``d`` where ``members`` (its kernel's nodes) compute an operand from its
    K position ``k`` through ``k mod d`` (an int4 weight, two values to a
    byte: which half of byte ``k // 2`` is ``k mod 2``), else 1: one such d
    of 2, 4 or 8 (a view splitting K into rows of 64 is not packing).  Any d is correct
    (it only orders the sum); this one loads the packed bytes whole."""
    (r,) = ix.reduce_symbols(1)
    inliner, values = _operand_values(graph, members, dot)
    found: set[int] = set()
    for value in values:
        for e in _index_exprs(value, inliner):
            found |= {int(m.args[1]) for m in e.atoms(sympy.Mod) if m.args[0] == r}
    packs = found & {2, 4, 8}
    return packs.pop() if len(packs) == 1 else 1


def _operand_values(
    graph: Graph, members: Collection[str], dot: Node
) -> tuple[Inliner, list[InlinedExpr]]:
    """``dot``'s operands as its kernel computes them, ``members`` (the
    kernel's nodes) inlined, over its index symbols and K position ``r0``;
    and the inliner (its bindings: indices read from data)."""
    (r,) = ix.reduce_symbols(1)
    inliner = Inliner(graph, set(members), {r: dot.reduce_shape[0]})
    return inliner, [inliner.body(dataclasses.replace(dot, body=e), {}) for e in dot.body.args]


def _index_exprs(value: InlinedExpr, inliner: Inliner) -> list[sympy.Expr]:
    """The index arithmetic in ``value``: its loads' indices (``Inliner.loads``:
    gathered ones too) and its index values."""
    out = [sympy.sympify(c) for load in inliner.loads(value) for c in load.index]

    def visit(e: InlinedExpr) -> None:
        if isinstance(e, Index):
            out.append(sympy.sympify(e.expr))
        elif isinstance(e, Call):
            for a in e.args:
                visit(a)

    for e in (value, *inliner.bindings.values()):
        visit(e)
    return out


# A few-row int4 product's tiles (``packed_small_m``): the K step of a
# 16-column tile, and the pipeline stages of 16- and 64-column ones.
PACKED_NARROW_BLOCK_K = 256
PACKED_NARROW_STAGES = 4
PACKED_WIDE_STAGES = 3


def packed_small_m(config: GemmConfig, target: Target) -> GemmConfig:
    """A few-row product's configuration when its weight packs K positions
    (int4), with fewer stages to fit the dequantized tiles.  A 64-column
    tile keeps the unpacked product's 512-position steps
    (``SMALL_M_BLOCK_K``: a 16-row tile's step takes the same time whatever
    its width, ``Target.few_row_step_s``, so the fewer the better): on
    sm_90 a lone 1 x 11264 x 2048 (8 warps, 3 stages) took 166 KB of shared
    memory and 152 to 178 registers with triton 3.6 to 3.8 (4 stages: 249
    KB, more than a block may have).  A 16-column tile takes steps of 256:
    with 512 (4 warps, 2 to 4 stages) triton 3.8 kept the dequantized tile
    in 255 registers and spilled 28 to 96 bytes (1 x 512 x 2048, 1 x 2048 x
    5632; 3.7: 209 registers, no spill; 8 warps spilled too), with 256 every
    version took 138 to 144 registers, no spill, and 32 KB at 4 stages."""
    narrow = config.block_n < 64
    block_k = min(config.block_k, PACKED_NARROW_BLOCK_K) if narrow else config.block_k
    fits = PACKED_NARROW_STAGES if narrow else PACKED_WIDE_STAGES
    stages = config.num_stages if target.interpret else min(config.num_stages, fits)
    warps = min(config.num_warps, small_m_warps(config.block_n, block_k))
    return dataclasses.replace(config, block_k=block_k, num_warps=warps, num_stages=stages)


@dataclasses.dataclass(frozen=True)
class Template:
    """A GEMM template kernel as :func:`template_config` chooses it."""

    config: GemmConfig
    # K positions a byte of its operands packs (1: none, :func:`packing`).
    pack: int
    # Its K loop as the cost model counts it (:meth:`GemmConfig.k_loop`:
    # on a GPU with an unpacked weight, with the shared memory of the
    # kernel's loads); None where K is symbolic.
    loop: cost.KLoop | None


def template_config(graph: Graph, group: Group, dot: Node, target: Target) -> Template:
    """The tile configuration of ``group``'s template kernel, anchored on
    ``dot``, its packing and its K loop: what codegen writes and the cost
    model prices (``passes/matmul_gain.py``)."""
    problem = GEMM.problem(graph, dot)
    (k,) = dot.reduce_shape
    pack = packing(graph, group.nodes, dot)
    batch = math.prod(int(ix.hint(s, graph.hints)) for s in dot.shape[:-2])
    left = pack == 1 and two_tile_left(graph, group.nodes, dot)
    epilogue = None if target.interpret else epilogue_of(graph, group.nodes, group.stored, dot)
    values = 0 if epilogue is None else epilogue.values
    config = gemm_config(target, *problem, batch=batch, two_tile_left=left, epilogue=values)
    config, pack = packed_config(config, target, problem[0], k, pack)
    if pack > 1 and problem[0] <= SMALL_M and cost.has_figures(target):
        config = _fastest_packed(graph, group, dot, config, pack, target)
    m, n, _, dtype = problem
    staged = None
    if not target.interpret and pack == 1:  # packed tiles: packed_small_m's stages
        staged = _staged_bytes(graph, group, dot, config)
        if m <= SMALL_M and dtype.itemsize <= 2 and target.few_row_step_s is not None:
            # The stages again, for the shared memory the kernel's loads take.
            first = gpu_gemm_config(m, n, problem[2], dtype, target.sm_count)
            tiles = cost.output_tiles(m, n, (config.block_m, config.block_n), batch)
            config = dataclasses.replace(config, num_stages=first.num_stages)
            config = fewest_waves(config, tiles, problem[2], dtype.itemsize, target, staged)
        config = fit_shared_memory(config, staged, target)
    loop = (
        config.k_loop(int(k), dtype.itemsize, target, pack, staged, epilogue)
        if ix.is_static([k])
        else None
    )
    return Template(config, pack, loop)


def fit_shared_memory(config: GemmConfig, staged: tuple[int, int], target: Target) -> GemmConfig:
    """``config`` with no more stages than fit a block's shared memory on
    ``target``: ``staged`` is (the bytes a K step's loads copy ahead, the
    bytes of operands computed in registers and staged for ``tl.dot``) for
    its tiles (:func:`_staged_bytes`), and a kernel takes
    :func:`staged_steps` of the first plus the second.  Triton refuses to launch
    a kernel over the limit (``OutOfResources``).

    Calibrated on sm_90 compiles of TinyLlama's decode GEMMs (triton
    3.7.1, 1 to 8 stages): the o projection's plain 16 x 16 x 512 bf16
    tiles take 32 KB a stage over ``stages - 1`` exactly (229 KB at 8);
    the gate/up product at 8 rows, its RMS norm in the prologue (x and the
    norm's weight copied ahead, 82,944 bytes a step), takes 16 KB more for
    the normalized left tile (265 KB at 4 stages: over the 227 KB an H100
    block may have); the int8 down projection at 8 rows (gate, up and the
    weight, 40 KB a step) took 287 KB at 8 stages, 16 KB less than this
    counts.  Not for int4 weights: their unpacked tiles took more than
    this counts, and :func:`packed_small_m` chose their stages from
    compiles."""
    ahead, staged_operands = staged
    while (
        config.num_stages > 1
        and staged_steps(config, target) * ahead + staged_operands > target.shared_memory_per_block
    ):
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    return config


def _staged_bytes(graph: Graph, group: Group, dot: Node, config: GemmConfig) -> tuple[int, int]:
    """(bytes a K step's loads copy ahead, bytes of operands computed in
    registers) of ``group``'s template anchored on ``dot`` with ``config``'s
    tiles: each distinct load that walks K, its tile (rows or columns of
    the output it varies along, positions of K: :func:`_k_positions`) at
    its dtype; and a ``BLOCK_M x BLOCK_K`` tile of the dot's operand dtype
    where the left operand is not one plain load (a prologue's result,
    staged for ``tl.dot``; a right operand computed so, a dequantized
    weight, took none on sm_90)."""
    (r,) = ix.reduce_symbols(1)
    *_, row, col = ix.out_symbols(len(dot.shape))
    inliner, values = _operand_values(graph, group.nodes, dot)
    ahead, computed, seen = 0, 0, set()
    for side, (expr, value) in enumerate(zip(dot.body.args, values)):
        plain = isinstance(_uncast(value), BufferLoad)
        for load in inliner.loads(value):
            symbols = _index_symbols(load.index)
            if r not in symbols or (load.buffer, load.index) in seen:
                continue
            seen.add((load.buffer, load.index))
            positions = _k_positions(load.index, r, config.block_k)
            rows = config.block_m if row in symbols else 1
            cols = config.block_n if col in symbols else 1
            ahead += rows * cols * positions * load.dtype.itemsize
        if side == 0 and not plain:
            computed += config.block_m * config.block_k * operand(expr).dtype.itemsize
    return ahead, computed


def _uncast(value: InlinedExpr) -> InlinedExpr:
    while isinstance(value, Call) and value.op == "cast":
        value = value.args[0]
    return value


def _k_positions(index: tuple, r: sympy.Symbol, block_k: int) -> int:
    """The distinct elements a load at ``index`` reads along a K step of
    ``block_k`` positions ``r``: ``block_k // d`` where it reads K only as
    ``r // d`` (an int4 weight's bytes, 2 positions each; a group's scale),
    else ``block_k``."""
    divisors = set()
    for c in (sympy.sympify(c) for c in index):
        floors = [f for f in c.atoms(sympy.floor) if r in f.free_symbols]
        rest = c.xreplace({f: sympy.Dummy() for f in floors})
        if r in rest.free_symbols:
            return block_k
        for f in floors:
            coeff, term = f.args[0].as_coeff_Mul()
            if term != r or coeff.p != 1:
                return block_k
            divisors.add(int(coeff.q))
    return max(1, block_k // min(divisors)) if divisors else block_k


def packed_config(
    config: GemmConfig, target: Target, m: int, k: ix.Size, pack: int
) -> tuple[GemmConfig, int]:
    """``config`` and the packing ``pack`` (:func:`packing`) as a product of
    ``m`` rows over ``k`` takes them: no packing where K is masked or a
    step would hold fewer than ``tl.dot``'s 16 packed positions, and a
    few-row product's packed tiles (:func:`packed_small_m`)."""
    if masks_k(k, config.block_k) or config.block_k // pack < MIN_DOT_K:
        pack = 1
    if pack > 1 and m <= SMALL_M:
        config = packed_small_m(config, target)
    return config, pack


def _fastest_packed(
    graph: Graph, group: Group, dot: Node, config: GemmConfig, pack: int, target: Target
) -> GemmConfig:
    """:func:`fastest_packed` for ``group``'s template anchored on ``dot``:
    its bytes those of the buffers it reads from outside (the weight's
    packed bytes, not its dequantized view) and writes."""
    m, n, k, dtype = GEMM.problem(graph, dot)
    members = set(group.nodes)
    computed = left_computed(graph, dot, members)
    hint = lambda s: int(ix.hint(s, graph.hints))  # noqa: E731
    reads = {view_base(graph, i) for name in members for i in graph.nodes[name].inputs}
    reads -= members
    nbytes = sum(hint(graph.nodes[b].nbytes) for b in reads | set(group.stored))
    batch = math.prod(hint(s) for s in dot.shape[:-2])
    return fastest_packed(config, target, (m, n, k, dtype), pack, nbytes, batch, computed)


def fastest_packed(
    config: GemmConfig,
    target: Target,
    problem: tuple[int, int, int, torch.dtype],
    pack: int,
    nbytes: int,
    batch: int = 1,
    left_computed: bool = False,
) -> GemmConfig:
    """The faster, as the cost model predicts, of ``config`` (a few-row
    int4 product's tiles, :func:`packed_small_m`) and its 64-column
    alternative (:func:`packed_alternative`), for ``batch`` products of
    ``problem`` (M, N, K, operand dtype) moving ``nbytes``.  Where 64-column
    tiles do not fill the SMs, :func:`_small_m_block_n` takes 16 columns,
    and a packed 16-column tile steps 256 positions: 2 KB of the int4
    weight a step, so a long K takes many steps of ``few_row_step_s``.
    64 columns move 4 or 8 times that a step over a quarter of the
    programs; ``cost.gemm`` prices both, the grid's share of the bandwidth
    against the K loop.  A one-row product of TinyLlama's down
    projection's size (2048 x 5632, its input as stored): 128 tiles of 22
    steps against 32 tiles of 11, about half the time.  ``pack``: the K
    positions a byte of the weight packs (:func:`packing`);
    ``left_computed``: the prologue computes the left operand."""
    m, n, k, dtype = problem
    wide = packed_alternative(config, target, m, n, k, dtype, left_computed)
    if wide is None:
        return config

    def seconds(c: GemmConfig) -> float:
        return cost.gemm(
            target,
            2 * batch * m * n * k,
            nbytes,
            dtype,
            template=True,
            tiles=cost.output_tiles(m, n, (c.block_m, c.block_n), batch),
            k_loop=c.k_loop(k, dtype.itemsize, target, pack),
        ).seconds

    return wide if seconds(wide) < seconds(config) else config


def packed_alternative(
    config: GemmConfig,
    target: Target,
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    left_computed: bool = False,
) -> GemmConfig | None:
    """The 64-column tile :func:`fastest_packed` weighs against a few-row
    int4 product's 16- or 32-column ``config`` (None: none, or ``config``
    is 64 columns already).  One row: 512 positions a step
    (``SMALL_M_BLOCK_K``: a 16-row tile's step takes the same time whatever
    its width, ``Target.few_row_step_s``), 8 warps, except where the
    prologue computes the left operand (``left_computed``: the down
    projection's silu(gate) * up spilled 64 bytes with triton 3.8; 229
    registers with 3.6, 193 with 3.7).  More rows: 256 positions of 8
    warps, since the dequantized 64 x 512 tile with 8 rows of input took
    221 to 255 registers on sm_90 (TinyLlama at 8 rows, triton 3.6 to 3.8;
    3.6 spilled 48 bytes on the o projection, and 500 bytes with the down
    projection's prologue), while 64 x 256 took 99 to 186 and spilled
    nothing, prologue or not (each of TinyLlama's four at 8 rows, triton
    3.6, 3.7.1 and 3.8.0, and products of 2 to 16 rows with ``silu(x) *
    y`` or ``x`` as the left operand); its left tile of 16 rows gives each thread 16
    positions to copy ahead, so 8 warps wait for no load (one row's 256
    positions would give each thread one 2-byte load:
    :func:`small_m_warps`)."""
    if config.block_n >= 64 or n < 64:
        return None
    if m == 1:
        if left_computed:
            return None
        block_k = _block_k(m, k, dtype)
        wide = dataclasses.replace(
            config,
            block_n=64,
            block_k=block_k,
            num_warps=small_m_warps(64, block_k),
            num_stages=STAGES,
        )
        wide = packed_small_m(wide, target)
    else:
        wide = dataclasses.replace(
            config,
            block_n=64,
            block_k=PACKED_NARROW_BLOCK_K,
            num_warps=8,
            num_stages=PACKED_WIDE_STAGES,
        )
    if masks_k(k, wide.block_k) != masks_k(k, config.block_k):
        return None  # the kernel's source would differ (K masks)
    return wide


class GemmAnchor:
    """The GEMM template's anchor kind (the :class:`~tilec.anchors.Anchor` protocol)."""

    kind = "gemm"

    def owns(self, node: Node) -> bool:
        return node.kind == "reduction" and node.reduce_op == DOT

    def operands(self, graph: Graph, node: Node) -> tuple[str, ...]:
        return tuple(base_inputs(graph, node))

    def weights(self, node: Node) -> tuple[str, ...]:
        # Inputs are (left, right), or (operand,) when both are one buffer.
        return (node.inputs[-1],)

    def problem(self, graph: Graph, node: Node) -> tuple[int, int, int, torch.dtype]:
        """(M, N, K at their hints, operand dtype) of the product ``node`` computes."""
        *_, m, n = node.shape
        (k,) = node.reduce_shape
        hint = lambda s: ix.hint(s, graph.hints)  # noqa: E731
        return hint(m), hint(n), hint(k), operand(node.body.args[0]).dtype

    def space(
        self,
        graph: Graph,
        node: Node,
        nodes: list[Node],
        stored: Callable[[str], bool],
        target: Target,
    ) -> tuple[tuple, tuple] | Reason:
        """A GEMM kernel: one dot reduction, pointwise producers of its
        operands computed per tile (the prologue, never stored; it must pay
        for its recomputation, :meth:`prologue_cost`), row reductions of the
        left operand's prologue (:meth:`row_reductions`: a norm's statistic)
        and pointwise nodes of its output's shape (the epilogue)."""
        dots = [n for n in nodes if self.owns(n)]
        if len(dots) > 1:
            return Reason("two_matmuls", "two matmuls in one kernel")
        prologue = []
        for n in nodes:
            if n.kind != "pointwise" and n is not node and n.kind != "reduction":
                return Reason(
                    "not_pointwise_in_gemm",
                    f"%{n.name} ({n.kind}) in the kernel of matmul %{node.name}",
                )
            # The epilogue stores values of the product's shape, or of a
            # reshape of it: (batch, seq, n) from a (batch * seq, n) product.
            epilogue = n.kind == "pointwise" and ix.numel(n.shape) == ix.numel(node.shape)
            if n is not node and stored(n.name) and not epilogue:
                return Reason(
                    "read_outside_gemm",
                    f"%{n.name} {list(n.shape)} is read outside the kernel of matmul "
                    f"%{node.name}, whose tiles cover {list(node.shape)}",
                )
            if n is not node and not epilogue:
                prologue.append(n)
        reductions = [n for n in prologue if n.kind == "reduction"]
        if reductions:
            why = self.row_reductions(graph, node, {n.name for n in nodes}, reductions)
            if why is not None:
                return why
        values = 0
        if prologue and cost.has_figures(target):  # the tile decides the recomputation
            names = [n.name for n in nodes]
            values = epilogue_values(graph, names, [n for n in names if stored(n)], node)
        costly = self.prologue_cost(graph, node, prologue, target, values)
        return costly if costly is not None else (node.shape, node.reduce_shape)

    def row_reductions(
        self, graph: Graph, node: Node, members: set[str], reductions: list[Node]
    ) -> Reason | None:
        """Why ``reductions`` cannot be computed in ``node``'s prologue, or
        None.  Each program computes such a reduction itself, in a loop over
        K before the product's (``codegen/gemm.py``), for the rows of its
        tile: so it must feed the left operand alone, reduce (sum, max or
        min) over as many elements as K from pointwise producers only, and
        be read by the left operand at one position per row of the product
        (its K index unused: a norm's statistic, read at the row it
        normalizes)."""
        left = computing(graph, node.inputs[0], members)
        right = computing(graph, node.inputs[-1], members)
        (k,) = node.reduce_shape
        (r,) = ix.reduce_symbols(1)
        inliner = Inliner(graph, members, ix.symbol_ranges(node.shape, node.reduce_shape))
        left_loads = inliner.loads(
            inliner.body(dataclasses.replace(node, body=node.body.args[0]), {})
        )
        for red in reductions:
            where = f"reduction %{red.name} in the prologue of matmul %{node.name}"
            if len(node.inputs) != 2 or red.name not in left or red.name in right:
                return Reason("prologue_reduction", f"{where} does not feed its left operand alone")
            why = row_statistic_problem(graph, red, members, k)
            if why is not None:
                return Reason("prologue_reduction", f"{where} {why}")
            reads = {load.index for load in left_loads if load.buffer == red.name}
            if len(reads) != 1 or any(
                r in sympy.sympify(c).free_symbols for c in next(iter(reads))
            ):
                return Reason(
                    "prologue_reduction", f"{where} is read at more than one position per row"
                )
        return None

    def prologue_cost(
        self,
        graph: Graph,
        node: Node,
        prologue: list[Node],
        target: Target,
        epilogue: int = 0,
    ) -> Reason | None:
        """Why ``prologue`` must not be computed in ``node``'s kernel, or None.

        Each program computes the operand tiles it reads, so a left operand's
        prologue runs once per column tile and a right operand's once per row
        tile.  Priced by the cost model, per operand: the recomputation's
        FLOPs against what a kernel of its own would cost beyond reading the
        same inputs (storing the operand, the GEMM reading it back, a
        launch).  Without figures (the interpreter), an operand's prologue
        may cost at most :data:`PROLOGUE_OPS` ops per element.  ``epilogue``:
        :func:`epilogue_values` of the kernel, which may narrow its tiles."""
        ops = {n.name: sum(1 for e in walk(n.body) if isinstance(e, Call)) for n in prologue}
        members = {n.name: n for n in prologue}
        if not cost.has_figures(target):
            for operand_name in node.inputs:
                computed = computing(graph, operand_name, members)
                total = sum(ops[n] for n in computed)
                if total > PROLOGUE_OPS:
                    names = ", ".join(f"%{n}" for n in computed)
                    return Reason(
                        "prologue_too_costly",
                        f"{names} cost {total} ops per element, too many to recompute per tile",
                    )
            return None
        m, n_cols, k, dtype = self.problem(graph, node)
        config = gemm_config(target, m, n_cols, k, dtype, epilogue=epilogue)
        batch = math.prod(ix.hint(s, graph.hints) for s in node.shape[:-2])
        tiles = (math.ceil(n_cols / config.block_n), math.ceil(m / config.block_m))
        hint = lambda s: ix.hint(s, graph.hints)  # noqa: E731
        # One input: both operands read it, so both sides recompute it.
        sides = zip(node.inputs, tiles) if len(node.inputs) == 2 else [(node.inputs[0], sum(tiles))]
        along = _read_along_batch(node)
        for operand_name, per_batch in sides:
            computed = computing(graph, operand_name, members)
            if not computed:
                continue
            points = {
                n: hint(ix.numel(members[n].shape + members[n].reduce_shape)) for n in computed
            }
            flops = sum((ops[n] + (members[n].kind == "reduction")) * points[n] for n in computed)
            # Read along the batch (a split's chunks of K): each element
            # computes its own slice of ``points``; else each the whole.
            repeats = per_batch if operand_name in along else batch * per_batch
            fused = cost.kernel(target, 0, flops * repeats).compute_s
            # A row reduction reads its rows again in its own loop, in every
            # tile: priced as if from memory, though mostly L2 hits.
            reread = sum(
                hint(graph.nodes[view_base(graph, b)].nbytes)
                for b in {
                    b
                    for n in computed
                    if members[n].kind == "reduction"
                    for m in computing(graph, n, members)
                    for b in base_inputs(graph, members[m])
                    if b not in members
                }
            )
            fused += cost.memory_seconds(target, reread * repeats) if reread else 0.0
            nbytes = hint(graph.nodes[view_base(graph, operand_name)].nbytes)
            separate = cost.memory_seconds(target, 2 * nbytes) + cost.launch_seconds(target)
            if fused > separate:
                names = ", ".join(f"%{n}" for n in computed)
                return Reason(
                    "prologue_too_costly",
                    f"{names} ({flops} FLOPs) computed again for each of {repeats} tiles: predicted "
                    f"{fused * 1e6:.2f} us, more than the {separate * 1e6:.2f} us a kernel of "
                    f"their own costs (storing {nbytes} bytes, read back, one launch)",
                )
        return None

    def grid(self, node: Node) -> tuple[tuple, tuple]:
        return node.shape, node.reduce_shape

    def reference(
        self, node: Node, evaluate: Callable[[Expr, dict | None], torch.Tensor]
    ) -> torch.Tensor:
        """A matmul of the two operands, each evaluated over its own index
        space only: (batch, M, K) @ (batch, K, N)."""
        *batch, m, n = node.shape
        (k,) = node.reduce_shape
        left, right = (evaluate(e, None) for e in node.body.args)
        left = torch.broadcast_to(left, (*batch, m, 1, k)).squeeze(-2)
        right = torch.broadcast_to(right, (*batch, 1, n, k)).squeeze(-3)
        return torch.matmul(left, right.transpose(-1, -2)).to(node.dtype)

    def work(self, graph: Graph, node: Node) -> cost.Work:
        """The library call's FLOPs (a multiply and an add per point of the
        product and K) and bytes (operands read once, the product written
        once in the operands' dtype)."""
        operands = [graph.nodes[i] for i in node.inputs]
        dtype = operands[0].dtype
        flops = 2 * int(ix.numel(node.shape)) * int(ix.numel(node.reduce_shape))
        nbytes = sum(int(o.nbytes) for o in operands) + int(ix.numel(node.shape)) * dtype.itemsize
        return cost.Work(flops, nbytes, dtype)


def operand(expr: Expr) -> Expr:
    """An operand of the dot body as ``tl.dot`` takes it: without the cast
    up to float32 that the body applies to 16-bit operands."""
    if isinstance(expr, Call) and expr.op == "cast" and expr.args[0].dtype.itemsize < 4:
        return expr.args[0]
    return expr


# Reductions a GEMM's prologue computes as a row statistic (codegen/gemm.py).
ROW_STATISTICS = ("sum", "max", "min")


def row_statistic_problem(
    graph: Graph, red: Node, members: Collection[str], k: ix.Size
) -> str | None:
    """Why reduction ``red`` (its producers among ``members``) cannot be a
    row statistic that a GEMM's prologue computes in a loop over ``k``, or
    None: it must be a sum, max or min over ``k`` elements of pointwise
    producers (an RMS norm's mean square; not a variance of its mean).
    Shared by the anchor (``GemmAnchor.row_reductions``) and the matmul
    choice (``passes/matmul_gain.py``)."""
    if red.reduce_op not in ROW_STATISTICS or red.reduce_shape != (k,):
        return f"is not a sum, max or min over K ({k}) elements"
    if any(graph.nodes[n].kind != "pointwise" for n in computing(graph, red.name, members)[1:]):
        return "reads another reduction"
    return None


def _index_symbols(index: tuple) -> set[sympy.Symbol]:
    """The symbols a load's ``index`` (one expression per dimension) uses."""
    return set().union(*(sympy.sympify(c).free_symbols for c in index))


def _read_along_batch(node: Node) -> set[str]:
    """The inputs of dot ``node`` that an operand reads at an index varying
    along the product's batch dimensions (a split product's chunks of K,
    ``passes/split_k.py``), not the same for every batch element."""
    batch = set(ix.out_symbols(len(node.shape))[:-2])
    found = set()
    for e in node.body.args:
        load = operand(e)
        if isinstance(load, Load):
            symbols = _index_symbols(load.index)
            if batch & symbols:
                found.add(node.inputs[load.src])
    return found


def computing(graph: Graph, operand_name: str, members: Collection[str]) -> list[str]:
    """The nodes of ``members`` that reading ``operand_name`` computes: it
    and its producers among them, through views (a template's prologue)."""
    found, todo = [], buffers_of(graph, operand_name)
    while todo:
        name = todo.pop()
        if name in members and name not in found:
            found.append(name)
            todo += base_inputs(graph, graph.nodes[name])
    return found


def left_computed(graph: Graph, dot: Node, members: Collection[str]) -> bool:
    """Whether the prologue of dot ``dot``'s template (``members``) computes
    its left operand, rather than loading it as stored."""
    left = operand(dot.body.args[0])
    return not isinstance(left, Load) or bool(computing(graph, dot.inputs[left.src], members))


GEMM = GemmAnchor()
