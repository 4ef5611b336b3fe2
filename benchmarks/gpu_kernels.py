"""The ``gpu_check`` sections that time tilec's programs themselves:
``gemms`` (the Triton GEMM template against cuBLAS), ``launch`` (host cost per
launch, with and without CUDA graphs) and ``kernels`` (each zoo model's
costliest kernels against :func:`benchmarks.gpu_check.predicted_seconds`).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

import tilec
from benchmarks.gpu_check import predicted_seconds
from benchmarks.gpu_timing import (
    Section,
    capture_launches,
    failure,
    release,
    rotations,
    time_calls,
    time_launch,
    time_loop,
)
from benchmarks.measure import DTYPES
from benchmarks.zoo import MODELS
from benchmarks.zoo_gemms import zoo_gemms
from tilec.anchors import anchors_in
from tilec.codegen.gemm import gemm_launch
from tilec.gemm import SMALL_M, GemmConfig
from tilec.target import Target


def _new_programs(before: set[str]) -> dict[str, Any]:
    return {name: p for name, p in tilec.programs().items() if name not in before}


def _inputs(s: Section, name: str) -> tuple[torch.Tensor, ...]:
    dtype = DTYPES[s.cfg["dtype"]]
    made = MODELS[name].inputs(s.cfg["size"], 1, torch.Generator().manual_seed(0))
    return tuple(t.to(s.device, dtype if t.is_floating_point() else t.dtype) for t in made)


# --------------------------------------------------------------- 3. GEMMs


def gemms(s: Section) -> None:
    """cuBLAS against tilec's Triton GEMM template, each timed alone: first
    the decode step's products (``decode``: a row against an ``nn.Linear``
    weight, ``[N, K]``, as ``F.linear``; those of one row also as sum
    reductions, the option ``gemv_reduction``), then the zoo's GEMM shapes
    (``torch.mm``)."""
    shapes, failed = zoo_gemms(s.cfg["size"], s.cfg["dtype"], s.cfg["shapes"])
    decode = [
        {"m": m, "n": n, "k": k, "dtype": s.cfg["dtype"], "models": ["decode"], "linear": True}
        for m, n, k in s.cfg.get("decode", [])
    ]
    s.data.update(shape_errors=failed, rows=[])
    for shape in decode + shapes:
        if s.out_of_time(s.cfg["item_min_s"], f"{shape['m']}x{shape['n']}x{shape['k']}"):
            continue
        dtype, linear = DTYPES[shape["dtype"]], shape.get("linear", False)
        try:
            row = {**shape, **_gemm(s, shape["m"], shape["n"], shape["k"], dtype, linear)}
        except Exception:
            row = {**shape, "error": failure()}
        s.data["rows"].append(row)
        s.save()
        release()


def _gemm(
    s: Section, m: int, n: int, k: int, dtype: torch.dtype, linear: bool = False
) -> dict[str, Any]:
    """One product timed by cuBLAS and by the template: ``x @ w`` with ``w``
    ``[k, n]`` (``torch.mm``), or with ``linear`` ``F.linear(x, w)``, ``w``
    ``[n, k]`` (a layer's weight, K contiguous)."""
    cfg, device = s.cfg, s.device
    torch.manual_seed(0)
    count = rotations((m * k + k * n + m * n) * dtype.itemsize, cfg["max_input_sets"])
    weight = (n, k) if linear else (k, n)
    sets = [
        (
            torch.randn(m, k, device=device, dtype=dtype),
            torch.randn(*weight, device=device, dtype=dtype),
        )
        for _ in range(count)
    ]
    fn = torch.nn.functional.linear if linear else torch.mm
    library = time_calls(lambda i: fn(*sets[i % count]), device, cfg["runs"], cfg["warmup"])
    torch._dynamo.reset()
    before = set(tilec.programs())
    t0 = time.perf_counter()
    mm = torch.compile(fn, backend="tilec", dynamic=False, options={"matmul": "triton"})
    out = mm(*sets[0])
    compile_s = time.perf_counter() - t0
    (program,) = _new_programs(before).values()
    (step,) = [step for step in program.launches() if step.kernel.template == "gemm"]
    launcher, args = capture_launches(program, lambda: program(*sets[0]))[step.kernel.name]
    template = time_launch(launcher, args, device, cfg["runs"], cfg["warmup"], count)
    variants = cfg.get("variants", {}).get(f"{m}x{n}x{k}") if linear else None
    if variants is not None:
        variants = _variants(s, program.graph, step, args, k, count, variants)
    x, w = sets[0]
    reference = x.float() @ (w.float().t() if linear else w.float())
    scale = reference.abs().max().item()
    flops = 2 * m * n * k
    reduction = {}
    if linear and m == 1:
        reduction = _reduction(s, fn, sets, count, reference, scale)
    return (
        reduction
        | {
            "library": library,
            "template": template,
            "template_predicted_s": predicted_seconds(step.kernel),
            "template_compile_s": compile_s,
            "template_launch": launch_record(step),
            "library_tflops": flops / library["median_s"] / 1e12,
            "template_tflops": flops / template["median_s"] / 1e12,
            "template_vs_library": library["median_s"] / template["median_s"],
            "template_rel_error": (out.float() - reference).abs().max().item() / scale,
            "library_rel_error": (fn(*sets[0]).float() - reference).abs().max().item() / scale,
        }
        | ({"variants": variants} if variants is not None else {})
    )


def _reduction(
    s: Section, fn: Any, sets: list, count: int, reference: torch.Tensor, scale: float
) -> dict[str, Any]:
    """A one-row product compiled with the option ``gemv_reduction`` (a sum
    reduction, not the template) and its kernel timed alone, beside the
    cost model's time of it and its error."""
    torch._dynamo.reset()
    before = set(tilec.programs())
    options = {"matmul": "triton", "gemv_reduction": True}
    out = torch.compile(fn, backend="tilec", dynamic=False, options=options)(*sets[0])
    (program,) = _new_programs(before).values()
    (step,) = program.launches()
    launcher, args = capture_launches(program, lambda: program(*sets[0]))[step.kernel.name]
    cfg = s.cfg
    timed = time_launch(launcher, args, s.device, cfg["runs"], cfg["warmup"], count)
    return {
        "reduction": timed,
        "reduction_predicted_s": predicted_seconds(step.kernel),
        "reduction_launch": launch_record(step),
        "reduction_rel_error": (out.float() - reference).abs().max().item() / scale,
    }


def _variants(
    s: Section, graph: Any, step: Any, args: tuple, k: int, count: int, variants: list[list[int]]
) -> list[dict[str, Any]]:
    """The template's kernel relaunched with each of ``variants``
    (``[BLOCK_N, BLOCK_K, warps, stages]``, 16-row tiles; the same source,
    so only K steps that divide K), each timed alone: what a decode GEMV's
    K step costs by its width, stages, warps and columns (the cost model's
    ``few_row_step_s`` is one slope over 16 x 16 x 512 tiles of 8 stages),
    and whether fewer stages, more programs an SM, take fewer waves."""
    cfg = s.cfg
    (_, dot), *_ = anchors_in(graph, step.kernel.group.nodes)
    # The template's own results (its last timed launch), which each
    # variant's must match: a variant that computed something else would
    # time the wrong thing.
    outputs = [i for i, a in enumerate(step.kernel.args) if a.is_output]
    expected = [args[i].float().clone() for i in outputs]
    rows = []
    for block_n, block_k, warps, stages in variants:
        row: dict[str, Any] = {"config": [block_n, block_k, warps, stages], "steps": k // block_k}
        if k % block_k:
            rows.append(row | {"error": f"BLOCK_K {block_k} does not divide K {k}"})
            continue
        launch = gemm_launch(dot, GemmConfig(SMALL_M, block_n, block_k, warps, stages))
        grid = tuple(int(g) for g in launch.grid)

        def run(*a: Any, _grid: tuple = grid, _options: dict = launch.options) -> Any:
            return step.fn[_grid](*a, **_options)

        try:
            row |= time_launch(run, args, s.device, cfg["runs"], cfg["warmup"], count)
            for i in outputs:  # a variant that wrote nothing would not match
                args[i].fill_(float("nan"))
            run(*args)
            row["max_abs_diff"] = max(
                (args[i].float() - e).abs().max().item() for i, e in zip(outputs, expected)
            )
        except Exception:
            row["error"] = failure().strip().splitlines()[-1]
        rows.append(row | {"programs": math.prod(grid)})
    return rows


def launch_record(step: Any) -> dict[str, Any]:
    """A launch step's block sizes, grid, warps and stages, for a result."""
    launch = step.kernel.launch
    return {
        **launch.constexprs,
        "grid": [int(g) for g in step.grid],
        "num_warps": launch.num_warps,
        "num_stages": launch.num_stages,
    }


# -------------------------------------------------------------- 4. launch


def launch(s: Section) -> None:
    """Host cost per kernel launch of a tilec program: a chain of tiny
    kernels of two lengths, the per-launch cost being the slope; plain
    calls through Triton's JIT, through the direct launcher
    (``runtime/launcher.py``), CUDA graph replays, and graph replays of
    kernels launched with programmatic dependent launch (the option
    ``pdl``, on GPUs that have it), and graph replays of the chain as one
    chained kernel (the option ``chain``: each op a stage waiting inside the
    kernel for the one before, ``passes/chain.py``), whose slope is what a
    stage boundary costs against a replayed launch (``Target.chain_wait_s``).
    The direct, dependent and chained launches' results must equal the
    JIT's bit for bit."""
    cfg = s.cfg
    x = torch.randn(1024, device=s.device)
    rows = []
    jit_results = {}  # ops -> the JIT program's results, which the others' must equal
    configs = [
        (False, False, False, False),
        (False, True, False, False),
        (True, False, False, False),
        (True, False, False, True),
    ]
    if s.device == "cuda" and Target.for_device(torch.device("cuda")).programmatic_launch:
        configs.append((True, False, True, False))
    else:
        s.data["pdl_skipped"] = (
            "no GPU with programmatic dependent launch (compute capability 9.0+)"
        )
    for graphs, direct, pdl, chain in configs:
        for ops in (1, cfg["chain"]):
            program = _chain_program(ops, graphs, x, direct, pdl, chain)
            timing = time_loop(lambda p=program: p(x), s.device, cfg["calls"], cfg["repeats"])
            replayed = type(getattr(program.executor, "graph", None)).__name__
            row = {
                "graphs": graphs,
                "direct": direct,
                "pdl": pdl,
                "chain": chain,
                "launches": len(program.launches()),
                # The kernels the ops are (a chained kernel's stages each).
                "kernels": sum(len(st.kernel.stages) or 1 for st in program.launches()),
                "capture": program.cudagraphs,
                "replayed_by": replayed,
                "launch_counts": program.launch_counts(),
            }
            if not graphs and not direct:
                jit_results[ops] = program(x)
            if direct or pdl or chain:
                row["equal_to_jit"] = all(
                    torch.equal(a, b) for a, b in zip(program(x), jit_results[ops], strict=True)
                )
            if pdl:
                row["launched_with_pdl"] = all(st.kernel.launch.pdl for st in program.launches())
            rows.append(row | timing)
            # The first GPU run timed the CPU stand-in here (the backend
            # had taken the device from metadata Dynamo does not set).
            if graphs and s.device == "cuda" and replayed != "CUDAGraph":
                raise RuntimeError(f"the program replayed a {replayed}, not a CUDA graph")
            s.data["rows"] = rows
            s.save()
    for config, name in (
        ((False, False, False, False), "jit_us_per_launch"),
        ((False, True, False, False), "direct_us_per_launch"),
        ((True, False, False, False), "graph_us_per_launch"),
        ((True, False, True, False), "pdl_graph_us_per_launch"),
        ((True, False, False, True), "chain_graph_us_per_stage"),
    ):
        pair = [r for r in rows if (r["graphs"], r["direct"], r["pdl"], r["chain"]) == config]
        if not pair:
            continue
        short, long = pair
        # Per kernel: a launch each, or a chained kernel's stage each.
        slope = (long["median_s"] - short["median_s"]) / (long["kernels"] - short["kernels"])
        s.data[name] = 1e6 * slope
    if not all(r["equal_to_jit"] for r in rows if "equal_to_jit" in r):
        raise RuntimeError("direct or dependent launches gave other results than the JIT's")
    if not all(r["launched_with_pdl"] for r in rows if "launched_with_pdl" in r):
        raise RuntimeError("a program built with pdl has kernels launched without it")


def _chain_program(
    ops: int,
    graphs: bool,
    x: torch.Tensor,
    direct: bool = False,
    pdl: bool = False,
    chained: bool = False,
) -> Any:
    """The Program of ``ops`` multiply-adds, one kernel per op (fusion off),
    or with ``chained`` one kernel of a stage per op."""

    def chain(t: torch.Tensor) -> torch.Tensor:
        for _ in range(ops):
            t = t * 1.0001 + 0.5
        return t

    torch._dynamo.reset()
    before = set(tilec.programs())
    options = {
        "fuse": False,
        "cudagraphs": graphs,
        "direct_launch": direct,
        "pdl": pdl,
        "chain": chained,
    }
    compiled = torch.compile(chain, backend="tilec", dynamic=False, options=options)
    compiled(x)
    (program,) = _new_programs(before).values()
    return program


# ------------------------------------------------------------- 5. kernels


def kernels(s: Section) -> None:
    """Each zoo model's costliest kernel sources, each timed alone, against
    :func:`benchmarks.gpu_check.predicted_seconds`; which are costliest, a
    profiled call of the model says (``Program.profile``: every launch
    bracketed by events, in place)."""
    s.data["models"] = {}
    for name in s.cfg["models"]:
        if s.out_of_time(s.cfg["item_min_s"], name):
            continue
        try:
            s.data["models"][name] = _model_kernels(s, name)
        except Exception:
            s.data["models"][name] = {"error": failure()}
        release()
        rows = [r for m in s.data["models"].values() for r in m.get("kernels", [])]
        errors = [abs(math.log(r["measured_s"] / r["predicted_s"])) for r in rows]
        s.data["summary"] = {
            "kernels": len(rows),
            "median_abs_log_error": statistics.median(errors) if errors else None,
            "median_measured_over_predicted": (
                statistics.median(r["measured_s"] / r["predicted_s"] for r in rows)
                if rows
                else None
            ),
        }
        s.save()


def _model_kernels(s: Section, name: str) -> dict[str, Any]:
    cfg = s.cfg
    torch.manual_seed(0)
    with torch.device(s.device):  # initialised where it runs: fast for full sizes
        model = MODELS[name].build(cfg["size"]).model.eval().to(DTYPES[cfg["dtype"]])
    inputs = _inputs(s, name)
    torch._dynamo.reset()
    before = set(tilec.programs())
    compiled = torch.compile(model, backend="tilec", dynamic=False)
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled(*inputs)
        compile_s = time.perf_counter() - t0
        programs = _new_programs(before)
        for program in programs.values():
            program.profile()
        for _ in range(cfg["profile_calls"]):
            compiled(*inputs)
        profiled = {
            (graph, kernel): statistics.median(times)
            for graph, program in programs.items()
            for kernel, times in program.kernel_times.items()
        }
        for program in programs.values():
            program.profile(False)
        # Identical kernels (a norm in every layer) share one source: rank the
        # sources by their time summed over their launches, and time the
        # costliest alone at their first launch.
        by_source: dict[str, list[tuple[str, Any]]] = {}
        for graph, program in programs.items():
            for step in program.launches():
                by_source.setdefault(step.kernel.function, []).append((graph, step))

        def total(source: str) -> float:
            return sum(profiled.get((g, st.kernel.name), 0.0) for g, st in by_source[source])

        ran = [source for source in by_source if total(source) > 0]
        costliest = sorted(ran, key=lambda source: -total(source))[: cfg["per_model"]]
        captured = {
            graph: capture_launches(program, lambda: compiled(*inputs))
            for graph, program in programs.items()
        }
        rows = []
        for source in costliest:
            graph, step = by_source[source][0]
            launcher, args = captured[graph][step.kernel.name]
            timing = time_launch(
                launcher, args, s.device, cfg["runs"], cfg["warmup"], cfg["max_input_sets"]
            )
            profiled_s = profiled[(graph, step.kernel.name)]
            rows.append(_kernel_row(name, graph, step, len(by_source[source]), profiled_s, timing))
    steps = [st for p in programs.values() for st in p.launches()]
    return {
        "compile_s": compile_s,
        "launches": len(steps),
        "library_calls": sum(len(p.plan.library_calls()) for p in programs.values()),
        "profiled_kernel_s": sum(profiled.values()),
        "predicted_kernel_s": sum(predicted_seconds(st.kernel) for st in steps),
        "kernels": rows,
    }


def _kernel_row(
    model: str, graph: str, step: Any, launches: int, profiled_s: float, timing: dict
) -> dict[str, Any]:
    k = step.kernel
    predicted = predicted_seconds(k)
    return {
        "model": model,
        "graph": graph,
        "kernel": k.name,
        "function": k.function,
        "launches": launches,
        "template": k.template,
        "group": k.group.reason[:120],
        "grid": [int(g) for g in step.grid],
        "launch": {**k.launch.constexprs, "num_warps": k.launch.num_warps},
        "bytes": k.bytes_read + k.bytes_written,
        "flops": k.flops,
        "profiled_s": profiled_s,
        "measured_s": timing["median_s"],
        "times_s": timing["times_s"],
        "input_sets": timing["input_sets"],
        "predicted_s": predicted,
        "measured_over_predicted": timing["median_s"] / predicted,
    }
