"""Split-K for products of few rows: more programs for a decode GEMV.

A GEMM template kernel runs one program per output tile.  A product of at
most ``SMALL_M`` rows (a decode step) over few columns has few tiles: a
one-row product against a ``[256, 2048]`` weight is 16 tiles of 16 columns
on an H100's 132 SMs, streaming its weight at an eighth of the bandwidth
(``compiler/cost.fill``).  This pass splits such a product's reduction
(K) into ``S`` chunks: the dot node ``(M, N)`` over ``K`` becomes a dot
node ``(S, M, N)`` over ``K / S`` (chunk ``s`` reads ``k = s * K/S + r``:
the template's batch dimension, each program one chunk of one tile, its
prologue, such as an int8 weight's dequantization, per chunk as before)
and a sum over the ``S`` float32 partial products under the dot's name,
which fusion puts in one small kernel with the product's epilogue.  Each
weight byte is still read once.

``S`` divides K into chunks of at least :data:`MIN_CHUNK` that are
whole K steps of the template's ``BLOCK_K`` (any such count: TinyLlama's
down projection, K 5632, is 11 steps of 512, split in 11 or 2).  For
one row, or on a target without figures, the largest whose programs fill
at most the target's SMs (nothing is split when the tiles fill half the
SMs already).  For more rows on a target with figures, the one predicted
fastest, however many waves of the programs an SM holds its programs
take (``cost.gemm`` prices the waves), each in the split product's own
tiles (whose stages ``gemm.fewest_waves`` chooses), with an int4 weight's
tiles as the template chooses them (``gemm.fastest_packed``: 16 or 64
columns of 256 positions, so TinyLlama's down projection at 8 rows takes
22 steps unsplit, and split in 11, two).  Nothing is split where sizes are symbolic.  On a target with
figures the split must be predicted faster (the template over ``S`` times
the programs, plus the sum's kernel), as ``cost`` prices both,
with a replayed launch's cost where the program runs in a CUDA graph
(``cudagraphs``; outside one the extra launch usually costs more than the
fuller grid wins);
the interpreter keeps the H100's SM count and no figures, so the CPU tests
split too.  The pass's count is ``split_k`` (products split).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from tilec import cost
from tilec import index as ix
from tilec.gemm import (
    DOT,
    GEMM,
    SMALL_M,
    GemmConfig,
    fastest_packed,
    gemm_config,
    left_computed,
    packed_config,
    packing,
    two_tile_left,
)
from tilec.ir import Call, Const, Graph, Load, Node, prologue_reads, walk
from tilec.passes.split_reduction import shifted
from tilec.target import Target

# Fewest K elements per chunk: below this the partial products' traffic and
# the sum's kernel outweigh what more programs win.
MIN_CHUNK = 256


def split_k(graph: Graph, target: Target, replayed: bool = False) -> tuple[Graph, dict[str, int]]:
    """``graph`` with decode-shaped GEMM products split over K (module
    docstring); ``replayed``: the program runs in a CUDA graph replay, where
    the sum's launch costs less."""
    replaced: dict[str, list[Node]] = {}
    for node in graph.nodes.values():
        if GEMM.owns(node) and len(node.shape) == 2:
            splits = _splits(graph, node, target, replayed)
            if splits > 1:
                replaced[node.name] = _split(graph, node, splits)
    if not replaced:
        return graph, {"split_k": 0}
    nodes = [n for node in graph.nodes.values() for n in replaced.get(node.name, [node])]
    return graph.replace_nodes(nodes), {"split_k": len(replaced)}


def _splits(graph: Graph, node: Node, target: Target, replayed: bool) -> int:
    """Chunks of K for dot ``node`` (1: none)."""
    sizes = (*node.shape, *node.reduce_shape)
    if not all(isinstance(s, int) for s in sizes):
        return 1
    parts = list(walk(node.body))
    if not all(
        isinstance(e, Call | Const) or (isinstance(e, Load) and e.mask is None) for e in parts
    ):
        return 1
    m, n, k, dtype = GEMM.problem(graph, node)
    if m > SMALL_M:
        return 1
    priced = cost.has_figures(target)
    # One row, or without figures: the most chunks whose programs fit the
    # SMs, where predicted faster (a one-row int4 product's width is the
    # template's own choice, ``gemm._fastest_packed``, so it is not known
    # here).  More rows, with figures: the fastest split predicted, in
    # any number of waves, with an int4 weight's tiles (``_config``): a K
    # loop of many short steps can bound a product whose tiles fill the SMs.
    wave = priced and m > 1

    def config_of(splits: int) -> tuple[GemmConfig, int]:
        """The tiles of the product split into ``splits`` chunks (its stages
        may differ from the whole product's: ``gemm.fewest_waves``) and
        the packing of its weight (``gemm.packing``)."""
        if wave:
            return _config(graph, node, target, splits)
        return gemm_config(target, m, n, k // splits, dtype, batch=splits), 1

    config, _ = config_of(1)
    tiles = cost.output_tiles(m, n, (config.block_m, config.block_n))
    candidates = []
    for splits in range(2, k // max(MIN_CHUNK, config.block_k) + 1):
        if k % splits or (k // splits) % config.block_k or k // splits < MIN_CHUNK:
            continue
        if wave or tiles * splits <= target.sm_count:
            candidates.append(splits)
    if not candidates:
        return 1
    if not priced:
        return candidates[-1]
    seconds = functools.partial(
        _split_seconds, graph, node, config_of=config_of, target=target, replayed=replayed
    )
    chosen = min(candidates, key=seconds) if wave else candidates[-1]
    return chosen if seconds(chosen) < seconds(1) else 1


def _config(graph: Graph, node: Node, target: Target, splits: int) -> tuple[GemmConfig, int]:
    """The tiles the template takes for dot ``node`` split into ``splits``
    chunks of K (``template_config``'s): an int4 weight's
    (``packed_config``, then the faster width, ``fastest_packed``) where
    the operands' producers unpack one; and that packing."""
    m, n, k, dtype = GEMM.problem(graph, node)
    producers, todo = {node.name}, list(node.inputs)
    while todo:
        name = todo.pop()
        if name not in producers and graph.nodes[name].kind in ("pointwise", "view"):
            producers.add(name)
            todo += graph.nodes[name].inputs
    pack = packing(graph, producers, node)
    left = pack == 1 and two_tile_left(graph, producers, node)
    config = gemm_config(target, m, n, k // splits, dtype, batch=splits, two_tile_left=left)
    config, pack = packed_config(config, target, m, k // splits, pack)
    if pack > 1:
        # The template's choice of width (``gemm.fastest_packed``), priced
        # with the bytes ``_split_seconds`` counts.
        computed = left_computed(graph, node, producers)
        problem = (m, n, k // splits, dtype)
        nbytes = _operand_bytes(graph, node) + splits * m * n * 4
        config = fastest_packed(config, target, problem, pack, nbytes, splits, computed)
    return config, pack


def _split_seconds(
    graph: Graph,
    node: Node,
    splits: int,
    *,
    config_of: Callable[[int], tuple[GemmConfig, int]],
    target: Target,
    replayed: bool,
) -> float:
    """Predicted seconds of the template over ``splits`` times the
    programs, each a chunk of K in ``config_of(splits)``'s tiles, plus the
    kernel summing the partial products (``splits`` 1: the product
    unsplit)."""
    m, n, k, dtype = GEMM.problem(graph, node)
    config, pack = config_of(splits)
    tiles = cost.output_tiles(m, n, (config.block_m, config.block_n))
    flops = 2 * m * n * k
    operands = _operand_bytes(graph, node)
    product = m * n * 4
    written = product if splits == 1 else splits * product
    template = cost.gemm(
        target,
        flops,
        operands + written,
        dtype,
        template=True,
        tiles=tiles * splits,
        replayed=replayed,
        k_loop=config.k_loop(k // splits, dtype.itemsize, target, pack),
    ).seconds
    if splits == 1:
        return template
    programs = math.ceil(m * n / 1024)
    total = cost.kernel(target, written + product, replayed=replayed, programs=programs)
    return template + total.seconds


def _operand_bytes(graph: Graph, node: Node) -> int:
    """The bytes dot ``node``'s prologue reads: its operands' buffers as stored."""
    return sum(int(graph.nodes[b].nbytes) for i in node.inputs for b in prologue_reads(graph, i))


def _split(graph: Graph, node: Node, splits: int) -> list[Node]:
    """The partial products over ``splits`` chunks of K, and their sum under ``node``'s name."""
    m, n = node.shape
    (k,) = node.reduce_shape
    chunk = k // splits
    i0, i1, i2 = ix.out_symbols(3)
    (r0,) = ix.reduce_symbols(1)
    old_m, old_n = ix.out_symbols(2)
    shift = {old_n: i2, old_m: i1, r0: i0 * chunk + r0}

    partial = Node(
        graph.fresh_name(f"{node.name}_partial"),
        "reduction",
        (splits, m, n),
        torch.float32,
        node.inputs,
        shifted(node.body, shift),
        reduce_op=DOT,
        reduce_shape=(chunk,),
    )
    total = Node(
        node.name,
        "reduction",
        node.shape,
        torch.float32,
        (partial.name,),
        Load(0, (r0, old_m, old_n), torch.float32),
        reduce_op="sum",
        reduce_shape=(splits,),
    )
    return [partial, total]
