"""Independent kernels combined into one launch (``passes/combine.py``):
small ones, and large ones whose results all leave the program; against
eager torch; the combined kernel compiled for sm_90."""

from __future__ import annotations

import torch

import tilec
from benchmarks.sm90 import compile_kernel
from tests.compare import assert_matches_eager, run_tilec
from tests.lowering import new_programs
from tilec.codegen.record import kernel_entry
from tilec.passes.combine import SMALL


def _program(fn, *inputs, options=None):
    """The output of ``fn`` compiled, and its one program."""
    before = set(tilec.programs())
    out = run_tilec(fn, *inputs, options=options)
    (program,) = new_programs(before)
    return out, program


def _combined(program) -> list:
    return [s.kernel for s in program.launches() if s.kernel.group.parts]


def _independent(x, y, z):
    """Three kernels that read only inputs, each its own: two pointwise, one
    row reduction (a persistent reduction kernel)."""
    return x.sin() * 2, y.cos() + 1, (z * z).sum(-1)


def test_independent_small_kernels_run_as_one_launch_like_eager():
    x, y, z = torch.randn(8, 33), torch.randn(5, 7), torch.randn(3, 40)
    expected = _independent(x, y, z)
    out, program = _program(_independent, x, y, z)
    for a, b in zip(out, expected, strict=True):
        torch.testing.assert_close(a, b)
    (kernel,) = _combined(program)
    assert len(program.launches()) == 1
    assert len(kernel.group.parts) == 3 and kernel.template == "combined"
    # Program ranges: each part's grid, one after the other.
    ends = [v for k, v in kernel.launch.constexprs.items() if k.startswith("END")]
    assert ends == sorted(ends) and kernel.launch.grid == (ends[-1],)
    assert kernel.bytes_written == sum(t.nbytes for t in expected)


def test_the_combined_kernel_compiles_for_sm90_with_the_same_source():
    """``kernel_entry`` writes the kernel again for the H100 and checks the
    source is the same (only the launch parameters differ)."""
    x, y, z = torch.randn(8, 33), torch.randn(5, 7), torch.randn(3, 40)
    _, program = _program(_independent, x, y, z)
    (kernel,) = _combined(program)
    result = compile_kernel(kernel_entry(program.graph, kernel.group, kernel))
    assert result["ok"], result.get("error")
    assert not result.get("spill_bytes")


def test_dependent_kernels_stay_apart():
    """The softmax reads the sum's result: two steps, never one launch."""

    def chain(x, y):
        total = x.sum(0)
        return torch.softmax(y * total, -1)

    x, y = torch.randn(6, 16), torch.randn(4, 16)
    _, program = _program(chain, x, y)
    assert not _combined(program)
    assert_matches_eager(chain, x, y)


def test_large_kernels_with_intermediate_results_stay_apart():
    """The sine and the cosine are read by library calls: combined, both
    large buffers would be live together."""
    x, y, w = torch.randn(257, 256), torch.randn(257, 256), torch.randn(256, 8)
    assert x.numel() > SMALL

    def fn(x, y, w):
        return x.sin() @ w, y.cos() @ w

    out, program = _program(fn, x, y, w)
    assert not _combined(program)
    torch.testing.assert_close(out, fn(x, y, w))


def test_large_kernels_that_store_only_outputs_are_one_launch():
    x, y = torch.randn(SMALL + 1), torch.randn(3, SMALL)
    out, program = _program(lambda x, y: (x.sin(), y.cos()), x, y)
    (kernel,) = _combined(program)
    assert len(program.launches()) == 1 and len(kernel.group.parts) == 2
    torch.testing.assert_close(out, (x.sin(), y.cos()))


def test_many_parts_find_their_part_by_bisection():
    """Eleven independent kernels of different sizes: one launch, each
    program finds its part in a few comparisons (nested, not a chain)."""
    inputs = [torch.randn(3 + 7 * k) for k in range(11)]

    def fn(*xs):
        return [x * (k + 1) + k for k, x in enumerate(xs)]

    out, program = _program(fn, *inputs)
    (kernel,) = _combined(program)
    assert len(program.launches()) == 1 and len(kernel.group.parts) == 11
    torch.testing.assert_close(out, fn(*inputs))
    dispatch = kernel.source[kernel.source.index(f"def {kernel.function}(") :]
    assert dispatch.count("if pid < END") == 10 and "elif" not in dispatch
    # A call nested in d ifs is indented 4 + 4 d: at most 4 comparisons
    # (ceil(log2(11))) per program, not up to 10 as in a chain.
    calls = [line for line in dispatch.splitlines() if "_part(" in line]
    depths = [(len(line) - len(line.lstrip()) - 4) // 4 for line in calls]
    assert len(calls) == 11 and max(depths) == 4 and min(depths) == 3, dispatch


def test_a_write_into_an_input_is_not_combined_with_a_read_of_its_old_value():
    """The cache's old values are summed, then a row is written in place:
    the sum must finish before the write starts, so they are two launches."""

    def step(cache, x, position):
        old = cache.sum(-1)
        cache.index_copy_(0, position, x)
        return old * 2

    cache, x, position = torch.randn(16, 8), torch.randn(1, 8), torch.tensor([3])
    expected_cache = cache.clone()
    expected = step(expected_cache, x, position)
    out, program = _program(step, cache, x, position)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(cache, expected_cache)
    assert program.graph.in_place
    for kernel in _combined(program):
        stored = {n for p in kernel.group.parts for n in p.stored}
        assert not stored & set(program.graph.in_place), kernel.group.reason


def test_fuse_off_combines_nothing():
    x, y, z = torch.randn(8, 33), torch.randn(5, 7), torch.randn(3, 40)
    _, program = _program(_independent, x, y, z, options={"fuse": False})
    assert not _combined(program)
