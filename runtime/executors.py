"""Executors: what runs a :class:`~tilec.runtime.plan.Plan`.

:class:`EagerExecutor` runs the plan's call function on every call: the
steps, in order, on the call's own input tensors.

:class:`GraphExecutor` (``mode="reduce-overhead"``, or the option
``cudagraphs=True``) runs the first call eagerly (the warm-up: kernels are
compiled, library handles made), then *captures* the call function into a
graph and from then on only *replays* it:

- parameters and other static inputs (the tensors AOTAutograd says keep
  their storage between calls), inputs whose storage did not move between
  the warm-up call and the capture (a static KV cache) and constants are
  used in place; every other input is copied into a static buffer of its own
  before each replay;
- every buffer tilec allocates (the arena, the buffers kernels write) is
  allocated before capture: the call function refuses to allocate during
  capture.  Library calls and ATen fallbacks may allocate (into the graph's
  memory pool, one per compiled model); a fallback that is not all device
  work is not captured (:func:`capture_refusal`);
- outputs are copied out of the graph's static buffers after each replay,
  so a tensor returned by one call is never changed by a later one;
- when an input used in place moved to another storage since the capture,
  the program is captured again: a parameter stays in place (up to
  :data:`RECAPTURE_LIMIT` times, then the program runs eagerly); an input
  that had only seemed stable stays in place where copying it for as many
  replays as the last graph served would have cost more than a capture
  (the KV cache of each new ``generate``), and is copied otherwise; a
  copied input that stays put until its copies have cost a capture is read
  in place again (on targets with cost figures: ``GraphExecutor``).

:class:`BucketExecutor` does the same for a generic program (symbolic
sizes): one graph per size bucket, whose kernels read the call's sizes
from memory (its docstring).

Graphs come from a :class:`GraphBackend`: :class:`CudaGraphs` (CUDA graphs,
for programs on a GPU) or :class:`StandInGraphs`, the CPU stand-in with the
same interface, which records the kernel launches and library calls made
during capture and replays that sequence; it raises on a launch that reads
a tensor that is not in a static buffer, so every rule above is tested
without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any, Protocol

import sympy
import torch
from torch.utils._pytree import tree_map

from tilec import index as ix
from tilec.codegen.cache import load_module, write_source
from tilec.codegen.kernel import KernelSource, sizes_in_memory
from tilec.decisions import Reason
from tilec.ir import apply_view
from tilec.runtime.launcher import DirectLaunch, launch_counts
from tilec.runtime.plan import Plan, Role, Slot, ViewStep, at_sizes, keep_strides, write_input

log = logging.getLogger("tilec.cudagraphs")

Sizes = dict[str, int]  # values of the size symbols, by name ({} for static graphs)

# Times a graph is captured again because a static input moved, before the
# program gives up on graphs and runs eagerly.
RECAPTURE_LIMIT = 3
# A generic program's graphs: one per size bucket, each symbol's value
# rounded up to a power of two from MIN_BUCKET; calls in buckets past
# BUCKET_LIMIT run eagerly.
MIN_BUCKET = 16
BUCKET_LIMIT = 8


class _NoOp:
    """A kernel that does nothing, launched either way (``k(...)``, ``k[grid](...)``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getitem__(self, grid: Any) -> _NoOp:
        return self


class _FirstResult:
    """A library call that computes once and then returns that result."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.result: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.result is None:
            self.result = self.fn(*args, **kwargs)
        return self.result


# GPU cycles a timed launch holds the device for before its start event
# (``EagerExecutor.timed``): about 50 us at an H100's 1.98 GHz, longer than
# the host takes to record an event and launch through Triton's JIT (about
# 20 us measured, benchmarks/results/gpu/2026-11-28-nvidia-h200).
HOLD_CYCLES = 100_000


class EagerExecutor:
    """Run the plan's call function on each call's inputs."""

    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        constants: dict[str, torch.Tensor],
        direct_launch: bool = False,
    ):
        self.plan = plan
        self.device = device
        self.constants = constants
        # Kernels launched by :class:`~tilec.runtime.launcher.DirectLaunch`
        # (the option ``direct_launch``), not Triton's JIT dispatch.
        self.direct_launch = direct_launch
        self.namespace: dict[str, Any] | None = None
        self.arena: torch.Tensor | None = None

    def __call__(self, inputs: Sequence[Any], sizes: Sizes) -> list[Any]:
        run = self._prepared()["run"]
        return run(*inputs, sizes) if self.plan.symbols else run(*inputs)

    def _prepared(self) -> dict[str, Any]:
        """The call function's namespace, made on first use."""
        if self.namespace is None:
            self.namespace = self.prepare(static_buffers=False)
            exec(self.plan.source(), self.namespace)  # noqa: S102 - source written by Plan
        return self.namespace

    def timed(self, inputs: Sequence[Any], sizes: Sizes, times: dict[str, list[float]]) -> list:
        """A call with every launch timed alone into ``times`` (kernel name ->
        seconds per call); slower than a plain call.  On a GPU each launch
        is timed by events around it, the device held busy
        (``torch.cuda._sleep``) while the host records the first and
        launches: the events then bracket the kernel, not the host's launch
        path, which would otherwise count in every kernel's time."""
        namespace = self._prepared()
        if "run_timed" not in namespace:
            exec(self.plan.source(timed=True).replace("def run(", "def run_timed(", 1), namespace)  # noqa: S102
        marks: list[tuple[str, Any, Any]] = []
        cuda = self.device.type == "cuda"

        def event() -> Any:
            if not cuda:
                return time.perf_counter()
            mark = torch.cuda.Event(enable_timing=True)
            mark.record()
            return mark

        def start() -> Any:
            if cuda:
                torch.cuda._sleep(HOLD_CYCLES)
            return event()

        def stop(name: str, begun: Any) -> None:
            marks.append((name, begun, event()))

        namespace.update(start=start, stop=stop)
        run = namespace["run_timed"]
        outputs = run(*inputs, sizes) if self.plan.symbols else run(*inputs)
        if cuda:
            torch.cuda.synchronize()
        for name, begun, ended in marks:
            seconds = begun.elapsed_time(ended) / 1000 if cuda else ended - begun
            times.setdefault(name, []).append(seconds)
        return outputs

    def prepare(self, static_buffers: bool, bucket: Sizes | None = None) -> dict[str, Any]:
        """The call function's namespace: kernels, library targets, constants
        and everything made once (the arena and its views; with
        ``static_buffers`` the per-call buffers too).  ``bucket``: the size
        symbols' largest values, for a graph captured once for every size up
        to them: per-call buffers are made that large, and kernels read their
        sizes from memory (``Plan.source(device_sizes=True)``)."""
        plan, device = self.plan, self.device
        namespace: dict[str, Any] = {
            "torch": torch,
            "math": math,  # floats computed from sizes (generic programs)
            "device": device,
            "empty_strided": torch.empty_strided,
            "view": apply_view,
            "keep_strides": keep_strides,
            "write_input": write_input,
            **plan.names,
            **self.constants,
        }
        for step in plan.launches():
            fn = step.fn
            if bucket is not None and step.kernel.sizes:
                fn = _sizes_in_memory(step.kernel, plan.size_positions(step.kernel), device)
                namespace[step.var] = fn
            grid = None if step.symbolic else step.grid  # else evaluated per call
            if self.direct_launch:
                namespace[step.var] = DirectLaunch(fn, step.options, grid, self._device_index())
            elif grid is not None:
                namespace[step.var] = functools.partial(fn[grid], **step.options)
            if step.symbolic:
                namespace[f"options_{step.var}"] = step.options
        namespace.update(self._static_views(namespace))
        memory = plan.graph.memory
        if self.arena is None:
            self.arena = torch.empty(memory.arena_bytes, dtype=torch.uint8, device=device)
        for item in plan.prepared(static_buffers):
            if isinstance(item, ViewStep):
                namespace[item.out] = item.apply(namespace[item.src])
            elif item.role == Role.ARENA:
                node = item.node
                offset, size = memory.offsets[node.name], memory.sizes[node.name]
                flat = self.arena[offset : offset + size].view(node.dtype)
                namespace[item.var] = flat.as_strided(node.shape, node.buffer_stride)
            else:
                node = item.node
                shape, stride = node.shape, node.buffer_stride
                if bucket is not None:
                    shape, stride = at_sizes(shape, bucket), at_sizes(stride, bucket)
                namespace[item.var] = torch.empty_strided(
                    shape, stride, dtype=node.dtype, device=device
                )
        return namespace

    def _device_index(self) -> Callable[[], int] | None:
        return torch.cuda.current_device if self.device.type == "cuda" else None

    def launch_counts(self) -> dict[str, int]:
        """Launches made directly and through Triton's JIT so far (direct
        launch on), counted by the launchers of the call function."""
        return launch_counts(self.namespace or {})

    def _static_views(self, namespace: dict[str, Any]) -> dict[str, Any]:
        """``refresh_static_views(*static inputs)``: the call function calls it
        when a static input it makes views of moved (and on the first call)."""
        roots = self.plan.refreshed_roots()
        views = self.plan.refreshed()

        def refresh_static_views(*tensors: torch.Tensor) -> None:
            namespace.update(zip(roots, tensors))
            for step in views:
                namespace[step.out] = step.apply(namespace[step.src])
            namespace["static_pointers"] = tuple(t.data_ptr() for t in tensors)

        return {"refresh_static_views": refresh_static_views, "static_pointers": None}

    def stub_compute(self) -> None:
        """Kernels become no-ops and library calls return their first result:
        what is left of a call is the host work around them (measuring)."""
        if self.namespace is None:
            raise RuntimeError("call the program once before stubbing its compute")
        _stub(self.plan, self.namespace)


def _sizes_in_memory(kernel: KernelSource, positions: tuple[int, ...], device: torch.device) -> Any:
    """The @triton.jit function of ``kernel`` reading its sizes from memory
    (:func:`~tilec.codegen.kernel.sizes_in_memory`), interpreted on a CPU
    (modules are imported once: ``codegen/cache.py``)."""
    source, function = sizes_in_memory(kernel, positions)
    return getattr(load_module(write_source(source), device.type != "cuda"), function)


def _stub(plan: Plan, namespace: dict[str, Any]) -> None:
    for step in plan.launches():
        namespace[step.var] = _NoOp()
    for step in plan.library_calls():
        namespace[step.var] = _FirstResult(namespace[step.var])


@dataclasses.dataclass
class Capture:
    """What a graph backend captures: ``run()`` (the call function on the
    static buffers), the namespace it runs in, its plan, and the tensors that
    stay in place between replays."""

    run: Callable[[], list[Any]]
    namespace: dict[str, Any]
    plan: Plan
    static: list[torch.Tensor]
    # Memory another graph lent, read in place (its storage's address ->
    # the input's position): the graph keeps no tensor on it (one would
    # count as a holder, :meth:`GraphExecutor._lent_busy`), only its address.
    borrowed: dict[int, int] = dataclasses.field(default_factory=dict)


class GraphBackend(Protocol):
    """Where graphs come from: ``capture`` runs ``job.run`` under capture and
    returns the graph and what ``run`` returned; ``replay`` replays it for a
    call's ``inputs`` (at the addresses it was captured at)."""

    def capture(self, job: Capture) -> tuple[Any, list[Any]]: ...

    def replay(self, graph: Any, inputs: Sequence[Any]) -> None: ...


class CudaGraphs:
    """CUDA graphs, in one memory pool shared by a compiled model's programs."""

    def __init__(self) -> None:
        self.pool: Any = None

    def capture(self, job: Capture) -> tuple[Any, list[Any]]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = job.run()
        return graph, outputs

    def replay(self, graph: Any, inputs: Sequence[Any]) -> None:
        graph.replay()  # it holds addresses, borrowed memory's among them


class StandInGraphs:
    """A CPU stand-in for CUDA graphs: capture records the launches and
    library calls without running the launches; replay runs the recorded
    sequence on the same tensors (a library call's new result is copied into
    the tensor it returned during capture, as a CUDA graph would write the
    same memory)."""

    def capture(self, job: Capture) -> tuple[RecordedGraph, list[Any]]:
        graph = RecordedGraph(job.static, job.borrowed)
        namespace = job.namespace
        for step in job.plan.launches():
            fn = namespace[step.var]
            if step.symbolic:  # launched as ``fn[grid](...)``
                namespace[step.var] = _Gridded(graph, step.kernel.name, fn)
            else:
                namespace[step.var] = graph.recorder(step.kernel.name, fn, False)
        for step in job.plan.library_calls():
            name = str(step.node.extern.target)
            namespace[step.var] = graph.recorder(name, namespace[step.var], True)
        namespace["keep_strides"] = graph.recorder("keep_strides", keep_strides, True)
        namespace["write_input"] = graph.recorder("write_input", write_input, False)
        return graph, job.run()

    def replay(self, graph: RecordedGraph, inputs: Sequence[Any]) -> None:
        graph.replay(inputs)


class _Gridded:
    """A kernel launched as ``fn[grid](...)`` whose launches a graph records."""

    def __init__(self, graph: RecordedGraph, name: str, fn: Any):
        self.graph, self.name, self.fn = graph, name, fn

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.graph.recorder(self.name, self.fn[grid], False)


class RecordedGraph:
    """The stand-in's graph: the launches and library calls recorded, each
    with its arguments.  A tensor on memory ``borrowed`` (another graph's,
    read in place) is recorded as where it lies (:class:`_Borrowed`), as a
    CUDA graph holds its address, and made again at each replay on the
    call's input there."""

    def __init__(self, static: list[torch.Tensor], borrowed: dict[int, int] | None = None):
        self.steps: list[tuple[Callable[..., Any], tuple, dict, Any]] = []
        self.storages = {t.untyped_storage().data_ptr() for t in static}
        self.borrowed = dict(borrowed or {})

    def recorder(self, name: str, fn: Callable[..., Any], returns: bool) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            for t in _tensors((args, kwargs)):
                if t.untyped_storage().data_ptr() not in self.storages:
                    raise RuntimeError(
                        f"tilec: during graph capture, {name} reads a tensor of shape "
                        f"{tuple(t.shape)} that is not in a static buffer (its memory would "
                        f"not be the same on replay)"
                    )
            result = fn(*args, **kwargs) if returns else None
            self.storages |= {t.untyped_storage().data_ptr() for t in _tensors(result)}
            # A result on borrowed memory too (``keep_strides`` returns its
            # argument where its strides are kept).
            self.steps.append((fn, *tree_map(self._where, (args, kwargs, result))))
            return result

        return record

    def _where(self, value: Any) -> Any:
        """``value``, or where it lies if it is a tensor on borrowed memory."""
        if not isinstance(value, torch.Tensor):
            return value
        position = self.borrowed.get(value.untyped_storage().data_ptr())
        if position is None:
            return value
        return _Borrowed(position, value.dtype, value.shape, value.stride(), value.storage_offset())

    def replay(self, inputs: Sequence[Any] = ()) -> None:
        for fn, args, kwargs, result in self.steps:
            if self.borrowed:
                args, kwargs, result = tree_map(lambda v: _on(v, inputs), (args, kwargs, result))
            _copy_into(result, fn(*args, **kwargs))


@dataclasses.dataclass(frozen=True)
class _Borrowed:
    """A tensor a recorded step read on borrowed memory: the input whose
    storage it is on, and its dtype and layout there."""

    position: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int


def _on(value: Any, inputs: Sequence[Any]) -> Any:
    """``value``, or the tensor a :class:`_Borrowed` describes, on the
    storage of the call's input (which the replay's caller checked is
    where the capture's was)."""
    if not isinstance(value, _Borrowed):
        return value
    base = inputs[value.position]
    tensor = torch.empty(0, dtype=value.dtype, device=base.device)
    return tensor.set_(base.untyped_storage(), value.offset, value.shape, value.stride)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


def _copy_into(kept: Any, new: Any) -> None:
    if isinstance(kept, torch.Tensor):
        if kept is not new:
            kept.copy_(new)
    elif isinstance(kept, (list, tuple)):
        for k, n in zip(kept, new):
            _copy_into(k, n)


def _refuse_allocation(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "tilec: a buffer was allocated during graph capture; every buffer of a "
        "captured program must be allocated before capture (a bug in tilec)"
    )


class GraphExecutor:
    """Warm up eagerly, capture once, then replay (see the module docstring).
    ``static_inputs``: positions of the inputs used in place (parameters);
    ``report(reason)`` is told when the program stops using graphs;
    ``copy_seconds(nbytes)``: what copying that many bytes costs on the
    device (None where the target has no figures), which decides whether an
    input that moved is copied or read in place (:meth:`_in_place_now`).
    ``lent``: positions of outputs only the backward reads (a training
    forward's saved activations), returned as the graph's own memory, not
    copied (:meth:`_lent_busy`)."""

    def __init__(
        self,
        eager: EagerExecutor,
        backend: GraphBackend,
        static_inputs: frozenset[int],
        report: Callable[[str], None],
        warmup: int = 1,
        bucket: Sizes | None = None,
        copy_seconds: Callable[[int], float] | None = None,
        lent: frozenset[int] = frozenset(),
    ):
        self.eager = eager
        self.plan = eager.plan
        self.backend = backend
        self.static_inputs = static_inputs
        self.report = report
        self.warmup = warmup
        # A generic program's graph for every size up to these (None: a static program).
        self.bucket = bucket
        graph = self.plan.graph
        self.input_nodes = [graph.nodes[name] for name in graph.inputs]
        self.output_nodes = [
            graph.nodes[name] if name else None
            for k, name in enumerate(graph.outputs)
            if k not in graph.mutations
        ]
        # Inputs and outputs of symbolic shape (made at the bucket's sizes, used at a call's).
        self.symbolic = {
            n.name for n in (*self.input_nodes, *self.output_nodes)
            if n is not None and not ix.is_static(n.shape)
        }  # fmt: skip
        # Inputs a bucket's graph copies into buffers of the bucket's size, never in place.
        self.sized_inputs = {
            k
            for k, n in enumerate(self.input_nodes)
            if bucket is not None and n.name in self.symbolic
        }
        self.mutated_inputs = set(graph.mutations.values())
        # A bucket graph's outputs that are views of buffers, made at each
        # call's sizes of the buffer they view, whose layout is the call's
        # even where their shape is static (output -> its chain of views).
        # (Views of anything else have one layout at every size: sizes_refusal.)
        # Each output's position among the graph's (mutated inputs' come back apart).
        graph_positions = [j for j in range(len(graph.outputs)) if j not in graph.mutations]
        outputs = [self.plan.outputs[j] for j in graph_positions]
        chains = {
            k: self.plan.view_chain(var)
            for k, var in enumerate(outputs)
            if var is not None and self.plan.role_of(var) == Role.VIEW
        }
        self.sized_views = {
            k: chain
            for k, chain in chains.items()
            if bucket is not None and self.plan.role_of(chain.root) == Role.BUFFER
        }
        # A bucket graph's outputs that are sizes (symbolic ints: the capture
        # returned the bucket's), computed at each call's (output -> expression).
        self.size_outputs = {
            k: graph.literal_outputs[j]
            for k, j in enumerate(graph_positions)
            if bucket is not None
            and isinstance(graph.literal_outputs.get(j), sympy.Basic)
            and graph.literal_outputs[j].free_symbols
        }
        # Outputs that are views of an input (output -> the input's position).
        # AOTAutograd makes such an output again from the caller's input with
        # the output's shape, strides and storage offset, so a copy (offset 0)
        # would make the wrong view: it is returned as that view of the
        # caller's input, as the eager call returns it.
        input_vars = {slot.var: k for k, slot in enumerate(self.plan.inputs())}
        self.viewed_inputs = {
            k: input_vars[chain.root] for k, chain in chains.items() if chain.root in input_vars
        }
        self.view_roots: dict[int, torch.Tensor] = {}  # their buffers, once captured
        # Outputs returned as the graph's memory (``lent``): what kernels or
        # library calls of the graph write (or views of it), at static sizes.
        self.lent = frozenset(
            k
            for k, var in enumerate(outputs)
            if k in lent
            and bucket is None
            and var is not None
            and self.plan.role_of(self.plan.view_root(var)) in (Role.BUFFER, Role.LIBRARY)
        )
        # Per lent output, its memory's references when none was lent (the
        # graph's own), counted after each capture.
        self.lent_baseline: dict[int, int] = {}
        self.lent_busy = 0  # calls run eagerly as a lent output was still held
        # Per output: the position of the input it is, returned as it is (None: computed).
        positions = {name: k for k, name in enumerate(graph.inputs)}
        self.returned_inputs = [
            None if node is None else positions.get(node.name) for node in self.output_nodes
        ]
        # The symbols' values the kernels read (a graph captured for a bucket).
        self.size_values: torch.Tensor | None = None
        self.calls = 0
        self.captures = 0
        self.disabled: str | None = None
        self.graph: Any = None
        self.buffers: list[Any] = []  # what the call function was captured with
        self.static_ptrs: tuple[int, ...] = ()
        self.outputs: list[Any] = []
        self.copied: list[int] = []  # positions of the inputs copied into buffers
        self.written_back: list[int] = []  # of those, the ones the graph writes
        self.in_place: list[int] = []  # positions of the inputs read where they are
        self.borrowed: list[int] = []  # of those, the ones on memory another graph lent
        self.replay_bytes = 0  # what a replay copies in and out (``_replay_bytes``)
        self.warm_ptrs: list[int] = []  # the inputs' addresses in the last warm-up call
        self.demoted: set[int] = set()  # inputs that moved after seeming stable
        self.copy_seconds = copy_seconds
        self.capture_s = 0.0  # host seconds the last capture took (measured)
        self.replays = 0  # of the graph captured last
        self.static_moves = 0  # captures because a static input moved
        # Per copied input that may be read in place: its address, and what
        # copying it has cost since it came there (the rent of _promoted).
        self.rent: dict[int, tuple[int, float]] = {}
        self.copy_cost: dict[int, float] = {}  # what copying each of them costs a replay

    def __call__(self, inputs: Sequence[Any], sizes: Sizes) -> list[Any]:
        if self.disabled is not None or self.calls < self.warmup:
            self.calls += 1
            self.warm_ptrs = _pointers(inputs)
            return self.eager(inputs, sizes)
        in_place = self._in_place_now(inputs)
        if in_place is not None:
            reason = self._capture(inputs, in_place)
            if reason is not None:
                self.disabled = reason
                self.graph = self.buffers = self.outputs = None
                self.report(reason)
                return self.eager(inputs, sizes)
        elif self._lent_busy():
            # A replay would write over what a caller still holds (two
            # forwards before their backwards): this call's outputs are new.
            self.lent_busy += 1
            return self.eager(inputs, sizes)
        if self.copied:
            _copy_all(
                [self._input_buffer(k, sizes) for k in self.copied],
                [inputs[k] for k in self.copied],
            )
        if self.size_values is not None:
            values = [sizes[s.name] for s in self.plan.symbols]
            # From pinned memory, queued: a copy from pageable memory waits
            # for the device to finish its queue first (torch's copy_ syncs).
            # torch's pinned allocator keeps the block until the copy ran.
            cuda = self.size_values.is_cuda
            host = torch.tensor(values, dtype=torch.int32, pin_memory=cuda)
            self.size_values.copy_(host, non_blocking=cuda)
        self.backend.replay(self.graph, inputs)
        self.replays += 1
        if self.written_back:  # inputs the graph writes, replayed into copies
            torch._foreach_copy_(
                [inputs[k] for k in self.written_back],
                [self._input_buffer(k, sizes) for k in self.written_back],
            )
        return self._copy_out(inputs, sizes)

    def _lent_busy(self) -> bool:
        """Whether an output lent by the last replay is still held: its
        memory has more references than the graph's own.  After the
        backward, autograd lets go of what it saved."""
        return any(_references(self.outputs[k]) > n for k, n in self.lent_baseline.items())

    def _input_buffer(self, k: int, sizes: Sizes) -> torch.Tensor:
        """Input ``k``'s static buffer, at the call's sizes."""
        return self._at(self.buffers[k], self.input_nodes[k], sizes)

    def _at(self, tensor: torch.Tensor, node: Any, sizes: Sizes) -> torch.Tensor:
        """``tensor`` (made at the bucket's sizes) as ``node`` is at ``sizes``:
        the kernels read and write its elements at the true sizes' strides,
        within the bucket's extent."""
        if self.bucket is None or node.name not in self.symbolic:
            return tensor
        shape, stride = at_sizes(node.shape, sizes), at_sizes(node.buffer_stride, sizes)
        return tensor.as_strided(shape, stride, tensor.storage_offset())

    def _in_place_now(self, inputs: Sequence[Any]) -> set[int] | None:
        """The inputs a capture for this call reads in place, or None when
        the graph captured last serves it.

        The first capture reads in place the static inputs, the inputs
        whose storage did not move since the warm-up call (a static KV
        cache) and those on memory another graph lent (a forward's saved
        activations, in its backward: they stay where the forward's graph
        keeps them).  When an input read in place has moved, the graph is
        captured again: a static input stays in place; one that only seemed
        stable (a KV cache a new ``generate`` made, or a storage that came
        back by chance) stays in place too where the graph it leaves was
        replayed long enough that copying it for as many replays would have
        cost more than a capture, and is copied from then on otherwise.  A
        copied input that then stays put long enough to cost a capture is
        read in place again (:meth:`_promoted`).  On a target without cost
        figures an input that moved stays copied."""
        if self.graph is None:
            ptrs = _pointers(inputs)
            stable = {k for k, p in enumerate(ptrs) if p and p == self.warm_ptrs[k]}
            borrowed = _on_lent_memory(inputs, range(len(inputs)))
            return self.static_inputs | stable | set(borrowed)
        now = self._static_ptrs(inputs)
        moved = {k for k, p, q in zip(self.in_place, now, self.static_ptrs) if p != q}
        if moved:
            self.static_moves += bool(moved & self.static_inputs)
            seeming = moved - self.static_inputs
            copies_s = sum(self._copy_seconds(k, inputs[k]) for k in seeming)
            if seeming and not self._paid(copies_s * self.replays):
                self.demoted |= seeming
            return set(self.in_place) - self.demoted
        promoted = self._promoted(inputs)
        if promoted:
            self.demoted -= promoted
            return set(self.in_place) | promoted
        return None

    def _paid(self, copies_s: float) -> bool:
        """Whether copies that cost ``copies_s`` paid for a capture (never
        without cost figures)."""
        return self.copy_seconds is not None and copies_s >= self.capture_s

    def _copy_seconds(self, k: int, x: Any) -> float:
        """What copying input ``k`` (``x``) costs a replay: read and written
        once into its buffer, and once more back where the graph writes it
        (0 without cost figures)."""
        if self.copy_seconds is None or not isinstance(x, torch.Tensor):
            return 0.0
        return self.copy_seconds(x.nbytes * (4 if k in self.mutated_inputs else 2))

    def _promoted(self, inputs: Sequence[Any]) -> set[int]:
        """The copied inputs to read in place from this call on: of those
        that stayed where they are, the costliest to copy, as many as it
        takes for their copies so far to cost more than the last capture
        took (a rental paid up to the price of buying: at most twice what
        knowing the future would have cost; a small input whose storage
        happens to come back, like a token id's, does not come along with a
        KV cache).  An input copied because it has a symbolic shape is never
        one."""
        if self.copy_seconds is None or not self.rent:
            return set()
        for k, (ptr, paid) in self.rent.items():
            now = inputs[k].data_ptr()
            self.rent[k] = (now, paid + self.copy_cost[k] if now == ptr else 0.0)
        if not self._paid(sum(paid for _, paid in self.rent.values())):
            return set()  # (most replays: nothing to choose)
        stayed = sorted(((paid, k) for k, (_, paid) in self.rent.items() if paid > 0), reverse=True)
        chosen, total = set(), 0.0
        for paid, k in stayed:
            chosen.add(k)
            total += paid
            if self._paid(total):
                return chosen
        return set()

    def _static_ptrs(self, inputs: Sequence[Any]) -> tuple[int, ...]:
        return tuple(inputs[k].data_ptr() for k in self.in_place)

    def _copy_out(self, inputs: Sequence[Any], sizes: Sizes) -> list[Any]:
        """The call's outputs: copies of the graph's, but an input returned
        as it is (a parameter a training forward saves for its backward),
        which is the caller's tensor, as the eager call returns it."""
        returned = self.returned_inputs
        viewed = {k: view for k, view in self._input_views(inputs).items() if view is not None}
        copied = self._copied_outputs(viewed)
        tensors = [
            self.sized_views[k].at(self.view_roots[k], sizes)
            if k in self.sized_views
            else self._at(self.outputs[k], self.output_nodes[k], sizes)
            for k in copied
        ]
        # Laid out as the eager call returns them: a strided view (one of a
        # tensor's chunks, a training forward's saved activation, an
        # expanded one too) keeps its strides, which the backward's kernels
        # were compiled to read (``empty_like`` would make it dense).
        fresh = [_like(t) for t in tensors]
        _copy_all(fresh, tensors)
        results = list(self.outputs)
        for k, t in zip(copied, fresh):
            results[k] = t
        for k, given in enumerate(returned):
            if given is not None and isinstance(self.outputs[k], torch.Tensor):
                results[k] = inputs[given]
        for k, view in viewed.items():
            results[k] = view
        for k, size in self.size_outputs.items():
            results[k] = at_sizes(size, sizes)
        for k in self.lent_baseline:  # a tensor of its own, on the graph's memory
            out = self.outputs[k]
            results[k] = out.as_strided(out.shape, out.stride(), out.storage_offset())
        return results

    def _copied_outputs(self, viewed: Container[int]) -> list[int]:
        """The outputs a replay copies out: all but the inputs returned as
        they are, the views of inputs (``viewed``) and the lent ones."""
        return [
            k
            for k, (o, given) in enumerate(zip(self.outputs, self.returned_inputs))
            if isinstance(o, torch.Tensor)
            and given is None
            and k not in viewed
            and k not in self.lent_baseline
        ]

    def _replay_bytes(self) -> int:
        """The bytes a replay of the graph captured last copies (at the
        bucket's sizes): the copied inputs into their buffers, those the
        graph writes back out, and the copied outputs out of the graph
        (views of inputs counted as made, not copied)."""
        inputs = [self.buffers[k] for k in (*self.copied, *self.written_back)]
        outputs = [self.outputs[k] for k in self._copied_outputs(self.viewed_inputs)]
        return sum(t.nbytes for t in (*inputs, *outputs))

    def _input_views(self, inputs: Sequence[Any]) -> dict[int, torch.Tensor | None]:
        """Each output that is a view of an input, as that view of the
        caller's input (its layout within the graph's buffer, moved to the
        caller's tensor); None where the caller's tensor is laid out
        otherwise than the buffer (a backward's input), which is copied."""
        views: dict[int, torch.Tensor | None] = {}
        for k, position in self.viewed_inputs.items():
            out, base, given = self.outputs[k], self.buffers[position], inputs[position]
            if (
                base is None
                or not isinstance(given, torch.Tensor)
                or given.stride() != base.stride()
            ):
                views[k] = None
                continue
            offset = given.storage_offset() + out.storage_offset() - base.storage_offset()
            views[k] = given.as_strided(out.shape, out.stride(), offset)
        return views

    def _capture(self, inputs: Sequence[Any], in_place: set[int]) -> str | None:
        """Capture the call function reading the inputs ``in_place`` where
        they are (the replay reads them there, and a call where one moved
        captures again) and copying the others into buffers; the reason
        when it cannot be (or no longer should be) captured."""
        if self.static_moves > RECAPTURE_LIMIT:
            return f"static inputs moved {RECAPTURE_LIMIT} times; it runs eagerly from now on"
        device = self.eager.device
        others = [x for x in inputs if isinstance(x, torch.Tensor) and x.device != device]
        if others:
            return f"an input is on {others[0].device}, not {device}"
        if self.captures:
            log.info("%s: an input moved or stayed; capturing again", self.plan.graph.name)
        self.captures += 1
        if device.type == "cuda":  # what the capture takes, not the work queued before it
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        self.in_place = sorted(in_place - self.sized_inputs)
        self.buffers = [
            x if k in self.in_place or not isinstance(x, torch.Tensor) else self._like(k, x)
            for k, x in enumerate(inputs)
        ]
        # Memory another graph lent (a forward's saved activations, in its
        # backward), read in place: the graph keeps its address, no tensor
        # on it, else the forward would find it held at every call
        # (``_lent_busy``).
        on_lent = _on_lent_memory(inputs, self.in_place)
        # Per storage, an input on it (several may be: a result and a view of it).
        borrowed = {inputs[k].untyped_storage().data_ptr(): k for k in on_lent}
        self.copied = [k for k, x in enumerate(inputs) if self.buffers[k] is not x]
        self.written_back = [k for k in self.copied if k in self.mutated_inputs]
        self.static_ptrs = self._static_ptrs(inputs)
        may_stay = [k for k in self.copied if k not in self.sized_inputs]
        self.copy_cost = {k: self._copy_seconds(k, inputs[k]) for k in may_stay}
        self.rent = {k: (inputs[k].data_ptr(), 0.0) for k in may_stay}
        self.replays = 0
        namespace = self.eager.prepare(static_buffers=True, bucket=self.bucket)
        namespace["empty_strided"] = _refuse_allocation
        bucketed = self.bucket is not None
        exec(self.plan.source(static_buffers=True, device_sizes=bucketed), namespace)  # noqa: S102
        static = [t for t in self.buffers if isinstance(t, torch.Tensor)]
        static += [self.eager.arena, *self.eager.constants.values()]
        static += [namespace[s.var] for s in self._buffer_slots()]
        self.view_roots = {k: namespace[chain.root] for k, chain in self.sized_views.items()}
        if bucketed:
            values = [self.bucket[s.name] for s in self.plan.symbols]
            self.size_values = torch.tensor(values, dtype=torch.int32, device=device)
            namespace["size_values"] = self.size_values
            static.append(self.size_values)
            job = Capture(
                lambda: namespace["run"](*self.buffers, self.bucket),
                namespace,
                self.plan,
                static,
                borrowed,
            )
        else:
            job = Capture(
                lambda: namespace["run"](*self.buffers), namespace, self.plan, static, borrowed
            )
        try:
            self.graph, self.outputs = self.backend.capture(job)
        except Exception as e:
            # The buffers changed: the graph captured before reads others.
            self.graph, self.outputs = None, []
            if not self.plan.fallbacks():
                raise  # tilec's own steps always capture: a failure is a bug
            # An ATen fallback that synchronizes, which _uncapturable missed.
            return f"capture failed in an ATen fallback, so it runs eagerly: {e}".splitlines()[0]
        self.capture_s = time.perf_counter() - start
        self._find_library_views()
        self.borrowed = on_lent
        for k in self.borrowed:  # its address is all the graph keeps (``Capture.borrowed``)
            self.buffers[k] = None
        self.lent_baseline = {
            k: _references(self.outputs[k])
            for k in self.lent
            if isinstance(self.outputs[k], torch.Tensor)
            and k not in self.viewed_inputs
            and self.returned_inputs[k] is None
        }
        if self.lent_baseline:
            _LENDERS.add(self)
        self.replay_bytes = self._replay_bytes()
        return None

    def lent_memory(self) -> set[int]:
        """Where the outputs this graph lends are (their storages' addresses)."""
        if not self.outputs:
            return set()
        return {self.outputs[k].untyped_storage().data_ptr() for k in self.lent_baseline}

    def _find_library_views(self) -> None:
        """Add to :attr:`viewed_inputs` the captured outputs that share an
        input's memory without being a view the plan made: an ATen
        fallback of a view op (``as_strided``).  A copy of one would start
        at offset 0, and AOTAutograd, remaking the output from the caller's
        input by its storage offset, would return the wrong view."""
        storages = {
            x.untyped_storage().data_ptr(): k
            for k, x in enumerate(self.buffers)
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr()
        }
        for k, out in enumerate(self.outputs):
            if (
                isinstance(out, torch.Tensor)
                and k not in self.viewed_inputs
                and self.returned_inputs[k] is None
                and out.untyped_storage().data_ptr() in storages
            ):
                self.viewed_inputs[k] = storages[out.untyped_storage().data_ptr()]

    def _like(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """A static buffer for input ``k``, laid out as the kernels read it
        (its node's layout; for an input of symbolic shape, at the bucket's
        sizes): the copy into it lays out whatever the caller gave.  Dynamo
        guards a user's inputs' strides, but nothing guards a backward's
        (the activations its forward saved)."""
        node = self.input_nodes[k]
        if ix.is_static(node.shape):
            shape, stride = node.shape, node.buffer_stride
        elif self.bucket is None:  # (a graph of symbolic shapes is captured per bucket)
            return _like(x)
        else:
            shape, stride = (
                at_sizes(node.shape, self.bucket),
                at_sizes(node.buffer_stride, self.bucket),
            )
        return torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device)

    def _buffer_slots(self) -> list[Slot]:
        return [s for s in self.plan.slots.values() if s.role == Role.BUFFER]

    def stub_compute(self) -> None:
        self.eager.stub_compute()


def bucket_of(value: int) -> int:
    """The size bucket of a symbol's value: the next power of two, at least :data:`MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << (value - 1).bit_length())


class BucketExecutor:
    """A generic program (symbolic sizes) under graphs: one graph per size
    bucket (every symbol's value rounded up by :func:`bucket_of`), captured
    at the bucket's sizes and replayed for every call whose sizes fall in it.

    The graph's kernels read the call's sizes from a device tensor written
    before each replay (``Plan.source(device_sizes=True)``), so grids and
    buffers are the bucket's and the programs past the true sizes are
    masked off, as for any size that is not a multiple of a block.  Inputs of
    symbolic shape are copied into buffers of the bucket's size, laid out at
    the call's sizes; outputs are copied out at them.  The first call runs
    eagerly (warm-up); a call whose bucket breaks the program's guards, or
    past :data:`BUCKET_LIMIT` buckets, runs eagerly too, and so does one
    that ``refuses`` refuses (``Program``: where copying the inputs and
    outputs of symbolic shape costs more than the launches a replay saves).
    What a graph can serve is :meth:`Plan.sizes_refusal`'s to say."""

    def __init__(
        self,
        eager: EagerExecutor,
        capture: Callable[[Sizes, Callable[[str], None]], GraphExecutor],
        refuses: Callable[[Sizes], str | None],
        warmup: int = 1,
        stopped: Callable[[Sizes, str], None] = lambda bucket, reason: None,
    ):
        self.eager = eager
        self.plan = eager.plan
        # (a bucket's sizes, what to call if its graph stops) -> the executor of its graph
        self.capture = capture
        self.refuses = refuses  # a bucket's sizes -> why no graph serves it (or None)
        self.stopped = stopped  # told when a bucket's graph stops (its sizes, why)
        self.warmup = warmup
        self.calls = 0
        self.warm_ptrs: list[int] = []
        self.graphs: dict[tuple[int, ...], GraphExecutor] = {}
        self.refused: dict[tuple[int, ...], str] = {}  # buckets that run eagerly, and why
        self.eager_calls = 0  # calls that no graph served (after the warm-up)

    def __call__(self, inputs: Sequence[Any], sizes: Sizes) -> list[Any]:
        if self.calls < self.warmup:
            self.calls += 1
            self.warm_ptrs = _pointers(inputs)
            return self.eager(inputs, sizes)
        bucket = {s.name: bucket_of(sizes[s.name]) for s in self.plan.symbols}
        key = tuple(bucket.values())
        graph = self.graphs.get(key)
        if graph is None and key not in self.refused:
            if len(self.graphs) >= BUCKET_LIMIT:
                self.refused[key] = f"{BUCKET_LIMIT} buckets captured already"
            else:
                reason = self.refuses(bucket)
                if reason is not None:
                    self.refused[key] = reason
            if key in self.refused:
                log.info("%s: sizes up to %s run eagerly: %s", self.plan.graph.name, bucket,
                         self.refused[key])  # fmt: skip
        if key in self.refused:
            self.eager_calls += 1
            return self.eager(inputs, sizes)
        if graph is None:
            graph = self.capture(bucket, functools.partial(self._stop, key, bucket))
            graph.warm_ptrs = self.warm_ptrs
            self.graphs[key] = graph
            log.info("%s: capturing for sizes up to %s", self.plan.graph.name, bucket)
        return graph(inputs, sizes)

    def _stop(self, key: tuple[int, ...], bucket: Sizes, reason: str) -> None:
        """Bucket ``key``'s graph stopped (its static inputs kept moving):
        its sizes run eagerly from now on; the other buckets keep theirs."""
        self.refused[key] = reason
        del self.graphs[key]
        self.stopped(bucket, reason)

    def stub_compute(self) -> None:
        self.eager.stub_compute()


# The graphs that lend outputs (``GraphExecutor``'s ``lent``), while they live.
_LENDERS: weakref.WeakSet[GraphExecutor] = weakref.WeakSet()


def _lent_memory() -> set[int]:
    """Where every living graph's lent outputs are."""
    return set().union(*(lender.lent_memory() for lender in list(_LENDERS)))


def _on_lent_memory(inputs: Sequence[Any], positions: Iterable[int]) -> list[int]:
    """Of ``positions``, those of the ``inputs`` on memory a living graph
    lent (:func:`_lent_memory`)."""
    lent = _lent_memory()
    return [
        k
        for k in positions
        if isinstance(inputs[k], torch.Tensor) and inputs[k].untyped_storage().data_ptr() in lent
    ]


def _references(x: torch.Tensor) -> int:
    """References to ``x``'s memory (its storage): one per tensor viewing
    it, the graph's own among them."""
    return torch._C._storage_Use_Count(x.untyped_storage()._cdata)


def _pointers(inputs: Sequence[Any]) -> list[int]:
    """Each tensor input's address (0 for other inputs)."""
    return [x.data_ptr() if isinstance(x, torch.Tensor) else 0 for x in inputs]


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy each of ``srcs`` into the same-shaped tensor of ``dsts``.  A
    destination whose elements share memory (an expanded view a training
    forward saved, kept in the layout its backward's kernels read) cannot
    take an elementwise copy: where the source has its strides, the memory
    the view spans is copied whole; elsewhere, where it shares memory only
    along dimensions of stride 0, each such dimension's first element is
    copied (the one the kernels read)."""
    plain: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dst, src in zip(dsts, srcs):
        if dst.numel() == 0:
            continue
        if not _may_overlap(dst):
            plain.append((dst, src))
        elif dst.stride() == src.stride():
            plain.append((_spanned(dst), _spanned(src)))
        else:
            plain.append(_first_of_expanded(dst, src))
    if plain:
        torch._foreach_copy_([d for d, _ in plain], [s for _, s in plain])


def _spanned(x: torch.Tensor) -> torch.Tensor:
    """The memory ``x`` spans (its first element to its last), as a vector."""
    extent = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n)
    return x.as_strided((extent,), (1,), x.storage_offset())


def _first_of_expanded(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` narrowed to the first element of each dimension
    along which ``dst`` has stride 0; an error if ``dst`` overlaps still."""
    for d, (n, st) in enumerate(zip(dst.shape, dst.stride())):
        if st == 0 and n > 1:
            dst, src = dst.narrow(d, 0, 1), src.narrow(d, 0, 1)
    if _may_overlap(dst):
        raise RuntimeError(
            f"tilec: cannot copy a tensor of strides {tuple(src.stride())} into a graph's "
            f"buffer of shape {tuple(dst.shape)} and strides {tuple(dst.stride())}, whose "
            "elements share memory other than along expanded dimensions"
        )
    return dst, src


def _may_overlap(x: torch.Tensor) -> bool:
    """Whether two elements of ``x`` may share memory (asked of every
    buffer on every replay, so each layout is worked out once)."""
    return _layout_overlaps(x.shape, x.stride())


@functools.lru_cache(maxsize=4096)
def _layout_overlaps(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    """Whether two elements of a tensor so laid out may share memory:
    unless each dimension's stride (smallest first) passes the farthest
    element the smaller ones reach."""
    reach = 0
    for stride, size in sorted((st, n) for n, st in zip(shape, strides) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def capture_refusal(plan: Plan, kind: str) -> Reason | None:
    """Why a program cannot be captured into a graph; None when it can."""
    if kind != "inference" and plan.symbols:
        return Reason(
            "training_graph",
            f"{kind} graph of symbolic sizes: training graphs are captured at static sizes only",
        )
    refused = plan.sizes_refusal()
    if refused is not None:
        return Reason(
            "symbolic_sizes",
            f"dynamic shapes: {refused} (the generic variant runs eagerly)",
        )
    for step in plan.fallbacks():
        why = _uncapturable(plan, step.node)
        if why is not None:
            return Reason("aten_fallback", f"ATen fallback {step.node.extern.target} {why}")
    return None


# ATen ops that wait for the device to read a value on the host (an error
# flag, a range) although their tags do not say so.
HOST_READS = frozenset(
    {
        torch.ops.aten._linalg_check_errors.default,  # raises on the info tensor's value
        torch.ops.aten.histc.default,  # min == max: reads the input's range
        torch.ops.aten.is_nonzero.default,
    }
)
# Tags of an op whose result or shape the host computes from the data (or
# that says it cannot be captured; torch names the tag from 2.9 on).
HOST_TAGS = tuple(
    getattr(torch.Tag, name)
    for name in ("data_dependent_output", "dynamic_output_shape", "cudagraph_unsafe")
    if hasattr(torch.Tag, name)
)
INDEXING = frozenset(
    {
        torch.ops.aten.index.Tensor,
        torch.ops.aten.index_put.default,
        torch.ops.aten.index_put_.default,
        torch.ops.aten._unsafe_index_put.default,
    }
)


def _uncapturable(plan: Plan, node: Any) -> str | None:
    """Why an ATen fallback cannot be replayed from a graph (None: it can,
    as Inductor captures its own: a graph replays its kernels, and the
    memory it allocated during capture comes from the graph's pool).  A
    replay skips whatever the host did during capture, so the op must be
    all device work: an ATen op, on the graph's device, neither reading a
    value back (which also fails the capture) nor shaping its result by
    one.  Anything else, or an op this misses, runs eagerly: a capture that
    fails is reported and the program runs without graphs
    (:meth:`GraphExecutor._capture`)."""
    extern = node.extern
    target = extern.target
    if extern.device is not None:
        return f"touches a tensor on {extern.device}"
    if target is torch.ops.higher_order.with_effects:
        return f"of {extern.args[1]} has effects on the host (a replay would skip them)"
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return "is not an ATen op (it may run host code that a replay would skip)"
    tags = [t.name for t in HOST_TAGS if t in target.tags]
    if tags:
        return f"is tagged {tags[0]} (the host reads its data)"
    if target in HOST_READS:
        return "reads a value on the host (it waits for the device)"
    if target in INDEXING and any(plan.graph.nodes[i].dtype == torch.bool for i in node.inputs):
        return "indexes by a boolean mask (the host counts its elements)"
    return None
