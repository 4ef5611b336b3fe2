"""fp8 linear layers: e4m3 weights and activations, scaled per channel and row.

A linear layer ``x @ W.t() (+ bias)`` with a constant float weight ``W``
(``[N, K]``) becomes a GEMM over float8 e4m3 operands:

* the weight, once at compile time: ``ws[n] = max|W[n, :]| / 448`` (448 is
  e4m3's largest finite value) and ``wq = W / ws[n]`` rounded to e4m3, a
  constant of one byte per element;
* the activations, at run time (*dynamic* scaling): a reduction computes
  ``xs[m] = max(max|x[m, :]|, tiny) / 448`` per row, and ``xq = x / xs[m]``
  rounded to e4m3 (fusion puts it in the row-max kernel, which writes one
  byte per element: less than the GEMM's prologue would read of ``x``);
* ``tl.dot`` multiplies the e4m3 tiles into a float32 accumulator, and the
  epilogue applies both scales and the bias: ``dot * xs[m] * ws[n] + bias``.

Only GPUs with fp8 tensor cores run this (compute capability 8.9 or later);
the Triton interpreter's fp8 casts round wrongly, so the CPU checks are the
reference interpreter (which rounds with torch) and compiling for sm_90.
"""

from __future__ import annotations

import torch

from tilec import index as ix
from tilec.ir import Call, Const, Graph, Load, Node, View
from tilec.passes.matmul import as_dot, matmul_operands

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
# Scales are at least this, so an all-zero row or channel divides by something.
TINY = 1e-12


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 per-output-channel scales) of a ``[N, K]`` weight."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_min(TINY)
    return (w / scale[:, None]).to(E4M3), scale


def fp8_linear(graph: Graph, node: Node, weight: str, channel: int = 0) -> Graph:
    """``graph`` with linear layer ``node`` (an ``mm``/``addmm`` of activations
    ``[M, K]`` and a view of the constant ``weight``: ``[N, K]`` transposed,
    or with ``channel`` 1 a ``[K, N]`` weight as it is) over fp8 operands.
    The float weight stays until dead code elimination drops it (when nothing
    else reads it)."""
    _, x, _, _, _ = matmul_operands(node)
    values = graph.constants[weight]
    w_q, w_scale = quantize_weight(values if channel == 0 else values.t())
    n_out, k = w_q.shape
    rows = graph.nodes[x].shape[0]
    name = node.name
    i0, i1 = ix.out_symbols(2)
    (r0,) = ix.reduce_symbols(1)
    f32 = torch.float32

    def up(load: Load) -> Call | Load:
        return load if load.dtype == f32 else Call("cast", (load,), f32)

    x_dtype = graph.nodes[x].dtype
    wq = Node(f"{name}_wq", "constant", (n_out, k), E4M3)
    ws = Node(f"{name}_ws", "constant", (n_out,), f32)
    wq_t = Node(
        f"{name}_wq_t", "view", (k, n_out), E4M3, (wq.name,), view=View("permute", ((1, 0),))
    )
    amax = Node(
        f"{name}_xamax",
        "reduction",
        (rows,),
        f32,
        (x,),
        body=Call("abs", (up(Load(0, (i0, r0), x_dtype)),), f32),
        reduce_op="max",
        reduce_shape=(k,),
    )
    x_scale = Node(
        f"{name}_xs",
        "pointwise",
        (rows,),
        f32,
        (amax.name,),
        body=Call(
            "truediv",
            (Call("maximum", (Load(0, (i0,), f32), Const(TINY, f32)), f32), Const(E4M3_MAX, f32)),
            f32,
        ),
    )
    x_q = Node(
        f"{name}_xq",
        "pointwise",
        (rows, k),
        E4M3,
        (x, x_scale.name),
        body=Call(
            "cast",
            (Call("truediv", (up(Load(0, (i0, i1), x_dtype)), Load(1, (i0,), f32)), f32),),
            E4M3,
        ),
    )
    added = [wq, ws, wq_t, amax, x_scale, x_q]
    nodes: list[Node] = []
    for n in graph.nodes.values():
        if n.name == name:
            nodes += added
            staged = graph.replace_nodes([*nodes, n])
            staged.constants.update({wq.name: w_q, ws.name: w_scale})
            nodes += as_dot(staged, n, (x_q.name, wq_t.name), ((x_scale.name, -2), (ws.name, -1)))
        else:
            nodes.append(n)
    out = graph.replace_nodes(nodes)
    out.constants.update({wq.name: w_q, ws.name: w_scale})
    parameter = graph.constant_names.get(weight, weight)
    out.constant_names.update({wq.name: parameter, ws.name: parameter})
    return out
