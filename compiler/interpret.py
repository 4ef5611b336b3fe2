"""The reference interpreter: runs any IR graph with plain torch ops.

This is the semantics of record.  Every pass is tested as
``interpret(before) == interpret(after)``, and compiled programs are tested
against it and against eager torch.
"""

from __future__ import annotations

import sympy
import torch

from tilec import index as ix
from tilec.anchors import anchor_of
from tilec.ir import (
    CHECK_INDEX,
    Call,
    Const,
    Expr,
    Graph,
    Index,
    Load,
    Node,
    index_error,
    scatter_parts,
)
from tilec.scalar_ops import run_call, run_reduction


def interpret(graph: Graph, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``graph`` on ``inputs``; returns its outputs (literals included)."""
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"graph {graph.name} takes {len(graph.inputs)} inputs, got {len(inputs)}")
    env: dict[str, torch.Tensor] = dict(zip(graph.inputs, inputs))
    env.update(graph.constants)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    for node in graph.nodes.values():
        if node.name not in env:
            value = run_node(node, [env[i] for i in node.inputs], device)
            env[node.name] = _laid_out(node, value)
    return [
        graph.literal_outputs[k] if k in graph.literal_outputs else env[name]
        for k, name in enumerate(graph.outputs)
    ]


def run_node(node: Node, args: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if node.kind == "view":
        return node.view.apply(args[0], node.shape)
    if node.kind == "extern":
        return run_extern(node, args)
    if node.kind == "pointwise":
        symbols = ix.symbol_ranges(node.shape)
        env = _grid(symbols, device)
        value = eval_expr(node.body, args, env)
        return torch.broadcast_to(torch.as_tensor(value, device=device), node.shape).to(node.dtype)
    if node.kind == "reduction":
        anchor = anchor_of(node)
        if anchor is not None:
            env = _grid(ix.symbol_ranges(*anchor.grid(node)), device)
            return anchor.reference(node, lambda e, leaves=None: eval_expr(e, args, env, leaves))
        symbols = ix.symbol_ranges(node.shape, node.reduce_shape)
        env = _grid(symbols, device)
        full = (*node.shape, *node.reduce_shape)
        value = torch.broadcast_to(eval_expr(node.body, args, env), full)
        value = value.reshape(*node.shape, ix.numel(node.reduce_shape))
        return run_reduction(node.reduce_op, value, node.dtype)
    if node.kind == "scatter":
        return _scatter(node, args, device)
    raise ValueError(f"cannot run node kind {node.kind!r}")


def _laid_out(node: Node, value: torch.Tensor) -> torch.Tensor:
    """A computed node's value in its buffer's layout (``Node.stride``), as a
    compiled program stores it: views of it and graph outputs then have the
    strides the program gives them."""
    if node.kind not in ("pointwise", "reduction", "scatter") or node.stride is None:
        return value
    if value.stride() == tuple(node.stride):
        return value
    return torch.empty_strided(
        node.shape, node.stride, dtype=value.dtype, device=value.device
    ).copy_(value)


# How a scatter combines a value with what is at its position (None: replaces it).
_SCATTER_REDUCE = {"max": "amax", "min": "amin"}


def _scatter(node: Node, args: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The base with the values stored at their positions (which
    ``check_index`` keeps inside the node, see ``ir.scatter_parts``)."""
    env = _grid(ix.symbol_ranges(node.update_shape), device)
    value, position = scatter_parts(node)
    space = node.update_shape
    values = torch.broadcast_to(eval_expr(value, args, env).to(node.dtype), space)
    where = [torch.broadcast_to(eval_expr(c, args, env).long(), space) for c in position]
    out = args[0].to(node.dtype).clone()
    if node.reduce_op in (None, "sum"):
        return out.index_put_(tuple(where), values, accumulate=node.reduce_op == "sum")
    flat = sum(
        (c * s for c, s in zip(where, ix.contiguous_strides(node.shape))),
        torch.zeros_like(values, dtype=torch.long),
    )
    combined = out.reshape(-1).scatter_reduce(
        0, flat.reshape(-1), values.reshape(-1), _SCATTER_REDUCE[node.reduce_op]
    )
    return out.copy_(combined.view(node.shape))


def run_extern(node: Node, args: list[torch.Tensor]):
    from tilec.ir import Arg

    def bind(a):
        if isinstance(a, Arg):
            return args[a.position]
        if isinstance(a, (list, tuple)):
            return type(a)(bind(x) for x in a)
        return a

    call = node.extern
    return call.target(*bind(call.args), **{k: bind(v) for k, v in call.kwargs})


def _component(e, args, env, device) -> torch.Tensor:
    if isinstance(e, sympy.Expr):
        return torch.as_tensor(ix.evaluate_index(e, env), device=device)
    return eval_expr(e, args, env).long()


def _grid(ranges: dict, device: torch.device) -> dict:
    """Index tensors for every symbol, shaped to broadcast against each other."""
    rank = len(ranges)
    env = {}
    for k, (sym, size) in enumerate(ranges.items()):
        view = [1] * rank
        view[k] = size
        env[sym] = torch.arange(size, device=device).view(view)
    return env


def eval_expr(
    expr: Expr, args: list[torch.Tensor], env: dict, leaves: dict | None = None
) -> torch.Tensor:
    """``expr``'s value over the grid ``env``; ``leaves``: values of
    sub-expressions an anchor computes itself (attention's ``QK``)."""
    device = next(iter(env.values())).device if env else torch.device("cpu")
    if leaves and expr in leaves:
        return leaves[expr]
    if isinstance(expr, Const):
        return torch.tensor(expr.value, dtype=expr.dtype, device=device)
    if isinstance(expr, Index):
        return torch.as_tensor(ix.evaluate_index(expr.expr, env), device=device)
    if isinstance(expr, Load):
        src = args[expr.src]
        idx = [_component(e, args, env, device) for e in expr.index]
        if expr.mask is not None:
            mask = eval_expr(expr.mask, args, env)
            idx = [torch.where(mask, i, 0) for i in idx]
        if src.numel() == 0:
            shape = torch.broadcast_shapes(*(i.shape for i in idx)) if idx else ()
            return torch.zeros(shape, dtype=src.dtype, device=device)
        if not idx:
            return src
        idx = torch.broadcast_tensors(*idx)
        return src[tuple(idx)]
    if isinstance(expr, Call) and expr.op == CHECK_INDEX:
        return _check_index(expr, args, env)
    if isinstance(expr, Call):
        values = [eval_expr(a, args, env, leaves) for a in expr.args]
        return run_call(expr.op, values, expr.dtype)
    raise TypeError(f"not an expression: {expr!r}")


def _check_index(expr: Call, args: list[torch.Tensor], env: dict) -> torch.Tensor:
    """``check_index``: the index, or an IndexError naming the first one out of
    bounds.  Every position counts, also those a masked load does not read
    (lowering puts no gather under a mask)."""
    value, size, where = expr.args
    index = eval_expr(value, args, env)
    bad = (index < 0) | (index >= eval_expr(size, args, env))
    if bad.any():
        raise IndexError(index_error(where.value, int(index[bad].flatten()[0])))
    return index
