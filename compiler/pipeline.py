"""The pass list and the hand-off from IR to kernels and a runnable Program.

``PASSES`` is the documentation of the compiler: the passes run in this
order, each is dumped after it runs (``TILEC_DUMP`` / ``options["dump"]``)
and reports what it did into the compile summary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from tilec import stats as tilec_stats
from tilec.codegen.autotune import NO_DEVICE, Autotuner, tuner_for
from tilec.codegen.cache import load_module, write_source
from tilec.codegen.kernel import write_kernel
from tilec.codegen.record import record_kernel
from tilec.codegen.triton_ops import GPU_ONLY
from tilec.decisions import Decision
from tilec.interpret import interpret
from tilec.ir import CHECKS, Graph, format_graph
from tilec.lower import located_check_args, lower_graph
from tilec.lower_attention import RULES  # lower_ops' table, with attention's rules
from tilec.options import Options
from tilec.passes.attention import fuse_attention
from tilec.passes.attention_cache import read_cache_updates
from tilec.passes.attention_copies import read_through_copies
from tilec.passes.attention_sdpa import route_sdpa
from tilec.passes.attention_split import combine_in_kernel, split_attention
from tilec.passes.chain import chain
from tilec.passes.combine import combine
from tilec.passes.constant_fold import constant_bytes, constant_fold
from tilec.passes.cse import cse
from tilec.passes.dce import dce
from tilec.passes.fold_affine import fold_affine
from tilec.passes.fuse import fuse
from tilec.passes.in_place import write_in_place
from tilec.passes.layout import layout
from tilec.passes.matmul import Race, choose_matmul
from tilec.passes.memory_plan import memory_plan
from tilec.passes.merge_matmuls import merge_matmuls
from tilec.passes.quantize import quantize
from tilec.passes.simplify import simplify
from tilec.passes.split_k import split_k
from tilec.passes.split_reduction import split_reductions
from tilec.runtime.executors import GraphBackend
from tilec.runtime.program import Program
from tilec.target import INTERPRETER, Target

Pass = Callable[[Graph], tuple[Graph, dict[str, int]]]


def passes(
    options: Options,
    target: Target = INTERPRETER,
    race: Race | None = None,
    example_inputs: Sequence[Any] | None = None,
) -> list[tuple[str, Pass]]:
    """The pass list for kernels that run on ``target`` (matmul and layout
    choices); ``race``: measure library calls against templates (autotuning);
    ``example_inputs``: real inputs of the graph, for the quantization
    pass's error report (None: it measures on random inputs)."""
    gpu = not target.interpret
    matmul = functools.partial(
        choose_matmul,
        mode=options.matmul,
        target=target,
        race=race,
        replayed=options.cudagraphs,
        gemv_reduction=options.gemv_reduction,
    )
    quantizing = [
        (
            "quantize",
            functools.partial(
                quantize,
                scheme=options.quantize,
                group_size=options.quantize_group_size,
                skip=options.quantize_skip,
                head=options.quantize_head,
                example_inputs=example_inputs,
            ),
        )
    ]
    return [
        ("constant_fold", constant_fold),
        ("simplify", simplify),
        ("fold_affine", fold_affine),
        *(quantizing if options.quantize else []),
        ("merge_matmuls", functools.partial(merge_matmuls, enabled=options.fuse)),
        ("dce", dce),
        ("cse", cse),
        ("dce", dce),
        ("attention", functools.partial(fuse_attention, target=target, enabled=options.fuse)),
        (
            "attention_sdpa",
            functools.partial(
                route_sdpa, target=target, enabled=options.fuse, replayed=options.cudagraphs
            ),
        ),
        ("attention_cache", functools.partial(read_cache_updates, enabled=options.fuse)),
        ("attention_copies", functools.partial(read_through_copies, enabled=options.fuse)),
        (
            "attention_split",
            functools.partial(split_attention, target=target, chunks=options.attention_chunks),
        ),
        ("matmul", matmul),
        ("split_k", functools.partial(split_k, target=target, replayed=options.cudagraphs)),
        ("split_reduction", functools.partial(split_reductions, target=target)),
        ("fuse", functools.partial(fuse, enabled=options.fuse, target=target)),
        (
            "split_combine",
            functools.partial(combine_in_kernel, enabled=options.fuse and options.split_combine),
        ),
        ("layout", functools.partial(layout, mode=options.layout, gpu=gpu)),
        ("in_place", write_in_place),
        ("combine", functools.partial(combine, enabled=options.fuse)),
        ("chain", functools.partial(chain, enabled=options.chain)),
        ("memory_plan", memory_plan),
    ]


# Every live compiled Program by graph name (dump folder of a dumped graph:
# graphs are numbered per folder), for introspection (roofline reports).
_PROGRAMS: weakref.WeakValueDictionary[str, Program] = weakref.WeakValueDictionary()


def programs() -> dict[str, Program]:
    """The compiled programs still in use, by graph name (``000_inference``, ...),
    or by dump folder for graphs that are dumped (``dump/000_inference``)."""
    return dict(_PROGRAMS)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """How the compiled program will run: ``graphs``, the graph backend that
    captures and replays it (None: eagerly); ``static_inputs``, positions of
    inputs that keep their storage between calls; ``kind``: ``inference``,
    ``forward`` or ``backward``; ``notes``: files for the dump;
    ``direct_launch``: kernels launched without Triton's JIT dispatch after
    their first launch (:mod:`tilec.runtime.launcher`)."""

    graphs: GraphBackend | None = None
    static_inputs: frozenset[int] = frozenset()
    kind: str = "inference"
    # (file name, text) written into the graph's dump folder: a training
    # forward's split (``partition.txt``, ``tilec.partition``).
    notes: tuple[tuple[str, str], ...] = ()
    direct_launch: bool = False
    # A training forward's outputs that only its backward reads (the
    # activations it saves), by position (``Program``'s ``saved_outputs``).
    saved_outputs: frozenset[int] = frozenset()
    # A backward's inputs its forward lends (``Program``'s ``lent_inputs``).
    lent_inputs: frozenset[int] = frozenset()


def compile_graph(
    gm: torch.fx.GraphModule,
    name: str,
    device: torch.device,
    options: Options,
    symbol_values: dict | None = None,
    guards: tuple = (),
    generic: bool = False,
    runtime: Runtime = Runtime(),
    example_inputs: Sequence[Any] | None = None,
) -> Callable[..., list[Any]]:
    """ATen FX graph -> a callable that runs it with tilec's kernels.

    ``symbol_values``: the sizes a graph with symbolic sizes is specialized
    to, and ``guards`` the conditions that say so (dumped).  ``generic``:
    keep the sizes symbolic instead (``symbol_values`` are then only hints for
    tuning), for a Program called with ``sizes=``; its guards are its own.
    ``runtime``: graph capture and what it needs to know.  ``example_inputs``:
    the real inputs of the call that compiles it, where the backend has them
    (for the quantization pass's error report)."""
    target = Target.for_device(device)
    if generic and options.interpret:
        raise NotImplementedError("the IR interpreter runs graphs of static sizes only")
    summary: dict[str, Any] = {"graph": name, "device": str(device), "passes": []}
    dump = _Dumper(options.dump, name)
    for filename, text in runtime.notes:
        dump.text(filename, text)
    start = time.perf_counter()
    tuner = _autotuner(options, device, target, summary)
    pdl = dependent_launch(options, target, summary)
    graph, fallbacks = optimize_graph(
        gm, name, target, options, symbol_values, generic, summary, dump, tuner, example_inputs
    )
    if options.interpret:
        # Programs are called as program(*inputs); interpret takes a list.
        def program(*inputs: torch.Tensor) -> list[Any]:
            outputs = interpret(graph, list(inputs))
            for k, position in graph.mutations.items():
                inputs[position].copy_(outputs[k])
            return [o for k, o in enumerate(outputs) if k not in graph.mutations]

        kernel_count = 0
    else:
        t0 = time.perf_counter()
        kernels = {}
        for group in graph.groups:
            kernel = write_kernel(graph, group, target, pdl)
            path = write_source(kernel.source)
            record_kernel(graph, group, kernel, target)
            dump.text(f"kernels/{kernel.name}.py", kernel.source)
            fn = getattr(load_module(path, target.interpret), kernel.function)
            if tuner is not None:
                kernel = tuner.tune(graph, group, kernel, fn)
            kernels[group.name] = (kernel, fn)
        # The program's constants are real tensors on the device (a CPU
        # constant, as split_combine's counters, is copied to a GPU there),
        # made outside the tracer's fake tensor mode.
        with unset_fake_temporarily():
            program = Program(
                graph,
                kernels,
                device,
                runtime.graphs,
                runtime.static_inputs,
                runtime.kind,
                on_decision=lambda d: dump.text(
                    "cudagraphs.txt", f"{name}: graph {d.outcome}: {d.detail} [{d.reason}]\n"
                ),
                direct_launch=runtime.direct_launch,
                saved_outputs=runtime.saved_outputs,
                lent_inputs=runtime.lent_inputs,
            )
        summary["cudagraphs"] = program.cudagraphs
        if program.capture is not None:
            summary["decisions"].append(dataclasses.asdict(program.capture))
        if generic:
            guards = tuple(program.guards())
        _PROGRAMS[str(dump.dir or name)] = program
        kernel_count = len(kernels)
        summary["passes"].append({"name": "codegen", "seconds": time.perf_counter() - t0})
        dump.text("program.txt", program.describe)
        dump.text("program.py", program.plan.source)
    if tuner is not None:
        summary["autotune"] = tuner.summary()
        dump.text("autotune.txt", "".join(f"{line}\n" for line in tuner.report))
    summary["guards"] = [str(g) for g in guards]
    if guards:
        dump.text("guards.txt", "".join(f"{g}\n" for g in guards))
    externs = [n for n in graph.nodes.values() if n.kind == "extern"]
    library = sum(1 for n in externs if n.extern.role == "library")
    summary.update(
        kernels=kernel_count,
        extern_calls=library,
        fallbacks=fallbacks,
        seconds=time.perf_counter() - start,
    )
    tilec_stats.record_graph(kernel_count, library, fallbacks)
    dump.text("summary.json", lambda: json.dumps(summary, indent=2, default=str))
    dump.text("summary.txt", lambda: _format_summary(summary))
    return program


def optimize_graph(
    gm: torch.fx.GraphModule,
    name: str,
    target: Target,
    options: Options,
    symbol_values: dict | None = None,
    generic: bool = False,
    summary: dict[str, Any] | None = None,
    dump: _Dumper | None = None,
    tuner: Autotuner | None = None,
    example_inputs: Sequence[Any] | None = None,
) -> tuple[Graph, dict[str, int]]:
    """Lower ``gm`` for ``target`` and run the pass list: the graph whose groups
    codegen turns into kernels, and the fallback counts.  Per-pass times and
    counts go into ``summary``, each pass's graph into ``dump``; ``tuner``
    races library calls against templates."""
    summary = {"passes": []} if summary is None else summary
    dump = dump or _Dumper(None, name)
    start = time.perf_counter()
    rules = _rules_for(target)
    graph, fallbacks = lower_graph(gm, name, rules, None if generic else symbol_values or {})
    if generic:
        graph.hints = dict(symbol_values or {})
    summary["passes"].append({"name": "lower", "seconds": time.perf_counter() - start})
    dump.text("00-lowered.txt", functools.partial(format_graph, graph))
    summary["constant_bytes_lowered"] = constant_bytes(graph)
    race = None if tuner is None else tuner.race
    pass_list = passes(options, target, race, example_inputs)
    for k, (pass_name, run) in enumerate(pass_list, start=1):
        t0 = time.perf_counter()
        # Compilers run under the tracer's fake tensor mode; passes that fold
        # constants compute with the real ones.
        with unset_fake_temporarily():
            graph, counts = run(graph)
        summary["passes"].append({"name": pass_name, "seconds": time.perf_counter() - t0, **counts})
        dump.text(f"{k:02d}-{pass_name}.txt", functools.partial(format_graph, graph))
    summary["constant_bytes_final"] = constant_bytes(graph)
    summary["decisions"] = [dataclasses.asdict(d) for d in graph.decisions]
    return graph, fallbacks


def _autotuner(
    options: Options, device: torch.device, target: Target, summary: dict[str, Any]
) -> Autotuner | None:
    """The tuner of a graph compiled with ``autotune``, if kernels on ``device``
    (``target``) can be measured; the summary says what became of autotuning."""
    if not options.autotune:
        return None
    if options.interpret:
        summary["autotune"] = "off: the IR interpreter runs this graph (option interpret)"
        return None
    tuner = tuner_for(device, target)
    if tuner is None:
        summary["autotune"] = f"off: {NO_DEVICE}"
    return tuner


def dependent_launch(
    options: Options, target: Target, summary: dict[str, Any] | None = None
) -> bool:
    """Whether kernels are launched with programmatic dependent launch: the
    option ``pdl`` on a target that has it; ``summary`` (a compile's) says
    what became of the option where it was asked for."""
    summary = {} if summary is None else summary
    if not options.pdl:
        return False
    if options.interpret:
        summary["pdl"] = "off: the IR interpreter runs this graph (option interpret)"
        return False
    if not target.programmatic_launch:
        summary["pdl"] = (
            f"off: the {target.name} has no programmatic dependent launch (CUDA GPUs of "
            f"compute capability 9.0 or newer have it)"
        )
        return False
    summary["pdl"] = "on: every kernel launched with programmatic dependent launch"
    return True


def run_in_aten(
    gm: torch.fx.GraphModule, name: str, options: Options, reason: str
) -> Callable[..., Any]:
    """Run the whole ATen graph with torch, counting each op as a fallback."""
    fallbacks: dict[str, int] = {}
    for node in gm.graph.nodes:
        computes = isinstance(node.meta.get("val"), torch.Tensor | tuple | list)
        if node.op == "call_function" and (computes or "_local_scalar_dense" in str(node.target)):
            op = str(node.target)
            fallbacks[op] = fallbacks.get(op, 0) + 1
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in CHECKS:
            node.args = located_check_args(node, node.args)
    gm.recompile()
    tilec_stats.record_graph(0, 0, fallbacks)
    summary = {"graph": name, "runs_in_aten": reason, "kernels": 0, "fallbacks": fallbacks}
    dump = _Dumper(options.dump, name)
    dump.text("summary.json", json.dumps(summary, indent=2))
    dump.text("summary.txt", f"graph {name} runs in ATen: {reason}\nfallbacks: {fallbacks}\n")
    dump.text("00-aten.txt", functools.partial(gm.print_readable, print_output=False))
    return gm


@functools.cache
def _rules_for(target: Target) -> dict:
    """The lowering table for ``target``: its atomics for the scatters, its
    bf16 dot (attention), less the ops that need libdevice where there is none."""
    from tilec.lower_attention import for_target
    from tilec.lower_ops import BINARY_RULES, UNARY_RULES, with_atomics

    rules = for_target(with_atomics(RULES, target.atomics), target.bf16_dot)
    if target.libdevice:
        return rules
    table = {**UNARY_RULES, **BINARY_RULES}
    return {k: v for k, v in rules.items() if table.get(k) not in GPU_ONLY}


def _format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"graph {summary['graph']} on {summary['device']}",
        f"kernels: {summary['kernels']}  library calls: {summary['extern_calls']}  "
        f"fallbacks: {sum(summary['fallbacks'].values())} {summary['fallbacks'] or ''}",
        f"constants: {summary['constant_bytes_lowered']} bytes lowered, "
        f"{summary['constant_bytes_final']} bytes after folding",
        f"guards: {', '.join(summary['guards']) or 'none (static sizes)'}",
        f"graph capture: {summary.get('cudagraphs', 'off')}",
        f"autotune: {summary.get('autotune', 'off')}",
        f"programmatic dependent launch (pdl): {summary.get('pdl', 'off')}",
        f"compile time: {summary['seconds']:.3f}s",
    ]
    for p in summary["passes"]:
        extra = "  ".join(f"{k}={v}" for k, v in p.items() if k not in ("name", "seconds"))
        lines.append(f"  {p['name']:<14} {p['seconds'] * 1000:8.1f} ms  {extra}")
    quantization = [d for d in summary["decisions"] if d["stage"] == "quantize"]
    if quantization:
        lines.append("quantization:")
        lines += [f"  {Decision(**d).text()}" for d in quantization]
    return "\n".join(lines) + "\n"


class _Dumper:
    def __init__(self, root: str | None, name: str):
        self.dir = None if root is None else Path(root) / name

    def text(self, filename: str, text: str | Callable[[], str]) -> None:
        """Write ``text``, or what calling it returns: made only when dumping
        (formatting a graph after every pass is a tenth of a compile)."""
        if self.dir is None:
            return
        path = self.dir / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text() if callable(text) else text)
