"""Few-row reductions split over their reduced dimension for a GPU target
(``passes/split_reduction.py``), against eager (through the IR
interpreter: the CPU target keeps them whole) and compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

from benchmarks.sm90 import compile_kernel
from tests.lowering import gpu_kernels, lower, optimize
from tilec.codegen.record import kernel_entry
from tilec.interpret import interpret
from tilec.passes.split_reduction import MIN_CHUNK


def _split(graph) -> list:
    return [n for n in graph.nodes.values() if n.name.endswith("_partial")]


CASES = {
    "loss": (lambda x: ((x - 1) ** 2).mean(), (torch.randn(8192, 64),)),
    "norm": (lambda x: torch.linalg.vector_norm(x), (torch.randn(4096, 96),)),
    "max": (lambda x: x.amax(), (torch.randn(2048, 100),)),
    "columns": (lambda x, w: (x * w).sum(0)[:8], (torch.randn(65536, 8), torch.randn(8))),
    "any": (lambda x: (x > 4.5).any(), (torch.randn(4096, 64),)),
}


@pytest.mark.parametrize("case", CASES)
def test_split_reductions_match_eager(case):
    fn, inputs = CASES[case]
    graph = optimize(lower(fn, *inputs), gpu=True)
    partials = _split(graph)
    assert partials, "not split"
    for p in partials:  # chunks of at least MIN_CHUNK elements, rows x S programs
        chunk = 1
        for s in p.reduce_shape:
            chunk *= s
        assert chunk >= MIN_CHUNK
    (got,) = interpret(graph, list(inputs))
    expected = fn(*inputs)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_many_rows_stay_whole():
    """A row-wise softmax of 4096 rows fills the GPU already."""
    x = torch.randn(4096, 512)
    graph = optimize(lower(lambda x: torch.softmax(x, -1), x), gpu=True)
    assert not _split(graph)


def test_the_cpu_target_keeps_reductions_whole():
    x = torch.randn(8192, 64)
    assert not _split(optimize(lower(lambda x: x.sum(), x)))


def test_a_split_reduction_compiles_for_sm90():
    kernels = gpu_kernels(lambda x: ((x - 1) ** 2).mean(), torch.randn(8192, 64))
    assert len(kernels) == 2  # the partials, their sum
    for graph, kernel in kernels:
        result = compile_kernel(kernel_entry(graph, kernel.group, kernel))
        assert result["ok"], result.get("error")
        assert not result.get("spill_bytes")
