"""A compiled graph, ready to call: its plan and the executor that runs it.

``Program(graph, kernels, device)`` builds the :class:`~tilec.runtime.plan.Plan`
(every slot's role, the steps, the call function's source) and an executor
(:mod:`tilec.runtime.executors`): eager by default, or one that captures
the call into a CUDA graph (or its CPU stand-in) and replays it, when built
with ``graphs=`` and the plan allows it (``cudagraphs`` says what was
decided and why).

A graph compiled for symbolic sizes (the generic variant of a dynamic graph)
is called with the size symbols' values, ``program(*inputs, sizes={"s0": 7})``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy
import sympy
import torch
from triton.runtime.errors import InterpreterError

from tilec import cost
from tilec import index as ix
from tilec.codegen.kernel import KernelSource
from tilec.codegen.launch import INT32_LIMIT, interpreter_checks
from tilec.decisions import Decision, Reason
from tilec.ir import INDEX_ERROR, Graph
from tilec.runtime.executors import (
    BUCKET_LIMIT,
    MIN_BUCKET,
    BucketExecutor,
    EagerExecutor,
    GraphBackend,
    GraphExecutor,
    capture_refusal,
)
from tilec.runtime.plan import LaunchStep, LibraryStep, Plan, at_sizes
from tilec.target import Target

Sizes = dict[str, int]  # values of the size symbols, by name ({} for static graphs)

log = logging.getLogger("tilec.cudagraphs")

# Triton's interpreter patches process-wide state while it runs a kernel
# (``triton.language``'s builtins): two threads interpreting at once, even
# different kernels, fail inside it.  Every program's call on the CPU holds
# this lock.
INTERPRETER_LOCK = threading.RLock()


class Program:
    """Run a fused graph: ``program(*inputs) -> list of outputs``.

    ``graphs``: capture the program into graphs from this backend (after one
    warm-up call) and replay them; ``static_inputs``: positions of inputs
    that keep their storage between calls (parameters), used in place by a
    captured graph; ``kind``: ``inference``, ``forward`` or ``backward``.
    ``on_decision(decision)`` is told what became of graph capture (dumps).
    ``direct_launch``: launch kernels outside captured graphs through
    :class:`~tilec.runtime.launcher.DirectLaunch`.  ``saved_outputs``:
    positions of a training forward's outputs that only its backward reads
    (the activations it saves), which a replay returns as the graph's
    memory instead of copies (``GraphExecutor``'s ``lent``); ``lent_inputs``:
    positions of a backward's inputs that its forward lends so, which its
    graph reads where they lie (``Capture.borrowed``)."""

    def __init__(
        self,
        graph: Graph,
        kernels: dict[str, tuple[KernelSource, Any]],
        device: torch.device,
        graphs: GraphBackend | None = None,
        static_inputs: frozenset[int] = frozenset(),
        kind: str = "inference",
        on_decision: Callable[[Decision], None] | None = None,
        direct_launch: bool = False,
        saved_outputs: frozenset[int] = frozenset(),
        lent_inputs: frozenset[int] = frozenset(),
    ):
        self.graph = graph
        self.saved_outputs = saved_outputs
        self.lent_inputs = lent_inputs
        self.device = device
        self.plan = Plan(graph, kernels, static_inputs)
        self.target = Target.for_device(device)
        users = graph.users()
        constants = {
            self.plan.slots[name].var: tensor.to(constant_device(graph, name, device, users))
            for name, tensor in graph.constants.items()
        }
        self.eager = EagerExecutor(self.plan, device, constants, direct_launch)
        # One call at a time (``__call__``), and the stream of the last.
        self._lock = threading.RLock()
        self._stream: torch.cuda.Stream | None = None
        self.executor: EagerExecutor | GraphExecutor | BucketExecutor = self.eager
        self.kernel_times: dict[str, list[float]] | None = None
        self.size_limits = self.plan.size_limits
        self._limit_checks = [ix.size_function(c) for c in self.size_limits]
        self._on_decision = on_decision or (lambda decision: None)
        # What became of graph capture (None: not asked for).
        self.capture: Decision | None = None
        if graphs is not None:
            copy_seconds = (
                functools.partial(cost.memory_seconds, self.target)
                if cost.has_figures(self.target)
                else None
            )
            refused = capture_refusal(self.plan, kind)
            if refused is None and kind != "inference":
                why = self.training_refusal(static_inputs)
                refused = (
                    None if why is None else Reason("copies_cost_more", f"{kind} graph: {why}")
                )
            if refused is None and self.plan.symbols:

                def capture(bucket: Sizes, stopped: Callable[[str], None]) -> GraphExecutor:
                    return GraphExecutor(
                        self.eager, graphs, static_inputs, stopped, 0, bucket, copy_seconds
                    )

                self.executor = BucketExecutor(
                    self.eager, capture, self.bucket_refusal, stopped=self._bucket_stopped
                )
                self._decide(
                    "captured",
                    Reason(
                        "capturable",
                        f"after one warm-up call, one graph per size bucket (powers of two "
                        f"from {MIN_BUCKET}, at most {BUCKET_LIMIT}), then replayed",
                    ),
                )
            elif refused is None:
                self.executor = GraphExecutor(
                    self.eager,
                    graphs,
                    static_inputs,
                    self._stopped,
                    copy_seconds=copy_seconds,
                    lent=saved_outputs,
                )
                self._decide(
                    "captured", Reason("capturable", "after one warm-up call, then replayed")
                )
            else:
                self._decide("not captured", refused)

    @property
    def lent_outputs(self) -> frozenset[int]:
        """Positions of the outputs a replay returns as the graph's memory
        (``GraphExecutor.lent``; none where the program is not captured)."""
        return getattr(self.executor, "lent", frozenset())

    @property
    def cudagraphs(self) -> str:
        """What became of graph capture, in words."""
        return "off" if self.capture is None else f"{self.capture.outcome}: {self.capture.detail}"

    def _decide(self, outcome: str, why: Reason) -> None:
        self.capture = Decision.of("capture", self.graph.name, outcome, why)
        log.info("%s: graph %s", self.graph.name, self.cudagraphs)
        self._on_decision(self.capture)

    def _stopped(self, reason: str) -> None:
        self._decide("not captured", Reason("capture_stopped", reason))

    def _bucket_stopped(self, bucket: Sizes, reason: str) -> None:
        detail = f"one graph per size bucket, but sizes up to {bucket} no longer: {reason}"
        self._decide("captured", Reason("bucket_stopped", detail))

    @property
    def arena(self) -> torch.Tensor | None:
        return self.eager.arena

    def guards(self) -> list[str]:
        """What the code assumes of the size symbols (symbolic graphs)."""
        return self.plan.guards()

    def accepts(self, sizes: Sizes) -> str | None:
        """None when the program runs a call with these sizes, else the failed guard."""
        for count, check in zip(self.size_limits, self._limit_checks):
            if check(sizes) > INT32_LIMIT:
                return f"{count} <= {INT32_LIMIT}"
        for name, value in sizes.items():
            if value < 2:
                return f"{name} >= 2"
        return None

    def bucket_refusal(self, bucket: Sizes) -> str | None:
        """Why no graph should serve the calls of size bucket ``bucket`` (a
        generic program), or None: a failed guard, or, on a target with
        cost figures, copies that cost more than the launches a replay saves.
        A replay copies every input of symbolic shape into its buffer and
        every output of symbolic shape out of the graph (each read and
        written once, priced at the bucket's sizes: the most a call in it
        copies), and saves each launch the host's launch path."""
        failed = self.accepts(bucket)
        if failed is not None or not cost.has_figures(self.target):
            return failed
        graph = self.plan.graph
        copied = [graph.nodes[name] for name in graph.inputs]
        copied += [graph.nodes[name] for name in graph.outputs if name]
        nbytes = sum(at_sizes(n.nbytes, bucket) for n in copied if not ix.is_static(n.shape))
        return self._copies_refusal(nbytes, "inputs and outputs of symbolic shape")

    def training_refusal(self, static_inputs: frozenset[int]) -> str | None:
        """Why a training graph (forward or backward) should not be
        captured, or None: on a target with cost figures, when copying what
        a replay copies (:meth:`replay_copies`) costs more than the
        launches it saves."""
        if not cost.has_figures(self.target):
            return None
        return self._copies_refusal(self.replay_copies(static_inputs), "inputs and outputs")

    def replay_copies(self, static_inputs: frozenset[int]) -> int:
        """The bytes a replay of this training graph copies: every input
        that is not static into its buffer (a backward's saved activations
        are new tensors every step, unless its forward lends them:
        ``lent_inputs``) and every output out of the graph (a forward's
        saved activations among them, unless lent: ``saved_outputs``)."""
        graph = self.plan.graph
        kept = static_inputs | self.lent_inputs
        copied = [graph.nodes[n] for k, n in enumerate(graph.inputs) if k not in kept]
        # Outputs, less inputs written (written back only where copied in),
        # inputs returned as they are and saved activations returned as the
        # graph's memory (``GraphExecutor._copy_out``).
        copied += [
            graph.nodes[n]
            for k, n in enumerate(graph.outputs)
            if n
            and k not in graph.mutations
            and n not in graph.inputs
            and k not in self.saved_outputs
        ]
        return sum(int(n.nbytes) for n in copied)

    def _copies_refusal(self, nbytes: int, what: str) -> str | None:
        """Why copying ``nbytes`` of ``what`` per replay (each read and
        written once) does not pay for the launches a replay saves (the
        host's launch path, per launch and library call), or None."""
        copies = cost.memory_seconds(self.target, 2 * nbytes)
        steps = len(self.plan.launches()) + len(self.plan.library_calls())
        saved = steps * (cost.launch_seconds(self.target) - cost.launch_seconds(self.target, True))
        if copies > saved:
            return (
                f"copying {nbytes / 1e6:.1f} MB of {what} ({copies * 1e6:.1f} us) costs more "
                f"than the {steps} launches a replay saves ({saved * 1e6:.1f} us)"
            )
        return None

    def __call__(self, *inputs: Any, sizes: Sizes | None = None) -> list[Any]:
        """Run the program; ``sizes``: the size symbols' values, for a
        graph compiled with symbolic sizes.

        Calls from several threads or streams at once are run one after
        another: every call uses the same arena, chain counters and (once
        captured) graph buffers.  A call holds the program's lock while it
        enqueues its work, and on a GPU a call on another stream than the
        last call's first waits for the work enqueued on that stream
        (``Stream.wait_stream``), so the two calls' kernels do not overlap."""
        if self.device.type == "cuda":
            # Triton's launchers, the direct launcher and graph capture all
            # use the current device: a model on ``cuda:1`` while the current
            # device is 0 would launch on device 0.
            with self._lock, torch.cuda.device(self.device):
                self._order_after_last_call()
                return self._run(inputs, sizes)
        # The interpreter computes masked-off lanes too (0/0 in a ragged
        # tail, say); numpy's warnings about them are noise.
        with INTERPRETER_LOCK, numpy.errstate(all="ignore"), interpreter_checks():
            try:
                return self._run(inputs, sizes)
            except InterpreterError as err:
                # A kernel's bounds check (``ir.check_index``): eager's IndexError.
                failed = err.__cause__
                if isinstance(failed, AssertionError) and str(failed).startswith(INDEX_ERROR):
                    raise IndexError(str(failed)) from None
                raise

    def _order_after_last_call(self) -> None:
        """On a stream other than the last call's, wait for the work that
        stream has (the last call's among it).  Inside a graph the caller
        is capturing, nothing: a captured stream may not wait for work
        outside its capture, and the caller orders its graph's replays."""
        stream = torch.cuda.current_stream(self.device)
        if stream == self._stream:
            return
        if torch.cuda.is_current_stream_capturing():
            return
        if self._stream is not None:
            stream.wait_stream(self._stream)
        self._stream = stream

    def _run(self, inputs: tuple[Any, ...], sizes: Sizes | None) -> list[Any]:
        if self.kernel_times is not None:
            return self.eager.timed(inputs, sizes or {}, self.kernel_times)
        return self.executor(inputs, sizes)

    def profile(self, enabled: bool = True) -> None:
        """Time every kernel launch of the following calls (slower: each launch
        is timed alone, and eagerly) into ``kernel_times``: kernel name ->
        seconds per call."""
        self.kernel_times = {} if enabled else None

    def stub_compute(self) -> None:
        """Replace every kernel with a no-op and every library call with its
        first result, to measure the host work around them
        (``python -m benchmarks.overhead``).  The program computes nothing
        right after this."""
        self.executor.stub_compute()

    def launches(self) -> list[LaunchStep]:
        return self.plan.launches()

    def launch_counts(self) -> dict[str, int]:
        """Kernel launches of the uncaptured calls so far, made directly and
        through Triton's JIT (both 0 unless built with ``direct_launch``:
        :mod:`tilec.runtime.launcher`)."""
        return self.eager.launch_counts()

    def step_counts(self) -> dict[str, int]:
        return self.plan.step_counts()

    def describe(self) -> str:
        """One line per step, in execution order (dumps; the call function is
        ``plan.source()``)."""
        lines = []
        made_once = {s.out for s in self.plan.prepared(static_buffers=False) if hasattr(s, "out")}
        for step in self.plan.steps:
            if isinstance(step, LaunchStep):
                k = step.kernel
                grid = "".join(f"{ix.print_index(sympy.sympify(g))}," for g in step.grid)
                constexprs = " ".join(f"{name}={v}" for name, v in k.launch.constexprs.items())
                params = ", ".join(f"{p}=%{a.buffer}" for p, a in zip(k.params, k.args)) + "".join(
                    f", {p}={s}" for p, s in zip(k.params[len(k.args) :], k.sizes)
                )
                lines.append(
                    f"launch {k.name} = {k.function}({params}) grid=({grid}) {constexprs} "
                    f"reads={k.bytes_read}B writes={k.bytes_written}B "
                    f"flops={k.flops} warps={k.launch.num_warps} stages={k.launch.num_stages} "
                    f"{'pdl ' if k.launch.pdl else ''}({k.template})"
                )
            elif isinstance(step, LibraryStep):
                lines.append(
                    f"{step.node.extern.role} %{step.node.name} = {step.node.extern.target}"
                )
            else:
                once = " (made once)" if step.out in made_once else ""
                lines.append(f"view %{step.node.name} = {step.node.view.op}{once}")
        counts = ", ".join(f"{n} {k}" for k, n in self.plan.step_counts().items())
        lines.append(f"# {counts}; graph capture: {self.cudagraphs}")
        return "\n".join(lines) + "\n"


def constant_device(
    graph: Graph, name: str, device: torch.device, users: dict[str, list[str]] | None = None
) -> torch.device:
    """Where constant ``name`` is kept: on the program's ``device``, unless
    only ATen fallbacks on its own device read it (``torch.tensor(5)``
    added to a CPU step counter beside CUDA tensors: moved to the GPU, the
    fallback's result would land there too, where eager's stays on the
    CPU).  ``users``: :meth:`Graph.users`, where a caller asks for many."""
    own = graph.constants[name].device
    readers = [graph.nodes[u] for u in (graph.users() if users is None else users)[name]]
    if readers and all(n.kind == "extern" and n.extern.device == own.type for n in readers):
        return own
    return device
