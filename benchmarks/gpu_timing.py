"""Timing for ``benchmarks/gpu_check.py``: calls timed alone, loops, kernels
alone, and the time budget of a section (:class:`Section`).

On a GPU every timed call is bracketed by CUDA events, after a write of a
buffer larger than the L2 cache: the cache is cold, as the roofline
prediction assumes, and the device is busy with that write while the host
enqueues the call, so the host's launch time does not show as device idle
time (``triton.testing.do_bench`` works the same way).  Inputs rotate over
several sets as well.  On a CPU the same functions time with
``perf_counter``; those are CPU (Triton interpreter) times.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tilec.runtime.program import Program

# Bytes written between timed calls on a GPU: five times the L2 cache of an
# H100 or H200 (50 MiB); writing it takes about 0.1 ms there, time in which
# the host enqueues the timed call.
FLUSH_BYTES = 256 << 20
# Input sets are made until together they are this large (twice an H100's
# L2), within the caller's limit on their number.
ROTATION_BYTES = 128 << 20


def summary(times: Sequence[float]) -> dict[str, Any]:
    """The raw seconds and their median."""
    return {"median_s": statistics.median(times), "times_s": list(times)}


def time_calls(fn: Callable[[int], Any], device: str, runs: int, warmup: int) -> dict[str, Any]:
    """Seconds of each of ``runs`` calls ``fn(k)`` timed alone, after
    ``warmup`` calls; ``k`` counts the calls, for the caller to rotate inputs."""
    for k in range(warmup):
        fn(k)
    if device != "cuda":
        times = []
        for k in range(runs):
            t0 = time.perf_counter()
            fn(k)
            times.append(time.perf_counter() - t0)
        return summary(times)
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    events = []
    torch.cuda.synchronize()
    for k in range(runs):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(k)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return summary([s.elapsed_time(e) / 1000 for s, e in events])


def time_loop(fn: Callable[[], Any], device: str, calls: int, repeats: int) -> dict[str, Any]:
    """Seconds per call of ``calls`` back-to-back calls (no flush: this times
    the host path, which the device waits on), ``repeats`` times, after one
    such loop of warm-up."""
    times = []
    for _ in range(repeats + 1):
        if device != "cuda":
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000 / calls)
    return summary(times[1:])


def rotations(set_bytes: int, most: int) -> int:
    """How many input sets of ``set_bytes`` to rotate over (1 to ``most``)."""
    return max(1, min(most, -(-ROTATION_BYTES // max(set_bytes, 1))))


def strided_clone(value: Any) -> Any:
    """A copy of a tensor with its shape and strides (kernels bake strides
    in); anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    copy = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return copy.copy_(value)


def nbytes(values: Sequence[Any]) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def capture_launches(
    program: Program, call: Callable[[], Any]
) -> dict[str, tuple[Callable[..., Any], tuple]]:
    """Kernel name -> (its launcher, the arguments it got) for each launch of
    ``program`` (sized at compile time) during ``call()``, which must run the
    program eagerly and after a first call (graph capture off).  The
    launcher, called with those arguments, launches that kernel alone."""
    namespace = program.eager.namespace
    if namespace is None:
        raise RuntimeError("call the program once before capturing its launches")
    seen: dict[str, tuple[Callable[..., Any], tuple]] = {}
    originals = {}
    for step in program.launches():
        if step.symbolic:
            continue
        originals[step.var] = launcher = namespace[step.var]

        def record(*args: Any, _name: str = step.kernel.name, _launch: Any = launcher) -> Any:
            seen[_name] = (_launch, args)
            return _launch(*args)

        namespace[step.var] = record
    try:
        call()
    finally:
        namespace.update(originals)
    return seen


def time_launch(
    launcher: Callable[..., Any], args: tuple, device: str, runs: int, warmup: int, most_sets: int
) -> dict[str, Any]:
    """One kernel launched alone, its arguments rotated over copies of them."""
    sets = [args]
    sets += [tuple(map(strided_clone, args)) for _ in range(rotations(nbytes(args), most_sets) - 1)]
    result = time_calls(lambda k: launcher(*sets[k % len(sets)]), device, runs, warmup)
    return {**result, "input_sets": len(sets)}


class Section:
    """A section's config and deadline, and the result it saves as it goes."""

    def __init__(self, cfg: dict[str, Any], path: Path) -> None:
        self.cfg, self.path = cfg, path
        self.device: str = cfg["device"]
        self.data: dict[str, Any] = {}

    def remaining(self) -> float:
        return self.cfg["deadline"] - time.time()

    def save(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(partial, self.path)

    def out_of_time(self, need: float, item: str) -> bool:
        """Whether fewer than ``need`` seconds are left; if so ``item`` is noted as skipped."""
        if self.remaining() >= need:
            return False
        self.data.setdefault("skipped_for_time", []).append(item)
        self.save()
        return True


def failure() -> str:
    """The traceback being handled, for a result (its end, where the error is)."""
    return traceback.format_exc()[-4000:]


def release() -> None:
    """Forget compiled code and free its memory, between a section's items."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
