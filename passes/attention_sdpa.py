"""SDPA library calls routed to the attention template where it is predicted faster.

``scaled_dot_product_attention`` reaches tilec as one of torch's fused
attention ops (flash for the CPU, flash, memory-efficient or cuDNN on a
GPU), lowered as a library call.  That is the right call where the library
does the least work: no mask, or ``is_causal``, whose flash kernel skips
the masked half.  With a mask it is not: torch hands the library a
materialized ``(B, H|1, M, N)`` float mask (a boolean one becomes ``where(m,
0, -inf)`` in the graph first), which some kernel wrote and which the
library reads whole, and the library visits every key of every row.

This pass replaces such a call by the attention template
(``compiler/attention.py``): the mask's producers are inlined into the
score, so the template reads what the mask was computed from (a padding
vector, a boolean matrix, nothing at all for positions compared), and a
``-inf`` mask becomes the template's mask condition, whose linear
comparisons (causal, a window) let it skip key tiles.  GQA (``enable_gqa``:
fewer K/V heads) is indexed, not copied.  Rows with nothing unmasked give
0, as eager's SDPA does.

The call is replaced only where the result is the output alone (inference:
a training forward's log-sum-exp is saved for the library's backward),
without dropout, for operands the target's ``tl.dot`` takes with static
batch, heads and head dimensions (the query and key lengths may be
symbolic: a decode step's cache in the generic variant), and, on a
target with figures, where the cost model predicts the template (the tiles
it visits at its measured rate, plus what it reads) faster than the
library (every key at the library's attention rate, half of them for
``is_causal``, plus the materialized mask read and, where nothing else
reads it, the kernel that writes it), symbolic lengths at the graph's
hints.  The interpreter has no figures and always replaces, so the tests
run the template.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tilec import cost
from tilec import index as ix
from tilec.attention import (
    MAX_HEAD_DIM,
    QK,
    attention_nodes,
)
from tilec.attention import parts as attention_parts
from tilec.inline import Bound, BufferLoad, InlinedExpr, Inliner
from tilec.ir import Arg, Call, Const, Expr, Graph, Index, Load, Node, readers, view_base
from tilec.lower import broadcast_index
from tilec.passes.attention import (
    _dot_operands,
    _hoist_mask,
    _is_const,
    _producers,
    _uncast_expr,
    template_seconds,
)
from tilec.passes.dce import dce
from tilec.target import Target

aten = torch.ops.aten

# torch's fused attention ops (forward), by the name of their mask argument
# (None: they take none).
SDPA_FORWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_flash_attention.default: None,
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
}


def route_sdpa(
    graph: Graph, target: Target, enabled: bool = True, replayed: bool = False
) -> tuple[Graph, dict[str, int]]:
    """``graph`` with its SDPA library calls that the template does faster
    computed by attention nodes.  ``replayed``: the program is to run in
    CUDA graphs, where a library call over symbolic lengths would keep a
    generic program out of them (``Plan.sizes_refusal``): such a call is
    routed wherever the template takes it, unpriced."""
    routed = 0
    if enabled:
        for name in list(graph.nodes):
            node = graph.nodes.get(name)
            if node is None or node.kind != "extern" or node.extern.target not in SDPA_FORWARD:
                continue
            rewritten = _rewrite(graph, node, target, replayed)
            if rewritten is not None:
                graph, routed = rewritten, routed + 1
    return graph, {"sdpa_to_template": routed}


def _arguments(call: Node) -> dict:
    """The call's arguments by their schema names, tensors as nodes' names."""
    schema = call.extern.target._schema.arguments
    positional = [s.name for s in schema if not s.kwarg_only]
    named = {**dict(zip(positional, call.extern.args)), **dict(call.extern.kwargs)}
    defaults = {s.name: s.default_value for s in schema if s.has_default_value()}
    return {
        key: call.inputs[value.position] if isinstance(value, Arg) else value
        for key, value in {**defaults, **named}.items()
    }


def _rewrite(graph: Graph, call: Node, target: Target, replayed: bool) -> Graph | None:
    """``graph`` with SDPA library call ``call`` an attention node, or None."""
    unpacks = [n for n in graph.nodes.values() if n.kind == "extern" and call.name in n.inputs]
    if [u.extern.args[1] for u in unpacks] != [0]:
        return None  # the log-sum-exp (or more) is read: a training forward
    (result,) = unpacks
    args = _arguments(call)
    q, k, v = (graph.nodes[args[key]] for key in ("query", "key", "value"))
    if args.get("dropout_p", 0.0) != 0.0 or args.get("return_debug_mask", False):
        return None
    if not all(len(t.shape) == 4 and _static_except_length(t.shape) for t in (q, k, v)):
        return None
    if not _dot_operands(q, k, v, target) or max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return None
    if q.shape[1] % k.shape[1] or k.shape[0] not in (1, q.shape[0]):
        return None
    mask_key = SDPA_FORWARD[call.extern.target]
    mask_name = args.get(mask_key) if mask_key else None
    inputs: list[Node] = [q, k, v]
    i0, i1, i2, _ = ix.out_symbols(4)
    r0, _ = ix.reduce_symbols(2)
    scale = args.get("scale") or 1 / math.sqrt(q.shape[-1])
    score: Expr = Call("mul", (QK, Const(float(scale), torch.float32)), torch.float32)
    mask: Expr = Const(True, torch.bool)
    if args.get("is_causal"):
        # SDPA's causal mask is aligned at the top left: key j for row i <= j.
        mask = Call("le", (Index(r0), Index(i2)), torch.bool)
    if mask_name is not None:
        ranges = ix.symbol_ranges((*q.shape[:3], 1), (k.shape[2], 1))
        added = _mask_value(graph, mask_name, (i0, i1, i2, r0), ranges, inputs)
        score, mask = _masked(score, added, q.shape[2], k.shape[2])
    out, _ = attention_nodes((result.name, f"{result.name}_lse"), tuple(inputs), score, mask,
                             result.dtype)  # fmt: skip
    out = dataclasses.replace(out, stride=result.stride)
    causal = bool(args.get("is_causal")) and mask_name is None
    symbolic = not all(ix.is_static(t.shape) for t in (q, k, v))
    priced = cost.has_figures(target) and not (replayed and symbolic)
    if priced and not _pays(graph, call, out, mask_name, causal, target):
        return None
    nodes = [out if n.name == result.name else n for n in graph.nodes.values() if n is not call]
    rewritten, _ = dce(graph.replace_nodes(nodes))
    return rewritten


def _static_except_length(shape: tuple) -> bool:
    """Whether a 4-d operand's batch, heads and head dimension are static
    (its length, dimension 2, may be symbolic)."""
    return all(isinstance(shape[d], int) for d in (0, 1, 3))


def _mask_value(graph: Graph, name: str, at: tuple, ranges: dict, inputs: list[Node]) -> Expr:
    """The materialized mask ``name`` at attention position ``at`` as an
    expression over ``inputs`` (what it is computed from appended): its
    pointwise producers inlined, or, where they index by data, a load of it."""
    mask = graph.nodes[name]
    index = broadcast_index(mask.shape, at)
    group = _producers(graph, name, set())[0] | {view_base(graph, name)}
    inliner = Inliner(graph, group, ranges)
    value = inliner.value(name, index)
    if inliner.bindings:
        value = BufferLoad(name, index, mask.dtype)
    return _as_loads(value, graph, inputs)


def _as_loads(e: InlinedExpr, graph: Graph, inputs: list[Node]) -> Expr:
    """Inlined expression ``e`` with its buffer loads as loads of ``inputs``."""
    if isinstance(e, BufferLoad):
        buffer = graph.nodes[e.buffer]
        if buffer not in inputs:
            inputs.append(buffer)
        mask = None if e.mask is None else _as_loads(e.mask, graph, inputs)
        return Load(inputs.index(buffer), e.index, e.dtype, mask=mask)
    if isinstance(e, Call):
        return Call(e.op, tuple(_as_loads(a, graph, inputs) for a in e.args), e.dtype)
    assert not isinstance(e, Bound)  # bindings were refused above
    return e


def _masked(score: Expr, added: Expr, m: int, n: int) -> tuple[Expr, Expr]:
    """(score, mask) for an additive ``added`` mask: ``where(c, 0, -inf)``
    is mask ``c`` whatever ``c`` is (a row with nothing unmasked gives 0 in
    both); a lowest float in place of ``-inf`` only where every row keeps a
    position (:func:`passes.attention._hoist_mask`); anything else is added."""
    inner, _ = _uncast_expr(added)
    if isinstance(inner, Call) and inner.op == "where":
        cond, keep, drop = inner.args
        for c, a, b in ((cond, keep, drop), (Call("logical_not", (cond,), torch.bool), drop, keep)):
            if _is_const(a, 0.0) and _is_const(b, -math.inf):
                return score, c
    as_f32 = added if added.dtype == torch.float32 else Call("cast", (added,), torch.float32)
    return _hoist_mask(Call("add", (score, as_f32), torch.float32), m, n)


def _pays(
    graph: Graph, call: Node, out: Node, mask_name: str | None, causal: bool, target: Target
) -> bool:
    """Whether the template is predicted faster than the library call and
    the kernels writing the mask and operands it reads where only SDPA
    calls read them (each call credited its share of one that several
    read): a mask, or key/value heads expanded by hand for GQA (a copy),
    which the template reads through instead.  Symbolic lengths
    are priced at the graph's hints, as the template's tiles are chosen."""

    def hint(size: ix.Size) -> int:
        return ix.hint(size, graph.hints)

    template = template_seconds(graph, out, target)
    batch, heads, m, ev = (hint(s) for s in out.shape)
    n, e = (hint(s) for s in out.reduce_shape)
    full = 2 * batch * heads * m * n * (e + ev)
    operands = sum(hint(graph.nodes[i].nbytes) for i in call.inputs) + hint(out.nbytes)
    library = cost.attention(
        target, full / 2 if causal else full, operands, attention_parts(out).q.dtype
    ).seconds
    read_by = readers(graph)

    def computed_for_call(name: str) -> tuple[Node, int] | None:
        """The kernel that computes operand ``name`` for SDPA calls only,
        and how many calls share it (every layer's calls read one mask):
        routing alike calls alike, the kernel goes when they all do, so
        each call is credited its share."""
        base = graph.nodes[view_base(graph, name)]
        if base.kind in ("input", "constant"):
            return None
        calls = set(read_by[base.name])
        if not all(_is_sdpa(graph.nodes.get(r)) for r in calls):
            return None
        return base, len(calls)

    written = []
    for name in call.inputs[:3]:
        computed = computed_for_call(name)
        if computed is not None and computed[0].kind == "pointwise":
            base, shared = computed
            written.append((base, {view_base(graph, s) for s in base.inputs}, shared))
    mask = computed_for_call(mask_name) if mask_name is not None else None
    if mask is not None:
        base, shared = mask
        written.append((base, {n for n in out.inputs[3:] if n != base.name}, shared))
    for base, sources, shared in written:
        nbytes = hint(base.nbytes) + sum(hint(graph.nodes[s].nbytes) for s in sources)
        library += cost.kernel(target, nbytes).seconds / shared
    return template < library


def _is_sdpa(node: Node | None) -> bool:
    return node is not None and node.kind == "extern" and node.extern.target in SDPA_FORWARD
