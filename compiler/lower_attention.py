"""Lowering attention to the attention template (``compiler/attention.py``).

``flex_attention`` (the higher-order op of ``torch.nn.attention.flex_attention``)
carries its ``score_mod`` and its block mask's ``mask_mod`` as FX subgraphs
over 0-d tensors: ``score_mod(score, b, h, q_idx, kv_idx, *buffers)`` and
``mask_mod(b, h, q_idx, kv_idx, *buffers)``.  Each subgraph is lowered with
the ordinary rules into 0-d IR nodes, and those are composed into one scalar
expression over the attention's index symbols (:func:`scalar_function`):
the score placeholder becomes the template's ``QK`` times the scale, the
index placeholders the index symbols, and a buffer the subgraph reads (a
bias, an ALiBi slope per head, a document id per position) a load of that
buffer, which becomes an input of the attention.

The mask is ``mask_mod`` at every position, as eager computes it.  Tiles
are skipped where the mask's linear comparisons prove them empty (causal,
a window); for other masks (packed documents) the template walks the
block mask's lists of blocks instead (:func:`_block_lists`).  What a
subgraph does that cannot be one scalar expression (a reduction, a library
call, a constant captured inside it) leaves the op to its ATen fallback.

``flex_attention_backward`` lowers to the backward template
(``compiler/attention_grad.py``): its joint graph (the gradient of
``score_mod``) is composed the same way, with ``attention_grad.DS`` for the
gradient that flows into the score.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from tilec import index as ix
from tilec.attention import MAX_HEAD_DIM, QK, attention_nodes, blocks_call, exact_constraints
from tilec.attention_grad import DS, grad_nodes
from tilec.ir import Call, Const, Expr, Graph, Index, Load, Node, View
from tilec.lower import Lowering, Unsupported, lower_graph
from tilec.lower_ops import RULES, rule

# Positions of a flex_attention block-mask tuple (``BlockMask.as_tuple``).
MASK_MOD = -1


@rule(torch.ops.higher_order.flex_attention)
def flex_attention(
    ctx: Lowering,
    q: Any,
    k: Any,
    v: Any,
    score_mod: torch.fx.GraphModule,
    block_mask: tuple,
    scale: float,
    kernel_options: dict,
    score_buffers: Sequence[Any] = (),
    mask_buffers: Sequence[Any] = (),
    *,
    bf16_dot: bool = True,
) -> tuple:
    """(output, log-sum-exp in base 2, None): the op's results, but for the
    running maxima, which only ``OUTPUT_MAX`` asks for.  ``bf16_dot``: the
    target has a bf16 ``tl.dot`` (:func:`for_target`)."""
    if not all(isinstance(t, Node) and len(t.shape) == 4 for t in (q, k, v)):
        raise Unsupported("flex_attention: q, k, v must be 4-d tensors")
    _check_template(q, v, (*score_buffers, *mask_buffers), bf16_dot)
    if kernel_options.get("OUTPUT_MAX"):
        raise Unsupported("flex_attention: OUTPUT_MAX")
    inputs: list[Node] = [q, k, v]
    i0, i1, i2, _ = ix.out_symbols(4)
    (r0, _) = ix.reduce_symbols(2)
    positions = (i0, i1, i2, r0)
    score = scalar_function(
        ctx, score_mod, [Call("mul", (QK, Const(float(scale), torch.float32)), torch.float32)],
        positions, score_buffers, inputs,
    )  # fmt: skip
    mask = scalar_function(ctx, block_mask[MASK_MOD], [], positions, mask_buffers, inputs)
    if mask.dtype != torch.bool:
        raise Unsupported("flex_attention: a mask_mod that does not return bool")
    blocks = _block_lists(block_mask, mask, inputs)
    out_name = ctx.fresh(ctx.hint())
    names = (out_name, f"{out_name}_lse")
    out, lse = attention_nodes(names, tuple(inputs), score, mask, q.dtype, blocks)
    val = ctx.meta()
    out = ctx.add(dataclasses.replace(out, stride=tuple(ctx.sizes(val[0].stride()))))
    lse = ctx.add(lse)
    # The op returns the log-sum-exp in base 2, of shape (B, Hq, M).
    lse3 = ctx.view(lse, View("reshape", (lse.shape[:3],)), lse.shape[:3])
    base2 = Const(1 / math.log(2), torch.float32)
    body = Call("mul", (Load(0, ix.out_symbols(3), torch.float32), base2), torch.float32)
    lse2 = ctx.pointwise(lse3.shape, torch.float32, [lse3], body)
    return out, lse2, None


@rule(torch.ops.higher_order.flex_attention_backward)
def flex_attention_backward(
    ctx: Lowering,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    grad_out: Any,
    grad_lse: Any,
    score_mod: torch.fx.GraphModule,
    joint: torch.fx.GraphModule,
    block_mask: tuple,
    scale: float,
    kernel_options: dict,
    score_buffers: Sequence[Any] = (),
    mask_buffers: Sequence[Any] = (),
    *,
    bf16_dot: bool = True,
) -> tuple:
    """(dq, dk, dv, gradients of the score's buffers: None) by the backward
    template (``compiler/attention_grad.py``).  ``lse`` is the forward op's,
    in base 2; ``delta`` (rowsum of ``grad_out * out``, less the natural
    log-sum-exp's gradient) is an ordinary reduction before it."""
    tensors = (q, k, v, out, grad_out)
    if not all(isinstance(t, Node) and len(t.shape) == 4 for t in tensors):
        raise Unsupported("flex_attention backward: q, k, v, out and grad_out must be 4-d tensors")
    if not isinstance(lse, Node) or not (grad_lse is None or isinstance(grad_lse, Node)):
        raise Unsupported("flex_attention backward: a log-sum-exp that is not a tensor")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise Unsupported("flex_attention backward: q, k and v of different dtypes")
    _check_template(q, v, (*score_buffers, *mask_buffers), bf16_dot)
    if k.shape[0] != q.shape[0]:
        raise Unsupported("flex_attention backward: K and V broadcast over the batch")
    batch, heads, m, _ = q.shape
    rows = (batch, heads, m, 1)
    i0, i1, i2, i3 = ix.out_symbols(4)
    (r0,) = ix.reduce_symbols(1)
    f32 = torch.float32
    as_f32 = lambda e: e if e.dtype == f32 else Call("cast", (e,), f32)  # noqa: E731
    ln2 = Const(math.log(2), f32)
    # The natural log-sum-exp, (B, Hq, M, 1).
    lse_body = Call("mul", (as_f32(Load(0, (i0, i1, i2), lse.dtype)), ln2), f32)
    natural = ctx.pointwise(rows, f32, [lse], lse_body)
    product = Call("mul", (as_f32(Load(0, (i0, i1, i2, r0), grad_out.dtype)),
                           as_f32(Load(1, (i0, i1, i2, r0), out.dtype))), f32)  # fmt: skip
    delta = ctx.reduction(rows, f32, [grad_out, out], product, "sum", (out.shape[-1],))
    if grad_lse is not None:
        # d(lse2) = d(lse) / ln 2, and it adds to every dp of its row.
        dlse = Call("truediv", (as_f32(Load(1, (i0, i1, i2), grad_lse.dtype)), ln2), f32)
        body = Call("sub", (Load(0, (i0, i1, i2, i3), f32), dlse), f32)
        delta = ctx.pointwise(rows, f32, [delta, grad_lse], body)
    inputs: list[Node] = [q, k, v, grad_out, natural, delta]
    positions = (i0, i1, i2, r0)
    scaled = [Call("mul", (QK, Const(float(scale), f32)), f32)]
    score = scalar_function(ctx, score_mod, scaled, positions, score_buffers, inputs)
    mask = scalar_function(ctx, block_mask[MASK_MOD], [], positions, mask_buffers, inputs)
    if mask.dtype != torch.bool:
        raise Unsupported("flex_attention: a mask_mod that does not return bool")
    dscore = scalar_function(ctx, joint, scaled, positions, score_buffers, inputs, after=[DS])
    dscore = Call("mul", (as_f32(dscore), Const(float(scale), f32)), f32)
    base = ctx.hint()
    names = tuple(ctx.fresh(f"{base}_{part}") for part in ("dq", "dk", "dv"))
    blocks = _block_lists(block_mask, mask, inputs)
    nodes = grad_nodes(names, tuple(inputs), score, mask, dscore, blocks)
    val = ctx.meta()
    dq, dk, dv = (
        ctx.add(dataclasses.replace(node, stride=tuple(ctx.sizes(meta.stride()))))
        for node, meta in zip(nodes, val[:3])
    )
    return dq, dk, dv, tuple(None for _ in score_buffers)


# Positions in a flex_attention block-mask tuple: the block lists' tensors
# (``BlockMask.as_tuple``: kv_num_blocks, kv_indices, full_kv_num_blocks,
# full_kv_indices, then the same for q), and the block sizes (q, kv).
BLOCK_LISTS = slice(2, 10)
Q_BLOCK, KV_BLOCK = -3, -2


def _block_lists(block_mask: tuple, mask: Expr, inputs: list[Node]) -> Call | None:
    """The block mask's lists of blocks for the template to walk (their
    tensors appended to ``inputs``), where they can skip what the mask
    expression cannot prove: None for a mask of linear comparisons only
    (causal, a window: the key ranges skip exactly) or none at all, for
    lists computed inside the graph (flex_attention's default block mask:
    reading them would run the sort that builds them), and for blocks that
    are not powers of two of at least 16 (a template tile must lie in one
    block)."""
    if isinstance(mask, Const) or exact_constraints(mask) is not None:
        return None
    tensors = block_mask[BLOCK_LISTS]
    sizes = (block_mask[Q_BLOCK], block_mask[KV_BLOCK])
    if not all(isinstance(t, Node) and t.kind in ("input", "constant") for t in tensors):
        return None
    if not all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in sizes):
        return None
    i0, i1, i2 = ix.out_symbols(3)
    (r0,) = ix.reduce_symbols(1)
    zero = sympy.Integer(0)
    loads = []
    for t in tensors:
        if t not in inputs:
            inputs.append(t)
        index = (i0 if t.shape[0] != 1 else zero, i1 if t.shape[1] != 1 else zero, i2, r0)
        loads.append(Load(inputs.index(t), index[: len(t.shape)], t.dtype))
    return blocks_call(loads, *sizes)


def _check_template(q: Node, v: Node, buffers: Sequence[Any], bf16_dot: bool) -> None:
    """What the attention templates cannot take: bf16 where the target's
    ``tl.dot`` has none, a head dimension over the limit, a buffer that is
    not a tensor."""
    if q.dtype == torch.bfloat16 and not bf16_dot:
        raise Unsupported("flex_attention: bf16 operands where tl.dot has no bf16")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise Unsupported(f"flex_attention: head dimension over {MAX_HEAD_DIM}")
    if not all(isinstance(b, Node) for b in buffers):
        raise Unsupported("flex_attention: a buffer that is not a tensor")


def for_target(rules: dict, bf16_dot: bool) -> dict:
    """``rules`` with flex_attention's rule for a target with (or without) a bf16 dot."""
    forward = torch.ops.higher_order.flex_attention
    backward = torch.ops.higher_order.flex_attention_backward
    return rules | {
        forward: functools.partial(flex_attention, bf16_dot=bf16_dot),
        backward: functools.partial(flex_attention_backward, bf16_dot=bf16_dot),
    }


def scalar_function(
    ctx: Lowering,
    gm: torch.fx.GraphModule,
    values: list[Expr],
    positions: Sequence[sympy.Symbol],
    buffers: Sequence[Node],
    inputs: list[Node],
    after: Sequence[Expr] = (),
) -> Expr:
    """The value of a flex_attention subgraph as one scalar expression: its
    placeholders are ``values`` (the score), then the index ``positions``
    (b, h, q_idx, kv_idx), then ``after`` (a joint graph's gradient of the
    modified score), then ``buffers``, whose loads become loads of
    ``inputs`` (buffers are appended to it).  Of a joint graph's outputs,
    the first (the score's gradient) is taken; the others (gradients of
    indices and buffers) must be None."""
    sub, fallbacks = lower_graph(gm, f"{ctx.name}_{ctx.hint()}_mod", RULES, ctx.symbol_values)
    if fallbacks:
        raise Unsupported(f"flex_attention: a subgraph falls back on {sorted(fallbacks)}")
    if sub.constants:
        raise Unsupported("flex_attention: a tensor captured inside a subgraph")
    placeholders = [sub.nodes[name] for name in sub.inputs]
    leaves: dict[str, Expr] = {}
    for node, value in zip(placeholders, [*values, *(Index(p) for p in positions), *after]):
        leaves[node.name] = (
            value if value.dtype == node.dtype else Call("cast", (value,), node.dtype)
        )
    outside = dict(zip((n.name for n in placeholders[len(leaves) :]), buffers))
    if len(leaves) + len(outside) != len(placeholders):
        raise Unsupported("flex_attention: a subgraph's arguments do not match its buffers")
    result, *others = sub.outputs
    if not result:
        raise Unsupported("flex_attention: a subgraph whose value is a constant")
    if any(name or sub.literal_outputs.get(k) is not None for k, name in enumerate(others, 1)):
        raise Unsupported("flex_attention: a gradient of a score_mod buffer")
    return _Composer(sub, leaves, outside, inputs).value(result, ())


@dataclasses.dataclass
class _Composer:
    """The value of a node of a lowered 0-d subgraph at an index, as an
    expression over the attention's inputs (see :func:`scalar_function`)."""

    sub: Graph
    leaves: dict[str, Expr]
    outside: dict[str, Node]
    inputs: list[Node]

    def value(self, name: str, index: tuple) -> Expr:
        if name in self.leaves:
            return self.leaves[name]
        node = self.sub.nodes[name]
        if name in self.outside:
            buffer = self.outside[name]
            if buffer not in self.inputs:
                self.inputs.append(buffer)
            return Load(self.inputs.index(buffer), index, buffer.dtype)
        if node.kind == "view":
            if not all(isinstance(c, sympy.Expr) for c in index):
                raise Unsupported("flex_attention: a view read at an index computed from data")
            source = self.sub.nodes[node.inputs[0]]
            return self.value(source.name, node.view.source_index(index, source.shape))
        if node.kind != "pointwise":
            raise Unsupported(f"flex_attention: a subgraph computes a {node.kind} node")
        if node.shape and not all(isinstance(c, sympy.Expr) for c in index):
            raise Unsupported("flex_attention: a computed tensor read at an index from data")
        subst = dict(zip(ix.out_symbols(len(node.shape)), index))
        return self.rewrite(node, node.body, subst)

    def rewrite(self, node: Node, e: Expr, subst: dict) -> Expr:
        if isinstance(e, Const):
            return e
        if isinstance(e, Index):
            return Index(sympy.sympify(e.expr).xreplace(subst), e.dtype)
        if isinstance(e, Call):
            return Call(e.op, tuple(self.rewrite(node, a, subst) for a in e.args), e.dtype)
        if e.mask is not None:
            raise Unsupported("flex_attention: a masked load in a subgraph")
        index = tuple(
            sympy.sympify(c).xreplace(subst)
            if isinstance(c, sympy.Expr)
            else self.rewrite(node, c, subst)
            for c in e.index
        )
        return self.value(node.inputs[e.src], index)
