"""Small independent kernels combined into one launch (``passes/combine.py``),
against eager torch; the combined kernel compiled for sm_90."""

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


def test_large_kernels_are_not_combined():
    x, y = torch.randn(SMALL + 1), torch.randn(SMALL + 1)
    out, program = _program(lambda x, y: (x.sin(), y.cos()), x, y)
    assert len(program.launches()) == 2 and not _combined(program)
    torch.testing.assert_close(out, (x.sin(), y.cos()))


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
