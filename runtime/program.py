"""A compiled graph as a static program: buffers and an ordered list of steps.

Everything that can be decided once is decided when the Program is built:
the order of kernel launches and library calls, every launch's grid and
arguments (as positions in one flat list of tensor slots), and the buffers to
allocate.  A call allocates the buffers, runs the steps and returns the
output slots.

A graph compiled for symbolic sizes (the generic variant of a dynamic graph)
is called with the size symbols' values, ``program(*inputs, sizes={"s0": 7})``:
grids, size arguments of kernels, the shapes of per-call buffers and the
arguments of library calls and views are evaluated from them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy
import sympy
import torch

from tilec import index as ix
from tilec.codegen.kernel import KernelSource
from tilec.codegen.templates import INT32_LIMIT
from tilec.interpret import run_extern
from tilec.ir import Graph, Node

Sizes = dict[str, int]  # values of the size symbols, by name ({} for static graphs)


@dataclasses.dataclass
class Launch:
    kernel: KernelSource
    fn: Any
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        launch = self.kernel.launch
        # Programs per grid dimension; symbolic graphs evaluate them per call.
        self.grid = launch.grid
        self.bind_grid = size_binder(launch.grid)
        self.options = {
            **launch.constexprs,
            "num_warps": launch.num_warps,
            "num_stages": launch.num_stages,
        }

    def run(self, slots: list[Any], sizes: Sizes) -> None:
        grid = self.grid if self.bind_grid is None else self.bind_grid(sizes)
        if not all(grid):
            return  # nothing to compute (a symbolic count that is 0 in this call)
        self.fn[grid](
            *(slots[s] for s in self.slots),
            *(sizes[s.name] for s in self.kernel.sizes),
            **self.options,
        )


def size_binder(value: Any) -> Callable[[Sizes], Any] | None:
    """A function giving ``value`` (a size, or lists/tuples holding some) with
    its symbolic sizes evaluated for a call's sizes; None when it holds none.
    Built when the Program is built, so a size the runtime cannot evaluate
    fails the compilation (the dispatcher then specializes) rather than a
    call, and a call does no sympy work."""
    if isinstance(value, sympy.Basic):
        return ix.size_function(value)
    if isinstance(value, (list, tuple)):
        parts = [size_binder(v) for v in value]
        if not any(parts):
            return None
        kind = type(value)
        return lambda sizes: kind(v if p is None else p(sizes) for v, p in zip(value, parts))
    return None


@dataclasses.dataclass
class ExternStep:
    node: Node
    slots: tuple[int, ...]
    out: int

    def __post_init__(self) -> None:
        call = self.node.extern
        self.bind = size_binder((self.node.shape, self.node.stride, call.args, call.kwargs))

    def run(self, slots: list[Any], sizes: Sizes) -> None:
        node = self.node
        if self.bind is not None:
            shape, stride, args, kwargs = self.bind(sizes)
            call = dataclasses.replace(node.extern, args=args, kwargs=kwargs)
            node = dataclasses.replace(node, shape=shape, stride=stride, extern=call)
        result = run_extern(node, [slots[s] for s in self.slots])
        if isinstance(result, torch.Tensor) and node.stride is not None and result.numel() > 1:
            if tuple(result.stride()) != node.stride:
                # Codegen baked the strides fake tensors predicted; keep that promise.
                fixed = torch.empty_strided(
                    node.shape, node.stride, dtype=result.dtype, device=result.device
                )
                result = fixed.copy_(result)
        slots[self.out] = result


@dataclasses.dataclass
class ViewStep:
    node: Node
    src: int
    out: int

    def __post_init__(self) -> None:
        self.bind = size_binder((self.node.view.args, self.node.shape))

    def run(self, slots: list[Any], sizes: Sizes) -> None:
        view, shape = self.node.view, self.node.shape
        if self.bind is not None:
            args, shape = self.bind(sizes)
            view = dataclasses.replace(view, args=args)
        slots[self.out] = view.apply(slots[self.src], shape)


@dataclasses.dataclass
class Buffer:
    slot: int
    shape: ix.Shape
    stride: ix.Shape
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self.bind = size_binder((self.shape, self.stride))


class Program:
    """Run a fused graph: ``program(*inputs) -> list of outputs``."""

    def __init__(
        self,
        graph: Graph,
        kernels: dict[str, tuple[KernelSource, Any]],
        device: torch.device,
    ):
        self.graph = graph
        self.device = device
        self.slot_of: dict[str, int] = {}
        self.steps: list[Launch | ExternStep | ViewStep] = []
        self.buffers: list[Buffer] = []
        self.constants: list[tuple[int, torch.Tensor]] = []
        for name in graph.inputs:
            self._slot(name)
        for name, tensor in graph.constants.items():
            self.constants.append((self._slot(name), tensor.to(device)))
        # Intermediates live in one arena, allocated on the first call (a
        # Program is built under the compiler's fake tensors) and reused by
        # every call after it, so one Program runs one call at a time.
        self.arena: torch.Tensor | None = None
        self.planned: list[tuple[int, Node]] = []
        self.arena_views: list[tuple[int, torch.Tensor]] = []
        self._schedule(kernels)
        self.output_slots = [
            None if k in graph.literal_outputs else self._materialize(name)
            for k, name in enumerate(graph.outputs)
        ]
        self.num_slots = len(self.slot_of)
        self.bind_literals = size_binder(tuple(graph.literal_outputs.values()))
        self.kernel_times: dict[str, list[float]] | None = None
        # Symbolic graphs index with 32-bit integers (codegen chose them for
        # the sizes compiled for): every tensor and every kernel's iteration
        # space must stay below 2**31 elements.
        counts = {ix.numel(n.shape) for n in graph.nodes.values() if n.kind != "view"}
        counts |= {ix.size(k.xnumel * k.rnumel) for k, _ in kernels.values()}
        # Only counts no other one always reaches (s0 follows from 64*s0).
        self.size_limits: list[sympy.Expr] = []
        for c in sorted((c for c in counts if not isinstance(c, int)), key=str):
            if not any(ix.always_positive(k - c + 1) for k in self.size_limits):
                self.size_limits = [
                    k for k in self.size_limits if not ix.always_positive(c - k + 1)
                ] + [c]
        self._limit_checks = [ix.size_function(c) for c in self.size_limits]

    def guards(self) -> list[str]:
        """What the code assumes of the size symbols (symbolic graphs)."""
        symbols = sorted({s.name for c in self.size_limits for s in ix.size_symbols(c)})
        return [f"{s} >= 2" for s in symbols] + [f"{c} <= {INT32_LIMIT}" for c in self.size_limits]

    def accepts(self, sizes: Sizes) -> str | None:
        """None when the program runs a call with these sizes, else the failed guard."""
        for count, check in zip(self.size_limits, self._limit_checks):
            if check(sizes) > INT32_LIMIT:
                return f"{count} <= {INT32_LIMIT}"
        for name, value in sizes.items():
            if value < 2:
                return f"{name} >= 2"
        return None

    def _slot(self, name: str) -> int:
        if name not in self.slot_of:
            self.slot_of[name] = len(self.slot_of)
        return self.slot_of[name]

    def _materialize(self, name: str) -> int:
        """Slot holding node ``name`` as a real tensor (views applied by torch)."""
        if name in self.slot_of:
            return self.slot_of[name]
        node = self.graph.nodes[name]
        if node.kind == "view":
            src = self._materialize(node.inputs[0])
            out = self._slot(name)
            self.steps.append(ViewStep(node, src, out))
            return out
        raise KeyError(f"node %{name} is used before it is computed")

    def _schedule(self, kernels: dict[str, tuple[KernelSource, Any]]) -> None:
        for u in self.graph.schedule:
            if u in kernels:
                self._add_launch(*kernels[u])
            else:
                node = self.graph.nodes[u]
                slots = tuple(self._materialize(i) for i in node.inputs)
                self.steps.append(ExternStep(node, slots, self._slot(u)))

    def _allocate_arena(self) -> None:
        plan = self.graph.memory
        self.arena = torch.empty(plan.arena_bytes, dtype=torch.uint8, device=self.device)
        for slot, node in self.planned:
            offset, size = plan.offsets[node.name], plan.sizes[node.name]
            flat = self.arena[offset : offset + size].view(node.dtype)
            self.arena_views.append((slot, flat.as_strided(node.shape, node.buffer_stride)))

    def _add_launch(self, kernel: KernelSource, fn: Any) -> None:
        slots = []
        for arg in kernel.args:
            if arg.is_output and arg.buffer not in self.slot_of:
                node = self.graph.nodes[arg.buffer]
                slot = self._slot(arg.buffer)
                offset = self.graph.memory.offsets.get(arg.buffer)
                if offset is None:  # may outlive the call: allocated per call
                    self.buffers.append(Buffer(slot, node.shape, node.buffer_stride, node.dtype))
                else:
                    self.planned.append((slot, node))
            slots.append(self.slot_of[arg.buffer])
        launch = Launch(kernel, fn, tuple(slots))
        if launch.bind_grid is not None or all(launch.grid):  # else nothing to compute
            self.steps.append(launch)

    def __call__(self, *inputs: torch.Tensor, sizes: Sizes | None = None) -> list[Any]:
        """Run the program; ``sizes``: the size symbols' values, for a
        graph compiled with symbolic sizes."""
        sizes = sizes or {}
        slots: list[Any] = [None] * self.num_slots
        slots[: len(inputs)] = inputs
        for slot, tensor in self.constants:
            slots[slot] = tensor
        if self.arena is None:
            self._allocate_arena()
        for slot, tensor in self.arena_views:
            slots[slot] = tensor
        for b in self.buffers:
            shape, stride = (b.shape, b.stride) if b.bind is None else b.bind(sizes)
            slots[b.slot] = torch.empty_strided(shape, stride, dtype=b.dtype, device=self.device)
        if self.kernel_times is not None:
            self._run_timed(slots, sizes)
        elif self.device.type == "cuda":
            for step in self.steps:
                step.run(slots, sizes)
        else:
            # The interpreter computes masked-off lanes too (0/0 in a ragged
            # tail, say); numpy's warnings about them are noise.
            with numpy.errstate(all="ignore"):
                for step in self.steps:
                    step.run(slots, sizes)
        literals = self.graph.literal_outputs
        if self.bind_literals is not None:  # sizes returned as values (for a backward graph)
            literals = dict(zip(literals, self.bind_literals(sizes)))
        return [literals[k] if s is None else slots[s] for k, s in enumerate(self.output_slots)]

    def profile(self, enabled: bool = True) -> None:
        """Time every kernel launch of the following calls (slower: each launch
        is timed alone) into ``kernel_times``: kernel name -> seconds per call."""
        self.kernel_times = {} if enabled else None

    def _run_timed(self, slots: list[Any], sizes: Sizes) -> None:
        cuda = self.device.type == "cuda"
        timed: list[tuple[str, Any, Any]] = []
        with numpy.errstate(all="ignore"):
            for step in self.steps:
                if not isinstance(step, Launch):
                    step.run(slots, sizes)
                    continue
                if cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    step.run(slots, sizes)
                    end.record()
                else:
                    start = time.perf_counter()
                    step.run(slots, sizes)
                    end = time.perf_counter()
                timed.append((step.kernel.name, start, end))
        if cuda:
            torch.cuda.synchronize()
        for name, start, end in timed:
            seconds = start.elapsed_time(end) / 1000 if cuda else end - start
            self.kernel_times.setdefault(name, []).append(seconds)

    def launches(self) -> list[Launch]:
        return [step for step in self.steps if isinstance(step, Launch)]

    def describe(self) -> str:
        """One line per step, in execution order (for dumps)."""
        lines = []
        for step in self.steps:
            if isinstance(step, Launch):
                k = step.kernel
                grid = "".join(f"{ix.print_index(sympy.sympify(g))}," for g in step.grid)
                constexprs = " ".join(f"{name}={v}" for name, v in k.launch.constexprs.items())
                params = ", ".join(f"{p}=%{a.buffer}" for p, a in zip(k.params, k.args)) + "".join(
                    f", {p}={s}" for p, s in zip(k.params[len(k.args) :], k.sizes)
                )
                lines.append(
                    f"launch {k.name} = {k.function}({params}) grid=({grid}) {constexprs} "
                    f"reads={k.bytes_read}B writes={k.bytes_written}B "
                    f"flops={k.flops} warps={k.launch.num_warps} ({k.template})"
                )
            elif isinstance(step, ExternStep):
                lines.append(
                    f"{step.node.extern.role} %{step.node.name} = {step.node.extern.target}"
                )
            else:
                lines.append(f"view %{step.node.name} = {step.node.view.op}")
        return "\n".join(lines) + "\n"
