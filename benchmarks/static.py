"""Static GPU performance report: tilec against Inductor's GPU code, without a GPU.

    python -m benchmarks.static --model NAME|all --size tiny|full --batch N \\
        --dtype float32|bf16 [--train] [--out DIR] [--no-inductor]

Compiles each zoo model for inference (with ``--train``: its training step,
forward, loss, backward and an AdamW step, dropout on; ``training_step``)
for an H100 (sm_90) on this machine and runs none of the kernels.  For tilec: every kernel's bytes read and written
and FLOPs (from codegen), launch parameters, and its sm_90 compilation with
the specializations a real launch gets (registers, spills, shared memory,
theoretical occupancy, share of 128-bit global loads and stores).  For
Inductor: the Triton kernels it generates for the same model with a GPU
target (``benchmarks/inductor_gpu.py``), their bytes and launches.  Per model:
launches, library calls, kernel bytes against an ideal lower bound (every
input and weight read once, every output written once, each library operand
written once and each library result read once), distinct kernel sources,
and a predicted H100 time for each side from tilec's cost model
(``compiler/cost.py``, the one the compiler decides with, on the H100 SXM
target's figures, ``compiler/target.py``): tilec's GEMM templates at the
template's rate with their own tiles, library calls at the library's rate
for their operands' dtype, on both sides alike.

Everything it prints is a PREDICTION FROM STATIC ANALYSIS, not a GPU timing.
Writes ``report.json`` (every number), ``report.md`` and ``report.png`` to
``--out`` (default ``static-report/<size>-b<batch>-<dtype>`` under the current
directory: a report joins the committed ones in ``benchmarks/results/static``
only when ``--out`` says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import triton
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.inductor_gpu import (
    InductorKernel,
    InductorReport,
    as_on_the_gpu,
    inductor_gpu_kernels,
    inductor_gpu_step,
    zeros_for_outputs,
)
from benchmarks.measure import DTYPES
from benchmarks.sm90 import H100, compile_kernel
from benchmarks.zoo import MODELS
from tilec import cost
from tilec.anchors import anchor_of
from tilec.backend import prepare_graph, through_aot_autograd
from tilec.codegen.kernel import KernelSource, write_kernel
from tilec.codegen.record import kernel_entry
from tilec.codegen.templates import WRITERS
from tilec.freeze import freeze_graph, frozen_inputs
from tilec.ir import Arg, Graph, Node, view_base
from tilec.options import Options
from tilec.partition import Split
from tilec.pipeline import dependent_launch, optimize_graph
from tilec.target import TEMPLATE_SOURCE, Figure, Target

GPU = H100
# Where reports go without --out: under the current directory, not beside the
# committed reports (benchmarks/results/static), which a run should not overwrite.
DEFAULT_OUT = Path("static-report")
NOTICE = (
    "PREDICTIONS FROM STATIC ANALYSIS: nothing ran on a GPU. Kernels were generated and "
    "compiled for sm_90 on a CPU-only machine; times come from tilec's cost model (compiler/cost.py) below."
)


def _constant(figure: Figure | None) -> tuple[float, str]:
    assert figure is not None, "the static report's target has every figure"
    return figure.value, f"{figure.basis}: {figure.source}"


# The cost model's figures on the report's target: name -> (value, where it comes from).
CONSTANTS: dict[str, tuple[float, str]] = {
    "memory_bytes_per_s": _constant(GPU.memory_bandwidth),
    **{
        f"gemm_flops_per_s_{kind}": _constant(GPU.peak_flops(dtype))
        for kind, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32))
    },
    **{
        f"template_flops_per_s_{kind}": _constant(GPU.peak_flops(dtype, template=True))
        for kind, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32))
    },
    "attention_flops_per_s": _constant(GPU.attention_flops),
    "launch_s": _constant(GPU.launch_s),
    "round_trip_s": _constant(GPU.round_trip_s),
    "few_row_step_s": _constant(GPU.few_row_step_s),
    "library_few_row_share": _constant(GPU.library_few_row_share),
    "sm_count": (GPU.sm_count, GPU.limits_source),
}
RULES = (
    "A kernel or library call takes the larger of its memory time (bytes read + written over "
    "the copy bandwidth) and its compute time, plus one launch. GEMMs compute at the rate of "
    "their operands' dtype divided by their wave efficiency (output tiles over whole waves of "
    f"{GPU.sm_count} SMs); tilec's templates with their own tiles at the template rate "
    f"({TEMPLATE_SOURCE}), library calls at the library's rate ({cost.LIBRARY_WAVES}); "
    "fused attention (SDPA) at the attention rate, at most the GEMM rate of its dtype. A "
    "template's K loop takes at least one memory round trip per num_stages - 1 steps "
    f"({cost.ASYNC_STEPS}), or with tiles of at most {cost.FEW_ROWS} rows the measured "
    "few-row step time per step; a template's tiles run in waves (as many per SM as their "
    "pipelines' shared memory allows), their loops one wave after another, their bytes at the "
    "share of the bandwidth each wave's programs reach; the library's GEMVs (at most "
    f"{cost.FEW_ROWS} FLOPs a byte) at its measured share of the bandwidth."
)
# The library's fused attention ops (SDPA), priced at the attention rate.
ATTENTION_OPS = frozenset(
    str(op)
    for op in (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    )
)


@dataclasses.dataclass
class Captured:
    """One graph tilec compiled for the GPU target."""

    graph: Graph
    kernels: list[KernelSource]
    fallbacks: dict[str, int]


def tilec_graphs(
    model: Callable[..., Any], inputs: tuple[torch.Tensor, ...], options: Options | None = None
) -> list[Captured]:
    """tilec's optimized graphs and GPU kernels for ``model(*inputs)``
    (inference) with ``options`` (default: tilec's defaults; with
    ``freeze``, parameters and buffers are frozen as the backend freezes
    them, which quantization needs).  Nothing is computed: each graph
    returns zeros of its outputs' shapes."""

    def run(backend: Callable[..., Any]) -> None:
        with torch.no_grad():
            torch.compile(model, backend=backend)(*inputs)

    captured, _ = tilec_step(run, options)
    return captured


def tilec_step(
    run: Callable[[Callable[..., Any]], None], options: Options | None = None
) -> tuple[list[Captured], list[Split]]:
    """tilec's optimized graphs and GPU kernels for whatever ``run(backend)``
    compiles with ``backend`` (a Dynamo backend) and calls, and the split of
    each joint graph it trains (``tilec.partition``): a training step is
    ``run`` compiling the forward and loss, calling ``backward()`` on the
    loss (AOTAutograd compiles the backward then) and compiling the
    optimizer's step.  The graphs are prepared and split as tilec's backend
    prepares and splits them; nothing is computed: each graph returns zeros
    of its outputs' shapes (gradients too)."""
    options = options or Options()
    captured: list[Captured] = []
    splits: list[Split] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        frozen = frozen_inputs(gm, example_inputs) if options.freeze else {}
        prepare_graph(gm, example_inputs, options)

        def compiler(kind: str) -> Callable[..., Any]:
            def compile_for_gpu(aten_gm: torch.fx.GraphModule, aten_inputs: list) -> Any:
                name = f"{len(captured):03d}_{kind}"
                zeros = zeros_for_outputs(aten_gm)
                if frozen and kind != "backward":
                    aten_gm, _, _ = freeze_graph(aten_gm, aten_inputs, frozen)
                graph, fallbacks = optimize_graph(aten_gm, name, GPU, options)
                pdl = dependent_launch(options, GPU)
                kernels = [write_kernel(graph, group, GPU, pdl) for group in graph.groups]
                captured.append(Captured(graph, kernels, fallbacks))
                return make_boxed_func(zeros)

            return compile_for_gpu

        return through_aot_autograd(gm, example_inputs, options, compiler, splits)

    torch._dynamo.reset()
    try:
        run(capture)
    finally:
        torch._dynamo.reset()
    return captured, splits


def ideal_bytes(graph: Graph, kernels: list[KernelSource]) -> int:
    """The least traffic any kernels for ``graph`` can have: each input, weight
    and library result they read, read once (only the elements some kernel
    needs: an embedding lookup reads rows, not the table); each output and
    library operand they compute, written once."""

    def computed(name: str) -> bool:
        return graph.nodes[name].kind in ("pointwise", "reduction")

    read, written = set(), set()
    for node in graph.nodes.values():
        bases = {view_base(graph, i) for i in node.inputs}
        if computed(node.name):
            read |= {b for b in bases if not computed(b)}
        elif node.kind == "extern":
            written |= {b for b in bases if computed(b)}
    outputs = {view_base(graph, o) for o in graph.outputs if o}
    written |= {o for o in outputs if computed(o)}
    needed = {b: max(k.reads.get(b, 0) for k in kernels) for b in read}
    return sum(needed.values()) + sum(int(graph.nodes[n].nbytes) for n in written)


def library_calls(graph: Graph) -> list[dict[str, Any]]:
    """Each library call of ``graph`` (matmul, convolution, attention) with its
    FLOPs (torch's flop counter on meta tensors) and operand bytes."""
    calls = []
    for node in graph.nodes.values():
        if node.kind != "extern" or node.extern.role != "library":
            continue
        operands = [graph.nodes[i] for i in node.inputs]
        args, kwargs = _meta_args(node.extern.args, dict(node.extern.kwargs), operands)
        with FlopCounterMode(display=False) as counter:
            as_on_the_gpu(node.extern.target)(*args, **kwargs)
        nbytes = sum(int(o.nbytes) for o in operands) + _output_bytes(graph, node)
        calls.append(
            {
                "graph": graph.name,
                "op": str(node.extern.target),
                "flops": counter.get_total_flops(),
                "bytes": nbytes,
                # a call without operands (a dropout's seed draw): its result's
                "dtype": str((operands or [node])[0].dtype),
            }
        )
    return calls


def templated_matmuls(graph: Graph) -> list[dict[str, Any]]:
    """Each library call tilec replaced by a template kernel (a GEMM
    template's dot reduction; ``compiler/anchors.py``), as that call: its
    FLOPs, operand and result bytes.  Inductor calls the library for these,
    so they are priced on its side."""
    calls = []
    for name, node in graph.nodes.items():
        anchor = anchor_of(node)
        if anchor is not None:
            work = anchor.work(graph, node)
            calls.append(
                {
                    "op": f"{anchor.kind} template {name}",
                    "flops": work.flops,
                    "bytes": work.nbytes,
                    "dtype": str(work.dtype),
                }
            )
    return calls


def _meta_args(args: tuple, kwargs: dict, operands: list[Node]) -> tuple[Any, Any]:
    """The call's arguments with each ``Arg`` replaced by a meta tensor of its operand."""

    def meta(a: Any) -> Any:
        if not isinstance(a, Arg):
            return a
        o = operands[a.position]
        return torch.empty_strided(o.shape, o.buffer_stride, dtype=o.dtype, device="meta")

    return pytree.tree_map(meta, (args, kwargs), is_leaf=lambda a: isinstance(a, Arg))


def _output_bytes(graph: Graph, node: Node) -> int:
    if node.shape != () or node.stride is not None:
        return int(node.nbytes)
    # A call returning several tensors: its unpack nodes hold them.
    unpacks = [n for n in graph.nodes.values() if n.kind == "extern" and node.name in n.inputs]
    return sum(int(u.nbytes) for u in unpacks if u.extern.role == "unpack")


def kernel_prediction(kernel: KernelSource, target: Target = GPU) -> cost.Prediction:
    """The cost model's prediction of one launch of a tilec kernel: a
    template's kernel as its writer prices it (a GEMM over its grid's tiles
    at the template's rate), any other kernel by its bytes and FLOPs."""
    writer = WRITERS.get(kernel.template)
    if writer is not None:
        return writer.predict(kernel, target)
    if kernel.stages:  # a chain: each stage as the kernel it would be alone
        return cost.chain(target, [_parts_prediction(stage, target) for stage in kernel.stages])
    return _parts_prediction((kernel,), target)


def _parts_prediction(parts: tuple[KernelSource, ...], target: Target) -> cost.Prediction:
    """Kernels side by side in one launch (one kernel, or a combination's
    parts) by their bytes and FLOPs over their programs together."""
    programs = sum(math.prod(int(g) for g in k.launch.grid) for k in parts)
    nbytes = sum(k.bytes_read + k.bytes_written for k in parts)
    return cost.kernel(target, nbytes, sum(k.flops for k in parts), programs=programs)


def programs_overcounted(kernel: KernelSource, compiled: dict[str, Any]) -> list[int] | None:
    """``[counted, compiled]`` where the cost model counts more programs of
    a GEMM kernel an SM (``GemmConfig.k_loop``, its waves) than its sm_90
    compile (:func:`benchmarks.sm90.compile_kernel`'s ``compiled``: its
    registers and shared memory) lets run; else None."""
    loop = kernel.program_loop if kernel.template == "gemm" and compiled["ok"] else None
    if loop is None or "registers" not in compiled:
        return None
    held = cost.resident_programs(
        GPU, compiled["shared"], kernel.launch.num_warps, compiled["registers"]
    )
    return [loop.resident, held] if loop.resident > held else None


def _dtype(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    return getattr(torch, name.removeprefix("torch."))


def library_predictions(calls: list[dict[str, Any]]) -> list[cost.Prediction]:
    """The cost model's prediction of each library call: attention at the
    attention rate, the others at the library's GEMM rate for their operands
    (a call without FLOPs as a copy of its bytes)."""

    def predict(c: dict[str, Any]) -> cost.Prediction:
        dtype = _dtype(c["dtype"])
        if not c["flops"]:  # no arithmetic (a dropout's seed draw): its bytes and launch
            return cost.kernel(GPU, c["bytes"])
        if c["op"] in ATTENTION_OPS:
            return cost.attention(GPU, c["flops"], c["bytes"], dtype)
        convolution = "convolution" in c["op"]
        return cost.gemm(
            GPU, c["flops"], c["bytes"], dtype, template=False, convolution=convolution
        )

    return [predict(c) for c in calls]


def library_time(calls: list[dict[str, Any]]) -> float:
    """Predicted seconds of the library calls (:func:`library_predictions`)."""
    return sum(p.seconds for p in library_predictions(calls))


def compile_all(entries: list[dict[str, Any]], jobs: int) -> list[dict[str, Any]]:
    """sm_90 results for ``entries``; identical kernels (same source and launch
    specialization) are compiled once."""
    unique = {json.dumps(e, sort_keys=True): e for e in entries}
    todo = list(unique.values())
    # A fresh Triton cache: a cache hit skips ptxas, and with it the register
    # and spill report.  (Workers inherit the variable.)
    with (
        tempfile.TemporaryDirectory(prefix="tilec-static-") as triton_cache,
        mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": triton_cache}),
    ):
        if jobs <= 1 or len(todo) < 8:
            done = [compile_kernel(e) for e in todo]
        else:
            # spawn, not fork: the parent has torch's thread pools running.
            with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
                done = list(pool.map(compile_kernel, todo, chunksize=2))
    results = dict(zip(unique, done))
    return [results[json.dumps(e, sort_keys=True)] for e in entries]


def tilec_side(captured: list[Captured], jobs: int) -> dict[str, Any]:
    """Per-kernel rows (with sm_90 compilation) and per-model totals for tilec."""
    entries, rows = [], []
    for c in captured:
        for kernel in c.kernels:
            entries.append(kernel_entry(c.graph, kernel.group, kernel, GPU))
            rows.append(
                {
                    "graph": c.graph.name,
                    "kernel": kernel.name,
                    "function": kernel.function,
                    "template": kernel.template,
                    "group": kernel.group.reason,
                    "bytes_read": kernel.bytes_read,
                    "bytes_written": kernel.bytes_written,
                    "flops": kernel.flops,
                    "constexprs": kernel.launch.constexprs,
                    "num_warps": kernel.launch.num_warps,
                    "num_stages": kernel.launch.num_stages,
                }
            )
    kernels = [kernel for c in captured for kernel in c.kernels]
    predictions = [kernel_prediction(kernel) for kernel in kernels]
    compiled = compile_all(entries, jobs)
    for row, kernel, result, predicted in zip(rows, kernels, compiled, predictions):
        row.update({k: v for k, v in result.items() if k not in ("name", "path")})
        row["predicted_s"] = predicted.seconds
        row["bound"] = predicted.bound
        row["programs_overcounted"] = programs_overcounted(kernel, result)
    calls = [call for c in captured for call in library_calls(c.graph)]
    fallbacks: dict[str, int] = {}
    for c in captured:
        for op, n in c.fallbacks.items():
            fallbacks[op] = fallbacks.get(op, 0) + n
    return {
        "kernels": rows,
        "launches": len(rows),
        "distinct_sources": len({e["source"] for e in entries}),
        "kernel_bytes": sum(r["bytes_read"] + r["bytes_written"] for r in rows),
        "ideal_bytes": sum(ideal_bytes(c.graph, c.kernels) for c in captured),
        "library_calls": calls,
        "templated_matmuls": [m for c in captured for m in templated_matmuls(c.graph)],
        "fallbacks": fallbacks,
        "failed_compiles": [r["kernel"] for r in rows if not r["ok"]],
        "spilling_kernels": [r["kernel"] for r in rows if r.get("spill_bytes")],
        "overcounted_kernels": [r["kernel"] for r in rows if r["programs_overcounted"]],
        "kernel_s": sum(r["predicted_s"] for r in rows),
    }


def inductor_bytes(kernel: InductorKernel) -> tuple[int | None, str | None]:
    """Bytes per launch of one of Inductor's kernels, and where they come
    from: the kernel's own estimate (``InductorKernel.kernel_bytes``: the
    positions its accesses reach), else its scheduler's count (which counts
    a buffer of a fused node whole: a gathered embedding table, a cache
    written in place), else unknown."""
    if kernel.kernel_bytes is not None:
        return kernel.kernel_bytes, "kernel"
    if kernel.bytes is not None:
        return kernel.bytes, "scheduler"
    return None, None


def inductor_side(report: InductorReport) -> dict[str, Any]:
    """Per-kernel rows and per-model totals for Inductor's Triton kernels
    (:func:`inductor_bytes`; a kernel with no byte count is listed, and makes
    the totals unknown rather than low)."""
    rows = []
    for k in report.kernels:
        nbytes, source = inductor_bytes(k)
        rows.append(
            {
                "kernel": k.name,
                "bytes": nbytes,
                "bytes_from": source,
                "launches": k.launches,
                "predicted_s": None
                if nbytes is None
                else k.launches * cost.kernel(GPU, nbytes).seconds,
            }
        )
    known = all(r["bytes"] is not None for r in rows)
    return {
        "kernels": rows,
        "launches": sum(r["launches"] for r in rows),
        "scheduler_counted": sum(r["bytes_from"] == "scheduler" for r in rows),
        "distinct_sources": len({k.source for k in report.kernels}),
        "kernel_bytes": sum(r["bytes"] * r["launches"] for r in rows) if known else None,
        "extern_calls": report.extern_calls,
        "kernel_s": sum(r["predicted_s"] for r in rows) if known else None,
    }


def training_step(
    model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
) -> Callable[[Callable[..., Any]], None]:
    """The zoo's training step as a ``run`` for :func:`tilec_step` and
    ``inductor_gpu_step``: the forward and its loss (the mean square of the
    output, in float32, as ``benchmarks.run`` trains) compiled as one
    function, ``backward()``, and AdamW's step (torch's multi-tensor
    implementation, its default for CUDA tensors) compiled.  The optimizer's
    state is made by one eager step first, as every step but the first finds
    it; the gradients are cleared before each run."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()

    def loss(*tensors: torch.Tensor) -> torch.Tensor:
        return model(*tensors).float().pow(2).mean()

    def run(backend: Callable[..., Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.compile(loss, backend=backend)(*inputs).backward()
        with torch.no_grad():
            torch.compile(optimizer.step, backend=backend)()

    return run


TRAINING_STEP = (
    "model in train mode (dropout on, batch statistics), loss = mean of the output squared "
    "(float32), backward, AdamW step (foreach) on every parameter, in the model's dtype; "
    "the forward and loss are one compiled function, the optimizer step another."
)
# The phase of a training step each of tilec's graph kinds is.
PHASES = {"forward": "forward", "backward": "backward", "inference": "optimizer"}


def report_model(
    name: str, size: str, batch: int, dtype: str, jobs: int, inductor: bool, train: bool = False
) -> dict:
    """One model's row of the report: its inference, or with ``train`` its
    training step (:func:`training_step`, in train mode: dropout on)."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.build(size).model.to(dtype=DTYPES[dtype])
    model.train(train)
    inputs = tuple(
        t.to(DTYPES[dtype]) if t.is_floating_point() else t
        for t in spec.inputs(size, batch, torch.Generator().manual_seed(0))
    )
    if train:
        step = training_step(model, inputs)
        compile_tilec = lambda: tilec_step(step)  # noqa: E731
        compile_inductor = lambda: inductor_gpu_step(step)  # noqa: E731
    else:
        compile_tilec = lambda: (tilec_graphs(model, inputs), [])  # noqa: E731
        compile_inductor = lambda: inductor_gpu_kernels(model, inputs)  # noqa: E731
    t0 = time.perf_counter()
    captured, splits = compile_tilec()
    tilec = tilec_side(captured, jobs)
    result: dict[str, Any] = {"model": name, "tilec": tilec, "tilec_seconds": 0.0}
    result["tilec_seconds"] = time.perf_counter() - t0
    library_s = library_time(tilec["library_calls"])
    result["library_s"] = library_s
    result["tilec_predicted_s"] = tilec["kernel_s"] + library_s
    if train:
        result["phases_s"] = phase_times(captured, tilec)
        result["activations"] = {
            "saved_bytes": sum(x.saved_bytes for x in splits),
            "save_all_bytes": sum(x.save_all_bytes for x in splits),
            "recomputed_ops": sum(len(x.recomputed) for x in splits),
        }
    if inductor:
        t0 = time.perf_counter()
        ind = inductor_side(compile_inductor())
        result["inductor"] = ind
        result["inductor_seconds"] = time.perf_counter() - t0
        # Inductor calls the library for every matmul, also those tilec
        # wrote as GEMM templates; its own count of launches.
        calls = tilec["library_calls"] + tilec["templated_matmuls"]
        extra = (ind["extern_calls"] - len(calls)) * CONSTANTS["launch_s"][0]
        if ind["kernel_s"] is not None:
            ind_library_s = library_time(calls)
            result["inductor_predicted_s"] = ind["kernel_s"] + ind_library_s + extra
            result["ratio"] = result["tilec_predicted_s"] / result["inductor_predicted_s"]
    return result


def phase_times(captured: list[Captured], tilec: dict[str, Any]) -> dict[str, float]:
    """tilec's predicted seconds per phase of a training step (forward,
    backward, optimizer): its kernels' and its library calls'."""
    phases: dict[str, float] = {}
    for c in captured:
        phase = PHASES[c.graph.name.split("_", 1)[1]]
        kernels = sum(k["predicted_s"] for k in tilec["kernels"] if k["graph"] == c.graph.name)
        calls = [call for call in tilec["library_calls"] if call["graph"] == c.graph.name]
        seconds = kernels + library_time(calls)
        phases[phase] = phases.get(phase, 0.0) + seconds
    return phases


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    what = "training step" if meta.get("train") else "models"
    lines = [
        f"# Static GPU report: {meta['size']} {what}, batch {meta['batch']}, {meta['dtype']}",
        "",
        f"**{NOTICE}**",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}; torch {meta['torch']}, triton {meta['triton']}; target sm_90.",
        "",
        "| model | launches tilec / Inductor | library tilec / extern Inductor | "
        "kernel kB tilec / Inductor / ideal | distinct sources tilec / Inductor | "
        "spills | programs an SM counted > compiled | predicted us tilec / Inductor | "
        "tilec/Inductor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        t, i = r["tilec"], r.get("inductor") or {}
        lines.append(
            f"| {r['model']} | {t['launches']} / {_num(i.get('launches'))} "
            f"| {len(t['library_calls'])} / {_num(i.get('extern_calls'))} "
            f"| {_num(t['kernel_bytes'], 1e-3)} / {_num(i.get('kernel_bytes'), 1e-3)} "
            f"/ {_num(t['ideal_bytes'], 1e-3)} "
            f"| {t['distinct_sources']} / {_num(i.get('distinct_sources'))} "
            f"| {len(t['spilling_kernels'])} | {len(t['overcounted_kernels'])} "
            f"| {_num(r['tilec_predicted_s'], 1e6)} / {_num(r.get('inductor_predicted_s'), 1e6)} "
            f"| {_num(r.get('ratio'), 1, '.2f')} |"
        )
    if meta.get("train"):
        lines += training_table(results)
    lines += ["", "## tilec's costliest kernels per model (predicted)", ""]
    lines += [
        "A kernel is one source (one compiled function); its cost is summed over every "
        "launch of it in the model.",
        "",
        "| model | kernel (launches) | group | bytes per launch | XBLOCK x RBLOCK, warps "
        "| registers | spills | occupancy | 128-bit loads / stores | predicted us, all launches |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        for k, launches, total_s in costliest(r["tilec"]["kernels"]):
            lines.append(
                f"| {r['model']} | {k['graph']}:{k['kernel']} ({launches}) | {k['group'][:40]} "
                f"| {k['bytes_read'] + k['bytes_written']} "
                f"| {' x '.join(map(str, k['constexprs'].values()))}, {k['num_warps']} "
                f"| {k.get('registers', '?')} "
                f"| {k.get('spill_bytes', 0)} | {k.get('occupancy', float('nan')):.2f} "
                f"| {k.get('loads_128', 0)}/{k.get('loads', 0)}, "
                f"{k.get('stores_128', 0)}/{k.get('stores', 0)} "
                f"| {1e6 * total_s:.2f} |"
            )
    lines += ["", "## The model", ""]
    lines += [f"- `{k}` = {v:g}: {why}" for k, (v, why) in CONSTANTS.items()]
    lines += [
        f"- The cost model (compiler/cost.py, what the compiler decides with): {RULES}",
        "- A tilec kernel's bytes are codegen's count of distinct elements its loads touch and "
        "its stores write; an Inductor kernel's are, per launch, the positions its accesses "
        "reach (Inductor's per-kernel estimate bounded by each index's loop ranges), or, "
        "for a kernel without that estimate (a combo kernel), Inductor's scheduler's count "
        "(the report's JSON says which: `bytes_from`).",
        "- Library calls (matmul, convolution, attention) are tilec's, costed on both sides "
        "alike; the matmuls tilec wrote as GEMM templates are library calls on Inductor's "
        "side; Inductor pays a launch for each extern call it makes beyond that count.",
        "- Ideal bytes: every input and weight the kernels read, read once; every output and "
        "library operand they compute, written once; every library result they read, read once.",
    ]
    return "\n".join(lines) + "\n"


def training_table(results: list[dict[str, Any]]) -> list[str]:
    """The training step's own rows: tilec's predicted time per phase, the
    activations the forward saves for the backward, and what falls back."""
    lines = [
        "",
        "## The training step in tilec (predicted)",
        "",
        f"The step: {TRAINING_STEP}",
        "",
        "| model | forward / backward / optimizer us | activations saved kB, min-cut "
        "/ saving all | ops recomputed in the backward | fallbacks |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results:
        phases, saved = r["phases_s"], r["activations"]
        fallbacks = ", ".join(f"{op} x{n}" for op, n in r["tilec"]["fallbacks"].items())
        lines.append(
            f"| {r['model']} | "
            + " / ".join(_num(phases.get(p), 1e6) for p in ("forward", "backward", "optimizer"))
            + f" | {_num(saved['saved_bytes'], 1e-3)} / {_num(saved['save_all_bytes'], 1e-3)} "
            f"| {saved['recomputed_ops']} | {fallbacks or 'none'} |"
        )
    return lines


def costliest(
    kernels: list[dict[str, Any]], count: int = 3
) -> list[tuple[dict[str, Any], int, float]]:
    """The ``count`` kernel sources that cost most, summed over their launches:
    (first launch's row, launches, predicted seconds of all launches)."""
    by_source: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in kernels:
        by_source.setdefault((k["graph"], k["function"]), []).append(k)
    ranked = sorted(by_source.values(), key=lambda ks: -sum(k["predicted_s"] for k in ks))
    return [(ks[0], len(ks), sum(k["predicted_s"] for k in ks)) for ks in ranked[:count]]


def _num(value: float | None, scale: float | None = None, fmt: str = ".1f") -> str:
    """A table cell: ``value`` as it is, or ``value * scale`` formatted with
    ``fmt``; ``-`` where there is no value."""
    if value is None:
        return "-"
    return str(value) if scale is None else format(value * scale, fmt)


def plot(results: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["model"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = list(range(len(results)))
    left.bar(x, [r.get("ratio") or float("nan") for r in results], color="tab:blue")
    left.set_ylabel("predicted H100 time, tilec / Inductor")
    for offset, side, label in ((-0.2, "tilec", "tilec"), (0.2, "inductor", "Inductor")):
        moved = [(r.get(side) or {}).get("kernel_bytes") or float("nan") for r in results]
        ideal = [max(r["tilec"]["ideal_bytes"], 1) for r in results]
        right.bar([i + offset for i in x], [m / i for m, i in zip(moved, ideal)], 0.4, label=label)
    right.set_ylabel("kernel bytes / ideal bytes")
    right.legend()
    for ax in (left, right):
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(x, names, rotation=45, ha="right")
    fig.suptitle(
        f"PREDICTED from static analysis (no GPU ran): {meta['size']}, batch {meta['batch']}, "
        f"{meta['dtype']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--decode" in argv:  # a decode step's report: benchmarks/static_decode.py
        from benchmarks.static_decode import main as decode_main

        return decode_main([a for a in argv if a != "--decode"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="all",
        help="zoo models, comma-separated, or all of them (default: %(default)s): "
        f"{', '.join(sorted(MODELS))}",
    )
    parser.add_argument(
        "--size",
        choices=("tiny", "full"),
        default="tiny",
        help="model configuration (default: %(default)s)",
    )
    parser.add_argument("--batch", type=int, default=2, help="batch size (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bf16"),
        default="float32",
        help="dtype of the weights and floating-point inputs (default: %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory to write report.json, report.md and report.png to (default: "
        f"{DEFAULT_OUT}/[train-]SIZE-bBATCH-DTYPE under the current directory; the committed "
        "reports are in benchmarks/results/static)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="processes compiling kernels for sm_90 (default: %(default)s)",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="the training step (forward, loss, backward, AdamW step; dropout on) "
        "instead of inference",
    )
    parser.add_argument(
        "--no-inductor",
        action="store_true",
        help="tilec's side only: skip generating Inductor's GPU kernels for comparison",
    )
    args = parser.parse_args(argv)
    names = sorted(MODELS) if args.model == "all" else args.model.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; known: all, {', '.join(sorted(MODELS))}")
    kind = "train-" if args.train else ""
    out = args.out or DEFAULT_OUT / f"{kind}{args.size}-b{args.batch}-{args.dtype}"
    torch.backends.mha.set_fastpath_enabled(False)  # the real graph, not one fused op
    print(NOTICE)
    print(f"writing the report to {out.resolve()}")
    meta = {
        "notice": NOTICE,
        "command": "python -m benchmarks.static " + " ".join(argv or sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "size": args.size,
        "batch": args.batch,
        "dtype": args.dtype,
        "train": args.train,
        "constants": {k: {"value": v, "source": why} for k, (v, why) in CONSTANTS.items()},
    }
    results: list[dict[str, Any]] = []
    for name in names:
        try:
            r = report_model(
                name,
                args.size,
                args.batch,
                args.dtype,
                args.jobs,
                not args.no_inductor,
                train=args.train,
            )
        except Exception as err:  # one model that fails is one line, not the end of the report
            print(f"{name}: FAILED {type(err).__name__}: {err}"[:500])
            results.append({"model": name, "error": f"{type(err).__name__}: {err}"[:2000]})
        else:
            results.append(r)
            t, i = r["tilec"], r.get("inductor") or {}
            print(
                f"{name}: tilec {t['launches']} launches, {t['kernel_bytes']} kernel bytes "
                f"(ideal {t['ideal_bytes']}), predicted {_num(r['tilec_predicted_s'], 1e6)} us; "
                f"Inductor {_num(i.get('launches'))} launches, {_num(i.get('kernel_bytes'))} "
                f"bytes, predicted {_num(r.get('inductor_predicted_s'), 1e6)} us; "
                f"ratio {_num(r.get('ratio'), 1, '.2f')}"
            )
        # After every model: an interrupted run keeps what it measured.
        write_report(results, meta, out)
    print(f"wrote {out.resolve()}/report.json, report.md, report.png")
    return 1 if any("error" in r for r in results) else 0


def write_report(results: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    ok = [r for r in results if "error" not in r]
    text = markdown(ok, meta)
    text += "".join(f"\n{r['model']}: FAILED {r['error']}\n" for r in results if "error" in r)
    (out / "report.md").write_text(text)
    if ok:
        plot(ok, meta, out / "report.png")


if __name__ == "__main__":
    sys.exit(main())
