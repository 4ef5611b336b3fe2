"""Split-KV attention for decode: few query rows against many keys.

An attention kernel runs one program per (batch, head, row tile): a decode
step (one to 16 query rows) of a batch of one with a few heads fills a few
of a GPU's SMs and walks all the keys in each.  This pass splits the keys
of such an attention into S chunks: on a target with the cost model's
figures, the S it predicts fastest (each program walks its chunk's key
blocks one after another, :func:`attention_seconds`); without them, chunks
of at least ``attention.MIN_CHUNK`` keys, as many as it takes to fill the
target's SMs.  One kernel computes each
chunk's partial results (``attention.split_nodes``: the unnormalized
accumulator, the row maximum and sum), and ordinary nodes combine them,

    g = max_s m_s,   w_s = exp(m_s - g) (0 for an empty chunk),
    out = sum_s acc_s w_s / sum_s l_s w_s,   lse = g + log(sum_s l_s w_s),

which fusion turns into one small kernel (each combining node has the
output's shape).  The output and log-sum-exp nodes
keep their names.  Without figures, does nothing for attention that fills
half the SMs already or with too few keys for two chunks; never with
symbolic sizes other than the key length.  A symbolic key length (a dynamic cache's) is split
into chunks of a fixed length, their number symbolic (one for a short
cache).
"""

from __future__ import annotations

import dataclasses
import math

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.attention import (
    ATTENTION,
    LOGSUMEXP,
    MIN_CHUNK,
    SPLIT_ACC,
    AttentionConfig,
    attention_config,
    combining_nodes,
    combining_outputs,
    counter_name,
    head_group,
    key_constraints,
    key_loop,
    parts,
    split_nodes,
    visited_keys,
)
from tilec.ir import Call, Const, Graph, Group, Load, Node, prologue_reads
from tilec.target import Target


def split_attention(
    graph: Graph, target: Target, chunks: int | None = None
) -> tuple[Graph, dict[str, int]]:
    """``graph`` with decode-shaped attention split over chunks of its keys
    (about ``chunks`` of them where given: the option ``attention_chunks``)."""
    replaced: dict[str, list[Node]] = {}
    for node in graph.nodes.values():
        if node.reduce_op != ATTENTION or node.kind != "reduction":
            continue
        if parts(node).blocks is not None:  # block lists walk their own blocks
            continue
        splits, chunk = splits_of(graph, node, target, chunks)
        if isinstance(splits, int) and splits < 2:
            continue
        lse = next(
            (n for n in graph.nodes.values() if n.reduce_op == LOGSUMEXP and n.body == node.body),
            None,
        )
        nodes = _combined(node, lse, splits, chunk)
        replaced[node.name] = nodes
        if lse is not None:
            replaced[lse.name] = []
    if not replaced:
        return graph, {"split_attention": 0}
    out = []
    for node in graph.nodes.values():
        out += replaced.get(node.name, [node])
    return graph.replace_nodes(out), {"split_attention": len([n for n in replaced if replaced[n]])}


def splits_of(
    graph: Graph, node: Node, target: Target, chunks: int | None = None
) -> tuple[ix.Size, int]:
    """(chunks, keys per chunk) for attention ``node`` of ``graph`` on
    ``target``: (1, 0) where it stays whole.  A symbolic key length (a
    dynamic cache's, in the generic variant; the graph's hints: its value
    when compiled, for the tiles) is split into chunks of a fixed length,
    as many as it takes: a decode step's cache grows, so the chunk is not
    fitted to the compiled length.  A static one, on a target with the cost
    model's figures, into the chunks (whole key blocks) that the model
    predicts fastest (:func:`attention_seconds`): more chunks are more
    programs, each walking fewer key blocks one after another, and more
    partial results to combine.  Without figures (the interpreter), as many
    chunks of at least ``MIN_CHUNK`` keys as fill the SMs.  ``chunks``
    (the option ``attention_chunks``) overrides both for a static key
    length: that many, about, of whole key blocks (fewer where the last
    would be empty)."""
    batch, heads, m, _ = node.shape
    n, e = node.reduce_shape
    if not all(isinstance(s, int) for s in (batch, heads, m, e)):
        return 1, 0
    config, _, programs = _tiling(graph, node, target)
    if not isinstance(n, int):
        if 2 * programs > target.sm_count:
            return 1, 0
        chunk = math.ceil(MIN_CHUNK / config.block_n) * config.block_n
        return sympy.floor((n + chunk - 1) / chunk), chunk
    if chunks is not None:
        chunk = math.ceil(n / chunks / config.block_n) * config.block_n
        return (1, 0) if chunk >= n else (math.ceil(n / chunk), chunk)
    if cost.has_figures(target):
        block = config.block_n
        options = [(1, 0)] + [(math.ceil(n / c), c) for c in range(block, n, block)]
        return min(options, key=lambda o: attention_seconds(graph, node, target, *o))
    splits = min(target.sm_count // programs, n // MIN_CHUNK)
    if splits < 2 or 2 * programs > target.sm_count:
        return 1, 0
    chunk = math.ceil(math.ceil(n / splits) / config.block_n) * config.block_n
    return math.ceil(n / chunk), chunk


def attention_seconds(
    graph: Graph, node: Node, target: Target, splits: ix.Size = 1, chunk: int = 0
) -> float:
    """Predicted seconds of the attention kernel of ``node`` (an attention
    output before splitting), whole or split into ``splits`` chunks of
    ``chunk`` keys: the tiles it visits (its mask's linear constraints skip
    the rest) at the template rate, the bytes of its inputs (their buffers)
    and output, its
    programs' loops over key blocks; a split also writes, and a second
    kernel combines, the chunks' partial accumulators, maxima and sums
    (fp32).  Symbolic sizes are priced at the graph's hints, the sizes its
    kernels are tuned for."""

    def hint(size: ix.Size) -> int:
        return ix.hint(size, graph.hints)

    batch, heads, m, ev = (hint(s) for s in node.shape)
    n, e = (hint(s) for s in node.reduce_shape)
    p = parts(node)
    config, packed, programs = _tiling(graph, node, target)
    constraints = key_constraints(p.mask)
    flops = 2 * batch * heads * visited_keys(constraints, m, n, config) * (e + ev)
    reads = {b for i in node.inputs for b in prologue_reads(graph, i)}
    operands = sum(hint(graph.nodes[b].nbytes) for b in reads)
    out = hint(ix.numel(node.shape)) * node.dtype.itemsize
    splits = hint(splits)
    whole = splits < 2
    itemsize = p.q.dtype.itemsize
    loop = key_loop(constraints, (m, n, e, ev), itemsize, config, target, 0 if whole else chunk,
                    packed)  # fmt: skip
    if whole:
        return cost.attention_template(
            target, flops, operands + out, p.q.dtype, programs, loop
        ).seconds
    partials = splits * batch * heads * m * (ev + 2) * 4
    split = cost.attention_template(
        target, flops, operands + partials, p.q.dtype, programs * splits, loop
    )
    combine = cost.kernel(target, partials + out, programs=batch * heads)
    return split.seconds + combine.seconds


def _tiling(graph: Graph, node: Node, target: Target) -> tuple[AttentionConfig, int, int]:
    """The tiles of attention ``node``'s kernel on ``target`` (sizes at the
    graph's hints), the query heads a program computes (``head_group``:
    its tile's rows are that many heads' rows) and its programs per key
    chunk."""
    batch, heads, m = (ix.hint(s, graph.hints) for s in node.shape[:3])
    n, e = (ix.hint(s, graph.hints) for s in node.reduce_shape)
    packed = head_group(node)
    config = attention_config(target, packed * m, n, e, parts(node).q.dtype)
    return config, packed, batch * heads // packed * math.ceil(packed * m / config.block_m)


def _combined(node: Node, lse: Node | None, splits: int, chunk: int) -> list[Node]:
    """The split nodes and the nodes that combine them into ``node`` (and
    ``lse``), by the same names."""
    acc, most, total = split_nodes(node, splits, chunk)
    batch, heads, m, ev = node.shape
    f32 = torch.float32
    i0, i1, i2, i3 = ix.out_symbols(4)
    (r0,) = ix.reduce_symbols(1)
    at = (i0, i1, i2)
    zero = sympy.Integer(0)

    def call(op: str, *args, dtype: torch.dtype = f32) -> Call:
        return Call(op, tuple(args), dtype)

    # Every combining node has the output's shape (the maximum and the sum
    # computed again for each output column, from the few partial values),
    # so fusion makes them one kernel.
    name = node.name
    at4 = (*at, i3)
    top = Node(f"{name}_top", "reduction", node.shape, f32, (most.name,),
               body=Load(0, (*at, zero, r0), f32), reduce_op="max", reduce_shape=(splits,))  # fmt: skip
    split_max = Load(0, (*at, zero, r0), f32)

    def weight(top_at: tuple) -> Call:
        """Chunk r0's weight, its maximum against the overall one (input 1) at ``top_at``."""
        return call(
            "where",
            call("eq", split_max, Const(-math.inf, f32), dtype=torch.bool),
            Const(0.0, f32),
            call("exp", call("sub", split_max, Load(1, top_at, f32))),
        )

    den = Node(f"{name}_den", "reduction", node.shape, f32, (most.name, top.name, total.name),
               body=call("mul", Load(2, (*at, zero, r0), f32), weight(at4)),
               reduce_op="sum", reduce_shape=(splits,))  # fmt: skip
    num = Node(f"{name}_num", "reduction", node.shape, f32, (most.name, top.name, acc.name),
               body=call("mul", Load(2, (*at, i3, r0), f32), weight(at4)),
               reduce_op="sum", reduce_shape=(splits,))  # fmt: skip
    empty = call("eq", Load(1, at4, f32), Const(0.0, f32), dtype=torch.bool)
    value = call(
        "where",
        empty,
        parts(node).empty,
        call("truediv", Load(0, at4, f32), Load(1, at4, f32)),
    )
    out = Node(name, "pointwise", node.shape, node.dtype, (num.name, den.name),
               body=Call("cast", (value,), node.dtype), stride=node.stride)  # fmt: skip
    nodes = [acc, most, total, top, den, num, out]
    if lse is not None:
        # Its own maximum and sum, at its own shape: a kernel beside the
        # output's (``passes/combine.py`` launches the two as one).
        rows = (batch, heads, m)
        lse_top = Node(f"{lse.name}_top", "reduction", rows, f32, (most.name,),
                       body=split_max, reduce_op="max", reduce_shape=(splits,))  # fmt: skip
        lse_den = Node(f"{lse.name}_den", "reduction", rows, f32,
                       (most.name, lse_top.name, total.name),
                       body=call("mul", Load(2, (*at, zero, r0), f32), weight(at)),
                       reduce_op="sum", reduce_shape=(splits,))  # fmt: skip
        empty = call("eq", Load(1, at, f32), Const(0.0, f32), dtype=torch.bool)
        log_sum = call("add", Load(0, at, f32), call("log", Load(1, at, f32)))
        body = call("where", empty, Const(-math.inf, f32), log_sum)
        nodes += [
            lse_top,
            lse_den,
            Node(lse.name, "pointwise", lse.shape, f32, (lse_top.name, lse_den.name), body=body),
        ]
    return nodes


def combine_in_kernel(graph: Graph, enabled: bool = False) -> tuple[Graph, dict[str, int]]:
    """``graph`` (fused) with each split attention's combining kernel
    merged into the attention's own (the option ``split_combine``).

    Each of a row tile's programs stores its chunk's partial results as
    before, then counts itself done on the tile's counter (an atomic add,
    acquire and release, at GPU scope); the one that counts last reads
    every chunk's partial results back and stores the output and
    log-sum-exp, by the combining nodes' formulas, then sets the counter
    back to 0 (``codegen/attention.py``).  The counters are a constant of
    the graph, zeros, that the kernel leaves as it found them.  The
    combining group must hold nothing but combining nodes (fusion did not
    pull a reader of the output into it); one that does stays a kernel of
    its own.  The nodes are unchanged, so the IR interpreter computes the
    same graph."""
    if not enabled or not graph.groups:
        return graph, {"combined_in_kernel": 0}
    by_node = {n: g for g in graph.groups for n in g.nodes}
    merged: dict[str, Group] = {}
    dropped: set[str] = set()
    counters: list[Node] = []
    tensors: dict[str, torch.Tensor] = {}
    for group in graph.groups:
        acc = next((graph.nodes[n] for n in group.nodes if graph.nodes[n].reduce_op == SPLIT_ACC),
                   None)  # fmt: skip
        if group.parts or acc is None or group.name in dropped:
            continue
        # A combining kernel that holds a reader of its result too stays a
        # kernel of its own, reading the partial results from memory.
        outputs = combining_outputs(graph, acc)
        mine = combining_nodes(outputs)
        tails = [by_node.get(n) for n in outputs]
        tails = [t for t in tails if t and not t.parts and t is not group and set(t.nodes) <= mine]
        if not tails:
            continue
        batch, heads, m = acc.shape[:3]
        counter = counter_name(acc)
        if counter in graph.nodes or not all(isinstance(s, int) for s in (batch, heads, m)):
            continue
        counters.append(Node(counter, "constant", (batch * heads * m,), torch.int32))
        tensors[counter] = torch.zeros(batch * heads * m, dtype=torch.int32)
        tails = list(dict.fromkeys(tails))
        merged[group.name] = dataclasses.replace(
            group,
            nodes=group.nodes + tuple(n for t in tails for n in t.nodes),
            stored=group.stored + tuple(n for t in tails for n in t.stored),
            reason=f"{group.reason}; chunks combined by the row tile's last program",
        )
        dropped |= {t.name for t in tails}
    if not merged:
        return graph, {"combined_in_kernel": 0}
    out = graph.replace_nodes(counters + list(graph.nodes.values()))
    out.constants |= tensors
    out.groups = [merged.get(g.name, g) for g in graph.groups if g.name not in dropped]
    return out, {"combined_in_kernel": len(merged)}
