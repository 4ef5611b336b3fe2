"""Direct kernel launch (``runtime/launcher.py``, option ``direct_launch``).

Oracles: Triton's own argument specialization (equal facts must mean the
same compiled kernel), a fake JIT function that records which path each
launch took, eager torch for whole programs; the ``gpu`` test runs the
direct launcher on a GPU against the JIT's results.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from tests.compare import assert_close_tree
from tilec.options import Options
from tilec.pipeline import programs
from tilec.runtime.launcher import DirectLaunch, facts


def _arguments() -> list:
    """Kernel arguments of every kind tilec passes, at the edges of Triton's
    specializations: tensors at every offset within 16 bytes, integers
    around 1, multiples of 16 and the 32/64-bit limits."""
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base[k:] for k in range(5)]
    tensors += [base.to(dtype)[k:] for dtype in (torch.float16, torch.bfloat16) for k in (0, 1, 8)]
    tensors += [base.to(torch.int32)[k:] for k in (0, 2, 4)]
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16]
    ints += [-(2**31), -(2**31) - 1, 2**63 - 16, 2**63, 2**63 + 16]
    return tensors + ints + [True, False, 0.5, 2.0]


def _triton(arg) -> tuple:
    """Triton's specialization of ``arg`` as a kernel argument (type, key)."""
    return tuple(native_specialize_impl(BaseBackend, arg, False, True, True))


def test_equal_facts_mean_the_same_triton_specialization():
    args = _arguments()
    checked = 0
    for a, b in itertools.combinations(args, 2):
        if facts([a]) == facts([b]):
            assert _triton(a) == _triton(b), (a, b)
            checked += 1
    # Distinct specializations are told apart, and the rule was exercised.
    assert facts([args[0]]) != facts([args[1]]) and facts([1]) != facts([2])
    assert checked > 20


class _Compiled:
    """A fake CompiledKernel: ``kernel[grid](*args)`` records a direct launch.
    Like Triton's (3.6 to 3.8), its launcher reads all three of the grid's
    dimensions: a shorter grid fails there, as on a GPU."""

    def __init__(self, log: list):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", (grid[0], grid[1], grid[2]), args))


class _Jit:
    """A fake JIT function of parameters (x, n, BLOCK: constexpr): records
    each launch and returns a compiled kernel (None: as the interpreter)."""

    arg_names = ["x", "n", "BLOCK"]

    def __init__(self, compiles: bool = True):
        self.log: list = []
        self.compiles = compiles

    def __getitem__(self, grid):
        def run(*args, **options):
            self.log.append(("jit", grid, args))
            return _Compiled(self.log) if self.compiles else None

        return run


def test_later_launches_with_the_same_facts_skip_the_jit():
    fn = _Jit()
    launch = DirectLaunch(fn, {"BLOCK": 64, "num_warps": 4}, grid=(3,))
    x = torch.zeros(64)
    launch(x, 17)
    launch(x, 18)  # same facts: direct, with the constexpr after the arguments
    launch(x[1:], 18)  # unaligned: a new specialization, through the JIT
    launch(x[5:], 33)  # the same facts as the last
    launch(x, 1)  # 1 is a specialization of its own
    launch(x, 16)  # a multiple of 16 too
    assert [(path, args[1:]) for path, _, args in fn.log] == [
        ("jit", (17,)),
        ("direct", (18, 64)),
        ("jit", (18,)),
        ("direct", (33, 64)),
        ("jit", (1,)),
        ("jit", (16,)),
    ]
    assert (launch.jit_calls, launch.direct_calls) == (4, 2)
    # The JIT takes the grid as given; the compiled launcher, all three dimensions.
    assert {grid for path, grid, _ in fn.log} == {(3,), (3, 1, 1)}


def test_a_grid_given_per_launch_reuses_the_compiled_kernel():
    """Generic programs launch ``k[grid](...)`` with the grid of the call's
    sizes: one JIT launch per specialization, whatever the grid."""
    fn = _Jit()
    launch = DirectLaunch(fn, {"BLOCK": 64})
    x = torch.zeros(64)
    for grid in ((2,), (5,), (2,)):
        launch[grid](x, 20, BLOCK=64)
    assert [(path, grid) for path, grid, _ in fn.log] == [
        ("jit", (2,)),
        ("direct", (5, 1, 1)),
        ("direct", (2, 1, 1)),
    ]


def test_without_a_compiled_kernel_every_launch_takes_the_jit():
    """The interpreter's launch returns no compiled kernel; a kernel whose
    parameters are not the arguments and then the options cannot be
    launched directly either."""
    fn = _Jit(compiles=False)
    launch = DirectLaunch(fn, {"BLOCK": 64}, grid=(1,))
    x = torch.zeros(64)
    for _ in range(3):
        launch(x, 20)
    assert [path for path, _, _ in fn.log] == ["jit"] * 3
    fn = _Jit()
    missing = DirectLaunch(fn, {"num_warps": 4}, grid=(1,))  # BLOCK passed nowhere
    for _ in range(2):
        missing(x, 20)
    assert [path for path, _, _ in fn.log] == ["jit"] * 2


def test_the_option_is_checked():
    assert Options.from_user(None, {"direct_launch": True}).direct_launch
    assert not Options.from_user(None, {}).direct_launch
    with pytest.raises(TypeError, match="direct_launch"):
        Options.from_user(None, {"direct_launch": "yes"})


def _compiled(direct: bool, dynamic: bool):
    def fn(x, y):
        return torch.softmax(x * 2, -1) + y, (x - y).abs().sum(0)

    options = {"direct_launch": direct, "max_specializations": 0}
    return fn, torch.compile(fn, backend="tilec", dynamic=dynamic, options=options)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_program_with_direct_launch_on_a_cpu_goes_through_the_jit(dynamic):
    """On a CPU the interpreter compiles nothing to launch directly: every
    launch is the JIT's, counted, and the results are eager's."""
    torch._dynamo.reset()
    before = set(programs())
    fn, compiled = _compiled(True, dynamic)
    for n in (8, 8, 12):
        x, y = torch.randn(4, n), torch.randn(4, n)
        assert_close_tree(compiled(x, y), fn(x, y))
    new = [p for name, p in programs().items() if name not in before]
    assert new
    for program in new:
        counts = program.launch_counts()
        assert counts["direct"] == 0 and counts["jit"] >= len(program.launches())


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_direct_launch_on_a_gpu_gives_the_jits_results(dynamic):
    """After the first launch of each specialization, kernels are launched
    directly; the results are bit for bit those of the JIT path, also for an
    input at an offset that breaks 16-byte alignment (a new specialization,
    through the JIT once)."""
    torch._dynamo.reset()
    before = set(programs())
    _, direct = _compiled(True, dynamic)
    _, jit = _compiled(False, dynamic)
    base = torch.randn(4 * 40 + 1, device="cuda")
    for n, offset in ((32, 0), (32, 0), (40, 0), (32, 1), (32, 1)):
        x = base[offset : offset + 4 * n].view(4, n)
        y = torch.randn(4, n, device="cuda")
        got, want = direct(x, y), jit(x, y)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    counts = [p.launch_counts() for name, p in programs().items() if name not in before]
    assert sum(c["direct"] for c in counts) > 0


def _bump_and_scale(buffer: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    buffer.add_(1)
    return (x * 2).softmax(-1) + buffer.sum()


def test_a_profiled_call_times_each_launch_and_runs_the_program_once():
    """``Program.profile``: each launch of a call timed into
    ``kernel_times``, and the call runs once (an input it writes is written
    once, as by a plain call: the decode step's KV cache)."""
    before = set(programs())
    compiled = torch.compile(_bump_and_scale, backend="tilec")
    buffer, x = torch.zeros(3), torch.randn(4, 3)
    expected_buffer = torch.zeros(3)
    with torch.no_grad():
        compiled(buffer, x)  # compiles and warms up
        _bump_and_scale(expected_buffer, x)
        (program,) = [p for name, p in programs().items() if name not in before]
        program.profile()
        assert_close_tree(compiled(buffer, x), _bump_and_scale(expected_buffer, x))
        times = program.kernel_times
        program.profile(False)
    torch.testing.assert_close(buffer, torch.full((3,), 2.0))
    assert sorted(times) == sorted(step.kernel.name for step in program.launches())
    assert all(len(seconds) == 1 and seconds[0] > 0 for seconds in times.values())
