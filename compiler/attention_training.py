"""Attention written out, in training: rewritten to ``scaled_dot_product_attention``
before AOTAutograd.

In inference, ``passes/attention.py`` turns ``softmax(q @ k^T * c + mask) @ v``
into the attention template.  In training it cannot: AOTAutograd saves the
probabilities (``M x N`` per head) for the backward, and the backward reads
them.  Rewriting the pattern in Dynamo's torch-level graph, before AOTAutograd
traces the backward, makes it one ``scaled_dot_product_attention`` call, whose
backward recomputes the probabilities (torch's flash or memory-efficient
kernels on a GPU; a library call either way): nothing ``M x N`` is saved.

The matched chain (each link read by the next alone; otherwise nothing is
rewritten, as when the probabilities are returned):

    s = matmul(q, transpose(k, -2, -1))     (``@``, ``torch.matmul``, ``.matmul``)
    x = s * c  |  s / c                      (optional; ``c`` a Python number)
    x = x + mask  |  mask + x                (optional; an additive float mask)
      | masked_fill(x, m, -inf)              (a boolean mask, True where masked)
    p = softmax(x, dim=-1[, dtype])          (then optionally ``.to`` / ``.float``,
                                              dropout with p = 0 or not training)
    out = matmul(p, v)

and ``out`` becomes ``scaled_dot_product_attention(q, k, v, attn_mask, scale=c)``
(``attn_mask``: the additive mask, or ``~m``).  One difference from eager:
a row whose every key is masked (``-inf``) gives 0, as SDPA gives (its
softmax is "safe"), where the written-out softmax gives nan, in the output
and the gradients; Inductor's rewrite to SDPA makes the same change.  With
transformers' additive masks (the float minimum, not ``-inf``) no row is
ever all ``-inf``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

_MATMULS = {torch.matmul, operator.matmul}
_SOFTMAXES = {F.softmax, torch.softmax}
_CASTS = {"to", "float", "type_as", "half", "bfloat16"}


def rewrite_attention(gm: GraphModule) -> int:
    """Rewrite every matched attention in ``gm``; returns how many."""
    found = 0
    for node in list(gm.graph.nodes):
        match = _match(node)
        if match is None:
            continue
        q, k, v, (mask, masked_where), scale = match
        with gm.graph.inserting_before(node):
            if masked_where:  # masked_fill's condition: SDPA's bool mask keeps where True
                mask = gm.graph.call_function(torch.logical_not, (mask,))
            sdpa = gm.graph.call_function(
                F.scaled_dot_product_attention,
                (q, k, v),
                {"attn_mask": mask, "dropout_p": 0.0, "scale": scale},
            )
        sdpa.meta = dict(node.meta)
        node.replace_all_uses_with(sdpa)
        found += 1
    if found:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return found


def _match(out: Node) -> tuple[Node, Node, Node, tuple[Node | None, bool], float] | None:
    """(q, k, v, (the mask, whether it says where masked), scale) if ``out``
    is ``matmul(p, v)`` of the chain."""
    operands = _matmul(out)
    if operands is None:
        return None
    p, v = operands
    p = _strip_casts(p)
    if p is None or not _softmax_last(p):
        return None
    x = p.args[0] if p.args else p.kwargs.get("input")
    if not _single_use(x, p):
        return None
    mask, masked_where, x = _mask(x)
    if x is None:
        return None
    scale, s = _scaled(x)
    if s is None or not _single_use(s, None):
        return None
    scores = _matmul(s)
    if scores is None:
        return None
    q, kt = scores
    k = _transposed(kt)
    if k is None or not _same_operands(q, k, v, mask):
        return None
    return q, k, v, (mask, masked_where), scale


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _single_use(node: Any, user: Node | None) -> bool:
    return isinstance(node, Node) and len(node.users) == 1 and (user is None or user in node.users)


def _matmul(node: Node) -> tuple[Node, Node] | None:
    if node.op == "call_function" and node.target in _MATMULS and len(node.args) == 2:
        a, b = node.args
    elif node.op == "call_method" and node.target == "matmul" and len(node.args) == 2:
        a, b = node.args
    else:
        return None
    if not (isinstance(a, Node) and isinstance(b, Node)):
        return None
    return a, b


def _strip_casts(p: Node) -> Node | None:
    """``p`` without float casts and inactive dropout after the softmax."""
    while True:
        if not isinstance(p, Node) or len(p.users) != 1:
            return None
        if p.op == "call_method" and p.target in _CASTS:
            value = _value(p)
            if value is None or not value.dtype.is_floating_point:
                return None
            p = p.args[0]
        elif p.op == "call_function" and p.target is F.dropout:
            rate = p.kwargs.get("p", p.args[1] if len(p.args) > 1 else 0.5)
            training = p.kwargs.get("training", p.args[2] if len(p.args) > 2 else True)
            if rate != 0 and training:
                return None
            p = p.args[0]
        else:
            return p


def _softmax_last(p: Node) -> bool:
    """``softmax(x, dim=-1)`` (its last dimension), any float ``dtype``."""
    if p.op == "call_function" and p.target in _SOFTMAXES:
        dim = p.kwargs.get("dim", p.args[1] if len(p.args) > 1 else None)
    elif p.op == "call_method" and p.target == "softmax":
        dim = p.kwargs.get("dim", p.args[1] if len(p.args) > 1 else None)
    else:
        return False
    value = _value(p)
    return isinstance(dim, int) and value is not None and dim in (-1, value.dim() - 1)


def _mask(x: Node) -> tuple[Node | None, bool, Node | None]:
    """(the mask, whether it marks the masked positions, the scores before
    it): an additive float mask; ``masked_fill(x, m, -inf)``'s ``m``; or
    no mask.  The scores are None where the form does not match."""
    if x.op == "call_function" and x.target in (operator.add, torch.add) and len(x.args) == 2:
        for scores, mask in (x.args, x.args[::-1]):
            value = _value(mask)
            if value is not None and value.dtype.is_floating_point and _single_use(scores, x):
                return mask, False, scores
        return None, False, None
    if x.op == "call_method" and x.target == "masked_fill" and len(x.args) == 3:
        scores, condition, fill = x.args
        if fill == -math.inf and isinstance(condition, Node) and _single_use(scores, x):
            return condition, True, scores
        return None, False, None
    return None, False, x


def _scaled(x: Node) -> tuple[float, Node | None]:
    """(the scale, the scores it multiplies): ``s * c``, ``c * s``, ``s / c``."""
    if x.op == "call_function" and len(x.args) == 2:
        a, b = x.args
        if x.target in (operator.mul, torch.mul):
            if isinstance(b, (int, float)) and isinstance(a, Node):
                return float(b), a
            if isinstance(a, (int, float)) and isinstance(b, Node):
                return float(a), b
        if x.target in (operator.truediv, torch.div) and isinstance(b, (int, float)) and b:
            return 1.0 / float(b), a if isinstance(a, Node) else None
    return 1.0, x


def _transposed(kt: Node) -> Node | None:
    """``k`` if ``kt`` swaps the last two dimensions of ``k`` (``transpose``, ``.mT``)."""
    value = _value(kt)
    if value is None or value.dim() < 2:
        return None
    last = {-1, value.dim() - 1}
    second = {-2, value.dim() - 2}
    if kt.op == "call_method" and kt.target == "transpose" and len(kt.args) == 3:
        a, b = kt.args[1:]
        if {a, b} & last and {a, b} & second:
            return kt.args[0]
    if kt.op == "call_function" and kt.target is torch.transpose and len(kt.args) == 3:
        a, b = kt.args[1:]
        if {a, b} & last and {a, b} & second:
            return kt.args[0]
    if kt.op == "call_function" and kt.target is getattr and kt.args[1] == "mT":
        return kt.args[0]
    return None


def _same_operands(q: Node, k: Node, v: Node, mask: Node | None) -> bool:
    """q, k and v of one dtype and rank; a float mask of their dtype (what
    SDPA takes), or a bool one."""
    values = [_value(n) for n in (q, k, v)]
    if any(v is None for v in values) or len({(v.dtype, v.dim()) for v in values}) != 1:
        return False
    if mask is None:
        return True
    found = _value(mask)
    return found is not None and found.dtype in (torch.bool, values[0].dtype)
