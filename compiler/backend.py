"""The ``torch.compile`` entry: ``torch.compile(model, backend="tilec")``.

Dynamo hands over a torch-level FX graph; AOTAutograd (with tilec's
decomposition table) turns it into functional ATen graphs: one inference
graph under ``torch.no_grad()``, or forward and backward graphs for
training.  Each is compiled by :func:`tilec.pipeline.compile_graph`.
With ``options={"freeze": True}`` parameters and buffers become constants
(:mod:`tilec.freeze`).

Graphs with symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic
shapes after a size changed) run one generic program with symbolic sizes,
and a set of size values seen often enough gets its own specialized
program, chosen by its guards (:mod:`tilec.guards`).  A graph whose
sizes depend on data computed inside it runs in ATen as a whole, every op
counted as a fallback.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from tilec.attention_training import rewrite_attention
from tilec.decompositions import decomposition_table, replace_wrong_composites
from tilec.freeze import drop_frozen, freeze_graph, frozen_inputs
from tilec.guards import Dispatcher, policy_for
from tilec.lower import graph_device
from tilec.options import Options, check_target
from tilec.partition import Split, partition_fn, saved_outputs
from tilec.pipeline import Runtime, compile_graph, run_in_aten
from tilec.runtime.executors import CudaGraphs, GraphBackend, StandInGraphs
from tilec.target import Target

# Graph numbers, counted per dump folder (None: graphs not dumped), so each
# folder's graphs are 000_..., 001_..., whatever else the process compiled.
_graph_ids: collections.defaultdict[str | None, itertools.count] = collections.defaultdict(
    itertools.count
)


def tilec_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    *,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable:
    """Dynamo backend: compile ``gm`` with tilec."""
    opts = Options.from_user(mode, options)
    prepare_graph(gm, example_inputs, opts)
    device = graph_device(gm)
    check_target(opts, Target.for_device(device))
    frozen = frozen_inputs(gm, example_inputs) if opts.freeze else {}
    # One graph backend (and so one memory pool) for this model's programs.
    graphs = _graph_backend(device) if opts.cudagraphs else None
    splits: list[Split] = []  # the joint graph's split, before its forward compiles
    # Dynamo's real inputs, for freezing, held only while AOTAutograd compiles
    # the forward: the backward's compiler, which autograd's graph keeps, must
    # not hold them.  An input the graph writes has a grad_fn leading back to
    # that graph: through autograd's C++ edges, a cycle the garbage collector
    # cannot see, and the programs, the inputs and their gradients would live
    # as long as the process.
    real_inputs = list(example_inputs) if frozen else []
    # The names of the activations the forward's program lends (returned as
    # its graph's memory): the backward reads its inputs of those names
    # where they lie (``Runtime.lent_inputs``).
    lent: set[str] = set()

    def compiler(kind: str):
        def compile_aten(aten_gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable:
            folder = None if opts.dump is None else os.path.abspath(opts.dump)
            name = f"{next(_graph_ids[folder]):03d}_{kind}"
            # The forward's split, in each of its variants' dump folders.
            notes = (("partition.txt", splits[-1].text()),) if kind == "forward" and splits else ()
            static = _static_inputs(aten_gm, kind)
            saved = saved_outputs(aten_gm) if kind == "forward" else frozenset()
            borrowed = _named_inputs(aten_gm, lent) if kind == "backward" else frozenset()
            run = Runtime(graphs, static, kind, notes, opts.direct_launch, saved, borrowed)
            if frozen and kind != "backward":
                aten_gm, inputs, keep = freeze_graph(aten_gm, inputs, frozen)
                run = dataclasses.replace(
                    run,
                    static_inputs=frozenset(
                        i for i, k in enumerate(keep) if k in run.static_inputs
                    ),
                )
                # Dynamo's inputs are real tensors, AOTAutograd's fake ones.
                example = [real_inputs[k] for k in keep]
                program = _specializing(aten_gm, inputs, name, opts, run, example)
                lent.update(_lent_names(program, aten_gm))
                return make_boxed_func(drop_frozen(program, keep))
            program = _specializing(aten_gm, inputs, name, opts, run)
            lent.update(_lent_names(program, aten_gm))
            return make_boxed_func(program)

        return compile_aten

    try:
        return through_aot_autograd(gm, example_inputs, opts, compiler, splits)
    finally:
        real_inputs.clear()


def _lent_names(program: Callable, gm: torch.fx.GraphModule) -> set[str]:
    """The names of ``gm``'s outputs that ``program``, compiled from it,
    lends (``Program.lent_outputs``: a training forward's activations
    returned as its graph's memory; none for other programs)."""
    positions = getattr(program, "lent_outputs", frozenset())
    if not positions:
        return set()
    (output,) = gm.graph.find_nodes(op="output")
    return {a.name for k, a in enumerate(output.args[0]) if k in positions and hasattr(a, "name")}


def _named_inputs(gm: torch.fx.GraphModule, names: set[str]) -> frozenset[int]:
    """Positions of ``gm``'s inputs named ``names``."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return frozenset(k for k, n in enumerate(placeholders) if n.name in names)


def prepare_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], opts: Options) -> None:
    """Rewrite Dynamo's graph as tilec compiles it, in place, before
    AOTAutograd traces it: torch composites that trace wrongly pointed at
    tilec's own, and (training) attention matched as SDPA before
    AOTAutograd saves the probabilities for the backward."""
    replace_wrong_composites(gm)
    if opts.fuse and trains(example_inputs):
        rewrite_attention(gm)


def through_aot_autograd(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    opts: Options,
    compiler: Callable[[str], Callable],
    splits: list[Split],
) -> Callable:
    """``gm`` through AOTAutograd as tilec compiles it: ``compiler(kind)``
    compiles each ATen graph (``forward``, ``backward``, ``inference``),
    with tilec's decompositions and option ``partitioner``'s split (each
    recorded in ``splits``)."""
    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=decomposition_table(),
        partition_fn=partition_fn(opts.partitioner, splits),
        # Input mutations (a KV cache, BatchNorm's running statistics) stay
        # in the graph as copy_ into the input: tilec writes them.
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def trains(example_inputs: list[Any]) -> bool:
    """Whether AOTAutograd will build a backward for these inputs."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def _graph_backend(device: torch.device) -> GraphBackend:
    return CudaGraphs() if device.type == "cuda" else StandInGraphs()


def _static_inputs(gm: torch.fx.GraphModule, kind: str) -> frozenset[int]:
    """Positions of the inputs of ``gm`` (an ATen graph of ``kind``) that keep
    their storage between calls: those AOTAutograd says are (parameters and
    buffers; its indices are the forward's).  A backward's inputs are what
    the forward saved and the tangents: a forward input saved as it is
    keeps its placeholder name (``primals_3`` is the forward's third
    input), so the static ones are found by name; the other saved values
    are new tensors every step."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    indices = getattr(meta, "static_input_indices", None) or ()
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if kind == "backward":
        static = {f"primals_{k + 1}" for k in indices}
        return frozenset(k for k, name in enumerate(names) if name in static)
    return frozenset(k for k in indices if k < len(names))


def _specializing(
    gm: torch.fx.GraphModule,
    inputs: list[Any],
    name: str,
    opts: Options,
    run: Runtime,
    example: list[Any] | None = None,
) -> Callable:
    device = graph_device(gm)
    unbacked = _data_dependent_sizes(gm)
    if unbacked:
        return run_in_aten(gm, name, opts, f"data-dependent sizes {', '.join(unbacked)}")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbolic = any(_is_symbolic(n.meta.get("val")) for n in placeholders)
    if not symbolic:
        return compile_graph(gm, name, device, opts, runtime=run, example_inputs=example)

    def compile_variant(values: dict, guards: tuple, index: int) -> Callable:
        return compile_graph(gm, f"{name}_{index}", device, opts, values, guards, runtime=run)

    def compile_generic(values: dict) -> Callable:
        return compile_graph(gm, f"{name}_generic", device, opts, values, generic=True, runtime=run)

    policy = policy_for(opts.specialize, opts.max_specializations, opts.hot_after)
    return Dispatcher(name, placeholders, compile_variant, policy, compile_generic)


def _data_dependent_sizes(gm: torch.fx.GraphModule) -> list[str]:
    """Sizes only known once the graph runs (``nonzero``, ``.item()`` under
    ``capture_scalar_outputs``): tilec's kernels are specialized to sizes
    known before the call."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        found |= {str(s) for s in free_unbacked_symbols(node.meta.get("val"))}
        # A size a check pinned (``torch._check(z.size(0) == 4)``) shows as
        # the number in the fake tensors, but the op still decides it per
        # call: only the graph's own checks, run in ATen, catch another value.
        found |= {str(s) for s in node.meta.get("unbacked_bindings") or ()}
    return sorted(found)


def _is_symbolic(val: Any) -> bool:
    if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
        return True
    if isinstance(val, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
    return False
