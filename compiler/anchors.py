"""Templates as a protocol: the anchors that a kernel is built around.

Most kernels are built by the generic tiling templates (pointwise,
reduction, scatter) from whatever fusion groups.  A *template kernel* is
built around one anchor node that needs a kernel structure of its own: the
GEMM's dot reduction (its K loop over operand tiles, ``tl.dot``) is the
first; fused attention (``compiler/attention.py``) the second, its
backward (``compiler/attention_grad.py``) the third.  Every stage that must
treat an anchor specially asks this module, never the node's fields:

* selection: :func:`anchor_of` says which anchor kind a node is, if any
  (the kind's :meth:`Anchor.owns`); the pass that creates anchors (for the
  GEMM, ``passes/matmul.py``) builds them with the kind's own constructor;
* legality of fusion: :meth:`Anchor.space` (what a group around the anchor
  may hold, and its iteration space) and :meth:`Anchor.operands` (the
  buffers whose producers would be computed per tile: the prologue);
* reference semantics for the IR interpreter: :meth:`Anchor.reference`,
  over the index grid :meth:`Anchor.grid`;
* work counts for reports and quantization: :meth:`Anchor.work` (the
  library call the template replaces) and :meth:`Anchor.weights`;
* the kernel writer, its tile candidates and launch live in codegen, which
  registers one writer per kind (``codegen/templates.py``: ``WRITERS``).

An anchor kind is an object with these methods (:class:`Anchor`); adding
one means adding it to :data:`ANCHORS` and a writer to codegen's table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from tilec.attention import ATTENTION_ANCHOR
from tilec.attention_grad import ATTENTION_GRAD_ANCHOR
from tilec.cost import Work
from tilec.decisions import Reason
from tilec.gemm import GEMM
from tilec.ir import Expr, Graph, Node
from tilec.target import Target


class Anchor(Protocol):
    """One kind of template anchor (see the module docstring)."""

    # The kind's name: also the name of its codegen template and writer.
    kind: str

    def owns(self, node: Node) -> bool:
        """Whether ``node`` is an anchor of this kind."""
        ...

    def operands(self, graph: Graph, node: Node) -> tuple[str, ...]:
        """The buffers the anchor reads tile by tile: their producers, fused
        into its kernel, are computed per tile (a prologue)."""
        ...

    def weights(self, node: Node) -> tuple[str, ...]:
        """The inputs that hold a layer's weights (quantization's accounting)."""
        ...

    def space(
        self,
        graph: Graph,
        node: Node,
        nodes: list[Node],
        stored: Callable[[str], bool],
        target: Target,
    ) -> tuple[tuple, tuple] | Reason:
        """The (rows, reduction) iteration space of a kernel holding ``nodes``
        around ``node``, whose members named by ``stored`` are stored, or the
        reason it cannot hold them on ``target``."""
        ...

    def grid(self, node: Node) -> tuple[tuple, tuple]:
        """The index grid of :meth:`reference`'s expressions: (rows,
        reduction) shapes, the node's own for most kinds."""
        ...

    def reference(
        self, node: Node, evaluate: Callable[[Expr, dict | None], torch.Tensor]
    ) -> torch.Tensor:
        """The anchor's value, computed by torch from its body's parts:
        ``evaluate(e, leaves)`` gives an expression's value over the node's
        index grid, with the sub-expressions in ``leaves`` (if any) taking
        the given values."""
        ...

    def work(self, graph: Graph, node: Node) -> Work:
        """The work of the library call the anchor replaces."""
        ...


ANCHORS: tuple[Anchor, ...] = (GEMM, ATTENTION_ANCHOR, ATTENTION_GRAD_ANCHOR)


def anchor_of(node: Node) -> Anchor | None:
    """The anchor kind of ``node``, or None for an ordinary node."""
    for anchor in ANCHORS:
        if anchor.owns(node):
            return anchor
    return None


def anchors_in(graph: Graph, names: Iterable[str]) -> list[tuple[Anchor, Node]]:
    """The anchors among the nodes ``names`` of ``graph``, in that order."""
    found = []
    for name in names:
        node = graph.nodes[name]
        anchor = anchor_of(node)
        if anchor is not None:
            found.append((anchor, node))
    return found
