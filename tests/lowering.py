"""Build tilec IR from a torch function without ``torch.compile``.

The unit tiers test passes and codegen on IR graphs: this traces a function to
an ATen graph with tilec's decomposition table (as AOTAutograd does in the
backend) and lowers it with the lowering table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tilec.codegen.kernel import KernelSource, Target, write_kernel
from tilec.decompositions import decomposition_table
from tilec.ir import Graph
from tilec.lower import lower_graph
from tilec.lower_ops import RULES
from tilec.options import Options
from tilec.pipeline import passes


def aten_graph(fn: Callable, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    """``fn`` traced to decomposed ATen ops; the graph returns a tuple, as AOT graphs do."""

    def as_tuple(*args: torch.Tensor) -> tuple:
        out = fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    with torch.no_grad():
        return make_fx(as_tuple, decomposition_table=decomposition_table(), tracing_mode="fake")(
            *inputs
        )


def lower(fn: Callable, *inputs: torch.Tensor, rules: dict[Any, Callable] = RULES) -> Graph:
    """The lowered (not yet optimized) IR of ``fn`` on inputs shaped like ``inputs``."""
    graph, _ = lower_graph(aten_graph(fn, *inputs), "test", rules)
    return graph


def optimize(graph: Graph, options: Options | None = None) -> Graph:
    """``graph`` after the pipeline's pass list."""
    for _, run in passes(options or Options()):
        graph, _ = run(graph)
    return graph


def gpu_kernels(fn: Callable, *inputs: torch.Tensor) -> list[tuple[Graph, KernelSource]]:
    """The kernels tilec generates for ``fn`` when compiling for a GPU.

    Lowered with the full table, so ops that only a GPU can run (libdevice)
    appear too.
    """
    graph = optimize(lower(fn, *inputs))
    target = Target(interpret=False)
    return [(graph, write_kernel(graph, group, target)) for group in graph.groups]
