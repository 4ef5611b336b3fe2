"""Per-kernel roofline report: where tilec's kernels stand against the device's peaks.

    python -m benchmarks.roofline --model gpt2 [--size full] [--dtype bf16] [--batch 8]

Compiles one zoo model with tilec for inference, then times every Triton
kernel alone (CUDA events on a GPU) over ``--runs`` calls.  Bytes and FLOPs
come from codegen (``KernelSource.bytes_read``/``bytes_written``: distinct
elements the kernel's loads touch and its stores write; ``flops``: arithmetic
ops over its iteration space).  On a GPU the peaks are measured once per run:
copy bandwidth (a large device-to-device copy, bytes read plus written) and
bf16 matmul FLOP/s; each kernel is reported as a percentage of them.  On a
CPU the kernels run in the Triton interpreter: times are printed, labelled,
and no percentages are claimed.  Kernels are sorted by total time, so the
next optimization target is the first line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

import tilec
from benchmarks.measure import DTYPES
from benchmarks.zoo import MODELS


def _median_seconds(fn, device: str, runs: int) -> float:
    """Median seconds of ``runs`` calls of ``fn``: CUDA events on a GPU,
    ``perf_counter`` on a CPU."""
    times = []
    for _ in range(runs):
        if device != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def measure_peaks(
    device: str = "cuda", copy_bytes: int = 1 << 28, n: int = 8192, runs: int = 20
) -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write) of a ``copy_bytes`` copy and the
    bf16 matmul rate (FLOP/s) of an ``n`` x ``n`` x ``n`` product on ``device``.
    The defaults are sized for a GPU: operands far larger than its L2 cache,
    so no input set needs rotating.  Random data, never zeros."""
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = _median_seconds(lambda: dst.copy_(src), device, runs)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    mm_s = _median_seconds(lambda: a @ b, device, runs)
    return {"bandwidth": 2 * src.numel() / copy_s, "flops": 2 * n**3 / mm_s}


def kernel_rows(graphs: list[str]) -> list[dict[str, Any]]:
    """One row per kernel of the programs of ``graphs``, with its median time."""
    rows = []
    for graph in graphs:
        program = tilec.programs()[graph]
        times = program.kernel_times or {}
        for launch in program.launches():
            k = launch.kernel
            samples = times.get(k.name, [])
            rows.append(
                {
                    "graph": graph,
                    "kernel": k.name,
                    "group": k.group.reason,
                    "grid": launch.grid[0],
                    "bytes": k.bytes_read + k.bytes_written,
                    "flops": k.flops,
                    "seconds": statistics.median(samples) if samples else None,
                }
            )
    return sorted(rows, key=lambda r: -(r["seconds"] or 0))


def format_rows(rows: list[dict[str, Any]], peaks: dict[str, float] | None, device: str) -> str:
    head = f"{'kernel':<28} {'grid':>7} {'bytes':>12} {'flops':>12} {'FLOP/B':>7} {'time us':>10}"
    head += f" {'GB/s':>8} {'%BW':>6} {'GFLOP/s':>9} {'%FLOP':>6}" if peaks else ""
    lines = [head]
    total = sum(r["seconds"] or 0 for r in rows)
    for r in rows:
        intensity = r["flops"] / r["bytes"] if r["bytes"] else 0.0
        line = f"{r['graph'] + ':' + r['kernel']:<28} {r['grid']:>7} {r['bytes']:>12} "
        line += f"{r['flops']:>12} {intensity:>7.2f} {1e6 * (r['seconds'] or 0):>10.1f}"
        if peaks and r["seconds"]:
            bw, fl = r["bytes"] / r["seconds"], r["flops"] / r["seconds"]
            line += f" {bw / 1e9:>8.1f} {100 * bw / peaks['bandwidth']:>5.1f}%"
            line += f" {fl / 1e9:>9.1f} {100 * fl / peaks['flops']:>5.2f}%"
        lines.append(line)
    lines.append(f"{len(rows)} kernels, {1e6 * total:.1f} us per call in kernels")
    if device != "cuda":
        lines.append(
            "CPU: kernels ran in the Triton interpreter; times are interpreter times, "
            "not GPU speed, and no roofline percentages are claimed."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=("tiny", "full"), default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    size = args.size or ("full" if cuda else "tiny")
    batch = args.batch or (8 if size == "full" else 2)
    runs = args.runs or (20 if cuda else 2)

    torch.backends.mha.set_fastpath_enabled(False)
    spec = MODELS[args.model]
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    model = spec.build(size).model.eval().to(args.device, dtype)
    inputs = tuple(
        t.to(args.device, dtype if t.is_floating_point() else t.dtype)
        for t in spec.inputs(size, batch, torch.Generator().manual_seed(0))
    )
    torch._dynamo.reset()
    earlier = set(tilec.programs())
    compiled = torch.compile(model, backend="tilec")
    with torch.no_grad():
        compiled(*inputs)  # compile and warm up
        graphs = sorted(set(tilec.programs()) - earlier)
        for graph in graphs:
            tilec.programs()[graph].profile()
        for _ in range(runs):
            compiled(*inputs)
    peaks = measure_peaks() if cuda else None
    print(
        f"{args.model} ({size}, {args.dtype}, batch {batch}) on {args.device}, {runs} timed calls"
    )
    if peaks:
        print(
            f"peaks: copy {peaks['bandwidth'] / 1e9:.0f} GB/s, bf16 matmul "
            f"{peaks['flops'] / 1e12:.0f} TFLOP/s"
        )
    print(format_rows(kernel_rows(graphs), peaks, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
