"""max-autotune: measure GEMM tile configurations, and library calls against
the template, on the device; remember the answers on disk.

The heuristics (:func:`~tilec.codegen.gemm.gemm_config`, and the matmul
pass's "the library wins unless fusion saves traffic") are one answer for
every GPU and shape.  With ``options={"autotune": True}`` (or
``mode="max-autotune"``) the pipeline asks an :class:`Autotuner` instead:

* :meth:`Autotuner.tune`: each GEMM template kernel, its real source with
  its prologue and epilogue, is launched with each of
  :func:`~tilec.codegen.gemm.gemm_candidates`; the fastest replaces the
  kernel's launch (constexprs, grid, warps, stages).  The source is the same
  for every candidate, so only the launch changes.
* :meth:`Autotuner.race`: a matmul that the heuristic leaves in the library
  (nothing to fuse) is timed as the bare template (its best configuration)
  and as the library call; the matmul pass takes the faster.

Measuring: random inputs laid out as the kernel's arguments (dtypes, shapes
and strides: the strides are in the source), allocated once per question,
outputs to scratch buffers, each candidate timed by the device's
:data:`Timer` (on CUDA ``triton.testing.do_bench``: warm-up, then the median
of repeated runs, each after an L2 flush).  Floats come from a private
generator (the user's random stream is untouched); integers are zero, since
they may be indices and index 0 is always in bounds.

Remembering: one JSON file per question in ``cache_dir("autotune")``, named
by a hash of its key: what the answer depends on (the kernel source's hash,
the arguments' shapes, strides and dtypes, the device's name and Triton's
version; for a race also the op and torch's and CUDA's versions).  A second
compile, in this process or another, reads the answer and measures nothing.
Files follow the kernel cache's trust rules (:func:`~tilec.codegen.cache.
read_private`): another user's file, or one writable by others, is ignored
with a warning and measured again.  An answer is used only if the file's key
is the question's and its configuration is one of the kernel's candidates,
so a file cannot make a kernel run with a ``BLOCK_K`` its source was not
written for.

Where the device type has no timer in :data:`TIMERS` (a CPU: interpreter
times say nothing about a GPU), :func:`tuner_for` gives no tuner and logs
once that max-autotune needs a CUDA device; the heuristics are used and the
dump says so.  Tests add a timer for the CPU to drive the interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import platform
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import triton
import triton.testing
from torch._subclasses.fake_tensor import unset_fake_temporarily
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from tilec.anchors import anchors_in
from tilec.codegen.cache import cache_dir, load_module, read_private, write_private, write_source
from tilec.codegen.kernel import KernelSource, write_kernel
from tilec.codegen.templates import WRITERS
from tilec.gemm import GemmConfig
from tilec.ir import Arg, Graph, Group, Node
from tilec.target import Target

log = logging.getLogger("tilec.autotune")

# Version of the files' layout; a file of another version is measured again.
FORMAT = 1

NO_DEVICE = (
    "max-autotune needs a CUDA device: nothing is measured, tile configurations "
    "and library-or-template choices are the heuristic's"
)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One way to compute a kernel's outputs that a :data:`Timer` times: the
    template with a tile configuration, or the library call (``config`` None)."""

    label: str
    config: GemmConfig | None
    run: Callable[[], object]


# Milliseconds per run of a trial.
Timer = Callable[[Trial], float]


def cuda_timer(trial: Trial) -> float:
    """GPU time per run: the median of about 100 ms of runs after 25 ms of
    warm-up (the first run compiles the kernel), each after an L2 flush,
    timed with CUDA events: the host's launch cost, which a CUDA graph
    removes, is hidden behind the flush."""
    return triton.testing.do_bench(trial.run, warmup=25, rep=100, return_mode="median")


# Timers by device type; a device type without one is never measured.
TIMERS: dict[str, Timer] = {"cuda": cuda_timer}


def tuner_for(device: torch.device, target: Target) -> Autotuner | None:
    """The tuner for kernels that run on ``device`` (described by ``target``);
    None (logged once) where nothing can be measured."""
    timer = TIMERS.get(device.type)
    if timer is None:
        _warn_no_device(device.type)
        return None
    return Autotuner(device, target, timer)


@functools.cache
def _warn_no_device(device_type: str) -> None:
    log.warning("tilec: %s (kernels run on %s)", NO_DEVICE, device_type)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """What tuning a kernel found: the fastest configuration, the time of
    each one measured (ms), and the ones that could not run, with why."""

    # Configurations of the template's writer (``Config``: a GemmConfig for a GEMM).
    best: Any
    times: dict[Any, float]
    failed: dict[Any, str]
    cached: bool


@dataclasses.dataclass(frozen=True)
class RaceResult:
    """A matmul timed as the bare template (its best tiles) and as the library call."""

    config: GemmConfig
    template_ms: float
    library_ms: float
    cached: bool

    @property
    def template_wins(self) -> bool:
        return self.template_ms < self.library_ms

    def __str__(self) -> str:
        where = ", from the autotune cache" if self.cached else ""
        return (
            f"autotune: template {self.template_ms:.4f} ms ({self.config}) vs "
            f"library {self.library_ms:.4f} ms{where}"
        )


class Autotuner:
    """Measures kernels on ``device`` (described by ``target``) with ``timer``
    and remembers the answers.

    One per compiled graph: ``report`` (the dump's ``autotune.txt``) and
    ``counts`` (its summary line) say what it measured and what it read.
    Candidates fit the target's shared memory per block (the interpreter's
    is an H100's, so tests measure a GPU's candidates)."""

    def __init__(self, device: torch.device, target: Target, timer: Timer):
        self.device = device
        self.timer = timer
        self.target = target
        if target.interpret:
            self.device_name = f"{device.type} ({platform.machine()})"
        else:
            self.device_name = target.name
        self.report: list[str] = []
        self.counts = {"tuned": 0, "tuned_cached": 0, "raced": 0, "raced_cached": 0}

    def summary(self) -> str:
        c = self.counts
        return (
            f"on {self.device_name}: {c['tuned']} GEMM kernels tuned, {c['tuned_cached']} from "
            f"the cache; {c['raced']} matmuls raced against the library, "
            f"{c['raced_cached']} from the cache"
        )

    def tune(self, graph: Graph, group: Group, kernel: KernelSource, fn: Any) -> KernelSource:
        """``kernel`` (loaded as ``fn``) launched with the fastest of its tile
        configurations if it is a GEMM template's; other kernels as they are."""
        writer = WRITERS.get(kernel.template)
        if writer is None:
            return kernel
        if kernel.sizes:
            self.report.append(f"{kernel.name}: not tuned: symbolic sizes (the generic variant)")
            return kernel
        _, anchor = anchors_in(graph, group.nodes)[0]  # the lead, as ``templates.tile``
        tiles = self._tiles(graph, anchor, kernel, fn)
        self.report += _tile_report(f"{kernel.name} ({kernel.function})", tiles)
        self.counts["tuned_cached" if tiles.cached else "tuned"] += 1
        launch = dataclasses.replace(writer.launch(anchor, tiles.best), pdl=kernel.launch.pdl)
        return dataclasses.replace(kernel, launch=launch)

    def race(self, bare: Graph, call: Node) -> RaceResult:
        """The library call ``call`` against the template: ``bare`` is the call
        alone as the template computes it, one kernel whose inputs are the
        call's (``passes/matmul.py``)."""
        (group,) = bare.groups
        kernel = write_kernel(bare, group, self.target)
        key = self._key(
            "library or template",
            op=str(call.extern.target),
            operands=[_operand(bare, name) for name in call.inputs],
            template=_sha(kernel.source),
            torch=torch.__version__,
            cuda=torch.version.cuda,
        )
        race = self._recall(key, _race_from)
        if race is None:
            fn = getattr(
                load_module(write_source(kernel.source), self.target.interpret), kernel.function
            )
            ((_, anchor),) = anchors_in(bare, group.nodes)
            tiles = self._tiles(bare, anchor, kernel, fn)
            self.report += _tile_report(f"bare template of %{call.name}", tiles)
            tensors = self._tensors(bare, bare.inputs)
            with self._on_device():
                operands = [_viewed(bare, name, tensors) for name in call.inputs]
            args = [_bind(a, operands) for a in call.extern.args]
            kwargs = {k: _bind(v, operands) for k, v in call.extern.kwargs}
            library = self._time(
                Trial("library", None, lambda: call.extern.target(*args, **kwargs))
            )
            race = RaceResult(tiles.best, tiles.times[tiles.best], library, cached=False)
            self._remember(
                key,
                {
                    "config": dataclasses.asdict(race.config),
                    "template_ms": race.template_ms,
                    "library_ms": race.library_ms,
                },
            )
        self.counts["raced_cached" if race.cached else "raced"] += 1
        self.report.append(f"%{call.name}: {race}")
        return race

    # ------------------------------------------------------------ measuring

    def _tiles(self, graph: Graph, anchor: Node, kernel: KernelSource, fn: Any) -> Tiles:
        """The template kernel's tile configurations, measured or from the
        cache.  The kernel's own configuration comes first: it wins ties."""
        writer = WRITERS[kernel.template]
        candidates = writer.candidates(graph, anchor, self.target, kernel.launch)
        key = self._key(
            "tiles",
            source=_sha(kernel.source),
            args=[_layout(graph.nodes[a.buffer]) for a in kernel.args],
        )
        cached = self._recall(
            key, functools.partial(_tiles_from, candidates=candidates, config=writer.Config)
        )
        if cached is not None:
            return cached
        tensors = self._tensors(graph, [a.buffer for a in kernel.args])
        arguments = [tensors[a.buffer] for a in kernel.args]
        times: dict[Any, float] = {}
        failed: dict[Any, str] = {}
        for config in candidates:
            launch = dataclasses.replace(writer.launch(anchor, config), pdl=kernel.launch.pdl)

            def run(launch=launch) -> None:
                fn[launch.grid](*arguments, **launch.options)

            try:
                times[config] = self._time(Trial(str(config), config, run))
            except (OutOfResources, CompilationError) as err:
                failed[config] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        if not times:
            raise RuntimeError(
                f"tilec: autotune: no tile configuration of {kernel.name} runs: "
                + "; ".join(f"{c}: {why}" for c, why in failed.items())
            )
        best = min(times, key=times.__getitem__)
        self._remember(
            key,
            {
                "best": dataclasses.asdict(best),
                "times": [[dataclasses.asdict(c), ms] for c, ms in times.items()],
            },
        )
        return Tiles(best, times, failed, cached=False)

    def _time(self, trial: Trial) -> float:
        with self._on_device():
            ms = float(self.timer(trial))
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"tilec: autotune: the timer gave {ms} ms for {trial.label}")
        return ms

    def _tensors(self, graph: Graph, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tensors laid out as the buffers ``names`` of ``graph``: random
        floats from a fixed seed, zero integers and booleans."""
        out = {}
        with self._on_device():
            generator = torch.Generator(self.device).manual_seed(0)
            for name in dict.fromkeys(names):
                node = graph.nodes[name]
                stride = node.buffer_stride
                extent = 1 + sum((s - 1) * st for s, st in zip(node.shape, stride))
                extent = extent if all(node.shape) else 0
                flat = torch.zeros(extent, dtype=node.dtype, device=self.device)
                if node.dtype.is_floating_point:
                    flat.copy_(torch.randn(extent, generator=generator, device=self.device))
                out[name] = flat.as_strided(node.shape, stride)
        return out

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """Real tensors on the device: compilers run under the tracer's fake
        tensor mode, and CUDA calls go to the tuner's device."""
        with unset_fake_temporarily():
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    yield
            else:
                yield

    # ------------------------------------------------------------ remembering

    def _key(self, question: str, **parts: Any) -> dict:
        key = {
            "question": question,
            **parts,
            "device": self.device_name,
            "triton": triton.__version__,
        }
        return json.loads(json.dumps(key))  # as it reads back from a file

    def _recall(self, key: dict, parse: Callable[[dict], T | None]) -> T | None:
        path = cache_dir("autotune") / _file_name(key)
        data = read_private(path)
        if data is None:
            return None
        try:
            record = json.loads(data)
        except ValueError:
            problem = "not JSON"
        else:
            problem = "written for another question or format"
            if isinstance(record, dict) and record.get("format") == FORMAT:
                if record.get("key") == key:
                    answer = parse(record)
                    if answer is not None:
                        return answer
                    problem = "its answer is not one of the candidates"
        log.warning("tilec: ignored autotune file %s: %s; measuring again", path, problem)
        return None

    def _remember(self, key: dict, answer: dict) -> None:
        record = {"format": FORMAT, "key": key, **answer}
        write_private("autotune", _file_name(key), json.dumps(record, indent=1).encode())


def _tiles_from(record: dict, candidates: list, config: type) -> Tiles | None:
    try:
        best = config(**record["best"])
        times = {config(**c): float(ms) for c, ms in record["times"]}
    except (KeyError, TypeError, ValueError):
        return None
    if best not in candidates or best not in times:
        return None
    return Tiles(best, times, {}, cached=True)


def _race_from(record: dict) -> RaceResult | None:
    try:
        config = GemmConfig(**record["config"])
        return RaceResult(
            config, float(record["template_ms"]), float(record["library_ms"]), cached=True
        )
    except (KeyError, TypeError, ValueError):
        return None


def _tile_report(title: str, tiles: Tiles) -> list[str]:
    where = "from the autotune cache" if tiles.cached else "measured"
    lines = [f"{title}: {tiles.best} ({where})"]
    for config, ms in sorted(tiles.times.items(), key=lambda item: item[1]):
        lines.append(f"  {ms:10.4f} ms  {config}")
    lines += [f"  failed      {config}: {why}" for config, why in tiles.failed.items()]
    return lines


def _layout(node: Node) -> list:
    return [list(node.shape), list(node.buffer_stride), str(node.dtype)]


def _operand(graph: Graph, name: str) -> list:
    """What a library call's operand is, named by nothing of the graph: its
    views (outermost first) and its buffer's layout."""
    node = graph.nodes[name]
    if node.kind == "view":
        return [node.view.op, repr(node.view.args), *_operand(graph, node.inputs[0])]
    return _layout(node)


def _viewed(graph: Graph, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor node ``name`` is: its buffer's, through its views."""
    node = graph.nodes[name]
    if node.kind != "view":
        return tensors[name]
    return node.view.apply(_viewed(graph, node.inputs[0], tensors), node.shape)


def _bind(value: Any, operands: list[torch.Tensor]) -> Any:
    """An extern call's argument with ``Arg(k)`` replaced by operand k."""
    if isinstance(value, Arg):
        return operands[value.position]
    if isinstance(value, (list, tuple)):
        return type(value)(_bind(v, operands) for v in value)
    return value


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _file_name(key: dict) -> str:
    return _sha(json.dumps(key, sort_keys=True))[:32] + ".json"
