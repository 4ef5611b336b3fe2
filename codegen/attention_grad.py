"""The attention backward template: dq, or dk and dv (``compiler/attention_grad.py``).

Two kernels, as FlashAttention-2's backward, both recomputing the scores
and probabilities ``p = exp(s - lse)`` tile by tile from q, k and the
forward's log-sum-exp, so that no ``M x N`` tensor is ever in memory:

* **dq**: one program per ``BLOCK_M`` query rows of one (batch, head)
  loads its q, ``do`` (the output's gradient), ``lse`` and ``delta`` once,
  then walks the key tiles: ``qk = q @ k^T``, the score and mask, ``p``,
  ``dp = do @ v^T``, ``ds = p * (dp - delta)``, the score's gradient
  ``dqk`` (the ``dscore`` expression, 0 where masked), and
  ``dq += dqk @ k``.
* **dk, dv**: one program per ``BLOCK_N`` key positions of one (batch,
  key/value head) loads its k and v once, then walks the query rows of
  each query head of its group: the same tiles transposed (keys along
  rows), ``dv += p^T @ do`` and ``dk += dqk^T @ q``.  A query head group
  (GQA) is summed in registers: nothing is written per query head.

Tiles that the mask's linear constraints rule out are skipped in both
(the key range of a row tile, or the query range of a key tile: the same
arithmetic, :func:`~tilec.codegen.attention.loop_bounds`).  Products run on
``tl.dot`` with float32 accumulation; ``p`` and ``dqk`` are cast to the
operands' dtype for theirs, as FlashAttention does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tilec import index as ix
from tilec.attention import (
    QK,
    AttentionConfig,
    Blocks,
    block_tiles,
    key_constraints,
    visited_keys,
)
from tilec.attention_grad import DK, DQ, DS, DV, grad_config, grad_parts, grid
from tilec.codegen.attention import Attention, loop_bounds, open_key_loops
from tilec.codegen.emit import Axis, Emitter, Scope, Value
from tilec.codegen.launch import LaunchConfig, program_id, programs
from tilec.codegen.triton_ops import TL_DTYPES
from tilec.gemm import next_pow2
from tilec.ir import Graph, Group, Node
from tilec.target import Target

if TYPE_CHECKING:
    pass

LOG2E = repr(1 / math.log(2))


class AttentionGrad(Attention):
    """The attention backward's writer (``codegen/templates.py``'s protocol);
    it shares the forward writer's operand and scalar emission."""

    Config = AttentionConfig

    def __init__(self, graph: Graph, group: Group, target: Target, anchor: Node):
        self.graph, self.group, self.target = graph, group, target
        self.members = {graph.nodes[n].reduce_op: graph.nodes[n] for n in group.nodes}
        self.node = anchor
        self.parts = grad_parts(anchor)
        self.blocks = Blocks.of(self.parts.blocks) if self.parts.blocks is not None else None
        self.dq = anchor.reduce_op == DQ
        self.constraints = key_constraints(self.parts.mask)
        (batch, heads, m, e), (n, ev) = grid(anchor)
        self.kv_heads = graph.nodes[anchor.inputs[1]].shape[1]
        self.group_size = int(heads) // int(self.kv_heads)
        self.sizes = (batch, heads, m, ev, n, e)
        hint = lambda s: ix.hint(s, graph.hints)  # noqa: E731
        self.config = self.config_for(target, anchor)
        self.block_e, self.block_ev = max(16, next_pow2(hint(e))), max(16, next_pow2(hint(ev)))

        def axis(name: str, size: ix.Size, block: int | None = None) -> Axis:
            masked = block is None or size != block
            return Axis(name, f"a{name}", (size,), (0,), f"{name}mask" if masked else "",
                        f"{name}zero")  # fmt: skip

        owner_heads = heads if self.dq else self.kv_heads
        self.bh = Axis("bh", "abh", (batch, owner_heads), (0, 1), "", "0")
        self.g = Axis("g", "ag", (self.group_size,), (0,), "", "0")
        # Positions along the score tile's columns and rows, and head dimensions.
        self.m, self.mv = axis("m", m), axis("mv", m)
        self.n, self.nv = axis("n", n), axis("nv", n)
        self.eq, self.ek = axis("eq", e, self.block_e), axis("ek", e, self.block_e)
        self.ev, self.evr = axis("ev", ev, self.block_ev), axis("evr", ev, self.block_ev)
        axes = (self.bh, self.g, self.m, self.mv, self.n, self.nv, self.eq, self.ek, self.ev,
                self.evr)  # fmt: skip
        self.e = Emitter(graph, group, axes)

    @staticmethod
    def config_for(target: Target, anchor: Node) -> AttentionConfig:
        """The tiles of ``anchor``'s kernel (:func:`grad_config`: the owned
        tile as ``block_m``)."""
        (_, _, m, e), (n, _) = grid(anchor)
        dq = anchor.reduce_op == DQ
        owned, walked = (m, n) if dq else (n, m)
        config = grad_config(target, int(owned), int(walked), int(e), anchor.dtype)
        blocks = grad_parts(anchor).blocks
        return block_tiles(config, Blocks.of(blocks) if blocks is not None else None, dq)

    @staticmethod
    def candidates(graph: Graph, anchor: Node, target: Target, launch: LaunchConfig) -> list:
        """Nothing is measured yet: the launch it was written with."""
        c = launch.constexprs
        owned, walked = ("BLOCK_M", "BLOCK_N") if anchor.reduce_op == DQ else ("BLOCK_N", "BLOCK_M")
        return [AttentionConfig(c[owned], c[walked], launch.num_warps, launch.num_stages)]

    @staticmethod
    def launch(anchor: Node, config: AttentionConfig) -> LaunchConfig:
        """One program per owned tile (query rows for dq, keys for dk/dv) of
        each (batch, head) of the node."""
        batch, heads, owned = anchor.shape[:3]
        grid_size = (ix.size(batch * heads * programs(owned, config.block_m)),)
        if anchor.reduce_op == DQ:
            constexprs = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n}
        else:
            constexprs = {"BLOCK_M": config.block_n, "BLOCK_N": config.block_m}
        return LaunchConfig(constexprs, grid_size, config.num_warps, config.num_stages)

    def program_loop(self) -> None:
        """None: ``predict`` reads the K loop from the kernel."""
        return None

    def work(self) -> tuple[dict[str, ix.Size], ix.Size]:
        """Three products per visited (row, key) point for dq (qk, dp, dq),
        four for dk/dv (qk, dp, dv, dk)."""
        batch, heads, m, ev, n, e = (ix.hint(s, self.graph.hints) for s in self.sizes)
        if self.dq:
            visited = visited_keys(self.constraints, m, n, self.config)
            return {}, 2 * batch * heads * visited * (2 * e + ev)
        visited = visited_keys(_transposed(self.constraints), n, m, self.config)
        return {}, 2 * batch * heads * visited * 2 * (e + ev)

    # ------------------------------------------------------------------ text
    def write(self) -> tuple[Emitter, LaunchConfig, ix.Size, ix.Size]:
        e = self.e
        batch, heads, m, _, n, emb = self.sizes
        owned = m if self.dq else n
        e.line(f"pid = {program_id(self.graph, batch * heads * owned)}")
        e.line(f"tiles = ({e.size_text(owned)} + {self.own_block} - 1) // {self.own_block}")
        e.line("bh = pid // tiles")
        e.index_variables(self.bh)
        e.line(f"first = (pid % tiles) * {self.own_block}")
        e.line(f"last = tl.minimum(first + {self.own_block}, {e.size_text(owned)}) - 1")
        for axis, rows in ((self.eq, False), (self.ek, True), (self.ev, False), (self.evr, True)):
            self.positions(axis, "0", rows)
        if self.dq:
            self.write_dq()
        else:
            self.write_dkdv()
        launch = self.launch(self.node, self.config)
        return e, launch, ix.numel(self.node.shape), n * emb

    @property
    def own_block(self) -> str:
        return "BLOCK_M" if self.dq else "BLOCK_N"

    def positions(self, axis: Axis, start: str, rows: bool) -> None:
        """The index variable of ``axis`` from ``start``: a column
        ``[1, BLOCK]`` or a row ``[BLOCK, 1]`` of positions."""
        block = self.block(axis)
        e = self.e
        e.line(
            f"{axis.name} = {start} + tl.arange(0, {block}){'[:, None]' if rows else '[None, :]'}"
        )
        if axis.mask:
            e.line(f"{axis.mask} = {axis.name} < {e.size_text(axis.numel)}")
        shape = f"[{block}, 1]" if rows else f"[1, {block}]"
        e.line(f"{axis.zero} = tl.full({shape}, 0, tl.int32)")
        e.index_variables(axis)

    def head(self) -> dict:
        """The query head (``i1``) and batch (``i0``) of the program."""
        i0, i1 = ix.out_symbols(2)
        b, h = self.bh.symbols
        if self.dq:
            return {i0: b, i1: h}
        if self.group_size == 1:
            return {i0: b, i1: h}
        return {i0: b, i1: h * self.group_size + self.g.symbols[0]}

    def tile_values(self, scope: Scope, at: dict, axes: frozenset[str]) -> tuple[str, str]:
        """The probabilities ``p`` and the score gradient ``dqk`` over the score
        tile, whose ``axes`` are (rows, columns) (``qk`` and ``dp`` computed,
        ``lse`` and ``delta`` loaded).  Positions past the walked sequence
        (the columns) are masked; the rows past theirs are never stored."""
        e = self.e
        scores = Scope(scope)
        scores.memo[QK] = "qk"
        e.values["qk"] = Value(QK, axes, torch.float32)
        score = self.scalar(self.parts.score, at, scores, torch.float32)
        mask = self.scalar(self.parts.mask, at, scores, torch.bool)
        walked = self.n if self.dq else self.m
        keep = " & ".join(x for x in (mask if mask != "True" else "", walked.mask) if x)
        lse = self.scalar(self.parts.lse, at, scores, torch.float32)
        delta = self.scalar(self.parts.delta, at, scores, torch.float32)
        e.line(f"keep = {keep} & ({lse} > float('-inf'))")
        e.line(f"p = tl.where(keep, tl.math.exp2(({score} - {lse}) * {LOG2E}), 0.0)")
        e.line(f"ds = p * (dp - {delta})")
        scores.memo[DS] = "ds"
        e.values["ds"] = Value(DS, axes, torch.float32)
        dscore = self.scalar(self.parts.dscore, at, scores, torch.float32)
        e.line(f"dqk = tl.where(keep, {dscore}, 0.0)")
        return "p", "dqk"

    def write_dq(self) -> None:
        e, p = self.e, self.parts
        _, _, _, _, n, _ = self.sizes
        r0, r1 = ix.reduce_symbols(2)
        i2, i3 = ix.out_symbols(4)[2:]
        head = self.head()
        (im,), (inn,) = self.m.symbols, self.n.symbols
        (ieq,), (iek,), (iev,), (ievr,) = (a.symbols for a in (self.eq, self.ek, self.ev, self.evr))
        top = Scope()
        self.positions(self.m, "first", rows=True)
        q = self.operand(p.q, {**head, i2: im, i3: ieq}, Scope(top), self.m, self.eq)
        do = self.operand(p.do, {**head, i2: im, r1: iev}, Scope(top), self.m, self.ev)
        e.line(f"dq = tl.full([BLOCK_M, {self.block_e}], 0, tl.float32)")
        loop_bounds(e, self.constraints, ("first", "last"), n, ("kv_start", "kv_end"), "BLOCK_N")
        depth = open_key_loops(e, self.graph, self.node, self.blocks, "kv", "first", head,
                               ("kv_start", "kv_end"), "noff", "BLOCK_N")  # fmt: skip
        self.positions(self.n, "noff", rows=False)
        loop = Scope(top)
        kt = self.operand(p.k, {**head, r0: inn, i3: iek}, Scope(loop), self.ek, self.n)
        vt = self.operand(p.v, {**head, r0: inn, r1: ievr}, Scope(loop), self.evr, self.n)
        e.line(f"qk = tl.dot({q}, {kt}{self.precision()})")
        e.line(f"dp = tl.dot({do}, {vt}{self.precision()})")
        _, dqk = self.tile_values(loop, {**head, i2: im, r0: inn}, frozenset({"m", "n"}))
        k_dtype = TL_DTYPES[p.k.dtype]
        e.line(f"dq += tl.dot({dqk}.to({k_dtype}), tl.trans({kt}){self.precision()})")
        e.indent -= depth
        node = self.members[DQ]
        rows = (*self.bh.symbols, im)
        e.define(node.name, "dq", frozenset({"m", "eq"}), torch.float32)
        e.store(node.name, (*rows, ieq), "dq", top, frozenset({"m", "eq"}))

    def write_dkdv(self) -> None:
        e, p = self.e, self.parts
        _, _, m, _, _, _ = self.sizes
        r0, r1 = ix.reduce_symbols(2)
        i2, i3 = ix.out_symbols(4)[2:]
        (im,), (imv,), (inv,) = self.m.symbols, self.mv.symbols, self.nv.symbols
        (ieq,), (iev,) = self.eq.symbols, self.ev.symbols
        top = Scope()
        self.positions(self.nv, "first", rows=True)
        b, hk = self.bh.symbols
        i0, i1 = ix.out_symbols(2)
        # k and v are read at the key/value head directly (the group's heads share it).
        kv_head = {i0: b, i1: hk * self.group_size}
        k = self.operand(p.k, {**kv_head, r0: inv, i3: ieq}, Scope(top), self.nv, self.eq)
        v = self.operand(p.v, {**kv_head, r0: inv, r1: iev}, Scope(top), self.nv, self.ev)
        e.line(f"dk = tl.full([BLOCK_N, {self.block_e}], 0, tl.float32)")
        e.line(f"dv = tl.full([BLOCK_N, {self.block_ev}], 0, tl.float32)")
        loop_bounds(e, _transposed(self.constraints), ("first", "last"), m,
                    ("q_start", "q_end"), "BLOCK_M")  # fmt: skip
        e.line(f"for g in range({self.group_size}):")
        e.indent += 1
        e.index_variables(self.g)
        head = self.head()
        depth = open_key_loops(e, self.graph, self.node, self.blocks, "q", "first", head,
                               ("q_start", "q_end"), "moff", "BLOCK_M")  # fmt: skip
        self.positions(self.m, "moff", rows=False)
        self.positions(self.mv, "moff", rows=True)
        loop = Scope(top)
        q = self.operand(p.q, {**head, i2: imv, i3: ieq}, Scope(loop), self.mv, self.eq)
        do = self.operand(p.do, {**head, i2: imv, r1: iev}, Scope(loop), self.mv, self.ev)
        e.line(f"qk = tl.dot({k}, tl.trans({q}){self.precision()})")
        e.line(f"dp = tl.dot({v}, tl.trans({do}){self.precision()})")
        # The score tile has keys along rows: its n symbol is the row axis's.
        prob, dqk = self.tile_values(loop, {**head, i2: im, r0: inv}, frozenset({"nv", "m"}))
        e.line(f"dv += tl.dot({prob}.to({TL_DTYPES[p.do.dtype]}), {do}{self.precision()})")
        e.line(f"dk += tl.dot({dqk}.to({TL_DTYPES[p.q.dtype]}), {q}{self.precision()})")
        e.indent -= depth + 1
        rows = (b, hk, inv)
        for op, value, column, axis in ((DK, "dk", ieq, "eq"), (DV, "dv", iev, "ev")):
            node = self.members.get(op)
            if node is None or node.name not in self.group.stored:
                continue
            axes = frozenset({"nv", axis})
            e.define(node.name, value, axes, torch.float32)
            e.store(node.name, (*rows, column), value, top, axes)

    def block(self, axis: Axis) -> str:
        sizes = {"m": "BLOCK_M", "mv": "BLOCK_M", "n": "BLOCK_N", "nv": "BLOCK_N",
                 "eq": self.block_e, "ek": self.block_e, "ev": self.block_ev,
                 "evr": self.block_ev}  # fmt: skip
        return str(sizes[axis.name])


def _transposed(constraints: list) -> list:
    """Constraints ``a * m + b * n + c >= 0`` read with the key as the row:
    ``(b, a, c)``, those that bound the query row (``a != 0``)."""
    return [(b, a, c) for a, b, c in constraints if a]
