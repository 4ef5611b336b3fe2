"""The attention template's anchor: fused attention as two IR nodes.

Attention is the second template kind (``compiler/anchors.py``).  One
kernel computes, for each (batch, head, query row), a softmax over the
key/value positions of a *score expression* and its weighted sum of V,
online (running max and sum in float32, as FlashAttention does), so the
scores are never in memory.  Two nodes of one kernel:

* the output, ``reduce_op=ATTENTION``: ``out[b, h, m, e]``, shape
  ``(B, Hq, M, Ev)``, reducing over ``(N, E)`` (key positions ``r0``, the
  query/key head dimension ``r1``);
* the log-sum-exp of each row, ``reduce_op=LOGSUMEXP``: ``lse[b, h, m, 0]``
  (a size-1 last dimension, so that both nodes have the same index
  symbols), natural logarithm, ``-inf`` for a row with every position
  masked.

Both have the same inputs (q, k, v, then tensors the score or the mask
reads) and a body ``attention(q, k, v, score, mask, empty)`` (:func:`parts`):

* ``q``, ``k``, ``v``: loads of the operands over the index symbols,
  ``q[i0, i1, i2, r1]``, ``k[i0, i1 // G, r0, r1]``,
  ``v[i0, i1 // G, r0, i3]`` (``G`` query heads share a key/value head:
  grouped-query attention by indexing, never by copying K and V; a batch
  of 1 in K and V broadcasts);
* ``score``: a scalar expression of the modified score over ``i0`` (batch),
  ``i1`` (head), ``i2`` (query row) and ``r0`` (key position), in which
  :data:`QK` stands for ``sum_e q * k`` in float32 (the scale is part of
  the expression);
* ``mask``: where the score counts (a bool expression over the same
  symbols); elsewhere it is ``-inf``;
* ``empty``: the output of a row whose every score is ``-inf`` (its
  log-sum-exp is ``-inf``): 0 for FlexAttention, nan for a softmax written
  out (eager's ``0 / 0``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.decisions import Reason
from tilec.gemm import next_pow2
from tilec.ir import Call, Const, Expr, Graph, Index, Load, Node, base_inputs, walk
from tilec.target import Target

if TYPE_CHECKING:
    from tilec.codegen.launch import LaunchConfig

# The reduce_op of the output node and of the log-sum-exp node.
ATTENTION = "attention"
LOGSUMEXP = "attention_lse"
# The op of both nodes' body: ``attention(q, k, v, score, mask)``.
BODY = "attention"
# The product of a query and a key row (float32), inside a score expression.
QK = Call("attention_qk", (), torch.float32)


@dataclasses.dataclass(frozen=True)
class Parts:
    """The pieces of an attention node's body (see the module docstring)."""

    q: Load
    k: Load
    v: Load
    score: Expr
    mask: Expr
    # The output of a row with every position masked (0.0 or nan).
    empty: Const
    # Split-KV nodes: the keys each split covers (a multiple of the kernel's
    # BLOCK_N); None for the others.
    chunk: Const | None = None
    # A BlockMask's lists of the blocks to visit (:class:`Blocks`), or None.
    blocks: Call | None = None


def parts(node: Node) -> Parts:
    """The body of an attention node, taken apart."""
    assert isinstance(node.body, Call) and node.body.op == BODY, node
    q, k, v, score, mask, empty, *rest = node.body.args
    chunk = next((a for a in rest if isinstance(a, Const)), None)
    blocks = next((a for a in rest if isinstance(a, Call) and a.op == BLOCKS), None)
    return Parts(q, k, v, score, mask, empty, chunk, blocks)


# A BlockMask's block lists, as the last argument of an attention body:
# ``attention_blocks(kv_num, kv_indices, full_kv_num, full_kv_indices, q_num,
# q_indices, full_q_num, full_q_indices, q_block, kv_block)``.  The loads
# are over (i0: batch, i1: query head, i2: the block's number along the
# owned sequence, r0: a position in its list); the sizes are constants.
BLOCKS = "attention_blocks"


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The block lists an attention kernel walks instead of every tile: for
    each block of ``q_block`` query rows, the ``kv_block``-key blocks with a
    position the mask allows (``kv``: partly masked, ``full_kv``: not masked
    at all), and for each key block the query blocks (``q``, ``full_q``)."""

    kv: tuple[Load, Load]
    full_kv: tuple[Load, Load]
    q: tuple[Load, Load]
    full_q: tuple[Load, Load]
    q_block: int
    kv_block: int

    @classmethod
    def of(cls, call: Call) -> Blocks:
        loads, (q_block, kv_block) = call.args[:8], call.args[8:]
        pairs = [tuple(loads[k : k + 2]) for k in range(0, 8, 2)]
        return cls(*pairs, int(q_block.value), int(kv_block.value))


def blocks_call(loads: list[Load], q_block: int, kv_block: int) -> Call:
    """The body argument of :class:`Blocks` (``loads`` in its order)."""
    sizes = (Const(q_block, torch.int64), Const(kv_block, torch.int64))
    return Call(BLOCKS, (*loads, *sizes), torch.int32)


def block_tiles(
    config: AttentionConfig, blocks: Blocks | None, rows_first: bool = True
) -> AttentionConfig:
    """``config`` with tiles no larger than the block lists' blocks (both
    powers of two, so a tile lies in one block); ``rows_first``: the config's
    ``block_m`` tiles query rows (else key positions, as the dk/dv kernel's)."""
    if blocks is None:
        return config
    rows, keys = (
        (blocks.q_block, blocks.kv_block) if rows_first else (blocks.kv_block, blocks.q_block)
    )
    return dataclasses.replace(
        config, block_m=min(config.block_m, rows), block_n=min(config.block_n, keys)
    )


# Split-KV (decode, few query rows): each of S programs per row tile covers a
# chunk of the keys and stores its partial results, unnormalized: the
# accumulator ``(B, Hq, M, Ev, S)``, the row maximum and the row sum
# ``(B, Hq, M, 1, S)``; ordinary nodes combine them
# (``passes/attention_split.py``).
SPLIT_ACC = "attention_split_acc"
SPLIT_MAX = "attention_split_max"
SPLIT_SUM = "attention_split_sum"
SPLITS = (SPLIT_ACC, SPLIT_MAX, SPLIT_SUM)
# The largest head dimension (q/k's, or v's) the template takes: the q tile
# and the accumulator hold a whole head row in registers.
MAX_HEAD_DIM = 256
# Keys a split covers at least: fewer make the combine cost more than it saves.
MIN_CHUNK = 256


def split_nodes(node: Node, splits: int, chunk: int) -> tuple[Node, Node, Node]:
    """The split-KV partial nodes (accumulator, maximum, sum) of attention
    output ``node`` over ``splits`` chunks of ``chunk`` keys."""
    batch, heads, m, ev = node.shape
    body = Call(BODY, (*node.body.args, Const(chunk, torch.int64)), torch.float32)
    acc = dataclasses.replace(
        node, name=f"{node.name}_acc", shape=(batch, heads, m, ev, splits),
        dtype=torch.float32, body=body, reduce_op=SPLIT_ACC, stride=None,
    )  # fmt: skip
    rows = (batch, heads, m, 1, splits)
    most = dataclasses.replace(acc, name=f"{node.name}_max", shape=rows, reduce_op=SPLIT_MAX)
    total = dataclasses.replace(acc, name=f"{node.name}_sum", shape=rows, reduce_op=SPLIT_SUM)
    return acc, most, total


def counter_name(acc: Node) -> str:
    """The constant counting a split's finished programs, per row tile."""
    return f"{acc.name[: -len('_acc')]}_done"


def combining_outputs(graph: Graph, acc: Node) -> list[str]:
    """The output and log-sum-exp nodes that ``passes/attention_split.py`` made from
    the split whose accumulator is ``acc`` (read from the graph: the
    nodes whose inputs are their own ``_num``/``_top`` and ``_den``)."""
    name = acc.name[: -len("_acc")]
    users = graph.users()
    found = []
    for part in users[f"{name}_max"]:
        for user in users[part]:
            if is_combining_output(graph.nodes[user]):
                found.append(user)
    return list(dict.fromkeys(found))


def combining_nodes(outputs: list[str]) -> set[str]:
    """The names of every node that combines a split into ``outputs``
    (:func:`combining_outputs`): each output's maximum, sum and weighted
    accumulator (the log-sum-exp has no ``_num``), and the outputs."""
    return {f"{o}_{part}" for o in outputs for part in ("top", "den", "num")} | set(outputs)


def is_combining_output(node: Node) -> bool:
    """Whether ``node`` is an output or log-sum-exp that combines a split
    (it reads its own ``_den``)."""
    return node.kind == "pointwise" and f"{node.name}_den" in node.inputs


def attention_nodes(
    names: tuple[str, str],
    inputs: tuple[Node, ...],
    score: Expr,
    mask: Expr,
    out_dtype: torch.dtype,
    blocks: Call | None = None,
) -> tuple[Node, Node]:
    """The output and log-sum-exp nodes (named ``names``) of attention over
    4-d ``inputs`` (q, k, v, then what ``score`` and ``mask`` load from),
    FlexAttention's: a row with nothing unmasked gives 0."""
    q, k, v = inputs[:3]
    batch, heads, m, e = q.shape
    kv_batch, kv_heads, n, _ = k.shape
    if heads % kv_heads or kv_batch not in (1, batch):
        raise ValueError(f"attention: q {q.shape} and k {k.shape} do not broadcast")
    group = heads // kv_heads
    i0, i1, i2, i3 = ix.out_symbols(4)
    r0, r1 = ix.reduce_symbols(2)
    kb = i0 if kv_batch == batch else sympy.Integer(0)
    kh = i1 if group == 1 else sympy.floor(i1 / group)
    loads = (
        Load(0, (i0, i1, i2, r1), q.dtype),
        Load(1, (kb, kh, r0, r1), k.dtype),
        Load(2, (kb, kh, r0, i3), v.dtype),
    )
    names_in = tuple(node.name for node in inputs)
    out = attention_node(names[0], (batch, heads, m, v.shape[-1]), out_dtype, names_in,
                         loads, score, mask, 0.0, (n, e), blocks)  # fmt: skip
    lse = dataclasses.replace(
        out, name=names[1], shape=(batch, heads, m, 1), dtype=torch.float32, reduce_op=LOGSUMEXP
    )
    return out, lse


def attention_node(
    name: str,
    shape: tuple,
    dtype: torch.dtype,
    inputs: tuple[str, ...],
    loads: tuple[Load, Load, Load],
    score: Expr,
    mask: Expr,
    empty: float,
    reduce_shape: tuple,
    blocks: Call | None = None,
) -> Node:
    """An attention output node: ``shape`` (B, Hq, M, Ev), reducing over
    ``reduce_shape`` (N, E); ``loads`` of q, k and v over the index symbols;
    ``empty``: the output of a row with nothing unmasked (0 for
    FlexAttention, nan for a softmax written out, as eager gives)."""
    args = (*loads, score, mask, Const(empty, torch.float32), *([blocks] if blocks else []))
    body = Call(BODY, args, torch.float32)
    return Node(name, "reduction", shape, dtype, inputs, body=body, reduce_op=ATTENTION,
                reduce_shape=reduce_shape)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def of(cls, launch: LaunchConfig) -> AttentionConfig:
        """The configuration an attention kernel's launch uses."""
        c = launch.constexprs
        return cls(c["BLOCK_M"], c["BLOCK_N"], launch.num_warps, launch.num_stages)

    def key_loop(self, steps: int, e: int, ev: int, itemsize: int, target: Target) -> cost.KLoop:
        """A program's loop of ``steps`` key blocks, for ``cost.attention_template``:
        its stages and tile rows, and how many programs share an SM (the q
        tile and ``num_stages`` blocks of keys and values in shared memory)."""
        shared = (self.block_m * e + self.num_stages * self.block_n * (e + ev)) * itemsize
        resident = cost.resident_programs(target, shared, self.num_warps)
        return cost.KLoop(steps, self.num_stages, self.block_m, resident)


# The most query rows one decode tile packs from the heads that share
# their keys and values (GQA): ``tl.dot``'s smallest tile, so packing adds
# no rows to a program's products.
PACKED_ROWS = 16


@functools.lru_cache(maxsize=1024)  # the split prices each chunk length with it
def head_group(node: Node) -> int:
    """How many query heads one program of attention ``node``'s kernel
    computes: the most consecutive heads ``G`` (dividing the heads, with
    ``G`` times the query rows at most :data:`PACKED_ROWS`) whose keys and
    values are one another's, which a program then loads once for all of
    its rows (row ``j`` of a tile of key/value head ``g``'s programs is query
    head ``g * G + j // M``); 1 for one head a program.

    Heads share keys and values where every index that K and V read with
    (the loads' and the index values' in their expressions) depends on the
    query head ``i1`` only through ``i1 // G``: at ``i1 = G * g + j`` they
    simplify to expressions without ``j``.  Not for block lists (each head
    has its own) or sizes not known when compiled."""
    batch, heads, m = node.shape[:3]
    p = parts(node)
    if p.blocks is not None or not all(isinstance(s, int) for s in (batch, heads, m)):
        return 1
    indices = []
    for x in (x for operand in (p.k, p.v) for x in walk(operand)):
        if isinstance(x, Load):
            indices += [c for c in x.index if isinstance(c, sympy.Expr)]
        elif isinstance(x, Index):
            indices.append(sympy.sympify(x.expr))
    if any(ix.gathered(c) for c in indices):
        return 1
    head = ix.out_symbols(2)[1]
    ranges = {s: r for s, r in ix.symbol_ranges(node.shape, node.reduce_shape).items()
              if isinstance(r, int) and s != head}  # fmt: skip
    g, j = sympy.symbols("head_group head_in_group", integer=True, nonnegative=True)
    for size in range(min(heads, PACKED_ROWS // m), 1, -1):
        if heads % size:
            continue
        at = {head: size * g + j}
        within = ranges | {g: heads // size, j: size}
        if all(j not in ix.simplify_index(c.subs(at), within).free_symbols for c in indices):
            return size
    return 1


def attention_config(target: Target, m: int, n: int, e: int, dtype: torch.dtype) -> AttentionConfig:
    """Tiles for ``m`` query rows against ``n`` positions with head dimension
    ``e``.  Under the interpreter, large tiles (it pays per program); on a
    GPU, FlashAttention-2's shapes for 16-bit operands (128 rows, 64
    positions; 8 warps for head dimensions over 64), 16 x 16 on 8 warps and
    1 stage for float32 (no tensor cores without TF32)."""
    fit = lambda size, cap: max(16, min(next_pow2(size), cap))  # noqa: E731
    if target.interpret:
        return AttentionConfig(fit(m, 64), fit(n, 128), 4, 1)
    if dtype.itemsize >= 4:
        # FMA dots: 64-row tiles spilled on sm_90 (312 bytes at head
        # dimension 64, 4.7 KB at 128); 32 x 32 (and 16 x 16 on 4 warps)
        # spilled 8 to 32 bytes in some of the tests' kernels (ALiBi, a
        # softcap, document masks), at 48 to 96 registers, and so did
        # 16 x 16 with loads pipelined over 2 stages.  16 x 16, 8 warps, 1
        # stage spilled in none, on triton 3.7 or 3.8.
        return AttentionConfig(fit(m, 16), fit(n, 16), 8, 1)
    warps = 8 if e > 64 else 4
    return AttentionConfig(fit(m, 128), fit(n, 64), warps, 3)


class AttentionAnchor:
    """The attention template's anchor kind (the :class:`~tilec.anchors.Anchor`
    protocol).  Both nodes of an attention are anchors of this kind; a
    kernel holds one attention's pair (or either one) and nothing else."""

    kind = "attention"

    def owns(self, node: Node) -> bool:
        return node.kind == "reduction" and node.reduce_op in (ATTENTION, LOGSUMEXP, *SPLITS)

    def operands(self, graph: Graph, node: Node) -> tuple[str, ...]:
        return tuple(base_inputs(graph, node))

    def weights(self, node: Node) -> tuple[str, ...]:
        return ()

    def space(
        self,
        graph: Graph,
        node: Node,
        nodes: list[Node],
        stored: Callable[[str], bool],
        target: Target,
    ) -> tuple[tuple, tuple] | Reason:
        """An attention kernel: the output and log-sum-exp nodes of one
        attention (same inputs and body), nothing else."""
        for other in nodes:
            if not self.owns(other):
                return Reason(
                    "not_in_attention",
                    f"%{other.name} ({other.kind}) in the kernel of attention %{node.name}",
                )
            if other.inputs != node.inputs or other.body != node.body:
                return Reason("two_attentions", "two attentions in one kernel")
        lead = next((n for n in nodes if n.reduce_op in (ATTENTION, SPLIT_ACC)), node)
        return lead.shape, lead.reduce_shape

    def grid(self, node: Node) -> tuple[tuple, tuple]:
        return node.shape, node.reduce_shape

    def reference(
        self, node: Node, evaluate: Callable[[Expr, dict | None], torch.Tensor]
    ) -> torch.Tensor:
        """Scores materialized: the score expression over (b, h, m, n) with
        :data:`QK` bound to the products, masked, soft-maxed, times V (a
        split node: over each chunk of the keys, unnormalized).  The grid
        is the node's dimensions, then (r0, r1)."""
        p = parts(node)
        q, k = evaluate(p.q, None).float(), evaluate(p.k, None).float()
        qk = (q * k).sum(dim=-1, keepdim=True)
        scores = evaluate(p.score, {QK: qk}).float()
        scores = torch.where(evaluate(p.mask, None), scores, -math.inf)
        scores = _pick(scores, node, keep=(0, 1, 2, "n"))
        v = _pick(evaluate(p.v, None).float(), node, keep=(0, 1, 3, "n"))  # (B, H, Ev, N)
        if node.reduce_op in SPLITS:
            return _split_reference(node, scores, v, int(p.chunk.value))
        if node.reduce_op == LOGSUMEXP:
            return torch.logsumexp(scores, dim=-1).unsqueeze(-1)
        probs = torch.softmax(scores, dim=-1)
        empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
        probs = torch.where(empty, p.empty.value, probs)
        return torch.einsum("bhmn,bhen->bhme", probs, v).to(node.dtype)

    def work(self, graph: Graph, node: Node) -> cost.Work:
        """A library call of fused attention: two products per head, of
        (M x E) by (E x N) and (M x N) by (N x Ev); q, k, v read once and the
        output written once."""
        batch, heads, m = (int(s) for s in node.shape[:3])
        n, e = (int(s) for s in node.reduce_shape)
        ev = int(value_columns(graph, node))
        flops = 2 * batch * heads * m * n * (e + ev)
        p = parts(node)
        read = {node.inputs[x.src] for e in (p.q, p.k, p.v) for x in walk(e) if isinstance(x, Load)}
        operands = [graph.nodes[i] for i in sorted(read)]
        dtype = p.q.dtype
        out = batch * heads * m * ev * dtype.itemsize
        return cost.Work(flops, sum(int(o.nbytes) for o in operands) + out, dtype)


def value_columns(graph: Graph, node: Node) -> ix.Size:
    """Ev of an attention node: the size of V's dimension that the output's
    last index (i3) reads (V may be laid out (N, Ev) or (Ev, N); V may be
    an expression, ``passes/attention_cache.py``: a load of it at i3)."""
    i3 = ix.out_symbols(4)[3]
    for load in (x for x in walk(parts(node).v) if isinstance(x, Load)):
        index = [sympy.sympify(c) for c in load.index]
        if i3 in index:
            return graph.nodes[node.inputs[load.src]].shape[index.index(i3)]
    raise AssertionError(f"attention %{node.name}: V is not read along the output's columns")


def _pick(value: torch.Tensor, node: Node, keep: tuple) -> torch.Tensor:
    """``value`` over the reference grid (the node's dimensions, then r0,
    r1; r1 summed away already or broadcast) with the dimensions ``keep``
    (positions of the node's shape; ``"n"``: r0) and the others at 0."""
    grid = (*node.shape, node.reduce_shape[0], 1)
    value = torch.broadcast_to(value, (*node.shape, node.reduce_shape[0], value.shape[-1]))
    value = value[..., :1]  # r1: summed (size 1) or, for V, constant along it
    wanted = [len(node.shape) if d == "n" else d for d in keep]
    index = tuple(slice(None) if d in wanted else 0 for d in range(len(grid)))
    return value[index]


def _split_reference(node: Node, scores: torch.Tensor, v: torch.Tensor, chunk: int) -> torch.Tensor:
    """A split node's value: per chunk of keys, the row maximum, the sum of
    ``exp(score - maximum)`` and those weights times V (0 where a chunk has
    nothing unmasked, its maximum ``-inf``)."""
    found = []
    for start in range(0, node.shape[4] * chunk, chunk):
        part = scores[..., start : start + chunk]  # none past the keys' end
        if part.shape[-1]:
            most = part.amax(dim=-1, keepdim=True)
        else:
            most = torch.full((*scores.shape[:-1], 1), -math.inf, device=scores.device)
        shift = torch.where(torch.isneginf(most), 0.0, most)
        weights = torch.exp(part - shift)
        if node.reduce_op == SPLIT_MAX:
            found.append(most)
        elif node.reduce_op == SPLIT_SUM:
            found.append(weights.sum(dim=-1, keepdim=True))
        else:
            found.append(torch.einsum("bhmn,bhen->bhme", weights, v[..., start : start + chunk]))
    return torch.stack(found, dim=-1).to(node.dtype)


ATTENTION_ANCHOR = AttentionAnchor()


# ------------------------------------------------------- visited key ranges

# A linear constraint ``a * m + b * n + c >= 0`` on the query row ``m`` (i2)
# and the key position ``n`` (r0) that every unmasked score satisfies.
Constraint = tuple[int, int, int]
# Comparison -> (sign, offset): ``x op y`` is ``sign * (x - y) + offset >= 0``.
_COMPARISONS = {"ge": (1, 0), "gt": (1, -1), "le": (-1, 0), "lt": (-1, -1)}


def exact_constraints(mask: Expr) -> list[Constraint] | None:
    """The constraints of :func:`key_constraints` if they are the whole
    mask (every conjunct a linear comparison), else None."""
    if _conjunction(mask):
        parts = [exact_constraints(arg) for arg in mask.args]
        return None if any(p is None for p in parts) else [c for p in parts for c in p]
    found = key_constraints(mask)
    return found if len(found) == 1 else None


def key_constraints(mask: Expr) -> list[Constraint]:
    """Linear constraints on (query row, key position) that the mask implies:
    from its top-level conjunction of integer comparisons (``q_idx >= kv_idx``,
    ``q_idx - kv_idx <= window``).  Conjuncts of another form are left out,
    so the constraints only ever admit more positions than the mask."""
    if _conjunction(mask):
        return [c for arg in mask.args for c in key_constraints(arg)]
    if not (isinstance(mask, Call) and mask.op in _COMPARISONS):
        return []
    sign, offset = _COMPARISONS[mask.op]
    x, y = (_integer(arg) for arg in mask.args)
    if x is None or y is None:
        return []
    m, n = ix.out_symbols(3)[2], ix.reduce_symbols(1)[0]
    linear = sympy.Poly(sympy.expand(sign * (x - y) + offset), m, n)
    if linear.total_degree() > 1 or not all(c.is_Integer for c in linear.coeffs()):
        return []
    a, b, c = (int(linear.coeff_monomial(t)) for t in (m, n, 1))
    return [(a, b, c)] if b else []


def _conjunction(e: Expr) -> bool:
    """``a & b`` of two bools (``logical_and``, or ``bitwise_and`` as ``&`` lowers)."""
    return (
        isinstance(e, Call)
        and e.op in ("logical_and", "bitwise_and")
        and all(a.dtype == torch.bool for a in e.args)
    )


def _integer(e: Expr) -> sympy.Expr | None:
    """An integer expression of the index symbols i2 and r0 as sympy, or None."""
    if isinstance(e, Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return sympy.Integer(e.value)
    if isinstance(e, Index):
        expr = sympy.sympify(e.expr)
        allowed = {ix.out_symbols(3)[2], ix.reduce_symbols(1)[0]}
        return expr if expr.free_symbols <= allowed else None
    if not isinstance(e, Call) or e.dtype.is_floating_point or e.dtype == torch.bool:
        return None
    if e.op == "cast":  # between integer types: index values fit every one
        return _integer(e.args[0]) if not e.args[0].dtype.is_floating_point else None
    args = [_integer(a) for a in e.args]
    if any(a is None for a in args):
        return None
    if e.op == "add":
        return args[0] + args[1]
    if e.op == "sub":
        return args[0] - args[1]
    if e.op == "neg":
        return -args[0]
    if e.op == "mul" and (args[0].is_Integer or args[1].is_Integer):
        return args[0] * args[1]
    return None


def visited_keys(constraints: list[Constraint], m: int, n: int, config: AttentionConfig) -> int:
    """Query rows times the key positions their tiles visit, summed over the
    row tiles of one (batch, head): what an attention kernel's dots compute."""
    total = 0
    for first in range(0, m, config.block_m):
        last = min(first + config.block_m, m) - 1
        start, end = key_range(constraints, first, last, n)
        total += (last - first + 1) * max(0, end - start // config.block_n * config.block_n)
    return total


def key_loop(
    constraints: list[Constraint],
    sizes: tuple[int, int, int, int],
    itemsize: int,
    config: AttentionConfig,
    target: Target,
    chunk: int = 0,
    heads: int = 1,
) -> cost.KLoop | None:
    """The loop over key blocks of the longest program (of ``m`` query rows
    against ``n`` keys, head dimensions ``e`` and ``ev``: ``sizes``; within
    one chunk of ``chunk`` keys for a split, 0: whole), for
    ``cost.attention_template``, where the rows fit one tile (decode): its
    programs stream the keys as a GEMV's stream a weight
    (``cost.KEY_STEPS``).  None for more rows: the template's measured rate
    (prefill shapes) covers their loops.  ``heads``: the query heads a
    tile packs (:func:`head_group`), its rows ``heads * m``."""
    m, n, e, ev = sizes
    if heads * m > config.block_m:
        return None
    start, end = key_range(constraints, 0, m - 1, n)
    start = start // config.block_n * config.block_n
    keys = end - start
    if chunk:  # the fullest chunk
        keys = max(max(0, min(end, lo + chunk) - max(start, lo)) for lo in range(0, n, chunk))
    return config.key_loop(math.ceil(keys / config.block_n), e, ev, itemsize, target)


def key_range(constraints: list[Constraint], first: int, last: int, n: int) -> tuple[int, int]:
    """The key positions ``[start, end)`` that query rows ``first..last``
    may see under ``constraints`` (within ``[0, n)``): the kernel's loop
    bounds (codegen writes the same arithmetic), and the metrics' count."""
    start, end = 0, n
    for a, b, c in constraints:
        if b < 0:  # n <= (a * m + c) / -b, largest at an end of the rows
            top = max(a * first + c, a * last + c)
            end = min(end, 0 if top < 0 else top // -b + 1)
        else:  # n >= (-a * m - c) / b, smallest at an end of the rows
            low = min(-a * first - c, -a * last - c)
            start = max(start, 0 if low <= 0 else (low + b - 1) // b)
    start = min(start, n)
    return start, max(start, end)
