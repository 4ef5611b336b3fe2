"""Build tilec IR from a torch function without ``torch.compile``.

The unit tiers test passes and codegen on IR graphs: this traces a function to
an ATen graph with tilec's decomposition table (as AOTAutograd does in the
backend) and lowers it with the lowering table.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import tilec
from tilec.codegen.kernel import KernelSource, write_kernel
from tilec.decompositions import decomposition_table
from tilec.freeze import Frozen, freeze_graph
from tilec.ir import Graph, is_free
from tilec.lower import lower_graph
from tilec.lower_ops import RULES
from tilec.options import Options
from tilec.passes.constant_fold import constant_valued
from tilec.pipeline import dependent_launch, passes
from tilec.target import H100_SXM, INTERPRETER, Target


def aten_graph(
    fn: Callable, *inputs: torch.Tensor, tracing_mode: str = "fake"
) -> torch.fx.GraphModule:
    """``fn`` traced to decomposed ATen ops; the graph returns a tuple, as AOT graphs do.
    ``tracing_mode="symbolic"`` gives every size a symbol (sizes 0 and 1 excepted)."""

    def as_tuple(*args: torch.Tensor) -> tuple:
        out = fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    with torch.no_grad():
        return make_fx(
            as_tuple, decomposition_table=decomposition_table(), tracing_mode=tracing_mode
        )(*inputs)


def lower(fn: Callable, *inputs: torch.Tensor, rules: dict[Any, Callable] = RULES) -> Graph:
    """The lowered (not yet optimized) IR of ``fn`` on inputs shaped like ``inputs``."""
    graph, _ = lower_graph(aten_graph(fn, *inputs), "test", rules)
    return graph


def lower_with_constants(
    fn: Callable, constants: tuple[torch.Tensor, ...], *inputs: torch.Tensor
) -> Graph:
    """The lowered IR of ``fn(*constants, *inputs)`` with ``constants`` captured
    as constants of the graph (as freezing captures parameters); the graph
    takes ``inputs``.  Each constant is named after ``fn``'s parameter (as
    freezing names a constant after the model's parameter; ``argN`` past
    ``fn``'s named parameters)."""
    gm = aten_graph(fn, *constants, *inputs)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in positional]
    frozen = {
        k: Frozen(names[k] if k < len(names) else f"arg{k}", t) for k, t in enumerate(constants)
    }
    gm, _, _ = freeze_graph(gm, [*constants, *inputs], frozen)
    graph, _ = lower_graph(gm, "test", RULES)
    return graph


def run_time_constants(graph: Graph) -> list[str]:
    """Nodes of ``graph`` that would compute a constant value at run time."""
    const = constant_valued(graph)
    return [
        n
        for n in const
        if graph.nodes[n].kind not in ("constant", "view") and not is_free(graph.nodes[n])
    ]


def new_programs(before: set[str]) -> list:
    """The compiled programs whose graph names are not in ``before``."""
    return [p for name, p in tilec.programs().items() if name not in before]


def optimize(graph: Graph, options: Options | None = None, gpu: bool = False) -> Graph:
    """``graph`` after the pipeline's pass list (for a GPU target: ``gpu``)."""
    for _, run in passes(options or Options(), H100_SXM if gpu else INTERPRETER):
        graph, _ = run(graph)
    return graph


def _shape_env(gm: torch.fx.GraphModule) -> ShapeEnv:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    raise ValueError("the graph has no symbolic sizes")


def gpu_kernels(
    fn: Callable,
    *inputs: torch.Tensor,
    generic: bool = False,
    options: Options | None = None,
    target: Target = H100_SXM,
    dynamic: Sequence[Sequence[int]] | None = None,
) -> list[tuple[Graph, KernelSource]]:
    """The kernels tilec generates for ``fn`` when compiling for a GPU
    (``target``: an H100 SXM with torch's default TF32 setting, off).

    Lowered with the full table, so ops that only a GPU can run (libdevice)
    appear too; written for programmatic dependent launch where
    ``options.pdl`` asks for it.  ``generic``: with symbolic sizes, as the generic variant is
    compiled (the sizes of ``inputs`` are only hints).
    """
    graph = gpu_graph(fn, *inputs, generic=generic, options=options, dynamic=dynamic)
    pdl = options is not None and dependent_launch(options, target)
    return [(graph, write_kernel(graph, group, target, pdl)) for group in graph.groups]


def gpu_graph(
    fn: Callable,
    *inputs: torch.Tensor,
    generic: bool = False,
    options: Options | None = None,
    dynamic: Sequence[Sequence[int]] | None = None,
) -> Graph:
    """The graph of :func:`gpu_kernels` after the GPU target's pass list.
    ``dynamic``: with ``generic``, the dimensions of each input that are
    symbolic, the others static (as Dynamo traces sizes that come from
    weights); by default every dimension but those of size 0 or 1."""
    if generic:
        if dynamic is None:
            gm = aten_graph(fn, *inputs, tracing_mode="symbolic")
        else:
            gm = aten_graph(fn, *_symbolic_fakes(inputs, dynamic))
        graph, _ = lower_graph(gm, "test", RULES, None)
        graph.hints = dict(_shape_env(gm).backed_var_to_val)
    else:
        graph = lower(fn, *inputs)
    return optimize(graph, options, gpu=True)


def _symbolic_fakes(
    inputs: Sequence[torch.Tensor], dynamic: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Fake tensors like ``inputs`` whose dimensions ``dynamic`` (per input)
    are symbolic, in one fake mode (``make_fx`` traces in it)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
        sizes = [DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    return [fake(t, dims) for t, dims in zip(inputs, dynamic, strict=True)]
