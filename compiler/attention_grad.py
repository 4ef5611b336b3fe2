"""The attention backward template's anchor: gradients of fused attention.

The third template kind (``compiler/anchors.py``).  The backward of the
attention of ``compiler/attention.py`` recomputes the probabilities from the
forward's log-sum-exp instead of reading stored scores, as FlashAttention-2
does, in two kernels:

* ``dq`` (``reduce_op=DQ``), shape ``(B, Hq, M, E)``: one program per tile of
  query rows walks the key/value positions;
* ``dk`` and ``dv`` (``DK``, ``DV``), shapes ``(B, Hkv, N, E)`` and
  ``(B, Hkv, N, Ev)``, one kernel: one program per tile of key positions
  walks the query rows of every query head that shares the key/value head
  (grouped-query attention: summed over the group in registers).

All three nodes have the same inputs (q, k, v, the output's gradient ``do``,
the natural log-sum-exp ``lse`` and ``delta``, both ``(B, Hq, M, 1)``, then
what the score or mask reads) and the same body
``attention_grad(q, k, v, do, lse, delta, score, mask, dscore)`` over one
canonical index grid, whatever the node's shape (:func:`grid`): ``i0`` the
batch, ``i1`` the query head, ``i2`` the query row, ``i3`` the q/k head
dimension, ``r0`` the key position, ``r1`` the v head dimension.

With ``s`` the score (``QK`` standing for q·k, as in the forward), masked
to ``-inf``, ``p = exp(s - lse)`` (0 in a row with nothing unmasked),
``dp = do · v`` and ``ds = p * (dp - delta)`` (``delta`` = rowsum(do * out)
less the log-sum-exp's own gradient), ``dscore`` is the gradient with
respect to ``QK`` (the score's derivative times :data:`DS`, which stands
for ``ds``; 0 where masked).  Then ``dq = dscore @ k``,
``dk = dscore^T @ q`` and ``dv = p^T @ do``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import sympy
import torch

from tilec import cost
from tilec import index as ix
from tilec.attention import QK, AttentionConfig
from tilec.decisions import Reason
from tilec.gemm import next_pow2
from tilec.ir import Call, Expr, Graph, Load, Node, base_inputs
from tilec.target import Target

DQ = "attention_dq"
DK = "attention_dk"
DV = "attention_dv"
GRADS = (DQ, DK, DV)
BODY = "attention_grad"
# The loss's gradient with respect to the (modified) score, inside ``dscore``.
DS = Call("attention_ds", (), torch.float32)


@dataclasses.dataclass(frozen=True)
class GradParts:
    """The pieces of a backward node's body (see the module docstring)."""

    q: Load
    k: Load
    v: Load
    do: Load
    lse: Load
    delta: Load
    score: Expr
    mask: Expr
    dscore: Expr
    # A BlockMask's lists of blocks to visit (``attention.Blocks``), or None.
    blocks: Call | None = None


def grad_parts(node: Node) -> GradParts:
    assert isinstance(node.body, Call) and node.body.op == BODY, node
    return GradParts(*node.body.args)


def grad_nodes(
    names: tuple[str, str, str],
    inputs: tuple[Node, ...],
    score: Expr,
    mask: Expr,
    dscore: Expr,
    blocks: Call | None = None,
) -> tuple[Node, Node, Node]:
    """The dq, dk and dv nodes (named ``names``) of attention over ``inputs``
    (q, k, v, do, lse, delta, then what the expressions load from)."""
    q, k, v, do = inputs[:4]
    batch, heads, m, e = q.shape
    kv_batch, kv_heads, n, _ = k.shape
    ev = v.shape[-1]
    if heads % kv_heads or kv_batch != batch:
        raise ValueError(f"attention backward: q {q.shape} and k {k.shape} do not match")
    group = heads // kv_heads
    i0, i1, i2, i3 = ix.out_symbols(4)
    r0, r1 = ix.reduce_symbols(2)
    kh = i1 if group == 1 else sympy.floor(i1 / group)
    zero = sympy.Integer(0)
    loads = (
        Load(0, (i0, i1, i2, i3), q.dtype),
        Load(1, (i0, kh, r0, i3), k.dtype),
        Load(2, (i0, kh, r0, r1), v.dtype),
        Load(3, (i0, i1, i2, r1), do.dtype),
        Load(4, (i0, i1, i2, zero), torch.float32),
        Load(5, (i0, i1, i2, zero), torch.float32),
    )
    body = Call(BODY, (*loads, score, mask, dscore, *([blocks] if blocks else [])), torch.float32)
    names_in = tuple(node.name for node in inputs)

    def node(name: str, shape: tuple, dtype: torch.dtype, op: str, reduce_shape: tuple) -> Node:
        return Node(name, "reduction", shape, dtype, names_in, body=body, reduce_op=op,
                    reduce_shape=reduce_shape)  # fmt: skip

    # dk's and dv's reductions: the rows of a head group, and the other head
    # dimension (from which :func:`grid` recovers the canonical grid).
    return (
        node(names[0], (batch, heads, m, e), q.dtype, DQ, (n, ev)),
        node(names[1], (batch, kv_heads, n, e), k.dtype, DK, (m, group, ev)),
        node(names[2], (batch, kv_heads, n, ev), v.dtype, DV, (m, group, e)),
    )


def grid(node: Node) -> tuple[tuple, tuple]:
    """The canonical grid of a backward node: ``(B, Hq, M, E)`` and ``(N, Ev)``."""
    if node.reduce_op == DQ:
        return node.shape, node.reduce_shape
    batch, kv_heads, n, last = node.shape
    m, group, other = node.reduce_shape
    e, ev = (last, other) if node.reduce_op == DK else (other, last)
    return (batch, kv_heads * group, m, e), (n, ev)


def grad_config(
    target: Target, rows: int, walked: int, e: int, dtype: torch.dtype
) -> AttentionConfig:
    """Tiles of a backward kernel whose programs own ``rows`` positions (query
    rows for dq, keys for dk/dv) and walk ``walked`` others: ``block_m`` is
    the owned tile, ``block_n`` the walked one.  A backward program holds
    two or three more tiles than the forward's (dk and dv, or dq, and the
    gradient of the output), so its tiles are 64 by 64 on a GPU in 16 bits
    (8 warps for head dimensions over 64); in float32 (FMA dots), 16 by 16
    on 8 warps and 1 stage, as the forward's (larger tiles, 4 warps or 2
    stages spilled on sm_90 in some of the tests' kernels)."""
    fit = lambda size, cap: max(16, min(next_pow2(size), cap))  # noqa: E731
    if target.interpret:
        return AttentionConfig(fit(rows, 64), fit(walked, 128), 4, 1)
    if dtype.itemsize >= 4:
        return AttentionConfig(fit(rows, 16), fit(walked, 16), 8, 1)
    return AttentionConfig(fit(rows, 64), fit(walked, 64), 8 if e > 64 else 4, 2)


class AttentionGradAnchor:
    """The attention backward's anchor kind (the :class:`~tilec.anchors.Anchor`
    protocol).  A kernel holds an attention's dq alone, or its dk and dv."""

    kind = "attention_grad"

    def owns(self, node: Node) -> bool:
        return node.kind == "reduction" and node.reduce_op in GRADS

    def operands(self, graph: Graph, node: Node) -> tuple[str, ...]:
        return tuple(base_inputs(graph, node))

    def weights(self, node: Node) -> tuple[str, ...]:
        return ()

    def grid(self, node: Node) -> tuple[tuple, tuple]:
        return grid(node)

    def space(
        self,
        graph: Graph,
        node: Node,
        nodes: list[Node],
        stored: Callable[[str], bool],
        target: Target,
    ) -> tuple[tuple, tuple] | Reason:
        """dq alone, or dk and dv of one attention (same inputs and body)."""
        for other in nodes:
            if not self.owns(other):
                return Reason(
                    "not_in_attention",
                    f"%{other.name} ({other.kind}) in the kernel of attention gradient %{node.name}",
                )
            if other.inputs != node.inputs or other.body != node.body:
                return Reason("two_attentions", "two attention gradients in one kernel")
            if (other.reduce_op == DQ) != (node.reduce_op == DQ):
                return Reason("dq_with_dkdv", "dq and dk/dv walk different loops")
        lead = next((n for n in nodes if n.reduce_op in (DQ, DK)), node)
        return lead.shape, lead.reduce_shape

    def reference(
        self, node: Node, evaluate: Callable[[Expr, dict | None], torch.Tensor]
    ) -> torch.Tensor:
        """The gradients with every score materialized, over the canonical
        grid ``(B, Hq, M, E, N, Ev)``."""
        p = grad_parts(node)
        (batch, heads, m, e), (n, ev) = grid(node)
        full = (batch, heads, m, e, n, ev)

        def at(expr: Expr, dims: tuple[int, ...], leaves: dict | None = None) -> torch.Tensor:
            # ``expr`` over the grid, size 1 along the dimensions not in ``dims``.
            value = evaluate(expr, leaves).float()
            shape = [s if d in dims else 1 for d, s in enumerate(full)]
            return torch.broadcast_to(value, shape)

        q, k = at(p.q, (0, 1, 2, 3)), at(p.k, (0, 1, 3, 4))
        qk = (q * k).sum(dim=3, keepdim=True)  # (B, H, M, 1, N, 1)
        keep = at(p.mask, (0, 1, 2, 4)).bool()
        score = torch.where(keep, at(p.score, (0, 1, 2, 4), {QK: qk}), -math.inf)
        lse = at(p.lse, (0, 1, 2))
        probs = torch.where(torch.isneginf(lse), 0.0, torch.exp(score - lse))
        do, v = at(p.do, (0, 1, 2, 5)), at(p.v, (0, 1, 4, 5))
        dp = (do * v).sum(dim=5, keepdim=True)
        ds = probs * (dp - at(p.delta, (0, 1, 2)))
        dqk = torch.where(keep, at(p.dscore, (0, 1, 2, 4), {QK: qk, DS: ds}), 0.0)
        if node.reduce_op == DQ:
            return (dqk * k).sum(dim=4)[..., 0].to(node.dtype)  # (B, H, M, E)
        if node.reduce_op == DK:
            grad = (dqk * q).sum(dim=2)[..., 0]  # (B, H, E, N)
        else:
            grad = (probs * do).sum(dim=2)[:, :, 0]  # (B, H, N, Ev)
        if node.reduce_op == DK:
            grad = grad.transpose(2, 3)
        kv_heads = node.shape[1]
        grad = grad.reshape(batch, kv_heads, heads // kv_heads, *grad.shape[2:]).sum(dim=2)
        return grad.to(node.dtype)

    def work(self, graph: Graph, node: Node) -> cost.Work:
        """The library backward of fused attention (FlashAttention-2's, one
        kernel): five products per head, split over the nodes: dq's
        (M x N by N x E) on dq; the recomputed scores (M x E by E x N),
        ``dp`` (M x Ev by Ev x N) and dk's (N x M by M x E) on dk; dv's (N x M
        by M x Ev) on dv.  q, k, v and do read once (on dq), each gradient
        written once."""
        (batch, heads, m, e), (n, ev) = (tuple(int(s) for s in part) for part in grid(node))
        columns = {DQ: e, DK: 2 * e + ev, DV: ev}[node.reduce_op]
        operands = [graph.nodes[i] for i in node.inputs[:4]]
        read = sum(int(o.nbytes) for o in operands) if node.reduce_op == DQ else 0
        flops = 2 * batch * heads * m * n * columns
        return cost.Work(flops, read + int(node.nbytes), operands[0].dtype)


ATTENTION_GRAD_ANCHOR = AttentionGradAnchor()
