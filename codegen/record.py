"""Record every generated kernel, for the PTX test tier.

When ``$TILEC_RECORD_KERNELS`` names a file, each kernel the pipeline writes
appends one JSON line to it: the kernel's source and name, its Triton
argument signature and the launch parameters a GPU would use
(:data:`RECORDED_GPU`, with the TF32 setting the kernel was written with).  The source
itself is recorded, not its cache path: the entry stays valid when the cache
folder it was written to is gone.  The
test suite sets it for the whole session, so the PTX tier can compile, for
sm_90, every kernel that the interpreter tiers ran on the CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from tilec import index as ix
from tilec.codegen.kernel import KernelSource, sizes_in_memory, write_kernel
from tilec.ir import Graph, Group
from tilec.target import Target

ENV = "TILEC_RECORD_KERNELS"
# The GPU the PTX tier compiles for (sm_90).
RECORDED_GPU = Target.named("h100-sxm")

# Pointer element types in Triton's signature notation.
TRITON_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}


def signature(kernel: KernelSource) -> dict[str, str]:
    """Triton signature of a kernel's arguments, in parameter order: the
    pointers, then the size arguments of a symbolic graph (32-bit: the
    generic variant guards on it)."""
    types = ["*" + TRITON_TYPES[a.dtype] for a in kernel.args] + ["i32"] * len(kernel.sizes)
    return dict(zip(kernel.params, types))


def gpu_launch(graph: Graph, group: Group, kernel: KernelSource, gpu: Target) -> KernelSource:
    """The same kernel with launch parameters for ``gpu``.

    The source must not depend on the target (that is what makes the PTX tier
    meaningful); a mismatch is a codegen bug, reported here.
    """
    written = write_kernel(graph, group, gpu, kernel.launch.pdl)
    if written.source != kernel.source:
        raise AssertionError(f"kernel {kernel.name}: source differs between targets")
    return written


def kernel_entry(
    graph: Graph, group: Group, kernel: KernelSource, gpu: Target = RECORDED_GPU
) -> dict:
    """What compiling ``kernel`` for ``gpu`` needs (``gpu``'s TF32 setting
    must be the one the kernel was written with)."""
    gpu_kernel = gpu_launch(graph, group, kernel, gpu)
    return {
        "source": kernel.source,
        "name": kernel.function,
        "signature": signature(kernel),
        "constexprs": gpu_kernel.launch.constexprs,
        "num_warps": gpu_kernel.launch.num_warps,
        "num_stages": gpu_kernel.launch.num_stages,
        "launch_pdl": gpu_kernel.launch.pdl,
        # Size arguments a launch at the compiled sizes specializes as divisible by 16.
        "divisible": [
            param
            for param, s in zip(kernel.params[len(kernel.args) :], kernel.sizes)
            if ix.hint(s, graph.hints) % 16 == 0
        ],
    }


def sizes_in_memory_entry(entry: dict, kernel: KernelSource) -> dict:
    """``entry`` (a kernel with size arguments) for the variant that reads its
    sizes from memory (:func:`~tilec.codegen.kernel.sizes_in_memory`, the one
    a graph captured for a size bucket launches)."""
    source, function = sizes_in_memory(kernel, tuple(range(len(kernel.sizes))))
    pointers = dict(list(entry["signature"].items())[: len(kernel.args)])
    return entry | {
        "source": source,
        "name": function,
        "signature": pointers | {"size_values": "*i32"},
        "divisible": [],
    }


def record_kernel(graph: Graph, group: Group, kernel: KernelSource, target: Target) -> None:
    """Append ``kernel``, written for ``target``, to ``$TILEC_RECORD_KERNELS``,
    if set; a kernel with size arguments also as the variant that reads them
    from memory (a graph captured for a size bucket launches that one)."""
    log = os.environ.get(ENV)
    if not log:
        return
    gpu = dataclasses.replace(RECORDED_GPU, tf32=target.tf32)
    entries = [kernel_entry(graph, group, kernel, gpu)]
    if kernel.sizes:
        entries.append(sizes_in_memory_entry(entries[0], kernel))
    line = "".join(json.dumps(entry) + "\n" for entry in entries).encode()
    # One write call in append mode: concurrent writers do not interleave.
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
