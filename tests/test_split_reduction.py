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


# The same inputs whatever ran before in the process (xdist groups files
# differently from run to run).
torch.manual_seed(0)
CASES = {
    "loss": (lambda x: ((x - 1) ** 2).mean(), (torch.randn(8192, 64),)),
    "norm": (lambda x: torch.linalg.vector_norm(x), (torch.randn(4096, 96),)),
    "max": (lambda x: x.amax(), (torch.randn(2048, 100),)),
    # Positive x: each column's sum keeps its magnitude (of unit normals it
    # would cancel 65536 terms to about 1, below what float32's rounding of
    # their magnitudes moves, whatever the order).
    "columns": (lambda x, w: (x * w).sum(0)[:8], (torch.rand(65536, 8), torch.randn(8))),
    "any": (lambda x: (x > 4.5).any(), (torch.randn(4096, 64),)),
    "argmax": (lambda x: x.argmax(), (torch.randn(2048, 100),)),
    "argmin-columns": (lambda x: x.argmin(0), (torch.randn(65536, 4),)),
    "max-dim": (lambda x: x.max(0), (torch.randn(65536, 3, dtype=torch.bfloat16),)),
    "logits-loss": (
        lambda x: x.float().pow(2).mean(),
        (torch.randn(4, 256, 1000, dtype=torch.bfloat16),),
    ),
    "short-first-max": (lambda x: x.amax((0, 1, 2)), (torch.randn(2, 512, 300, 2),)),
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
    got = interpret(graph, list(inputs))
    expected = fn(*inputs)
    expected = tuple(expected) if isinstance(expected, tuple) else (expected,)
    torch.testing.assert_close(tuple(got), expected, atol=1e-4, rtol=1e-4)


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


def _arg_case(x: torch.Tensor) -> torch.Tensor:
    graph = optimize(lower(lambda x: (x.argmax(), x.argmin()), x), gpu=True)
    assert len(_split(graph)) >= 2, "not split"
    return interpret(graph, [x])


def test_split_argmax_takes_the_first_of_ties_across_chunks():
    """Equal maxima in two chunks: the first position overall, as torch's."""
    x = torch.zeros(262144)
    x[200000] = x[5000] = 1.0
    x[150000] = x[7] = -1.0
    assert [int(v) for v in _arg_case(x)] == [5000, 7]


def test_split_argmax_finds_the_first_nan():
    """A NaN is the maximum and the minimum for torch's argmax and argmin:
    the first NaN's position, whichever chunk it is in."""
    x = torch.randn(262144)
    x[190000] = x[100000] = float("nan")
    assert [int(v) for v in _arg_case(x)] == [100000, 100000]
    assert [int(v) for v in (x.argmax(), x.argmin())] == [100000, 100000]


def test_a_split_argmax_compiles_for_sm90():
    kernels = gpu_kernels(lambda x: x.argmax(), torch.randn(2048, 100))
    assert len(kernels) == 2  # positions and maxima of the chunks; the answer
    for graph, kernel in kernels:
        result = compile_kernel(kernel_entry(graph, kernel.group, kernel))
        assert result["ok"], result.get("error")
        assert not result.get("spill_bytes")


def test_a_short_first_reduced_dimension_is_kept_whole_and_the_next_split():
    """A loss over (batch 4, sequence 256, vocabulary 1000) logits: split
    over the batch alone it would run on 4 programs; the partials keep the
    batch whole and split the sequence too, and one kernel reduces the
    4 x S partials."""
    x = torch.randn(4, 256, 1000, dtype=torch.bfloat16)
    graph = optimize(lower(lambda x: x.float().pow(2).mean(), x), gpu=True)
    (partial,) = _split(graph)
    assert partial.shape[0] == 4 and partial.shape[1] > 1 and len(partial.shape) == 2
    assert partial.reduce_shape == (256 // partial.shape[1], 1000)
    (total,) = [n for n in graph.nodes.values() if n.kind == "reduction" and n not in (partial,)]
    assert total.reduce_shape == partial.shape
    kernels = gpu_kernels(lambda x: x.float().pow(2).mean(), x)
    assert len(kernels) == 2
