"""Record every generated kernel, for the PTX test tier.

When ``$TILEC_RECORD_KERNELS`` names a file, each kernel the pipeline writes
appends one JSON line to it: the kernel's source and name, its Triton
argument signature and the launch parameters a GPU would use.  The source
itself is recorded, not its cache path: the entry stays valid when the cache
folder it was written to is gone.  The
test suite sets it for the whole session, so the PTX tier can compile, for
sm_90, every kernel that the interpreter tiers ran on the CPU.
"""

from __future__ import annotations

import json
import os

import torch

from tilec import index as ix
from tilec.codegen.kernel import KernelSource, write_kernel
from tilec.codegen.launch import Target
from tilec.ir import Graph, Group

ENV = "TILEC_RECORD_KERNELS"

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


def gpu_launch(graph: Graph, group: Group, kernel: KernelSource) -> KernelSource:
    """The same kernel with launch parameters for a GPU.

    The source must not depend on the target (that is what makes the PTX tier
    meaningful); a mismatch is a codegen bug, reported here.
    """
    gpu = write_kernel(graph, group, Target(interpret=False))
    if gpu.source != kernel.source:
        raise AssertionError(f"kernel {kernel.name}: source differs between targets")
    return gpu


def kernel_entry(graph: Graph, group: Group, kernel: KernelSource) -> dict:
    """What compiling ``kernel`` for a GPU needs."""
    gpu = gpu_launch(graph, group, kernel)
    return {
        "source": kernel.source,
        "name": kernel.function,
        "signature": signature(kernel),
        "constexprs": gpu.launch.constexprs,
        "num_warps": gpu.launch.num_warps,
        "num_stages": gpu.launch.num_stages,
        # Size arguments a launch at the compiled sizes specializes as divisible by 16.
        "divisible": [
            param
            for param, s in zip(kernel.params[len(kernel.args) :], kernel.sizes)
            if ix.hint(s, graph.hints) % 16 == 0
        ],
    }


def record_kernel(graph: Graph, group: Group, kernel: KernelSource) -> None:
    """Append ``kernel`` to ``$TILEC_RECORD_KERNELS``, if set."""
    log = os.environ.get(ENV)
    if not log:
        return
    line = (json.dumps(kernel_entry(graph, group, kernel)) + "\n").encode()
    # One write call per line in append mode: concurrent writers do not interleave.
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
