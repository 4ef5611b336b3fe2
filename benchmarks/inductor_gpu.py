"""Inductor's GPU (Triton) kernels for a model, generated on a CPU-only machine.

``inductor_gpu_kernels(model, inputs)`` compiles ``model(*inputs)`` for inference with
Inductor and hands back the Triton kernels Inductor would emit for an sm_90 (H100) GPU:
their source, how many bytes each moves per launch by Inductor's own accounting, how often
one call launches each, and how many library (extern) calls sit between them.  It is a
static look at generated code: no kernel is compiled for a GPU, nothing runs on one, and
no result of the compiled model is used.  It lets tilec's kernels be compared with
Inductor's on machines without a GPU.  ``inductor_gpu_step(run)`` does the same for
every graph a function compiles with the backend it is given: a training step's forward,
backward and optimizer step.

How (checked on torch 2.13 CPU + triton 3.7; see ``/work/shared/FACTS.md``):

* the tensors stay on the CPU and ``torch._inductor.config.cpu_backend = "triton"`` makes
  Inductor schedule, fuse and generate Triton (its GPU scheduler and fusion rules);
* a stand-in Triton driver reports ``GPUTarget("cuda", 90, 32)`` and
  ``torch.utils._triton.triton_backend`` is Triton's CUDA backend for that target, so the
  target-dependent parts of code generation see an H100;
* Inductor's device properties for the CPU are an H100's (132 SMs, ...): they drive its
  split-reduction decisions;
* ``GraphLowering._compile_to_module`` generates the wrapper (output code) and stops
  there: stock Triton has no CPU backend to compile the kernels with.  Each graph then
  returns zeros shaped like its outputs (:func:`zeros_for_outputs`), so that Dynamo
  reaches the graphs after a graph break without computing anything.

Everything patched is restored on the way out, even on error.  Inductor's caches are off
(a cache hit would generate nothing) and its and Triton's cache folders are a temporary
folder that is removed afterwards.

Where Inductor still follows the CPU (its lowerings look at the tensors' device, which is
the CPU): scaled-dot-product attention becomes the CPU attention op
(``_scaled_dot_product_flash_attention_for_cpu``, one extern call, as the CUDA flash or
efficient attention op would be, but without the CUDA ops' bias alignment copies);
variance (layer/group norm) uses the CPU's two-pass threshold (1024) instead of Welford;
division by a constant stays a division; ``add`` with ``alpha`` is not an FMA; ``mm``
padding (``pad_mm``, which benchmarks on a GPU) never happens; small ``mm``/``addmm``
decompositions follow the CPU's rules.  Two CPU-versus-GPU decisions are made the GPU way
here, because they change which kernels exist: ``addmm`` whose users are all pointwise is
split into ``mm`` plus a bias add fused into the next kernel (Inductor does that on GPUs
only), and the channels-last layout decision for convolutions uses the GPU heuristic
instead of the CPU's "always with oneDNN" (oneDNN is switched off while compiling).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.utils._triton
import triton.compiler.compiler
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor import decomposition, ir, metrics
from torch._inductor.codegen.triton import TritonScheduling
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.dependencies import MemoryDep
from torch._inductor.fx_passes import post_grad
from torch._inductor.graph import GraphLowering
from torch._inductor.runtime.hints import DeviceProperties
from torch._inductor.scheduler import ExternKernelSchedulerNode
from torch._inductor.utils import get_dtype_size, sympy_product
from torch._inductor.virtualized import V
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver

from benchmarks.sm90 import H100 as H100_TARGET
from benchmarks.sm90 import triton_target

H100 = triton_target(H100_TARGET)

# What torch.cuda.get_device_properties reports on an H100 SXM (the target's
# limits), as Inductor's DeviceProperties holds it.  The device type stays "cpu":
# these tensors are on the CPU and nothing here launches anything.
_H100_PROPERTIES = {
    "multi_processor_count": H100_TARGET.sm_count,
    "cc": H100.arch,
    "major": H100_TARGET.capability[0],
    "regs_per_multiprocessor": H100_TARGET.registers_per_sm,
    "max_threads_per_multi_processor": H100_TARGET.max_threads_per_sm,
    "max_threads_per_block": H100_TARGET.max_threads_per_block,
    "warp_size": H100_TARGET.warp_size,
}


@dataclasses.dataclass(frozen=True)
class InductorKernel:
    name: str  # Inductor's kernel name, e.g. triton_per_fused_native_layer_norm_0
    source: str  # the module text of the kernel (the @triton.jit function and its decorator)
    bytes: int | None  # bytes read + written per launch (Inductor's scheduler); None: unknown
    launches: int  # launches per call of the compiled model
    # Bytes per launch by the kernel's own estimate (each argument bounded by
    # the kernel's iteration space, see ``_kernel_bytes``); None: unknown
    kernel_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class InductorReport:
    kernels: list[InductorKernel]  # one per distinct kernel definition, in first-launch order
    extern_calls: int  # library / fallback calls per call (mm, addmm, convolution, sdpa, ...)
    wrapper: str  # the generated wrapper (output code) of every graph, concatenated
    # Each library / fallback call as ``benchmarks.static.library_calls``
    # describes tilec's: op, FLOPs, bytes, dtype (see ``_extern_call``).
    library: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def launches(self) -> int:
        return sum(k.launches for k in self.kernels)

    @property
    def bytes(self) -> int | None:
        """Bytes all Triton launches of one call move; None if a kernel's are unknown."""
        total = 0
        for kernel in self.kernels:
            if kernel.bytes is None:
                return None
            total += kernel.bytes * kernel.launches
        return total


def inductor_gpu_kernels(
    model: Callable[..., Any], inputs: tuple[torch.Tensor, ...], gemv_as_reduction: bool = False
) -> InductorReport:
    """Inductor's Triton kernels for ``model(*inputs)`` under ``torch.no_grad()``
    (inference), as Inductor would generate them for an sm_90 (H100) GPU, generated on this
    CPU-only machine without running any kernel.

    The model's mode is used as given (call ``.eval()`` first for inference layers) and
    Dynamo is reset before and after, which drops every earlier compilation.  Each graph
    Dynamo captures (several after graph breaks) is compiled by Inductor; each then returns
    zeros of its outputs' shapes, and the graphs' kernels and calls add up.

    ``bytes`` of a kernel is what Inductor's scheduler counts for the scheduler node the
    kernel was generated from: ``get_read_write_buffers_sizes()`` of that node (the number
    ``torch._inductor.metrics.num_bytes_accessed`` adds up), i.e. the sum over the buffers
    it reads and writes of min(elements accessed, elements of the buffer) times the element
    size.  Buffers that live only inside a fused node are left out.  For a single node the
    elements accessed are its iteration range times the number of accesses; for a fused
    node Inductor does not bound them, so each buffer counts whole (an embedding table
    counts whole even when a few rows are gathered).  It is the traffic of each buffer
    touched once, not what the loads do beyond that (a looped reduction's second pass,
    a broadcast operand re-read).  It is None when the scheduler's count is not this
    kernel's alone: the kernel covers only part of a scheduler node, one node gave several
    kernels, or one definition is shared by nodes whose counts differ.

    ``launches`` counts ``<kernel>.run(`` in the wrappers' code (comments and kernel
    sources left out); code under control flow (``cond``, ``while_loop``) counts once.
    ``extern_calls`` counts the library and fallback calls there: ``extern_kernels.<op>(``
    (mm, addmm, bmm, convolution, ...) and ``torch.ops.<namespace>.<op>.<overload>(``
    (ops Inductor falls back to, e.g. the attention op).
    """

    def run(backend: Callable[..., Any]) -> None:
        with torch.no_grad():
            torch.compile(model, backend=backend)(*inputs)

    return inductor_gpu_step(run, gemv_as_reduction)


def inductor_gpu_step(
    run: Callable[[Callable[..., Any]], None], gemv_as_reduction: bool = False
) -> InductorReport:
    """Inductor's Triton kernels for whatever ``run(backend)`` compiles with
    ``backend`` (a Dynamo backend) and calls, as :func:`inductor_gpu_kernels`
    describes them.  A training step is ``run`` compiling the forward and loss,
    calling ``backward()`` on the loss (AOTAutograd compiles the backward graph
    then) and compiling the optimizer's step: every graph's kernels add up.
    Each graph returns zeros (gradients too), so ``run`` sees no real value."""
    graphs: list[_Graph] = []
    with _generating_for_h100(graphs, gemv_as_reduction):
        torch._dynamo.reset()
        try:
            run(_capturing_backend)
        finally:
            torch._dynamo.reset()
    if not graphs:
        raise RuntimeError("Dynamo captured no graph for the model: nothing was compiled")
    return _report(graphs)


@dataclasses.dataclass
class _Graph:
    """What one Inductor compilation generated."""

    wrapper: str
    # kernel name -> bytes per launch as attributed from the scheduler (None: unknown)
    bytes: dict[str, int | None]
    # kernel name -> bytes per launch by the kernel's own estimate (None: unknown)
    kernel_bytes: dict[str, int | None]
    library: list[dict[str, Any]]


# The top-level scheduler nodes one kernel definition came from, and their bytes (None:
# the scheduler's count is not the kernel's alone).
_Origin = tuple[tuple[Any, ...], int | None]


class _CodegenDone(Exception):
    """Raised once the wrapper is generated: nothing is compiled and nothing runs."""


class _H100Driver(DriverBase):
    """A Triton driver that only says which GPU it is: an sm_90 with 32-thread warps."""

    @classmethod
    def is_active(cls) -> bool:
        return False  # never picked by Triton's own driver discovery

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the stand-in H100 driver launches nothing")

    def get_current_target(self) -> GPUTarget:
        return H100

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise NotImplementedError("the stand-in H100 driver benchmarks nothing")


@contextlib.contextmanager
def _generating_for_h100(graphs: list[_Graph], gemv_as_reduction: bool = False) -> Iterator[None]:
    """Everything patched for one generation, restored on exit (also on error).
    ``gemv_as_reduction``: Inductor as gpt-fast runs it
    (``coordinate_descent_tuning``), whose ``mm`` decomposition on a GPU
    turns a product of one row (or one column) into a multiply and a sum, a
    reduction kernel that fuses what computes the operands (an int8
    weight's conversion); the CPU tensors here would skip that branch, so
    the decomposition table's ``mm`` takes it itself."""
    # kernel name -> what each definition of it came from, for the graph being generated
    kernels: dict[str, list[_Origin]] = {}
    # kernel name -> each definition's own byte estimate
    estimates: dict[str, set[int | None]] = {}
    # id of a combo kernel -> the sub-nodes it computes (one foreach node of the
    # scheduler may be partitioned into several combo kernels)
    combo_parts: dict[int, list[Any]] = {}
    define_kernel = TritonScheduling.define_kernel
    generate_combo = TritonScheduling.generate_combo_kernel_code

    def recording_generate_combo(self: TritonScheduling, *args: Any, **kwargs: Any) -> Any:
        code = generate_combo(self, *args, **kwargs)
        for _, kernel, parts in code:
            combo_parts[id(kernel)] = parts
        return code

    def recording_define_kernel(self: TritonScheduling, src_code: str, node_schedule, kernel):
        name = define_kernel(self, src_code, node_schedule, kernel)
        parts = combo_parts.get(id(kernel))
        origin = _attribute(node_schedule) if parts is None else _attribute_combo(parts)
        kernels.setdefault(name, []).append(origin)
        estimates.setdefault(name, set()).add(_kernel_bytes(kernel))
        return name

    def codegen_only(self: GraphLowering) -> Any:
        kernels.clear()
        combo_parts.clear()
        estimates.clear()
        wrapper, _ = self.codegen()
        own = {
            name: counts.pop() if len(counts) == 1 else None for name, counts in estimates.items()
        }
        library = [_extern_call(node) for node in self.scheduler.nodes if _is_call(node)]
        graphs.append(_Graph(wrapper.value, _bytes_per_kernel(kernels), own, library))
        raise _CodegenDone

    create_properties = DeviceProperties.create

    def h100_properties(cls: type[DeviceProperties], device: Any) -> DeviceProperties:
        properties = create_properties(device)
        if properties.type != "cpu":
            return properties
        return properties._replace(**_H100_PROPERTIES)

    gpu_device_types = post_grad.is_gpu
    mkldnn = torch.backends.mkldnn

    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="inductor_gpu_"))
        caches = {
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(folder, "triton"),
        }
        stack.enter_context(mock.patch.dict(os.environ, caches))
        stack.enter_context(_metrics_kept())
        stack.enter_context(
            torch._inductor.config.patch(
                cpu_backend="triton",
                fx_graph_cache=False,
                # one process: no compile worker pool that would outlive the cache folder
                compile_threads=1,
            )
        )
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        # Triton's active driver: save the slot itself (it may be unset) and restore it.
        stack.enter_context(mock.patch.object(driver, "_active", driver._active))
        driver.set_active(_H100Driver())
        backend = triton.compiler.compiler.make_backend(H100)
        stack.enter_context(
            mock.patch.object(torch.utils._triton, "triton_backend", lambda: backend)
        )
        stack.enter_context(
            mock.patch.object(DeviceProperties, "create", classmethod(h100_properties))
        )
        # post_grad's only use of is_gpu decides whether addmm is split into mm plus a
        # pointwise bias add (GPUs only); answer it as for a GPU.
        stack.enter_context(
            mock.patch.object(
                post_grad, "is_gpu", lambda device: device == "cpu" or gpu_device_types(device)
            )
        )
        # With oneDNN on, convolutions on the CPU always get channels-last; without it
        # Inductor takes the decision with its GPU heuristic.
        stack.enter_context(
            mkldnn.flags(
                enabled=False,
                deterministic=mkldnn.deterministic,
                allow_tf32=mkldnn.allow_tf32,
                fp32_precision=mkldnn.fp32_precision,
            )
        )
        stack.enter_context(
            mock.patch.object(TritonScheduling, "define_kernel", recording_define_kernel)
        )
        stack.enter_context(
            mock.patch.object(
                TritonScheduling, "generate_combo_kernel_code", recording_generate_combo
            )
        )
        stack.enter_context(mock.patch.object(GraphLowering, "_compile_to_module", codegen_only))
        if gemv_as_reduction:
            stack.enter_context(torch._inductor.config.patch(coordinate_descent_tuning=True))
            # The table itself and the copy its selection caches (with the
            # random ops' decompositions).
            for table in (decomposition.decompositions, decomposition.select_decomp_table()):
                mm = _gpu_mm(table)
                stack.enter_context(mock.patch.dict(table, {torch.ops.aten.mm.default: mm}))
        yield


def _gpu_mm(table: dict) -> Callable[..., Any]:
    """Inductor's ``mm`` decomposition with its GPU branch under
    ``coordinate_descent_tuning``: one row (or column) is a multiply and a
    sum over K, in float32 (the decomposition's opmath); otherwise its own."""
    own = table[torch.ops.aten.mm.default]

    def mm(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if statically_known_true(a.shape[0] == 1) or statically_known_true(b.shape[1] == 1):
            return (a.unsqueeze(2).float() * b.unsqueeze(0).float()).sum(dim=1).to(a.dtype)
        return own(a, b, *args, **kwargs)

    return mm


# Outputs of at least this many bytes are left unwritten by the stand-in.
UNWRITTEN_BYTES = 64 << 20


def zeros_for_outputs(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """A stand-in for running ``gm``: zeros shaped like its outputs (from the
    traced example values).  A static report needs the graphs, not results, and
    Dynamo only needs outputs of the right kind to reach the next graph; eager
    runs of full-size models at batch 32 take minutes on a CPU.

    Outputs of ``UNWRITTEN_BYTES`` or more are allocated and not written:
    such allocations are fresh pages from the system, which read as zero and
    take no memory until touched.  A training forward's outputs include
    every activation saved for the backward: written as zeros, the full
    LLaMA's at batch 8 took the report's process to 22.6 GB, and the system
    killed it.  Nothing reads them but the stand-in backward, which ignores
    them."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]

    def zeros(value: Any) -> Any:
        if not isinstance(value, torch.fx.Node):
            return value
        fake = value.meta.get("val", value.meta.get("example_value"))
        if not isinstance(fake, torch.Tensor):
            raise NotImplementedError(f"output {value.name} is not a tensor: {fake!r}")
        out = torch.empty_strided(fake.shape, fake.stride(), dtype=fake.dtype)
        if out.untyped_storage().nbytes() < UNWRITTEN_BYTES:
            out.zero_()
        return out

    def run(*args: Any) -> Any:
        return pytree.tree_map(zeros, output.args[0])

    return run


def _capturing_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """Dynamo backend: Inductor (forward, backward and inference graphs alike)
    generates each graph's code; each compiled graph returns zeros shaped like
    its outputs (nothing is computed)."""
    return compile_fx(gm, example_inputs, inner_compile=_generate_only)


def _generate_only(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's ``inner_compile`` for one AOTAutograd graph: generates its
    code (which stops at ``_CodegenDone``) and hands back zeros of its outputs."""
    try:
        compile_fx_inner(gm, example_inputs, **kwargs)
    except Exception as error:
        if not _caused_by(error, _CodegenDone):
            raise
    else:
        raise RuntimeError("Inductor finished without generating code: was a cache used?")
    return make_boxed_func(zeros_for_outputs(gm))


def _caused_by(error: BaseException | None, kind: type[BaseException]) -> bool:
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


def _attribute(node_schedule: Sequence[Any]) -> _Origin:
    """The top-level scheduler nodes one kernel was generated from, and their bytes.

    ``node_schedule`` lists the leaf scheduler nodes the kernel computes (and markers that
    are not nodes).  Inductor's byte count belongs to the top-level (fused) node: the bytes
    are only this kernel's when the kernel covers each of its nodes whole.
    """
    scheduler = V.graph.scheduler
    top_of = {id(leaf): top for top in scheduler.nodes for leaf in top.get_nodes()}
    # A combo kernel's schedule names the top-level node itself: take its leaves.
    tops_by_id = {id(top): top for top in scheduler.nodes}
    leaves = [
        leaf
        for n in node_schedule
        for leaf in (tops_by_id[id(n)].get_nodes() if id(n) in tops_by_id else [n])
        if id(leaf) in top_of
    ]
    tops = tuple({id(top_of[id(n)]): top_of[id(n)] for n in leaves}.values())
    covered = {id(n) for n in leaves}
    whole = all(
        id(leaf) in covered or leaf.get_name() in scheduler.removed_ops
        for top in tops
        for leaf in top.get_nodes()
    )
    if not tops or not whole:
        return tops, None  # part of a node: its bytes are not this kernel's alone
    return tops, sum(top.get_read_write_buffers_sizes() for top in tops)


def _attribute_combo(parts: Sequence[Any]) -> _Origin:
    """The sub-nodes one combo kernel computes, and their bytes: each part of
    a combo kernel is a whole (fused) scheduler node of its own, so its count
    is its own even when its foreach node spans several combo kernels."""
    return tuple(parts), sum(part.get_read_write_buffers_sizes() for part in parts)


def _kernel_bytes(kernel: Any) -> int | None:
    """Bytes one launch of ``kernel`` moves, counted as Inductor's per-kernel
    estimate (``estimate_kernel_num_bytes``, what its kernel benchmarks
    report as GB/s) counts them, argument by argument (an argument both read
    and written twice), but with each argument's elements the positions its
    accesses reach: for each distinct index, the product of the ranges of
    the loop variables it uses, at most the whole buffer.  The estimate
    itself counts a buffer whole unless it is larger than the kernel's
    iteration space, and then that whole space per index: a row gathered
    from an embedding table, or a cache entry written, in a GEMV's
    reduction kernel (whose space is the whole weight) counted as the table
    or the cache.  Unlike the scheduler's count it takes a mutation's
    write-back that the kernel does not perform as nothing.  None for a
    kernel without the estimate (a combo kernel)."""
    if getattr(kernel, "estimate_kernel_num_bytes", None) is None:
        return None
    hint = _size_hint()
    inplace = len({id(b): b for b in kernel.args.inplace_buffers.values()})
    _, call_args, _, _ = kernel.args.python_argdefs()
    accesses = kernel.features.buf_accesses()
    # An access without an index (a scatter's store, a StarDep) reaches at
    # most one position per point of the kernel's non-reduction axes.
    space = hint(sympy_product(n for axis, n in kernel.numels.items() if not axis.startswith("r")))
    total = 0
    for k, arg in enumerate(call_args):
        if arg not in accesses:
            continue
        whole = hint(V.graph.get_numel(arg))
        # One count per distinct index (an access without one counts alone).
        reads = {d.index if isinstance(d, MemoryDep) else id(d): d for d in accesses[arg]}
        numel = min(whole, sum(_positions(dep, space) for dep in reads.values()))
        total += numel * get_dtype_size(V.graph.get_dtype(arg)) * (1 + int(k < inplace))
    return total


def _positions(dep: Any, space: int) -> int:
    """Positions a memory access reaches: the product of the ranges of the
    loop variables its index uses (``space`` for an access without one)."""
    if not isinstance(dep, MemoryDep):
        return space
    used, hint = dep.index.free_symbols, _size_hint()
    return math.prod(hint(n) for v, n in dep.ranges.items() if v in used)


def _size_hint() -> Callable[[Any], int]:
    """The current graph's size hints (``optimization_hint`` from torch 2.13,
    ``size_hint`` before)."""
    sizes = V.graph.sizevars
    hint = getattr(sizes, "optimization_hint", None) or sizes.size_hint
    return lambda expr: int(hint(expr))


def _cuda_attention(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """The CUDA flash attention op on the CPU op's arguments (a mask changes
    which CUDA kernel runs, not the FLOPs torch counts for it)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, scale=scale
    )


def as_on_the_gpu(op: Any) -> Any:
    """The op a GPU would run for library call ``op``, for counting FLOPs.
    The report traces on CPU tensors, so attention is the CPU flash op, for
    which torch's FLOP counter counts nothing; the CUDA op it counts."""
    if op is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
        return _cuda_attention
    return op


def _is_call(node: Any) -> bool:
    """A scheduler node the wrapper runs as a library or fallback call (not
    one output of a multi-output call, which is a view of its result)."""
    return isinstance(node, ExternKernelSchedulerNode) and not isinstance(node.node, ir.MultiOutput)


def _extern_call(node: Any) -> dict[str, Any]:
    """One library or fallback call: its op, FLOPs (Inductor's flop count of
    its FX node, 0 where it has none), bytes (its operands and results, whole)
    and the dtype of its first operand."""
    call = node.node
    operands = [x for x in call.inputs if isinstance(x, ir.IRNode)]
    return {
        "op": str(getattr(call, "op_overload", None) or call.python_kernel_name),
        "flops": int(node.estimate_flops() or _gpu_flops(_origin(call))),
        "bytes": int(node.get_read_write_buffers_sizes()),
        "dtype": str((operands[0] if operands else call).get_dtype()),
    }


def _origin(call: Any) -> torch.fx.Node | None:
    """The FX node a library or fallback call computes (its origin node, or
    the origin that calls its op)."""
    op = getattr(call, "op_overload", None)
    found = [n for n in getattr(call, "origins", ()) if n.target is op]
    return call.get_origin_node() or (found[0] if found else None)


def _gpu_flops(fx_node: torch.fx.Node | None) -> int:
    """FLOPs torch's counter gives the op a GPU would run for ``fx_node``
    (:func:`as_on_the_gpu`), on meta tensors of its traced values; 0 without
    a node or a count."""
    if fx_node is None or not callable(fx_node.target):
        return 0

    def meta(a: Any) -> Any:
        if not isinstance(a, torch.fx.Node):
            return a
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")

    args, kwargs = pytree.tree_map(meta, (fx_node.args, fx_node.kwargs))
    with FlopCounterMode(display=False) as counter:
        as_on_the_gpu(fx_node.target)(*args, **kwargs)
    return int(counter.get_total_flops())


def _bytes_per_kernel(kernels: dict[str, list[_Origin]]) -> dict[str, int | None]:
    """Bytes per launch of each kernel name, None where the scheduler's count is not its."""
    kernels_of_node: dict[int, set[str]] = {}
    for name, uses in kernels.items():
        for tops, _ in uses:
            for top in tops:
                kernels_of_node.setdefault(id(top), set()).add(name)
    result: dict[str, int | None] = {}
    for name, uses in kernels.items():
        counts = {count for _, count in uses}
        # one node split over several kernels: its count is theirs together
        shared = any(len(kernels_of_node[id(top)]) > 1 for tops, _ in uses for top in tops)
        # a definition reused (same source) by nodes whose counts differ: no single value
        result[name] = None if shared or len(counts) != 1 else counts.pop()
    return result


# A kernel definition in the wrapper: NAME = async_compile.triton('NAME', '''SOURCE''', ...)
_DEFINITION = re.compile(
    r"^(\w+) = async_compile\.triton\('(\w+)', '''\n(.*?)''', device_str='\w+'\)$",
    re.DOTALL | re.MULTILINE,
)
# Extern (library / fallback) calls in the wrapper's call code: extern_kernels.mm(...),
# extern_kernels.addmm, .bmm, .convolution, ... and ATen or other ops Inductor falls back to,
# which it writes as torch.ops.aten.<op>.<overload>(...).  Allocations (empty_strided_*),
# views (reinterpret_tensor), asserts and alloc_from_pool are not calls of a kernel.
_EXTERN_CALL = re.compile(r"\bextern_kernels\.\w+\(|\btorch\.ops\.\w+\.\w+(?:\.\w+)?\(")


_COMMENT = re.compile(r"^\s*#.*$", re.MULTILINE)


def _call_code(wrapper: str) -> str:
    """The wrapper without kernel sources and comments: the code that calls kernels."""
    found = len(_DEFINITION.findall(wrapper))
    written = wrapper.count("async_compile.triton(")
    if found != written:  # a format this parser does not know: better stop than miscount
        raise RuntimeError(f"{written} Triton kernel definitions in the wrapper, {found} parsed")
    return _COMMENT.sub("", _DEFINITION.sub("", wrapper))


def _report(graphs: list[_Graph]) -> InductorReport:
    # (name, source, bytes, kernel bytes) -> [(graph, offset of its first launch), launches]
    kernels: dict[tuple[str, str, int | None, int | None], list[Any]] = {}
    extern_calls = 0
    for index, graph in enumerate(graphs):
        definitions = {m.group(1): m.group(3) for m in _DEFINITION.finditer(graph.wrapper)}
        call_code = _call_code(graph.wrapper)
        extern_calls += len(_EXTERN_CALL.findall(call_code))
        for name, source in definitions.items():
            launches = [m.start() for m in re.finditer(rf"\b{name}\.run\(", call_code)]
            if not launches:
                continue  # defined but never launched (e.g. benchmarking leftovers)
            # Separate graphs are separate definitions unless the very same kernel.
            key = (name, source, graph.bytes.get(name), graph.kernel_bytes.get(name))
            entry = kernels.setdefault(key, [(index, launches[0]), 0])
            entry[1] += len(launches)
    ordered = sorted(kernels.items(), key=lambda item: item[1][0])
    return InductorReport(
        kernels=[
            InductorKernel(
                name=name, source=source, bytes=count, launches=launches, kernel_bytes=own
            )
            for (name, source, count, own), (_, launches) in ordered
        ],
        extern_calls=extern_calls,
        wrapper="\n".join(graph.wrapper for graph in graphs),
        library=[call for graph in graphs for call in graph.library],
    )


@contextlib.contextmanager
def _metrics_kept() -> Iterator[None]:
    """Inductor's metrics and Dynamo's counters as they were before (generation counts)."""
    saved = {
        name: copy.copy(value)
        for name, value in vars(metrics).items()
        if not name.startswith("_") and isinstance(value, (int, float, list))
    }
    saved_counters = copy.deepcopy(counters)
    try:
        yield
    finally:
        for name, value in saved.items():
            current = getattr(metrics, name)
            if isinstance(value, list) and isinstance(current, list):
                current[:] = value  # in place: other modules may hold the list
            else:
                setattr(metrics, name, value)
        counters.clear()
        counters.update(saved_counters)
