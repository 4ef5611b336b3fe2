"""Attention written out by hand, recognized: one attention template (``compiler/attention.py``).

Models written before fused attention (and many research models) compute

    s = q @ k^T                      a matmul library call (views of q and k)
    x = f(s, ...)                    pointwise: a scale, a mask (``masked_fill``
                                     with a causal ``tril``, an additive float
                                     mask), a bias, casts
    p = softmax(x, dim=-1)           as lowering writes it: exp(x - max) / sum
    o = p @ v                        a matmul library call (p maybe cast first)

which writes and reads the ``M x N`` scores several times.  This pass finds
``o``'s matmul whose left operand is such a softmax of a function of another
matmul, and replaces ``o`` by a view of one attention node: the score
expression is ``f`` inlined (views folded, pointwise producers substituted)
with ``QK`` for ``s``, loads of what else ``f`` reads (a mask, a bias) on
the attention's own inputs.  A masking condition (``masked_fill`` with
``-inf``; a lowest-float additive mask from comparisons that leave every row
a position, as transformers builds a causal one) becomes the attention's
mask, where the template skips the key tiles it rules out.  A row whose
scores are all ``-inf`` gives nan, as eager's softmax does.  Matches are checked on the inlined expressions,
not on node names: the softmax must be exactly ``exp(x - max_n x) / sum_n``
of it along the last dimension (float casts aside: the template computes in
float32), the score must read ``s`` at the same (batch, row, column), and
the two matmuls must agree on the batch of heads.  The scores and the
softmax must be read by nothing else (not returned, not saved for a
backward): where they are computed anyway, the library's ``p @ v`` costs
less than computing the attention again, and nothing is rewritten.

Runs before the matmul choice.  Does nothing when no matmul of a softmax
is found, with option ``fuse`` off, for operands the target's ``tl.dot``
cannot take (bf16 without a bf16 dot, integers), for head dimensions over
``attention.MAX_HEAD_DIM``, or where the cost model predicts the attention
kernel slower than the two library matmuls and the softmax kernel it
replaces (a target with figures; the interpreter has none and always
rewrites).
"""

from __future__ import annotations

import math

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.attention import (
    MAX_HEAD_DIM,
    QK,
    attention_node,
    exact_constraints,
    key_range,
)
from tilec.inline import Bound, BufferLoad, InlinedExpr, Inliner
from tilec.ir import Call, Const, Expr, Graph, Index, Load, Node, View, is_matmul, view_base
from tilec.passes.attention_split import attention_seconds, splits_of
from tilec.passes.dce import dce
from tilec.passes.matmul import matmul_operands
from tilec.target import Target

TEMPLATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fuse_attention(
    graph: Graph, target: Target, enabled: bool = True
) -> tuple[Graph, dict[str, int]]:
    """``graph`` with each ``softmax(f(q @ k^T)) @ v`` one attention node."""
    if not enabled:
        return graph, {"attention": 0}
    found = 0
    for name in list(graph.nodes):
        node = graph.nodes.get(name)
        if node is None or not is_matmul(node):
            continue
        rewritten = _rewrite(graph, node, target)
        if rewritten is not None:
            graph, found = rewritten, found + 1
    return graph, {"attention": found}


def _rewrite(graph: Graph, mm2: Node, target: Target) -> Graph | None:
    """``graph`` with matmul ``mm2`` computed by an attention node, or None:
    ``p @ v``, or its transpose ``v^T @ p^T`` (a convolutional block's
    attention over channels)."""
    bias, left, right, _, alpha = matmul_operands(mm2)
    if bias is not None or alpha != 1:
        return None
    for p_operand, v_name, transposed in ((left, right, False), (right, left, True)):
        rewritten = _rewrite_as(graph, mm2, p_operand, v_name, transposed, target)
        if rewritten is not None:
            return rewritten
    return None


def _rewrite_as(
    graph: Graph, mm2: Node, p_operand: str, v_name: str, transposed: bool, target: Target
) -> Graph | None:
    """:func:`_rewrite` with ``p_operand`` as the probabilities (``p`` on the
    left, or ``p^T`` on the right: ``transposed``) and ``v_name`` as V."""
    p_name = _uncast(graph, view_base(graph, p_operand))
    softmax = _softmax_input(graph, p_name)
    if softmax is None:
        return None
    x_name, n = softmax
    x = graph.nodes[x_name]
    lead = x.shape[:-2]
    if len(lead) > 2 or not all(isinstance(s, int) for s in x.shape):
        return None
    batch, heads = (1,) * (2 - len(lead)) + tuple(lead)
    m = x.shape[-2]
    # The matmuls' batch (``bmm``) is the flattened leading dimensions of x.
    if (len(mm2.shape) == 3 and mm2.shape[0] == batch * heads) or (
        len(mm2.shape) == 2 and batch * heads == 1
    ):
        pass
    else:
        return None
    i0, i1, i2, i3 = ix.out_symbols(4)
    r0, r1 = ix.reduce_symbols(2)
    lead_syms = (i0, i1)[2 - len(lead) :]
    g = (ix.flatten_index(lead_syms, lead),) if len(mm2.shape) == 3 else ()
    ranges = ix.symbol_ranges((batch, heads, m, 1), (n, 1))
    at = (*g, r0, i2) if transposed else (*g, i2, r0)
    if not _reads_at(graph, p_operand, at, p_name, (*lead_syms, i2, r0), ranges):
        return None
    scored = _score(graph, x_name, (*lead_syms, i2, r0), g, ranges)
    if scored is None:
        return None
    mm1, score, others = scored
    _, q_name, k_name, _, alpha1 = matmul_operands(mm1)
    q, k, v = (graph.nodes[name] for name in (q_name, k_name, v_name))
    e, (v_keys, ev) = q.shape[-1], (v.shape[-1:-3:-1] if transposed else v.shape[-2:])
    if not _dot_operands(q, k, v, target) or v_keys != n or mm1.shape[-2:] != (m, n):
        return None
    if max(e, ev) > MAX_HEAD_DIM:
        return None
    if alpha1 != 1:
        scaled = Call("mul", (QK, Const(float(alpha1), torch.float32)), torch.float32)
        score = _substitute(score, QK, scaled)
    inputs = (q_name, k_name, v_name, *others)
    loads = (
        Load(0, (*g, i2, r1), q.dtype),
        Load(1, (*g, r1, r0), k.dtype),
        Load(2, (*g, i3, r0) if transposed else (*g, r0, i3), v.dtype),
    )
    score, mask = _hoist_mask(score, m, n)
    name = graph.fresh_name(f"{mm2.name}_attention")
    shape = (batch, heads, m, ev)
    attention = attention_node(name, shape, mm2.dtype, inputs, loads, score, mask, math.nan,
                               (n, e))  # fmt: skip
    if cost.has_figures(target) and not _pays(graph, attention, mm1, mm2, target):
        return None
    views = _output_views(mm2, attention, transposed)
    nodes = []
    for node in graph.nodes.values():
        nodes += [attention, *views] if node.name == mm2.name else [node]
    rewritten, _ = dce(graph.replace_nodes(nodes))
    # Scores or probabilities read elsewhere (returned, saved for a backward)
    # are computed anyway: then the library's p @ v is cheaper than recomputing.
    return rewritten if mm1.name not in rewritten.nodes else None


# An additive mask value this negative takes any score (|s| < 1e31) to it
# in float32, whose exp then underflows to exactly 0: the position counts as
# masked, as long as its row has a position that is not (the float32 and
# bf16 minimum that transformers adds; fp16's -65504 is not this negative).
MASKED_ADDEND = -1e30


def _hoist_mask(score: Expr, m: ix.Size, n: ix.Size) -> tuple[Expr, Expr]:
    """(score, mask) with a masking condition of ``score`` moved to the
    mask, where the template can skip the key tiles it rules out:
    ``where(c, -inf, s)`` (``masked_fill``) is ``s`` under ``not c``; ``s +
    where(c, 0, lowest)`` is ``s`` under ``c`` when ``c`` is linear
    comparisons only and leaves every row of ``m`` a position of ``n`` (so
    no row's softmax would spread over the masked ones; never proved for
    symbolic sizes, where the addend stays in the score).  Float casts
    around either are kept around ``s`` (``s + 0`` rounds as ``s`` does)."""
    inner, casts = _uncast_expr(score)

    def wrapped(e: Expr) -> Expr:
        for dtype in reversed(casts):
            e = Call("cast", (e,), dtype)
        return e

    if isinstance(inner, Call) and inner.op == "where":
        cond, a, b = inner.args
        if _is_const(a, -math.inf):
            return wrapped(b), _negate(cond)
        if _is_const(b, -math.inf):
            return wrapped(a), cond
    if isinstance(inner, Call) and inner.op == "add":
        for s, added in (inner.args, inner.args[::-1]):
            added, _ = _uncast_expr(added)
            if not (isinstance(added, Call) and added.op == "where"):
                continue
            cond, keep, drop = added.args
            lowest = isinstance(drop, Const) and drop.value <= MASKED_ADDEND
            if _is_const(keep, 0.0) and lowest and _rows_keep_a_key(cond, m, n):
                return wrapped(s), cond
    return score, Const(True, torch.bool)


def _uncast_expr(e: Expr) -> tuple[Expr, list[torch.dtype]]:
    """``e`` without its outer float-to-float casts, and those casts' dtypes
    (outermost first)."""
    casts = []
    while (
        isinstance(e, Call)
        and e.op == "cast"
        and e.dtype.is_floating_point
        and e.args[0].dtype.is_floating_point
    ):
        casts.append(e.dtype)
        e = e.args[0]
    return e, casts


def _rows_keep_a_key(cond: Expr, m: ix.Size, n: ix.Size) -> bool:
    """Whether ``cond`` is linear comparisons only and leaves every one of
    the ``m`` rows a key position of ``n`` (False for symbolic sizes: it
    would hold for some and not for others)."""
    constraints = exact_constraints(cond)
    if constraints is None or not (isinstance(m, int) and isinstance(n, int)):
        return False
    return all(len(range(*key_range(constraints, row, row, n))) > 0 for row in range(m))


def _is_const(e: Expr, value: float) -> bool:
    return isinstance(e, Const) and isinstance(e.value, float) and e.value == value


def _negate(cond: Expr) -> Expr:
    if isinstance(cond, Call) and cond.op == "logical_not":
        return cond.args[0]
    return Call("logical_not", (cond,), torch.bool)


def _pays(graph: Graph, attention: Node, mm1: Node, mm2: Node, target: Target) -> bool:
    """Whether the attention kernel is predicted faster than what it
    replaces: the two library matmuls and a softmax kernel that writes the
    probabilities after reading the scores (each at least once)."""
    template = template_seconds(graph, attention, target)
    scores = int(mm1.nbytes)
    library = 0.0
    for mm in (mm1, mm2):
        _, left, right, _, _ = matmul_operands(mm)
        a, b = graph.nodes[left], graph.nodes[right]
        flops = 2 * int(ix.numel(mm.shape)) * int(a.shape[-1])
        nbytes = int(a.nbytes) + int(b.nbytes) + int(mm.nbytes)
        library += cost.gemm(target, flops, nbytes, a.dtype, template=False).seconds
    softmax = cost.kernel(target, 2 * scores).seconds
    return template < library + softmax


def template_seconds(graph: Graph, attention: Node, target: Target) -> float:
    """Predicted seconds of the attention kernel for node ``attention``, split
    as ``splits_of`` splits it (``attention_split.attention_seconds``)."""
    return attention_seconds(graph, attention, target, *splits_of(graph, attention, target))


def _output_views(mm2: Node, attention: Node, transposed: bool) -> list[Node]:
    """Views of the attention output (B, Hq, M, Ev) that are ``mm2``'s value,
    the last one by ``mm2``'s name: its batch of heads flattened, and for
    ``v^T @ p^T`` the last two dimensions swapped."""
    *batch, rows, cols = mm2.shape
    flat = (*batch, cols, rows) if transposed else mm2.shape
    reshape = Node(f"{attention.name}_out" if transposed else mm2.name, "view", flat, mm2.dtype,
                   (attention.name,), view=View("reshape", (flat,)))  # fmt: skip
    if not transposed:
        return [reshape]
    order = (*range(len(batch)), len(batch) + 1, len(batch))
    swap = Node(mm2.name, "view", mm2.shape, mm2.dtype, (reshape.name,),
                view=View("permute", (order,)))  # fmt: skip
    return [reshape, swap]


def _reads_at(
    graph: Graph, name: str, index: tuple, source: str, expected: tuple, ranges: dict
) -> bool:
    """Whether node ``name`` at ``index`` is node ``source`` at ``expected``
    (through views and a float cast of the same shape)."""
    inliner = Inliner(graph, set(), ranges)
    value = inliner.value(name, index)
    if isinstance(value, BufferLoad) and value.buffer != source:
        node = graph.nodes[value.buffer]
        if _uncast(graph, node.name) == source:
            value = BufferLoad(source, value.index, node.dtype)
    if not isinstance(value, BufferLoad) or value.buffer != source or inliner.bindings:
        return False
    return _same_index(value.index, expected, ranges)


def _same_index(got: tuple, expected: tuple, ranges: dict) -> bool:
    """Whether two indices are the same position, size-1 dimensions at 0."""
    zero = ix.unit_symbols(ranges)
    got = tuple(ix.simplify_index(sympy.sympify(c), ranges) for c in got)
    return len(got) == len(expected) and all(
        sympy.expand(sympy.sympify(a - b).xreplace(zero)) == 0 for a, b in zip(got, expected)
    )


def _uncast(graph: Graph, name: str) -> str:
    """The node a float cast of the same shape reads (``p.to(v.dtype)``), or ``name``."""
    node = graph.nodes[name]
    body = node.body
    if node.kind == "pointwise" and isinstance(body, Call) and body.op == "cast":
        (arg,) = body.args
        source = graph.nodes[node.inputs[arg.src]] if isinstance(arg, Load) else None
        if source is not None and source.shape == node.shape and arg.dtype.is_floating_point:
            ranges = ix.symbol_ranges(node.shape)
            if _same_index(arg.index, ix.out_symbols(len(node.shape)), ranges):
                return source.name
    return name


def _softmax_input(graph: Graph, p_name: str) -> tuple[str, int] | None:
    """(x, N) where node ``p_name`` is ``softmax(x, dim=-1)`` over N columns
    (``x`` as the softmax reads it: the node computing it, or a view)."""
    p = graph.nodes[p_name]
    if p.kind != "pointwise" or not p.shape:
        return None
    reductions = {}
    for name in p.inputs:
        base = graph.nodes[view_base(graph, name)]
        if base.kind == "reduction" and base.reduce_op == "sum":
            reductions["sum"] = base
    if "sum" not in reductions:
        return None
    total = reductions["sum"]
    _, maxima = _producers(graph, total.name, set())
    if len(maxima) != 1:
        return None
    amax = graph.nodes[maxima.pop()]
    if amax.reduce_op != "max":
        return None
    # x as the max reads it (a view of the scores, or the node computing them).
    x_name = amax.inputs[0]
    rank = len(p.shape)
    n = p.shape[-1]
    row = ix.out_symbols(rank - 1)
    (r,) = ix.reduce_symbols(1)
    ranges = ix.symbol_ranges(p.shape, (n,))
    stop = {view_base(graph, x_name), amax.name, total.name}
    inliner = Inliner(graph, _producers(graph, p_name, stop)[0] | {p_name}, ranges)
    f32 = torch.float32

    def x_at(index: tuple) -> InlinedExpr:
        return inliner.value(x_name, index)

    def exp(index: tuple) -> Call:
        return Call("exp", (Call("sub", (x_at(index), _load(amax, row)), f32),), f32)

    expected_p = Call("truediv", (exp((*row, ix.out_symbols(rank)[-1])), _load(total, row)), f32)
    zero = ix.unit_symbols(ranges)
    if _plain(inliner.value(p_name, ix.out_symbols(rank)), zero) != _plain(expected_p, zero):
        return None
    if (total.reduce_shape, amax.reduce_shape) != ((n,), (n,)):
        return None
    if _plain(inliner.body(total, {}), zero) != _plain(exp((*row, r)), zero):
        return None
    if _plain(inliner.body(amax, {}), zero) != _plain(x_at((*row, r)), zero):
        return None
    return x_name, n


def _score(
    graph: Graph, x_name: str, index: tuple, g: tuple, ranges: dict
) -> tuple[Node, Expr, list[str]] | None:
    """(the matmul ``s``, the score expression with ``QK`` for ``s``, the
    other buffers it reads) of softmax input ``x_name`` at ``index``, whose
    batch of heads ``g`` indexes ``s``."""
    group = _producers(graph, x_name, set())[0] | {x_name}
    inliner = Inliner(graph, group, ranges)
    value = inliner.value(x_name, index)
    if inliner.bindings:
        return None  # an index read from data: not supported
    matmuls = [b for b in _loads(value) if is_matmul(graph.nodes[b.buffer])]
    if len({b.buffer for b in matmuls}) != 1:
        return None
    mm1 = graph.nodes[matmuls[0].buffer]
    if matmul_operands(mm1)[0] is not None or len(mm1.shape) != len(g) + 2:
        return None
    i2, r0 = index[-2], index[-1]
    if not all(_same_index(load.index, (*g, i2, r0), ranges) for load in matmuls):
        return None
    others: list[str] = []

    def convert(e: InlinedExpr) -> Expr:
        if isinstance(e, BufferLoad):
            if e.buffer == mm1.name:
                return QK if e.dtype == torch.float32 else Call("cast", (QK,), e.dtype)
            if e.mask is not None:
                raise _NoMatch
            if e.buffer not in others:
                others.append(e.buffer)
            return Load(3 + others.index(e.buffer), e.index, e.dtype)
        if isinstance(e, Bound):
            raise _NoMatch
        if isinstance(e, Call):
            return Call(e.op, tuple(convert(a) for a in e.args), e.dtype)
        return e

    try:
        return mm1, convert(value), others
    except _NoMatch:
        return None


class _NoMatch(Exception):
    """Raised inside an expression walk: the pattern does not hold."""


def _dot_operands(q: Node, k: Node, v: Node, target: Target) -> bool:
    """Whether ``tl.dot`` takes q, k (one dtype) and v on ``target``."""
    dtypes = {q.dtype, k.dtype, v.dtype}
    if not dtypes <= set(TEMPLATE_DTYPES) or q.dtype != k.dtype:
        return False
    return target.bf16_dot or torch.bfloat16 not in dtypes


def _producers(graph: Graph, name: str, stop: set[str]) -> tuple[set[str], set[str]]:
    """(pointwise nodes, reductions) that node ``name`` is computed from,
    walking through views and pointwise nodes, not past ``stop``."""
    pointwise: set[str] = set()
    reductions: set[str] = set()
    todo = list(graph.nodes[name].inputs)
    while todo:
        current = view_base(graph, todo.pop())
        node = graph.nodes[current]
        if current in pointwise or current in stop:
            continue
        if node.kind == "pointwise":
            pointwise.add(current)
            todo += node.inputs
        elif node.kind == "reduction":
            reductions.add(current)
    return pointwise, reductions


def _load(node: Node, index: tuple) -> BufferLoad:
    return BufferLoad(node.name, index, node.dtype)


def _plain(e: InlinedExpr, zero: dict) -> tuple:
    """``e`` without float casts and dtypes, with indices expanded and the
    symbols of size-1 dimensions (``zero``) at 0, for comparing structure."""
    if isinstance(e, Call):
        if e.op == "cast" and e.dtype.is_floating_point and e.args[0].dtype.is_floating_point:
            return _plain(e.args[0], zero)
        return (e.op, *(_plain(a, zero) for a in e.args))
    if isinstance(e, BufferLoad):
        index = tuple(sympy.expand(sympy.sympify(c).xreplace(zero)) for c in e.index)
        return ("load", e.buffer, index)
    if isinstance(e, (Const, Index)):
        return (type(e).__name__, e.value if isinstance(e, Const) else e.expr)
    return (repr(e),)


def _loads(e: InlinedExpr) -> list[BufferLoad]:
    if isinstance(e, BufferLoad):
        return [e]
    if isinstance(e, Call):
        return [b for a in e.args for b in _loads(a)]
    return []


def _substitute(e: Expr, old: Expr, new: Expr) -> Expr:
    if e == old:
        return new
    if isinstance(e, Call):
        return Call(e.op, tuple(_substitute(a, old, new) for a in e.args), e.dtype)
    return e
