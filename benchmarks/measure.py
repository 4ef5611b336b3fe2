"""One measurement: one model, one backend, one mode and dtype, in this process.

``python -m benchmarks.measure '<json>'`` prints one JSON result line.  The
harness (``benchmarks/run.py``) starts a fresh process per measurement, so the
compile time is a cold one (the kernel caches of tilec, Triton and Inductor
point at empty directories) and a model that hangs or crashes only costs
its own row.

Timing: after warm-up, each timed call gets the next of several input sets
(rotated, so that caches do not flatter) and is timed alone, with CUDA events
on a GPU and ``perf_counter`` on a CPU (CPU timings are labelled as such).
Accuracy: the output of the first call is compared with a float64 eager
reference run on the same inputs (see :func:`accuracy`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch._inductor.config as inductor_config
from torch._inductor import metrics

import tilec
from benchmarks.zoo import MODELS

# Accuracy passes when the compiled output's RMSE to the float64 reference is
# at most this multiple of eager's own RMSE (same dtype) ...
RMSE_FACTOR = 3.0
# ... or below this fraction of the reference's RMS (eager may round exactly).
RMSE_FLOOR = 1e-5

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def _fresh_caches() -> Iterator[None]:
    """Point every compiler cache at an empty directory for the block: cold
    compiles.  (All three read their variable when they compile, not when
    imported.)  The directory is removed and the variables restored after it."""
    variables = ("TILEC_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="tilec-bench-") as root:
        with mock.patch.dict(os.environ, {v: os.path.join(root, v.lower()) for v in variables}):
            yield


def _to(inputs: tuple[torch.Tensor, ...], device: str, dtype: torch.dtype) -> tuple:
    return tuple(t.to(device, dtype if t.is_floating_point() else t.dtype) for t in inputs)


def _rmse(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref).pow(2).mean().sqrt().item()


def accuracy(out: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """RMSE of the compiled and the eager output to the float64 reference, and
    whether the compiled one is within ``RMSE_FACTOR`` of eager's."""
    rmse, rmse_eager = _rmse(out, ref), _rmse(eager, ref)
    scale = ref.pow(2).mean().sqrt().item()
    ok = bool(rmse <= max(RMSE_FACTOR * rmse_eager, RMSE_FLOOR * scale))
    return {"rmse": rmse, "rmse_eager": rmse_eager, "ref_rms": scale, "accurate": ok}


class _Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, fn) -> float:
        """Seconds one call of ``fn`` takes (device time on a GPU)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _step(model: torch.nn.Module, optimizer, train: bool):
    """One inference call, or one training step (forward, loss, backward, optimizer)."""

    def run(inputs: tuple) -> torch.Tensor:
        if not train:
            with torch.no_grad():
                return model(*inputs)
        out = model(*inputs)
        out.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.detach()

    return run


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, compile, check and time one model; ``spec`` as the harness writes it."""
    with _fresh_caches():
        return _measure(spec)


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    torch.backends.mha.set_fastpath_enabled(False)  # the real graph, not one fused op
    device, dtype, train = spec["device"], DTYPES[spec["dtype"]], spec["mode"] == "training"
    name, _, compile_mode = spec["backend"].partition(":")
    backend, _, variant = name.partition("+")
    if backend not in ("eager", "inductor", "tilec") or variant not in ("", "freeze"):
        raise ValueError(f"unknown backend {spec['backend']!r}")
    if variant and train:
        raise ValueError("+freeze is for inference: frozen weights get no gradients")
    zoo = MODELS[spec["model"]]
    torch.manual_seed(0)
    built = zoo.build(spec["size"])
    gen = torch.Generator().manual_seed(0)
    input_sets = [zoo.inputs(spec["size"], spec["batch"], gen) for _ in range(spec["rotations"])]

    for module in built.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # deterministic training steps, comparable with the reference
    model = built.model.train(train)
    # Reference and eager outputs in the mode being measured (batch norm uses
    # batch statistics when training), from the first input set.
    with torch.no_grad():
        ref = model.to(device, torch.float64)(*_to(input_sets[0], device, torch.float64))
        model.to(device, dtype)
        inputs = [_to(s, device, dtype) for s in input_sets]
        eager_out = model(*inputs[0])

    if backend == "eager":
        compiled = model
    elif backend == "inductor":
        inductor_config.freezing = variant == "freeze"
        compiled = torch.compile(model, backend="inductor", mode=compile_mode or None)
    else:
        options = {"freeze": True} if variant == "freeze" else None
        compiled = torch.compile(model, backend="tilec", mode=compile_mode or None, options=options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if train else None
    step = _step(compiled, optimizer, train)
    timer = _Timer(device)
    tilec.reset_stats()
    metrics.reset()

    out_holder: list[torch.Tensor] = []
    compile_s = timer(lambda: out_holder.append(step(inputs[0])))
    result: dict[str, Any] = {**spec, "source": built.source, "compile_s": compile_s}
    result.update(accuracy(out_holder[0], eager_out, ref))
    stats = tilec.stats()
    result["kernels"] = {
        "eager": None,
        "inductor": metrics.generated_kernel_count,
        "tilec": stats["kernels"],
    }[backend]
    result["fallbacks"] = sum(stats["fallbacks"].values()) if backend == "tilec" else None
    result["fallback_ops"] = stats["fallbacks"] if backend == "tilec" else None

    for k in range(spec["warmup"]):
        step(inputs[k % len(inputs)])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [timer(lambda k=k: step(inputs[k % len(inputs)])) for k in range(spec["runs"])]
    median = statistics.median(times)
    result.update(
        times_s=times,
        median_s=median,
        throughput=spec["batch"] / median,
        peak_memory_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None,
        timing="cuda events" if device == "cuda" else "CPU perf_counter (CPU timing)",
    )
    return result


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = measure(spec)
    except Exception as err:  # one failing model is one row, not the end of the run
        result = {**spec, "error": f"{type(err).__name__}: {err}"[:2000]}
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
